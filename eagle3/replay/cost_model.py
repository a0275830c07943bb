"""Go / no-go before a 10-minute server start: predicted decode speed with speculation (pure).

Batch-1 greedy decoding. Without speculation every token costs one target decode step,
t_base = 1 / baseline tok/s. With EAGLE speculation every verify cycle costs

    t_cycle = t_verify(num_draft_tokens) + num_steps * t_draft_step + t_draft_extend

and emits `accept_length` tokens (SGLang's convention, bonus included), so

    tok/s = accept_length / t_cycle,   speed-up = accept_length * t_base / t_cycle,
    break-even accept length = t_cycle / t_base.

t_verify(n) = verify_ms + verify_ms_per_token * n: on a communication-bound server (the account:
8 GPUs over PCIe, ~25 of the ~30 ms are all-reduces) the verify cost hardly depends on n, so the
per-token slope is 0 there; the real loop measures both on the machine at hand.

Accept length from per-position acceptance (chain): tau = 1 + sum_k prod_{j<=k} a_j, where a_j is
the probability that draft j is accepted given drafts < j were (docs/design.md "Sources": SpecForge's
"simulated accept length" is the same sum without the +1).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from eagle3.engines.serve_costs import Latencies


def accept_length_from_acceptance(acceptance: Sequence[float]) -> float:
    """tau = 1 + sum_k prod_{j<=k} a_j for conditional per-position acceptance a_1..a_n of a chain."""
    tau, run = 1.0, 1.0
    for a in acceptance:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance {a} outside [0, 1]")
        run *= a
        tau += run
    return tau


def accept_length_iid(alpha: float, num_drafts: int) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha): every draft accepted with the same probability alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha {alpha} outside [0, 1]")
    return float(num_drafts + 1) if alpha == 1.0 else (1 - alpha ** (num_drafts + 1)) / (1 - alpha)


@dataclass(frozen=True)
class Prediction:
    accept_length: float
    num_steps: int
    num_draft_tokens: int
    cycle_ms: float
    baseline_tok_s: float
    spec_tok_s: float
    speedup: float
    break_even_accept_length: float
    wins: bool
    verdict: str
    latencies: dict

    def to_dict(self) -> dict:
        return asdict(self)


def predict(accept_length: float, latencies: Latencies, num_steps: int, num_draft_tokens: int,
            margin: float = 0.0) -> Prediction:
    """Predicted batch-1 decode speed with speculation vs without. `wins` needs speed-up > 1 + margin."""
    if not (accept_length >= 1.0 and math.isfinite(accept_length)):
        raise ValueError(f"accept length {accept_length}: must be a finite number >= 1 (bonus token included)")
    cycle = latencies.cycle_ms(num_steps, num_draft_tokens)
    base_tok_s = 1000.0 / latencies.baseline_token_ms
    spec_tok_s = 1000.0 * accept_length / cycle
    speedup = spec_tok_s / base_tok_s
    need = cycle / latencies.baseline_token_ms
    wins = speedup > 1.0 + margin
    verdict = (f"{'FASTER' if wins else 'SLOWER'} than no speculation: predicted {spec_tok_s:.1f} tok/s vs "
               f"{base_tok_s:.1f} baseline ({speedup:.2f}x) at accept length {accept_length:.2f} "
               f"(num_steps={num_steps}, num_draft_tokens={num_draft_tokens}, {cycle:.1f} ms per cycle); "
               f"break-even accept length {need:.2f}")
    return Prediction(accept_length, num_steps, num_draft_tokens, cycle, base_tok_s, spec_tok_s, speedup,
                      need, wins, verdict, asdict(latencies))


def fit_verify_latency(num_tokens: Sequence[int], ms: Sequence[float]) -> tuple[float, float]:
    """Least-squares t_verify(n) = a + b * n from measured verify times; returns (a, b >= 0)."""
    if len(num_tokens) != len(ms) or not ms:
        raise ValueError("fit_verify_latency: need matching, non-empty lists of sizes and times")
    n = len(ms)
    mx, my = sum(num_tokens) / n, sum(ms) / n
    var = sum((x - mx) ** 2 for x in num_tokens)
    b = 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(num_tokens, ms)) / var
    b = max(b, 0.0)
    return my - b * mx, b


def measured_latencies(baseline_token_ms: float, verify_ms_by_tokens: dict[int, float],
                       draft_step_ms: float, draft_extend_ms: float = 0.0,
                       source: Optional[str] = "measured") -> Latencies:
    """Latencies from a real loop's timings (verify times keyed by the number of verified tokens)."""
    a, b = fit_verify_latency(list(verify_ms_by_tokens), list(verify_ms_by_tokens.values()))
    return Latencies(baseline_token_ms=baseline_token_ms, verify_ms=max(a, 1e-6), verify_ms_per_token=b,
                     draft_step_ms=draft_step_ms, draft_extend_ms=draft_extend_ms, source=source or "measured")
