"""The eval stage: `run_eval(config)` (called by eval/run.py and by tests / the demo).

Reads the validation hidden-state store of the capture stage and a drafter directory, writes
`<out_dir>/report.json`, PNG plots and `manifest.json`, prints the summary. A rerun whose
manifest names the same config, capture fingerprint and drafter checksum is reused.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch

from eagle3.accept_sim import SpecKnobs
from eagle3.conf import ConfigError, as_plain_dict
from eagle3.cost_model import PRESETS, Latencies, predict
from eagle3.manifest import MANIFEST, atomic_write_json, fingerprint, write_manifest
from eagle3.schema.eval import EvalConfig
from eval.evaluate import EvalInputError, NgramSettings, evaluate_drafter

log = logging.getLogger(__name__)
REPORT = "report.json"


def drafter_checksum(drafter_dir: Path) -> str:
    """sha256 over the drafter's config.json and weight files (names + contents)."""
    h = hashlib.sha256()
    files = sorted(p for p in drafter_dir.iterdir() if p.name == "config.json" or p.name.endswith(".safetensors")
                   or p.name.endswith(".safetensors.index.json"))
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def latencies_from_config(cfg) -> Latencies:
    """The `cost` section: a named preset with per-field overrides."""
    base = PRESETS[cfg.preset] if cfg.preset else None
    pick = (lambda name, default=0.0: getattr(cfg, name) if getattr(cfg, name) is not None
            else (getattr(base, name) if base is not None else default))
    baseline_ms = 1000.0 / cfg.baseline_tok_s if cfg.baseline_tok_s is not None else base.baseline_token_ms
    changed = [n for n in ("baseline_tok_s", "verify_ms", "verify_ms_per_token", "draft_step_ms", "draft_extend_ms")
               if getattr(cfg, n) is not None]
    source = (f"preset {cfg.preset}" if cfg.preset else "config") + (f" with {', '.join(changed)} from config"
                                                                     if cfg.preset and changed else "")
    return Latencies(baseline_token_ms=baseline_ms, verify_ms=pick("verify_ms"),
                     verify_ms_per_token=pick("verify_ms_per_token"), draft_step_ms=pick("draft_step_ms"),
                     draft_extend_ms=pick("draft_extend_ms"), source=source)


def cost_section(report: dict, knobs: list[SpecKnobs], lat: Latencies) -> dict:
    by_knob = {}
    for k in knobs:
        entry = report["accept"][k.label]
        by_knob[k.label] = {}
        for name in ("drafter", "ngram"):
            tau = entry[name]["accept_length"]
            if tau == tau and tau >= 1.0:  # not NaN (no cycles)
                by_knob[k.label][name] = predict(tau, lat, k.num_steps, k.num_draft_tokens).to_dict()
    return {"latencies": as_plain_dict(lat.__dict__), "by_knob": by_knob}


def best_setting(report: dict, knobs: list[SpecKnobs]) -> Optional[dict]:
    """The knob setting with the highest predicted speed-up for the drafter (what export's SERVE.md uses)."""
    scored = [(k, report["cost"]["by_knob"][k.label]["drafter"]) for k in knobs
              if "drafter" in report["cost"]["by_knob"].get(k.label, {})]
    if not scored:
        return None
    k, pred = max(scored, key=lambda kp: kp[1]["speedup"])
    return {"label": k.label, "num_steps": k.num_steps, "topk": k.topk, "num_draft_tokens": k.num_draft_tokens,
            "accept_length": pred["accept_length"], "speedup": pred["speedup"], "predicted_tok_s": pred["spec_tok_s"],
            "baseline_tok_s": pred["baseline_tok_s"], "break_even_accept_length": pred["break_even_accept_length"],
            "wins": pred["wins"], "verdict": pred["verdict"]}


def _prompts_from_store(store, n: int) -> list[torch.Tensor]:
    """The text before each validation sequence's first assistant token (what a user would send)."""
    out = []
    for i in range(len(store)):
        if len(out) >= n:
            break
        s = store[i]
        where = s["loss_mask"].bool().nonzero()
        if where.numel() and int(where[0]) >= 1:
            out.append(s["input_ids"][: int(where[0])].long())
    return out


def _reusable(out_dir: Path, config: dict, inputs: dict) -> Optional[dict]:
    try:
        m = json.loads((out_dir / MANIFEST).read_text())
        report = json.loads((out_dir / REPORT).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    ok = m.get("config") == config and m.get("eval_inputs") == inputs
    return report if ok else None


def _log_wandb(cfg: EvalConfig, report: dict, out_dir: Path, plots: dict) -> Optional[str]:
    if cfg.wandb.mode == "disabled":
        return None
    try:
        import wandb

        run = wandb.init(project=cfg.wandb.project, name=f"eval-{cfg.name}", dir=str(out_dir), mode=cfg.wandb.mode,
                         config=as_plain_dict(cfg), reinit=True)
        flat = {f"eval/{label}/{name}/accept_length": e[name]["accept_length"]
                for label, e in report["accept"].items() for name in ("drafter", "ngram")}
        for k, a in enumerate((report.get("accuracy") or {}).get("step_accuracy", [])):
            flat[f"eval/acc_step{k}"] = a
        flat.update({f"plots/{k}": wandb.Image(str(out_dir / v)) for k, v in plots.items()})
        run.log(flat)
        run.finish()
        return cfg.wandb.mode
    except Exception as e:  # logging must never cost the evaluation
        log.warning("wandb logging failed (%s); the report and plots are on disk", e)
        return f"failed: {e}"


def run_eval(cfg: EvalConfig, console=None) -> Path:
    from eagle3.drafter_io import load_drafter_dir
    from eagle3.store import HiddenStateStore
    from eagle3.target_io import load_embed_tokens, load_target, read_text_config
    from eval.plots import write_plots
    from eval.real_check import real_vs_simulated
    from eval.summary import print_summary

    out_dir, drafter_dir = Path(cfg.out_dir), Path(cfg.drafter_dir)
    store_dir = Path(cfg.capture_dir) / cfg.split
    if not (drafter_dir / "config.json").is_file():
        raise ConfigError(f"no drafter at {drafter_dir} (no config.json): train one first "
                          f"(python train/run.py +init=...) or pass drafter_dir=<a drafter directory>")
    if not (store_dir / MANIFEST).is_file():
        raise ConfigError(f"no {cfg.split} store at {store_dir}: run `make capture-hidden` first")
    knobs = [SpecKnobs(k.num_steps, k.topk, k.num_draft_tokens) for k in cfg.knobs]
    inputs = {"capture": fingerprint(Path(cfg.capture_dir)) if (Path(cfg.capture_dir) / MANIFEST).is_file()
              else fingerprint(store_dir), "drafter_sha256": drafter_checksum(drafter_dir)}
    config_dict = as_plain_dict(cfg)
    if not cfg.force and (old := _reusable(out_dir, config_dict, inputs)) is not None:
        print(f"eval: reusing {out_dir} (same config, capture and drafter)")
        print_summary(old, console)
        return out_dir

    t0 = time.time()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    torch.manual_seed(cfg.seed)
    store = HiddenStateStore(store_dir)
    embed = load_embed_tokens(cfg.target.path, cfg.target.layout)
    drafter = load_drafter_dir(drafter_dir, embed_tokens=embed, device=device, dtype=cfg.dtype).eval()
    report = {"name": cfg.name, "drafter_dir": str(drafter_dir), "store": str(store_dir), "device": device}
    report.update(evaluate_drafter(drafter, store, knobs=knobs, ttt_length=cfg.ttt_length,
                                   max_sequences=cfg.max_sequences,
                                   ngram=NgramSettings(cfg.ngram.max_ngram, cfg.ngram.min_ngram, cfg.ngram.prefer),
                                   progress=cfg.progress))
    report["cost"] = cost_section(report, knobs, latencies_from_config(cfg.cost))
    report["best"] = best_setting(report, knobs)

    if cfg.real_loop.enabled and cfg.real_loop.num_prompts > 0:
        prompts = _prompts_from_store(store, cfg.real_loop.num_prompts)
        if prompts:
            target, _ = load_target(cfg.target.path, cfg.target.layout, cfg.target.dtype, cfg.target.device_map,
                                    cfg.target.trust_remote_code)
            if cfg.target.device_map is None:
                target.to(device)
            eos = read_text_config(cfg.target.path, cfg.target.layout).get("eos_token_id") \
                if cfg.real_loop.stop_at_eos else None
            report["real_loop"] = real_vs_simulated(target, drafter, prompts, knobs, cfg.real_loop.max_new_tokens, eos)
            bad = [k for k, r in report["real_loop"]["knobs"].items() if not r["lossless"]]
            if bad:
                report["warnings"].append(f"the real speculative loop was NOT lossless for {bad}: its output differs "
                                          f"from the target's greedy decode (numerics of the verify pass?)")
            del target
        else:
            report["warnings"].append("real loop skipped: no validation sequence has a prompt before its first "
                                      "assistant token")
    report["seconds"] = time.time() - t0

    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out_dir, cfg.train_dir)
    report["wandb"] = _log_wandb(cfg, report, out_dir, report["plots"])
    atomic_write_json(out_dir / REPORT, report)
    manifest_inputs = {"capture": Path(cfg.capture_dir)} if (Path(cfg.capture_dir) / MANIFEST).is_file() else {}
    write_manifest(out_dir, "eval", cfg, manifest_inputs, eval_inputs=inputs,
                   counts={"sequences": report["sequences"]},
                   summary={label: {n: e[n]["accept_length"] for n in ("drafter", "ngram")}
                            for label, e in report["accept"].items()})
    print_summary(report, console)
    return out_dir


__all__ = ["run_eval", "EvalInputError"]
