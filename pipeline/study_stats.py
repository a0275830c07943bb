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
    """How many fewer tokens the `fast` runs need to reach the `slow` runs' final value, over every pair
    (fast run i, slow run j): token_saving_pairs of the cross product."""
    return token_saving_pairs([(f, s) for f in fast for s in slow])


def token_saving_pairs(pairs: Sequence[tuple[Sequence[tuple[float, float]], Sequence[tuple[float, float]]]]) -> dict:
    """For each (fast curve, slow curve) pair: ratio = slow's final tokens / the tokens fast needs to reach
    slow's final value. -> {ratios (reached pairs), mean, std, min, max, pairs, not_reached, at_start}; a
    pair reached already at 0 tokens (the start is as good as the finished slow run) is counted in
    `at_start` and left out of the ratios (its ratio is unbounded)."""
    ratios, not_reached, at_start = [], 0, 0
    for f, s in pairs:
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
            "max": max(ratios, default=float("nan")), "pairs": len(pairs),
            "not_reached": not_reached, "at_start": at_start}


def world_spread(by_world: dict) -> dict:
    """Values of one metric grouped by world ({world: [value per seed]}): the seed spread (pooled
    within-world sample std) and the world spread (sample std of the world means).
    -> {mean, seed_std, world_std, worlds, runs}; world_std NaN with one world, seed_std NaN when no
    world has two seeds."""
    groups = {w: [float(x) for x in xs if x == x] for w, xs in by_world.items()}
    groups = {w: xs for w, xs in groups.items() if xs}
    means = [sum(xs) / len(xs) for xs in groups.values()]
    ss = sum(sum((x - m) ** 2 for x in xs) for xs, m in zip(groups.values(), means))
    dof = sum(len(xs) - 1 for xs in groups.values())
    return {"mean": mean_std(means)[0], "seed_std": math.sqrt(ss / dof) if dof else float("nan"),
            "world_std": mean_std(means)[1] if len(means) > 1 else float("nan"),
            "worlds": len(groups), "runs": sum(len(xs) for xs in groups.values())}


def world_difference(a: dict, b: dict, confidence: float = 0.95) -> dict:
    """Difference of means a - b when runs come from several worlds ({world: [value per seed]}).
    One world: Welch's interval over seeds (`level` 'seeds (one world)'). Several: the worlds are the
    units, each contributing mean(a_w) - mean(b_w) (the seed noise averages inside it), and the
    interval is Student's t over those differences (`level` 'worlds'), so world-to-world variation is
    in it. -> welch_interval's keys + {level, worlds, per_world}."""
    common = sorted(w for w in a if w in b and mean_std(a[w])[0] == mean_std(a[w])[0]
                    and mean_std(b[w])[0] == mean_std(b[w])[0])
    if len(common) <= 1:
        w = common[0] if common else None
        out = welch_interval(a.get(w, []), b.get(w, []), confidence)
        return {**out, "level": "seeds (one world)", "worlds": len(common),
                "per_world": {str(w): out["diff"]} if common else {}}
    diffs = [mean_std(a[w])[0] - mean_std(b[w])[0] for w in common]
    m, sd = mean_std(diffs)
    n = len(diffs)
    q = t_quantile(0.5 + confidence / 2, n - 1)
    half = q * sd / math.sqrt(n)
    return {"diff": m, "low": m - half, "high": m + half, "df": float(n - 1), "n_a": sum(len(a[w]) for w in common),
            "n_b": sum(len(b[w]) for w in common), "confidence": confidence, "level": "worlds", "worlds": n,
            "per_world": {str(w): d for w, d in zip(common, diffs)}}
