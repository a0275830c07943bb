"""The eval stage: `run_eval(config)` (called by eval/run.py and by tests / the demo).

Reads the validation hidden-state store of the capture stage and a drafter directory, writes
`<out_dir>/report.json`, PNG plots and `manifest.json`, prints the summary. A rerun whose
manifest names the same config, capture fingerprint and drafter checksum is reused. What is measured is
eval/report.py's `evaluate`; this file is the recipe: inputs checked, reuse decided, the report published.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from eagle3.config import resolve
from eagle3.config.conf import ConfigError
from eagle3 import fingerprints as fp
from eagle3.formats.manifest import MANIFEST, ManifestError, atomic_write_json, read_json
from eagle3.stage_dir import StageDir
from eagle3.replay.evaluate import EvalInputError
from eagle3.config.schema.eval import EvalConfig
from eval.report import evaluate
from eval.wandb_log import log_run

REPORT = "report.json"


def _reused_report(stage: StageDir, config, inputs: dict) -> Optional[dict]:
    """The report of a finished eval with this config and these inputs, else None."""
    if stage.reused({"config": config, "eval_inputs": inputs}) is None:
        return None
    try:
        return read_json(stage.out / REPORT)
    except ManifestError:
        return None


def _log_wandb(cfg: EvalConfig, report: dict, out_dir: Path, plots: dict) -> Optional[str]:
    flat = {f"eval/{label}/{name}/accept_length": e[name]["accept_length"]
            for label, e in report["accept"].items() for name in ("drafter", "ngram")}
    for k, a in enumerate((report.get("accuracy") or {}).get("step_accuracy", [])):
        flat[f"eval/acc_step{k}"] = a
    return log_run(cfg, f"eval-{cfg.name}", flat, plots, out_dir)


def run_eval(cfg: EvalConfig, console=None) -> Path:
    """The eval stage: inputs checked, reuse decided, the drafter judged, the report published."""
    from eval.plots import write_plots
    from eval.summary import print_summary

    out_dir, drafter_dir, capture_dir = Path(cfg.out_dir), Path(cfg.drafter_dir), Path(cfg.capture_dir)
    stage, store_dir = StageDir(out_dir, "eval", EvalInputError), capture_dir / cfg.split
    if not (drafter_dir / "config.json").is_file():
        raise ConfigError(f"no drafter at {drafter_dir} (no config.json): train one first "
                          f"(python train/run.py +init=...) or pass drafter_dir=<a drafter directory>")
    if not (store_dir / MANIFEST).is_file():
        raise ConfigError(f"no {cfg.split} store at {store_dir}: run `make capture-hidden` first")
    captured = {"capture": capture_dir} if (capture_dir / MANIFEST).is_file() else {}
    inputs = {"capture": fp.stage_dir(captured.get("capture", store_dir)), "drafter_sha256": fp.drafter_dir(drafter_dir)}
    if not cfg.force and (old := _reused_report(stage, cfg, inputs)) is not None:
        print(f"eval: reusing {out_dir} (same config, capture and drafter)")
        print_summary(old, console)
        return out_dir
    resolved = {"device": resolve.device(cfg.device), "image_embeddings": resolve.image_embeddings(cfg.image_embeddings)}

    report = evaluate(cfg, resolved, store_dir, drafter_dir)
    stage.begin()  # the report and plots are written in place
    report["plots"] = write_plots(report, out_dir, cfg.train_dir)
    report["wandb"] = _log_wandb(cfg, report, out_dir, report["plots"])
    atomic_write_json(out_dir / REPORT, report)
    stage.publish(cfg, inputs=captured, eval_inputs=inputs, counts={"sequences": report["sequences"]},
                  summary={label: {n: e[n]["accept_length"] for n in ("drafter", "ngram")}
                           for label, e in report["accept"].items()}, resolved=resolved)
    print_summary(report, console)
    return out_dir


__all__ = ["run_eval", "EvalInputError"]
