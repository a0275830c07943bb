"""Assertions that hold on any x86-64 CPU: floating-point results differ between CPUs (summation
order, vector width, libm), so where a test compares a choice made from floats (an argmax), it
allows what float noise can change and nothing else."""
from __future__ import annotations

import torch


def assert_argmax_up_to_ties(ids: torch.Tensor, logits: torch.Tensor, tol: float) -> None:
    """`ids` [T] is the argmax of `logits` [T, V] except where two logits lie within `tol` of each
    other (a tie that float noise decides): every chosen token's logit is within `tol` of the row's
    largest. A wrong choice is far from the largest; `tol` is the tolerance the logits were checked to."""
    logits = logits.float()
    best = logits.max(dim=-1).values
    chosen = logits.gather(-1, ids.long()[:, None]).squeeze(-1)
    gap = best - chosen  # [T], 0 where the choice is the argmax
    bad = (gap > tol).nonzero().flatten().tolist()
    assert not bad, f"positions {bad[:8]} chose a token {gap.max().item():.3g} below the largest logit (> {tol})"
