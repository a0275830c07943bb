"""Sampling seeded per prompt, not per batch: what a sampled regeneration needs to be reproducible.

`generate(do_sample=True)` draws every row's token from one global generator, so a conversation's
sampled answer depends on which other conversations shared its batch, and in which order. Here each
row owns a generator seeded from (seed, its prompt text): `PerRowSampler` is a logits processor that
draws each row's token itself (temperature, top-p, then the Gumbel-max trick with that row's noise) and
leaves only that token allowed, so `generate(do_sample=False)` takes it. A row's draws then depend on
its own prompt and its own tokens alone (a row's stream advances once per step it is generated).

A `veto` (data/round_trip.py `canonical_veto`) refuses a row's pick; the row then takes its next candidate
(greedy: the next most likely token; sampled: the next under the same noise, so no extra draws).
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch

VETO_TRIES = 32  # candidates a row tries per step before its last one stands (refusals are rare in a real LM's text)


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
                 opening: Optional[tuple[int, int]] = None,
                 veto: Optional[Callable[[torch.Tensor, list[int]], list[bool]]] = None,
                 max_tries: Optional[int] = None):
        """`opening` = (prompt length, k): sample only the first k tokens after the prompt, greedy after them.
        `veto(input_ids, picks)` -> per row, whether its pick is allowed; a refused pick gives way to the row's
        next candidate, up to `max_tries` (default VETO_TRIES) candidates (then the last one stands).
        temperature 0 needs a veto: greedy picks with a veto, no sampling."""
        if temperature <= 0 and veto is None:
            raise ValueError("PerRowSampler: temperature must be > 0 (greedy needs no sampler unless it has a veto)")
        max_tries = VETO_TRIES if max_tries is None else max_tries
        if max_tries < 1:
            raise ValueError(f"PerRowSampler: max_tries={max_tries} must be >= 1")
        self.temperature, self.top_p, self.opening = temperature, top_p, opening
        self.veto, self.max_tries = veto, max_tries
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.vetoed = 0  # picks refused so far (a count for the stats)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        past_opening = bool(self.opening) and input_ids.shape[1] - self.opening[0] >= self.opening[1]
        sampling = self.temperature > 0 and not past_opening
        if not sampling and self.veto is None:
            return scores  # past the opening: the (guarded) argmax
        key = scores.float()                                                          # [B, V]
        if sampling:
            key = key / self.temperature
            key = key.masked_fill(~nucleus_mask(key, self.top_p), float("-inf"))
            uniform = torch.stack([torch.rand(key.shape[-1], generator=g, device=key.device)
                                   for g in self.generators])                          # [B, V], one stream per row
            key = key + -torch.log(-torch.log(uniform.clamp_min(1e-20)))               # Gumbel-max
        pick = key.argmax(dim=-1)                                                     # [B]
        if self.veto is not None:
            pick = self._allowed(input_ids, key, pick)
        return torch.full_like(scores, float("-inf")).scatter(-1, pick[:, None], 0.0)

    def _allowed(self, input_ids: torch.Tensor, key: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
        """Each row's best candidate (by `key`) that the veto allows, trying at most max_tries per row."""
        key, pending = key.clone(), list(range(pick.numel()))
        for _ in range(self.max_tries - 1):
            ok = self.veto(input_ids[pending], pick[pending].tolist())
            refused = [r for r, good in zip(pending, ok) if not good]
            if not refused:
                break
            self.vetoed += len(refused)
            idx = torch.tensor(refused, device=key.device)
            key[idx, pick[idx]] = float("-inf")
            pick[idx] = key[idx].argmax(dim=-1)
            pending = refused
        return pick
