"""The study's statistics (pure: numbers in, numbers out; only `math`).

Seeds are few (3 by default), so every spread is the sample standard deviation (n - 1) and the
interval of a difference of means is Welch's t interval, whose Student-t quantile at a fractional
degree of freedom is computed here (no scipy on the GPU image nor in the project's pins).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation); std is 0.0 for a single value, both NaN for none."""
    xs = [float(x) for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _t_pdf(t: float, df: float) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(t * t / df))


def t_cdf(t: float, df: float, intervals: int = 2000) -> float:
    """P(T <= t) for Student's t with `df` (> 0, may be fractional) degrees of freedom: 1/2 plus the
    density's integral over [0, |t|] by Simpson's rule (the density is smooth; 2000 intervals give
    ~1e-10 for the |t| < 50 a confidence interval needs)."""
    if df <= 0:
        raise ValueError(f"t_cdf: df={df} must be > 0")
    a = abs(t)
    if a == 0:
        return 0.5
    n = intervals + intervals % 2
    h = a / n
    s = _t_pdf(0.0, df) + _t_pdf(a, df)
    s += sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, n))
    half = min(0.5, s * h / 3)
    return 0.5 + half if t > 0 else 0.5 - half


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (0.5 <= p < 1), by bisection on t_cdf."""
    if not 0.5 <= p < 1:
        raise ValueError(f"t_quantile: p={p} must be in [0.5, 1)")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
        if hi > 1e6:
            return float("inf")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict:
    """Difference of means mean(a) - mean(b) with Welch's t interval at `confidence`.
    -> {diff, low, high, df, n_a, n_b}; low/high NaN when a side has fewer than 2 values."""
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    na, nb = sum(1 for x in a if x == x), sum(1 for x in b if x == x)
    out = {"diff": ma - mb, "low": float("nan"), "high": float("nan"), "df": float("nan"), "n_a": na, "n_b": nb,
           "confidence": confidence}
    if na < 2 or nb < 2:
        return out
    va, vb = sa * sa / na, sb * sb / nb
    se = math.sqrt(va + vb)
    if se == 0:  # identical values on both sides: the interval is the point
        out.update(low=ma - mb, high=ma - mb, df=float(na + nb - 2))
        return out
    df = (va + vb) ** 2 / (va * va / (na - 1) + vb * vb / (nb - 1))
    q = t_quantile(0.5 + confidence / 2, df)
    out.update(low=ma - mb - q * se, high=ma - mb + q * se, df=df)
    return out


def tokens_to_reach(curve: Sequence[tuple[float, float]], target: float) -> Optional[float]:
    """Training tokens at which a learning curve [(tokens, value)], sorted by tokens, first reaches
    `target`, linearly interpolated between the two budgets around the crossing; None if it never does."""
    prev = None
    for x, y in curve:
        if y >= target:
            if prev is None or prev[1] >= target:
                return float(x)
            (x0, y0) = prev
            return x0 + (target - y0) * (x - x0) / (y - y0)
        prev = (x, y)
    return None


def token_saving(fast: Sequence[Sequence[tuple[float, float]]], slow: Sequence[Sequence[tuple[float, float]]]) -> dict:
    """How many fewer tokens the `fast` runs need to reach the `slow` runs' final value: for every pair
    (fast run i, slow run j), ratio = slow_j's final tokens / the tokens fast_i needs to reach slow_j's
    final value. -> {ratios (reached pairs), mean, std, min, max, pairs, not_reached, at_start}; a
    pair reached already at 0 tokens (the start is as good as the finished slow run) is counted in
    `at_start` and left out of the ratios (its ratio is unbounded)."""
    ratios, not_reached, at_start = [], 0, 0
    for f in fast:
        for s in slow:
            if not s:
                continue
            end_tokens, end_value = s[-1]
            need = tokens_to_reach(f, end_value)
            if need is None:
                not_reached += 1
            elif need <= 0:
                at_start += 1
            else:
                ratios.append(end_tokens / need)
    m, sd = mean_std(ratios)
    return {"ratios": ratios, "mean": m, "std": sd, "min": min(ratios, default=float("nan")),
            "max": max(ratios, default=float("nan")), "pairs": len(fast) * len(slow),
            "not_reached": not_reached, "at_start": at_start}
