"""Learning-rate schedule (pure): linear warmup, then cosine decay to `min_ratio` x lr."""
from __future__ import annotations

import math


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """LR multiplier for optimizer step `step` (0-based: the multiplier used *by* update step+1).

    Warmup ramps (step+1)/warmup_steps up to 1, so the first update already moves the weights;
    the cosine then runs from 1 at the end of warmup to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_warmup(total_steps: int, warmup_steps: int | None, warmup_ratio: float) -> int:
    if warmup_steps is not None:
        return min(int(warmup_steps), total_steps)
    return int(round(total_steps * warmup_ratio))
