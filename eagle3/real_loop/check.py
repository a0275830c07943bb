"""The real loop against the simulation and the cost model, on the same sequences.

For each prompt: the target's plain greedy decode (reference + baseline timing), the real
speculative decode per knob setting (chain: eagle3/real_loop/chain.py, tree: eagle3/real_loop/tree.py;
must be token-identical: lossless), then the replay of eagle3/accept_sim.py over prompt + the target's
greedy output (captured by one target forward), which must give the same accept length; and the cost
model fed with the real loop's measured latencies, whose predicted tok/s is compared with the loop's
measured tok/s.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.accept_sim import AcceptStats, SpecKnobs, build_sglang_tree, replay_sequence
from eagle3.cost_model import measured_latencies, predict
from eagle3.real_loop.chain import greedy_decode, speculative_decode
from eagle3.real_loop.tree import tree_speculative_decode
from eagle3.replay.drafter_session import SequenceDrafter
from eagle3.target_io import AuxHiddenCapture, lm_head, text_model


@torch.no_grad()
def capture_sequence(target, ids: torch.Tensor, hf_indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over ids Long [T] -> (aux [T, 3*Ht], target_argmax Long [T]), as capture stores them."""
    decoder, head = text_model(target), lm_head(target)
    dev = decoder.embed_tokens.weight.device
    with AuxHiddenCapture(target, hf_indices) as cap:
        out = decoder(input_ids=ids.to(dev)[None], use_cache=False)
        aux = cap.aux_concat(dev)[0]
    return aux, head(out.last_hidden_state[0]).argmax(-1)


def simulate_on_generation(target, drafter, prompt: torch.Tensor, generated: Sequence[int], knobs: SpecKnobs
                           ) -> AcceptStats:
    """The replay over prompt + generated, with the loss mask on the generated tokens."""
    ids = torch.cat([prompt.long().reshape(-1), torch.tensor(list(generated), dtype=torch.long)])
    aux, argmax = capture_sequence(target, ids, drafter.config.aux_hf_indices)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[prompt.numel():] = True
    seq = SequenceDrafter(drafter, aux.cpu(), ids, knobs.topk)
    return replay_sequence(ids, mask, argmax.cpu(), lambda q: build_sglang_tree(seq.at(q), knobs), knobs.max_depth)


def real_vs_simulated(target, drafter, prompts: Sequence[torch.Tensor], knobs: Sequence[SpecKnobs],
                      max_new_tokens: int, eos_token_id: Optional[int] = None) -> dict:
    """Per knob setting: lossless flag, real and simulated accept length, measured latencies, and the
    cost model's prediction from those latencies next to the measured speed."""
    drafter.eval()
    chains = list(knobs)  # every knob: chains by eagle3/real_loop/chain.py, trees by eagle3/real_loop/tree.py
    out: dict = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "knobs": {}, "skipped_knobs": []}
    base_ms: list[float] = []
    runs = {k.label: {"emitted": [], "sim": AcceptStats(k.max_depth), "lossless": True, "draft": [], "verify": [],
                      "extend": []} for k in chains}
    for prompt in prompts:
        base = greedy_decode(target, prompt, max_new_tokens, eos_token_id)
        base_ms.extend(base.token_ms)
        for k in chains:
            r = runs[k.label]
            if k.topk == 1:
                spec = speculative_decode(target, drafter, prompt, max_new_tokens, k.num_steps, k.num_draft_tokens,
                                          eos_token_id)
            else:
                spec = tree_speculative_decode(target, drafter, prompt, max_new_tokens, k, eos_token_id)
            r["lossless"] &= spec.tokens == base.tokens
            r["emitted"] += spec.emitted
            r["draft"] += spec.draft_ms
            r["verify"] += spec.verify_ms
            r["extend"] += spec.extend_ms
            r["sim"] += simulate_on_generation(target, drafter, prompt, base.tokens, k)
    mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
    baseline_token_ms = mean(base_ms)
    out["baseline_token_ms"] = baseline_token_ms
    for k in chains:
        r = runs[k.label]
        real = sum(r["emitted"]) / len(r["emitted"]) if r["emitted"] else float("nan")
        cycle_ms = [a + b + c for a, b, c in zip(r["draft"], r["verify"], r["extend"])]
        entry = {"lossless": r["lossless"], "real_accept_length": real, "sim_accept_length": r["sim"].accept_length,
                 "cycles": len(r["emitted"]), "sim_cycles": r["sim"].cycles,
                 "draft_step_ms": mean(r["draft"]) / k.num_steps, "verify_ms": mean(r["verify"]),
                 "extend_ms": mean(r["extend"]), "cycle_ms": mean(cycle_ms),
                 "measured_spec_tok_s": 1000.0 * sum(r["emitted"]) / sum(cycle_ms) if cycle_ms else float("nan"),
                 "measured_baseline_tok_s": 1000.0 / baseline_token_ms if base_ms else float("nan")}
        if base_ms and r["emitted"]:
            lat = measured_latencies(baseline_token_ms, {k.num_draft_tokens: entry["verify_ms"]},
                                     draft_step_ms=entry["draft_step_ms"], draft_extend_ms=entry["extend_ms"],
                                     source="measured by eagle3/real_loop/chain.py")
            entry["prediction_from_measured"] = predict(max(r["sim"].accept_length, 1.0), lat, k.num_steps,
                                                        k.num_draft_tokens).to_dict()
        out["knobs"][k.label] = entry
    return out
