"""The cost split fitted from a live server's timings (pure, standard library only).

The cost model (eagle3/replay/cost_model.py) prices a verify cycle as
    t_cycle = verify_ms + verify_ms_per_token * num_draft_tokens + draft_step_ms * num_steps
(the drafter's extend over the accepted tokens is folded into verify_ms: it happens once per cycle).
A server measured at one knob setting gives one mean cycle time, which cannot separate three costs.
`fit_cycle_costs` takes timed points (num_draft_tokens n, num_steps s, ms per cycle) from several
settings and solves least squares for (verify_ms, verify_ms_per_token, draft_step_ms) >= 0, with
residuals. A plain decode step is a forward over one token, so with `anchor_baseline` the baseline's
ms per token enters as a point (n = 1, s = 0): then two speculative settings whose (n, s) are not on
one line with (1, 0) determine the split (chains with num_draft_tokens = num_steps + 1 all are: one
of them needs num_draft_tokens != num_steps + 1, e.g. 2/1/3 with 3/1/3).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

PARAMS = ("verify_ms", "verify_ms_per_token", "draft_step_ms")


class CostFitError(ValueError):
    """The points cannot determine the split (too few, or settings on one line)."""


@dataclass(frozen=True)
class CyclePoint:
    num_draft_tokens: int     # tokens verified per cycle (the root included); 1 for a plain decode step
    num_steps: int            # draft steps per cycle; 0 for a plain decode step
    ms: float                 # measured ms per cycle (per token for a plain decode step)
    label: str = ""           # the server / knob setting it came from


@dataclass
class CostFit:
    verify_ms: float
    verify_ms_per_token: float
    draft_step_ms: float
    residuals_ms: list = field(default_factory=list)        # per point: measured - fitted
    rms_ms: float = 0.0
    by_label: dict = field(default_factory=dict)            # label -> {points, mean measured, fitted, residual}
    clamped: list = field(default_factory=list)             # parameters held at 0 (the free fit made them < 0)

    def predict(self, num_draft_tokens: int, num_steps: int) -> float:
        return self.verify_ms + self.verify_ms_per_token * num_draft_tokens + self.draft_step_ms * num_steps

    def to_dict(self) -> dict:
        return asdict(self)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small square system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-9 * max(1.0, max(abs(x) for row in m for x in row[:n])):
            raise CostFitError("singular")
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _least_squares(rows: list[list[float]], y: list[float], free: list[int]) -> list[float]:
    a = [[sum(r[i] * r[j] for r in rows) for j in free] for i in free]
    b = [sum(r[i] * v for r, v in zip(rows, y)) for i in free]
    sol = _solve(a, b)
    out = [0.0] * len(PARAMS)
    for i, v in zip(free, sol):
        out[i] = v
    return out


def fit_cycle_costs(points: Sequence[CyclePoint]) -> CostFit:
    """Least squares over the points (module docstring); parameters the free fit makes negative are held
    at 0 and the rest refitted."""
    designs = {(p.num_draft_tokens, p.num_steps) for p in points}
    if len(designs) < 3:
        raise CostFitError(f"{len(designs)} distinct (num_draft_tokens, num_steps) settings {sorted(designs)}: "
                           f"three are needed to separate verify, per-verified-token and draft-step cost "
                           f"(the baseline counts as (1, 0) with anchor_baseline=true)")
    rows = [[1.0, float(p.num_draft_tokens), float(p.num_steps)] for p in points]
    y = [float(p.ms) for p in points]
    free = [0, 1, 2]
    try:
        theta = _least_squares(rows, y, free)
    except CostFitError:
        raise CostFitError(f"the settings {sorted(designs)} lie on one line in (num_draft_tokens, num_steps): "
                           f"verified-token and draft-step costs cannot be told apart; add a setting with "
                           f"num_draft_tokens != num_steps + 1 (e.g. 3/1/3 next to 2/1/3)") from None
    clamped = []
    while any(theta[i] < 0 for i in free[1:]) and len(free) > 1:
        worst = min(free[1:], key=lambda i: theta[i])
        free.remove(worst)
        clamped.append(PARAMS[worst])
        theta = _least_squares(rows, y, free)
    fitted = [sum(t * x for t, x in zip(theta, r)) for r in rows]
    resid = [v - f for v, f in zip(y, fitted)]
    by_label: dict = {}
    for p, f, r in zip(points, fitted, resid):
        e = by_label.setdefault(p.label, {"num_draft_tokens": p.num_draft_tokens, "num_steps": p.num_steps,
                                          "points": 0, "measured_ms": 0.0, "fitted_ms": f, "residual_ms": 0.0})
        e["points"] += 1
        e["measured_ms"] += p.ms
        e["residual_ms"] += r
    for e in by_label.values():
        e["measured_ms"] /= e["points"]
        e["residual_ms"] /= e["points"]
    rms = (sum(r * r for r in resid) / len(resid)) ** 0.5
    return CostFit(theta[0], theta[1], theta[2], resid, rms, by_label, clamped)
