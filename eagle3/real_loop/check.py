"""The real loop against the simulation and the cost model, on the same sequences.

For each prompt: the target's plain greedy decode (reference + baseline timing), the real
speculative decode per knob setting (chain: eagle3/real_loop/chain.py, tree: eagle3/real_loop/tree.py;
must be token-identical: lossless), then the replay of eagle3/replay/accept_sim.py over prompt + the target's
greedy output (captured by one target forward), which must give the same accept length; and the cost
model fed with the real loop's measured latencies, whose predicted tok/s is compared with the loop's
measured tok/s.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.replay.accept_sim import AcceptStats, build_sglang_tree, replay_sequence
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.replay.cost_model import measured_latencies, predict
from eagle3.real_loop.chain import PromptImages, greedy_decode, speculative_decode
from eagle3.real_loop.tree import tree_speculative_decode
from eagle3.replay.drafter_session import SequenceDrafter
from eagle3.target_model.target_io import AuxHiddenCapture, lm_head, text_model


@torch.no_grad()
def capture_sequence(target, ids: torch.Tensor, hf_indices: list[int], images: Optional[PromptImages] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over ids Long [T] -> (aux [T, 3*Ht], target_argmax Long [T]), as capture stores them
    (images: the image rows among ids, read as fused input embeddings)."""
    decoder, head = text_model(target), lm_head(target)
    dev = decoder.embed_tokens.weight.device
    ids = ids.to(dev)
    inputs = {"input_ids": ids[None]} if images is None else \
        {"inputs_embeds": images.target_embeds(decoder.embed_tokens, ids)}
    with AuxHiddenCapture(target, hf_indices) as cap:
        out = decoder(**inputs, use_cache=False)
        aux = cap.aux_concat(dev)[0]
    return aux, head(out.last_hidden_state[0]).argmax(-1)


def simulate_on_generation(target, drafter, prompt: torch.Tensor, generated: Sequence[int], knobs: SpecKnobs,
                           images: Optional[PromptImages] = None) -> AcceptStats:
    """The replay over prompt + generated, with the loss mask on the generated tokens."""
    ids = torch.cat([prompt.long().reshape(-1), torch.tensor(list(generated), dtype=torch.long)])
    aux, argmax = capture_sequence(target, ids, drafter.config.aux_hf_indices, images)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[prompt.numel():] = True
    emb = None if images is None else images.drafter_embeds(drafter, ids.to(drafter.fc.weight.device))
    seq = SequenceDrafter(drafter, aux.cpu(), ids, knobs.topk, emb)
    return replay_sequence(ids, mask, argmax.cpu(), lambda q: build_sglang_tree(seq.at(q), knobs), knobs.max_depth)


def real_vs_simulated(target, drafter, prompts: Sequence[torch.Tensor], knobs: Sequence[SpecKnobs],
                      max_new_tokens: int, eos_token_id: Optional[int] = None,
                      images: Optional[Sequence[Optional[PromptImages]]] = None) -> dict:
    """Per knob setting: lossless flag, real and simulated accept length, measured latencies, and the
    cost model's prediction from those latencies next to the measured speed. images: per prompt, its image
    rows (None: a text prompt)."""
    drafter.eval()
    chains = list(knobs)  # every knob: chains by eagle3/real_loop/chain.py, trees by eagle3/real_loop/tree.py
    out: dict = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "knobs": {}, "skipped_knobs": []}
    base_ms: list[float] = []
    runs = {k.label: {"emitted": [], "sim": AcceptStats(k.max_depth), "lossless": True, "draft": [], "verify": [],
                      "extend": []} for k in chains}
    images = list(images) if images is not None else [None] * len(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image entries")
    for prompt, img in zip(prompts, images):
        base = greedy_decode(target, prompt, max_new_tokens, eos_token_id, images=img)
        base_ms.extend(base.token_ms)
        for k in chains:
            r = runs[k.label]
            if k.topk == 1:
                spec = speculative_decode(target, drafter, prompt, max_new_tokens, k.num_steps, k.num_draft_tokens,
                                          eos_token_id, images=img)
            else:
                spec = tree_speculative_decode(target, drafter, prompt, max_new_tokens, k, eos_token_id, images=img)
            r["lossless"] &= spec.tokens == base.tokens
            r["emitted"] += spec.emitted
            r["draft"] += spec.draft_ms
            r["verify"] += spec.verify_ms
            r["extend"] += spec.extend_ms
            r["sim"] += simulate_on_generation(target, drafter, prompt, base.tokens, k, img)
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
