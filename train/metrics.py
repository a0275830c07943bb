"""Metrics sinks: `out_dir/metrics.jsonl` (always, one JSON object per logging event) and wandb
(offline by default, under `out_dir/wandb/`; online when configured; skipped with a warning when
the package is absent, as on the GPU image). Only rank 0 logs.

On resume, rows of metrics.jsonl past the resumed step are dropped (they belong to work that
the crash threw away), and the wandb run continues under the same id.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    """JSON-safe floats (NaN/inf become strings: JSON has no literal for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def truncate_metrics(path: Path, after_step: int) -> int:
    """Keep rows with step <= after_step; returns how many rows were dropped."""
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            dropped += 1
            continue
        if int(row.get("step", 0)) <= after_step:
            keep.append(line)
        else:
            dropped += 1
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return dropped


class MetricsLogger:
    def __init__(self, out_dir: Path, *, enabled: bool, wandb_conf, run_config: dict,
                 resume_step: Optional[int] = None):
        self.enabled = enabled
        self.path = Path(out_dir) / METRICS_FILE
        self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run: old rows are from a run whose checkpoints are gone
        self._file = open(self.path, "a", buffering=1)
        if wandb_conf.mode != "disabled":
            self.wandb = _init_wandb(Path(out_dir), wandb_conf, run_config, resumed=resume_step is not None)

    def log(self, step: int, values: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        row = {"step": step, "kind": kind, **values}
        self._file.write(json.dumps(_clean(row)) + "\n")
        if self.wandb is not None:
            flat = {f"{kind}/{k}": v for k, v in _flatten(values).items() if isinstance(v, (int, float))}
            self.wandb.log(flat, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb is not None:
            for k, v in _flatten(values).items():
                self.wandb.summary[k] = v

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    @property
    def wandb_dir(self) -> Optional[str]:
        return None if self.wandb is None else str(self.wandb.dir)


def _flatten(values: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{prefix}{k}/{i}": x for i, x in enumerate(v)})
        else:
            out[f"{prefix}{k}"] = v
    return out


def _init_wandb(out_dir: Path, conf, run_config: dict, resumed: bool):
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed: metrics go to %s only", out_dir / METRICS_FILE)
        return None
    # A stable id per output directory, so a resumed run continues the same wandb run.
    run_id = hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:12]
    (out_dir / "wandb").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(project=conf.project, entity=conf.entity, name=conf.name or out_dir.name, group=conf.group,
                      tags=list(conf.tags), mode=conf.mode, dir=str(out_dir), id=run_id,
                      resume="allow" if resumed else None, config=run_config, reinit="finish_previous",
                      settings=wandb.Settings(console="off", x_disable_stats=True))
