"""The SGLang knob settings a search measures and how they are priced (pure): the grid of chains and
trees (knob_grid) and, for measured accept lengths, the cost model's speed-up of each (knob_table).
Shared by the study (pipeline/study.py) and bench-serve (eval/bench_serve.py)."""
from __future__ import annotations

from eagle3.engines.serve_launch import SpecKnobs
from eagle3.replay.cost_model import predict


def knob_grid(grid) -> list[SpecKnobs]:
    """Chains s/1/s+1 for every s, trees s/k/n for every valid combination with k > 1 (SpecKnobs
    refuses a draft-token count the tree cannot hold), in a stable order without repeats."""
    out: list[SpecKnobs] = []
    for s in grid.num_steps:
        out.append(SpecKnobs(s, 1, s + 1))
        for k in (k for k in grid.topk if k > 1):
            for n in grid.num_draft_tokens:
                try:
                    out.append(SpecKnobs(s, k, n))
                except ValueError:
                    continue
    return list(dict.fromkeys(out))


def knob_table(taus: dict[str, float], knobs: list[SpecKnobs], lat) -> dict[str, dict]:
    """{label: {knobs, accept_length, speedup, spec_tok_s, break_even_accept_length}} from the cost model."""
    out = {}
    for k in knobs:
        tau = taus.get(k.label, float("nan"))
        if tau == tau and tau >= 1.0:
            p = predict(tau, lat, k.num_steps, k.num_draft_tokens)
            out[k.label] = {"num_steps": k.num_steps, "topk": k.topk, "num_draft_tokens": k.num_draft_tokens,
                            "accept_length": tau, "speedup": p.speedup, "spec_tok_s": p.spec_tok_s,
                            "break_even_accept_length": p.break_even_accept_length, "cycle_ms": p.cycle_ms}
    return out
