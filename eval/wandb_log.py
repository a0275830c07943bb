"""One wandb run for a finished measurement (the eval stage, bench-serve): init, log its flat metrics and
its plots, finish. Logging must never cost the measurement: any failure is a warning, and the report and
plots stay on disk."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from eagle3.config.conf import as_plain_dict

log = logging.getLogger(__name__)


def log_run(cfg, default_name: str, metrics: dict, plots: dict, out_dir: Path) -> Optional[str]:
    """`cfg`: a stage config with a `wandb` section (schema/common.WandbConf); `metrics`: {key: number};
    `plots`: {key: PNG file name under out_dir}. -> None (disabled), the mode, or "failed: <why>"."""
    if cfg.wandb.mode == "disabled":
        return None
    try:
        import wandb

        w = cfg.wandb
        run = wandb.init(project=w.project, entity=w.entity, name=w.name or default_name, group=w.group,
                         tags=list(w.tags), dir=str(out_dir), mode=w.mode, config=as_plain_dict(cfg), reinit=True)
        run.log({**metrics, **{f"plots/{k}": wandb.Image(str(Path(out_dir) / v)) for k, v in plots.items()}})
        run.finish()
        return w.mode
    except Exception as e:  # logging must never cost the measurement
        log.warning("wandb logging failed (%s); the report and plots are on disk", e)
        return f"failed: {e}"
