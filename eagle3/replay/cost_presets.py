"""Which server the cost model prices: the one home of cost preset names (standard library only).

A preset is either a name in eagle3/replay/cost_model.PRESETS (the account's assumed server) or
`measured:<file>`, a JSON file `make bench-serve` writes from a live server's timings
(eval/bench_serve.py): {"format": FORMAT, "latencies": {Latencies fields}, "fit": {...}, ...}.
The eval and study configs take either as `cost.preset` (eagle3/config/schema/eval.py CostConf), and
eval/stage.py:latencies_from_config resolves it here.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from eagle3.replay.cost_model import PRESETS, Latencies

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
