"""Sampling seeded per prompt, not per batch: what a sampled regeneration needs to be reproducible.

`generate(do_sample=True)` draws every row's token from one global generator, so a conversation's
sampled answer depends on which other conversations shared its batch, and in which order. Here each
row owns a generator seeded from (seed, its prompt text): `PerRowSampler` is a logits processor that
draws each row's token itself (temperature, top-p, then the Gumbel-max trick with that row's noise) and
leaves only that token allowed, so `generate(do_sample=False)` takes it. A row's draws then depend on
its own prompt and its own tokens alone (a row's stream advances once per step it is generated).
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch


def row_seed(seed: int, prompt_text: str) -> int:
    """The seed of one prompt's sampling stream (63 bits of sha256(seed, prompt))."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{prompt_text}".encode()).digest()[:8], "little") >> 1


def nucleus_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, V] bool: the smallest set of most likely tokens whose probability reaches `top_p` (the top
    token always kept)."""
    if top_p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs            # mass of the tokens ranked above each one
    keep_sorted = before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


class PerRowSampler:
    """A transformers LogitsProcessor: row i samples with its own generator (seeds[i])."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, device, *,
                 opening: Optional[tuple[int, int]] = None):
        """`opening` = (prompt length, k): sample only the first k tokens after the prompt, greedy after them."""
        if temperature <= 0:
            raise ValueError("PerRowSampler: temperature must be > 0 (greedy needs no sampler)")
        self.temperature, self.top_p, self.opening = temperature, top_p, opening
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.opening and input_ids.shape[1] - self.opening[0] >= self.opening[1]:
            return scores  # past the opening: the (guarded) argmax
        logits = scores.float() / self.temperature                                  # [B, V]
        logits = logits.masked_fill(~nucleus_mask(logits, self.top_p), float("-inf"))
        uniform = torch.stack([torch.rand(logits.shape[-1], generator=g, device=logits.device)
                               for g in self.generators])                          # [B, V], one stream per row
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
        pick = (logits + gumbel).argmax(dim=-1, keepdim=True)                      # [B, 1]
        return torch.full_like(scores, float("-inf")).scatter(-1, pick, 0.0)
