"""What a server costs per verify cycle, and which server the cost model prices: the one home of the
per-operation latencies (Latencies), the assumed servers (PRESETS) and the cost preset names (standard
library only). The cost model (eagle3/replay/cost_model.py) prices a cycle with them; the config schemas
check a preset name here.

A preset is either a name in PRESETS (the account's assumed server) or `measured:<file>`, a JSON file
`make bench-serve` writes from a live server's timings (eval/bench_serve.py):
{"format": FORMAT, "latencies": {Latencies fields}, "fit": {...}, ...}. The eval and study configs take
either as `cost.preset` (eagle3/config/schema/eval.py CostConf), and eval/report.py:latencies_from_config
resolves it here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Latencies:
    """Per-operation costs in milliseconds (batch 1)."""
    baseline_token_ms: float
    verify_ms: float
    verify_ms_per_token: float = 0.0
    draft_step_ms: float = 0.0
    draft_extend_ms: float = 0.0
    source: str = "given"

    def __post_init__(self):
        for name in ("baseline_token_ms", "verify_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Latencies.{name}={getattr(self, name)}: must be > 0 ms")
        for name in ("verify_ms_per_token", "draft_step_ms", "draft_extend_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"Latencies.{name}={getattr(self, name)}: must be >= 0 ms")

    @staticmethod
    def from_baseline_tok_s(baseline_tok_s: float, **kw) -> "Latencies":
        if not baseline_tok_s > 0:
            raise ValueError(f"baseline tok/s must be > 0, got {baseline_tok_s}")
        return Latencies(baseline_token_ms=1000.0 / baseline_tok_s, **kw)

    def verify(self, num_tokens: int) -> float:
        return self.verify_ms + self.verify_ms_per_token * num_tokens

    def cycle_ms(self, num_steps: int, num_draft_tokens: int) -> float:
        return self.verify(num_draft_tokens) + num_steps * self.draft_step_ms + self.draft_extend_ms


# The account (docs/design.md "Sources"): Kimi-K2.5 INT4 on 8 RTX PRO 6000 over PCIe, SGLang, 2/1/3:
# 82 tok/s without speculation; "approximately 30 ms per cycle" for the verify, which the account
# gives as the whole cycle's cost, so no separate draft-step cost is added.
ACCOUNT_8GPU_PCIE = Latencies.from_baseline_tok_s(82.0, verify_ms=30.0, source="account: 8x RTX PRO 6000 PCIe, SGLang")
# The same server with the cycle split so that 2/1/3 still costs 30 ms (23.5 + 3 x 1.5 + 2 x 1.0) while other settings
# pay for their size. ASSUMED, not measured (the account measured only the 2/1/3 cycle): a draft step of the one-layer
# drafter over 8 PCIe GPUs (~2-3 all-reduces at ~0.2 ms each) ~1 ms; each verified token adds MoE expert reads ~1.5 ms.
# The study prices its knob grid with it; `make bench-serve` measures the real split (cost.preset=measured:<file>).
ACCOUNT_8GPU_PCIE_SPLIT = Latencies.from_baseline_tok_s(
    82.0, verify_ms=23.5, verify_ms_per_token=1.5, draft_step_ms=1.0,
    source="account: 8x RTX PRO 6000 PCIe, SGLang; its 30 ms 2/1/3 cycle split as ASSUMED 23.5 + 1.5/token + 1.0/step")
PRESETS = {"account_8gpu_pcie": ACCOUNT_8GPU_PCIE, "account_8gpu_pcie_split": ACCOUNT_8GPU_PCIE_SPLIT}
# A split preset's cycle as its source gave it (one cost for every setting): the study reports the best knob under
# both, so the effect of the assumed split shows.
FLAT_OF = {"account_8gpu_pcie_split": "account_8gpu_pcie"}


MEASURED_PREFIX = "measured:"
FORMAT = "eagle3-cost-preset/1"
FIELDS = ("baseline_token_ms", "verify_ms", "verify_ms_per_token", "draft_step_ms", "draft_extend_ms", "source")


class PresetError(ValueError):
    """A preset name that names nothing, or a preset file that is not one."""


def preset_problem(name: Optional[str]) -> Optional[str]:
    """None when `name` resolves, else one line saying why not (for config validation)."""
    try:
        resolve_preset(name)
    except PresetError as e:
        return str(e)
    return None


def resolve_preset(name: Optional[str]) -> Optional[Latencies]:
    """The Latencies a preset name stands for; None for None."""
    if name is None:
        return None
    if name.startswith(MEASURED_PREFIX):
        return read_preset_file(Path(name[len(MEASURED_PREFIX):]))
    if name not in PRESETS:
        raise PresetError(f"cost.preset={name!r}: expected one of {sorted(PRESETS)}, "
                          f"{MEASURED_PREFIX}<file written by make bench-serve>, or null")
    return PRESETS[name]


def read_preset_file(path: Path) -> Latencies:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PresetError(f"cost preset file {path} does not exist (make bench-serve writes one: "
                          f"<its out_dir>/cost_preset.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise PresetError(f"cost preset file {path} is not readable JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("latencies"), dict):
        raise PresetError(f"cost preset file {path}: not a {FORMAT} file (no 'format'/'latencies')")
    lat = data["latencies"]
    missing = [k for k in FIELDS[:4] if k not in lat]
    if missing:
        raise PresetError(f"cost preset file {path}: latencies lack {missing}")
    try:
        return Latencies(**{k: lat[k] for k in FIELDS if k in lat})
    except (TypeError, ValueError) as e:
        raise PresetError(f"cost preset file {path}: {e}") from None


def preset_file_body(lat: Latencies, **extra) -> dict:
    """The JSON body of a measured preset (the caller writes it atomically)."""
    return {"format": FORMAT, "latencies": asdict(lat), **extra}
