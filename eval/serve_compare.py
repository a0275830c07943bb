"""Predicted vs served for `make bench-serve`: the eval stage's replay (eagle3/replay/accept_sim.py through
eagle3/replay, the target captured by eagle3/real_loop/check.py) over each prompt plus the server's
own generation, with the server's knobs; and the verdict of every cause of a gap that can be checked
from the client side and the drafter directory.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

from eagle3.engines import aux_layers
from eagle3.engines import serve_protocol as sp
from eagle3.replay.accept_sim import AcceptStats, acceptance_by_position, build_sglang_tree, replay_sequence
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.real_loop.check import capture_sequence
from eagle3.replay.drafter_session import SequenceDrafter


class GenerationReplay:
    """Replays prompt + generation sequences; the target is run once per distinct sequence."""

    def __init__(self, target, drafter, hf_indices: list[int]):
        self.target, self.drafter, self.hf_indices = target, drafter, list(hf_indices)
        self._captured: dict = {}

    def stats(self, prompt: list[int], generated: list[int], knobs: SpecKnobs) -> AcceptStats:
        ids = torch.tensor(list(prompt) + list(generated), dtype=torch.long)
        key = tuple(ids.tolist())
        if key not in self._captured:
            aux, argmax = capture_sequence(self.target, ids, self.hf_indices)
            self._captured[key] = (aux.cpu(), argmax.cpu())
        aux, argmax = self._captured[key]
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[len(prompt):] = True
        seq = SequenceDrafter(self.drafter, aux, ids, knobs.topk)
        return replay_sequence(ids, mask, argmax, lambda q: build_sglang_tree(seq.at(q), knobs), knobs.max_depth)


def _mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def compare_server(replay: GenerationReplay, prompts: list[list[int]], records: list[dict], knobs: SpecKnobs,
                   gap_sigmas: float) -> dict:
    """Served (decode tokens per verify step, the replay's convention) vs replayed, pooled and per request,
    per position where the engine gives it."""
    total = AcceptStats(knobs.max_depth)
    served_req, replay_req, diffs = [], [], []
    records = [r for r in records if r.get("spec")]  # a one-token reply has no verify step
    for rec in records:
        st = replay.stats(prompts[rec["i"]], rec["output_ids"], knobs)
        total += st
        c = sp.SpecCounts(**rec["spec"])
        served_req.append(c.decode_tokens_per_verify)
        replay_req.append(st.accept_length)
        diffs.append(c.decode_tokens_per_verify - st.accept_length)
    counts = sp.pooled([sp.SpecCounts(**r["spec"]) for r in records])
    served = counts.decode_tokens_per_verify
    gap = served - total.accept_length
    _, se = _mean_se(diffs)
    noise = gap_sigmas * (se if se == se else 0.0)
    served_pos = acceptance_by_position(counts.per_position, counts.verify_steps) if counts.per_position else None
    return {"knobs": knobs.label, "requests": len(records),
            "served_pooled": served, "replay_pooled": total.accept_length,
            "served_per_request_mean": _mean_se(served_req)[0], "replay_per_request_mean": _mean_se(replay_req)[0],
            "gap": gap, "gap_noise": noise, "finding": abs(gap) > max(noise, 1e-9),
            "served_verify_steps": counts.verify_steps, "replay_cycles": total.cycles,
            "served_by_position": served_pos, "replay_by_position": total.acceptance_by_position(),
            "replay_mismatches": total.mismatches, "replay_positions": total.assistant_positions}


def _verdict(cause: str, ok: Optional[bool], detail: str) -> dict:
    return {"cause": cause, "verdict": "unchecked" if ok is None else ("ok" if ok else "FOUND"), "detail": detail}


def gap_causes(cfg, drafter, probes: dict, servers: list, records: dict, comparisons: dict,
               think_ids: list[int]) -> list[dict]:
    """The verdict of each checkable cause of a served-vs-predicted gap (docs/bench_serve.md)."""
    from eagle3.drafter.drafter_keys import engine_reading_problems
    from eagle3.drafter.vocab_map import mapping_problems

    out = []
    raw = json.loads((Path(cfg.drafter_dir) / "config.json").read_text())
    ids = ((raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
           or raw.get("eagle_aux_hidden_state_layer_ids"))
    used = drafter.config.aux_hf_indices
    for s in servers:
        p = probes.get(s.name) or {}
        rule = "vllm" if s.engine == "vllm" else sp.sglang_aux_rule(p.get("version"))
        if not ids:
            out.append(_verdict(f"aux_layers ({s.name})", True, "no ids listed: every engine captures SGLang's "
                                                                 "default layers, as the replay does"))
        elif rule is None:
            out.append(_verdict(f"aux_layers ({s.name})", None, f"server version unknown; ids {list(ids)} read as "
                                                                f"{aux_layers.readings(ids)}; the replay uses h = {used}"))
        else:
            h = aux_layers.hf_indices_from_ids(ids, rule)
            out.append(_verdict(f"aux_layers ({s.name})", h == used,
                                f"{s.engine} {p.get('version') or ''} reads ids {list(ids)} as h = {h} (rule {rule}); "
                                f"the replay (and training) use h = {used}"))
    problems = engine_reading_problems(raw, "sglang")
    out.append(_verdict("drafter_keys", not problems, "; ".join(problems) or "every config switch an engine reads "
                                                                               "means the trained forward"))
    d2t_problems = mapping_problems(drafter.d2t.cpu(), drafter.t2d.cpu())
    gen = [t for recs in records.values() for r in recs for t in r["output_ids"]]
    cover = float(drafter.t2d.cpu()[torch.tensor(gen, dtype=torch.long)].float().mean()) if gen else float("nan")
    out.append(_verdict("d2t", not d2t_problems, "; ".join(d2t_problems) or
                        f"d2t/t2d describe one draft vocab; it covers {cover:.1%} of the served tokens"))
    out.append(_verdict("chat template", True, "prompts go as token ids (SGLang input_ids, vLLM token-id prompt): "
                                               "the server applies no template of its own"))
    think = sum(1 for t in gen if t in set(think_ids))
    out.append(_verdict("thinking tokens", None if think_ids == [] else think == 0,
                        "no think-token ids in the tokenizer" if not think_ids else
                        f"{think} think-token(s) in the generations (the replay scores them like any token; a drafter "
                        f"trained without reasoning text drafts them poorly)" if think else
                        "no think tokens in the generations"))
    t = cfg.request.temperature
    out.append(_verdict("temperature", t == 0, "greedy, as the replay" if t == 0 else
                        f"served at temperature {t}: the replay is greedy, a gap is expected"))
    cut = [(s.name, r["i"]) for s in [cfg.baseline, *servers] for r in records.get(s.name, [])
           if r.get("prompt_tokens") is not None and r["prompt_tokens"] != r["prompt_len"]]
    capped = sum(1 for recs in records.values() for r in recs if r.get("finish_reason") == "length")
    out.append(_verdict("truncation", not cut, (f"prompts cut by the server: {cut[:4]}" if cut else
                                               "every prompt arrived whole") +
                        f"; {capped} replies stopped at max_new_tokens (the replay caps the last cycle the same way)"))
    mism = {k: (c["replay_mismatches"], c["replay_positions"]) for k, c in comparisons.items()}
    bad = {k: v for k, v in mism.items() if v[0]}
    out.append(_verdict("served target = local target", not bad,
                        "the servers' generations are the local target's greedy tokens" if not bad else
                        f"generations leave the local target's greedy path at {bad} (mismatches, positions): the "
                        f"served target differs (quantization, numerics) and the replay stops at each mismatch"))
    return out
