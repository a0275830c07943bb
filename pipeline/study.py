"""`make study`: the demo's comparison (is the K2 drafter a better start for K2.5 than scratch?) with
error bars, through the stages themselves.

  1. the mini world, the K2 drafter and the K2.5 data: the demo's own `build_experiment`;
  2. for every seed and init (scratch, aqmedai_k2): the train stage with that seed (data order and
     every random initialisation), a checkpoint at each of `curve.points - 1` training budgets, all
     kept; the run groups by init in one wandb project;
  3. every checkpoint, and the init drafter at 0 tokens (train's own `build_drafter`), evaluated by
     the eval stage's `evaluate_drafter`: accuracy per TTT step, simulated accept length per knob;
  4. each final drafter and the zero-shot K2 drafter: the same on K2-like traffic (the K2 side's
     held-out store, served with k2-mini: what fine-tuning forgets), the simulated accept length over
     a grid of SGLang knobs priced by the cost model, and a real speculative loop (eagle3/real_loop/check.py);
  5. the report (pipeline/study_report.py): curves with spread, a table mean +- std per budget, the token
     saving of the K2 start and the final difference with its interval, forgetting, knobs.

Each run's measurements go to `<out_dir>/records/<name>.json` as soon as they exist (a rerun reuses
them while the train run's manifest is unchanged), so an interrupted study loses at most one run's
evaluation, and `report_only=true` rebuilds the report from them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Sequence

from eagle3.config import resolve
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.replay.knob_grid import knob_grid
from eagle3.config.conf import as_plain_dict, compose, to_schema
from eagle3 import fingerprints as fp
from eagle3.formats.manifest import atomic_write_json
from pipeline.image_traffic import MISMATCH_INIT
from pipeline.study_images import measure_mismatch, placeholder_run_name, traffic_metrics
from pipeline.study_report import NGRAM_FILE, RECORDS, ZERO_SHOT, load_records, machine, write_report



def knobs_of(confs) -> list[SpecKnobs]:
    return [SpecKnobs(k.num_steps, k.topk, k.num_draft_tokens) for k in confs]


def checkpoint_every(train_steps: int, points: int) -> int:
    """Optimizer steps between checkpoints so that budgets 0, e, 2e, ..., train_steps give `points` curve
    points (fewer when train_steps is not a multiple: the last interval is shorter)."""
    return max(1, -(-train_steps // (points - 1)))


def world_prefix(world: int) -> str:
    """Record and run names carry the world unless it is the default one (seed 0)."""
    return "" if world == 0 else f"world{world}-"


def run_name(init: str, seed: int, world: int = 0) -> str:
    return f"{world_prefix(world)}{init}-seed{seed}"


def train_overrides(cfg, k25: list[str], init: str, seed: int, world: int = 0) -> list[str]:
    """The train stage's overrides for one study run (run_overrides), grouped by init on wandb."""
    return run_overrides(cfg, k25, init, seed, run_name(init, seed, world), group=init)


def run_overrides(cfg, k25: list[str], init: str, seed: int, name: str, group: str,
                  extra: Sequence[str] = ()) -> list[str]:
    """The train stage's overrides for one run of an orchestrator that measures curves (the study, the
    learning A/B): the demo size's training settings (and the forwarded `+train.*`), `extra` (an A/B arm's
    code path), then the orchestrator's own (seed, out_dir `train-<name>`, every budget checkpointed and
    kept, validation only at start and end since the checkpoints are evaluated, one wandb project)."""
    every = checkpoint_every(cfg.train_steps, cfg.curve.points)
    return k25 + [f"+init={init}", f"max_steps={cfg.train_steps}"] + list(cfg.overrides.train) + list(extra) + [
        f"seed={seed}", f"out_dir={Path(cfg.stage_dir) / ('train-' + name)}",
        f"checkpoint_every={every}", "keep_checkpoints=0", "val_every=0",
        f"wandb.mode={cfg.wandb.mode}", f"wandb.project={cfg.wandb.project}", f"wandb.group={group}",
        f"wandb.name=train-{name}"]


def world_of(stage_dir: Path) -> Optional[dict]:
    """The world fingerprint a stage directory's manifest carries (eagle3/world.py), None if it has none."""
    from eagle3.formats.manifest import read_manifest
    from eagle3.world import WORLD_KEY

    return read_manifest(stage_dir).get(WORLD_KEY)


def point_metrics(report: dict) -> dict:
    """The study's metrics from an `evaluate_drafter` report: accuracy per TTT step and its mean,
    simulated accept length per knob label."""
    acc = (report.get("accuracy") or {}).get("step_accuracy") or []
    return {"acc": acc, "acc_step0": acc[0] if acc else float("nan"),
            "acc_mean": sum(acc) / len(acc) if acc else float("nan"),
            "tau": {label: e["drafter"]["accept_length"] for label, e in report["accept"].items()},
            **traffic_metrics(report),  # the same on text vs image conversations
            "sequences": report.get("sequences"), "warnings": report.get("warnings", [])}


class Evaluator:
    """The eval stage's offline evaluation of drafters on one side's held-out store (embeddings and
    store loaded once)."""

    def __init__(self, eval_cfg, device: str):
        from eagle3.formats.store import HiddenStateStore
        from eagle3.target_model.target_io import load_embed_tokens

        from eagle3.config.resolve import image_embeddings as resolve

        self.cfg, self.device = eval_cfg, device
        self.image_embeddings = resolve(eval_cfg.image_embeddings)  # what the drafter reads at image rows
        self.store = HiddenStateStore(Path(eval_cfg.capture_dir) / eval_cfg.split)
        self.embed = load_embed_tokens(eval_cfg.target.path, eval_cfg.target.layout)

    def load(self, drafter_dir: Path):
        from eagle3.drafter.drafter_io import load_drafter_dir

        return load_drafter_dir(drafter_dir, embed_tokens=self.embed, device=self.device, dtype="float32").eval()

    def metrics(self, drafter, knobs: list[SpecKnobs], max_sequences: Optional[int],
                image_embeddings: Optional[str] = None) -> dict:
        """`image_embeddings`: serve the image rows under another convention than the eval config's."""
        from eagle3.replay.evaluate import evaluate_drafter

        drafter = drafter.to(self.device).eval()
        rep = evaluate_drafter(drafter, self.store, knobs=knobs, ttt_length=self.cfg.ttt_length,
                               max_sequences=max_sequences, ngram=None, progress=False,
                               image_embeddings=image_embeddings or self.image_embeddings)
        return point_metrics(rep)


def curve(train_cfg, ev: Evaluator, knobs: list[SpecKnobs], max_sequences: Optional[int]) -> list[dict]:
    """[{step, tokens, metrics}] at 0 tokens (the init drafter) and at every kept checkpoint."""
    from eagle3.formats.checkpoints import list_checkpoints, load_training_state
    from train.model_setup import init_drafter  # the drafter the run starts from (0 tokens), train's own code

    points = [{"step": 0, "tokens": 0, **ev.metrics(init_drafter(train_cfg), knobs, max_sequences)}]
    for step, path in list_checkpoints(Path(train_cfg.out_dir) / "checkpoints"):
        tokens = int(load_training_state(path)["tokens_seen"])
        points.append({"step": step, "tokens": tokens, **ev.metrics(ev.load(path), knobs, max_sequences)})
        print(f"[study] {Path(train_cfg.out_dir).name} step {step}: {tokens:,} tokens, "
              + ", ".join(f"tau {k} {v:.3f}" for k, v in points[-1]["tau"].items()), flush=True)
    return points


class RealCheck:
    """The eval stage's real speculative loop (eagle3/real_loop/check.py) against k25-mini, loaded once."""

    def __init__(self, eval_cfg, device: str, conf):
        from eagle3.target_model.target_io import load_target, read_text_config
        from eagle3.config.resolve import image_embeddings as resolve
        from eval.report import prompt_images_from_store, prompts_from_store

        self.conf = conf
        t = eval_cfg.target
        self.target, _ = load_target(t.path, t.layout, t.dtype, t.device_map, t.trust_remote_code)
        if t.device_map is None:
            self.target.to(device)
        self.eos = read_text_config(t.path, t.layout).get("eos_token_id")
        from eagle3.formats.store import HiddenStateStore

        store = HiddenStateStore(Path(eval_cfg.capture_dir) / eval_cfg.split)
        self.prompts = prompts_from_store(store, conf.num_prompts)
        self.images = prompt_images_from_store(store, conf.num_prompts, resolve(eval_cfg.image_embeddings))

    def __call__(self, drafter) -> dict:
        from eagle3.real_loop.check import real_vs_simulated

        if not self.prompts:
            return {"skipped": "no validation sequence has a prompt before its first assistant token"}
        res = real_vs_simulated(self.target, drafter, self.prompts, knobs_of(self.conf.knobs),
                                self.conf.max_new_tokens, self.eos, images=self.images)
        return {label: {k: r[k] for k in ("lossless", "real_accept_length", "sim_accept_length", "cycles")}
                for label, r in res["knobs"].items()}


def final_measurements(drafter_k25, drafter_k2, sides: dict, cfg, real: Optional[RealCheck]) -> dict:
    """What a finished drafter is judged on besides its curve: K2-like traffic (forgetting), the knob
    grid on K2.5 traffic, the real loop."""
    grid = knob_grid(cfg.knob_grid)
    from eagle3.replay.evaluate import simulate_accept_length

    sims = simulate_accept_length(drafter_k25.to(sides["k25"].device), sides["k25"].store, knobs=grid,
                                  max_sequences=cfg.knob_grid.max_sequences, ngram=None, progress=False,
                                  image_embeddings=sides["k25"].image_embeddings)
    out = {"k2_traffic": sides["k2"].metrics(drafter_k2, knobs_of(cfg.curve.knobs), cfg.forgetting_max_sequences),
           "grid_tau": {label: r["drafter"].accept_length for label, r in sims.items()}}
    if real is not None:
        out["real"] = real(drafter_k25)
    return out


def ngram_baseline(cfg, ev: Evaluator, path: Path) -> None:
    """n-gram prompt lookup over the knob grid on the K2.5 store, once (it needs no drafter): the
    no-training alternative the knobs table sets beside the drafters."""
    from eagle3.replay.evaluate import simulate_accept_length

    key = _record_key(cfg, None, {"capture": fp.stage_dir(Path(ev.cfg.capture_dir))})
    if cached_record(path, key) is not None:
        return
    sims = simulate_accept_length(None, ev.store, knobs=knob_grid(cfg.knob_grid),
                                  max_sequences=cfg.knob_grid.max_sequences, progress=False)
    atomic_write_json(path, {"key": key, "grid_tau": {label: r["ngram"].accept_length for label, r in sims.items()}})


def _record_key(cfg, train_dir: Optional[Path], extra: dict) -> dict:
    done = train_dir is not None and (train_dir / "manifest.json").is_file()
    return {"train_manifest_sha256": fp.stage_dir(train_dir) if done else None,
            "curve": as_plain_dict(cfg.curve), "knob_grid": as_plain_dict(cfg.knob_grid),
            "forgetting_max_sequences": cfg.forgetting_max_sequences, "real_check": as_plain_dict(cfg.real_check),
            **extra}


def cached_record(path: Path, key: dict) -> Optional[dict]:
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if rec.get("key") == key else None


def run_study(cfg) -> Path:
    """Run the study of the module docstring in every world of `cfg.world_seeds`; returns the report
    directory."""
    from pipeline.demo import build_experiment, stage_log

    if cfg.report_only:
        return write_report(cfg, load_records(Path(cfg.out_dir) / RECORDS), Path(cfg.out_dir))
    t0 = time.time()
    log = stage_log(cfg, "study")
    for world in cfg.world_seeds:  # worlds outermost: an interrupted study holds whole worlds
        measure_world(cfg, build_experiment(cfg, log, world), log, t0, world)
    save_timings(Path(cfg.out_dir), t0, log.rows)
    return write_report(cfg, load_records(Path(cfg.out_dir) / RECORDS), Path(cfg.out_dir))


def study_on(cfg, worlds: dict, log, t0: float) -> Path:
    """Steps 2-5 on built experiments ({world seed: pipeline/demo.py `Experiment`}); returns the report dir."""
    for world, exp in worlds.items():
        measure_world(cfg, exp, log, t0, world)
    save_timings(Path(cfg.out_dir), t0, log.rows)
    return write_report(cfg, load_records(Path(cfg.out_dir) / RECORDS), Path(cfg.out_dir))


def measure_world(cfg, exp, log, t0: float, world: int) -> None:
    """Steps 2-4 in one world: every run trained and measured, each record written as it finishes."""
    from eagle3.config.schema.eval import EvalConfig
    from eagle3.config.schema.train import TrainConfig

    out_dir = Path(cfg.out_dir)
    runs_dir = out_dir / RECORDS
    device = resolve.device(cfg.eval_device)
    eval_cfgs = {side: to_schema(compose("eval", over + list(cfg.overrides.eval)), EvalConfig)
                 for side, over in (("k25", exp.k25), ("k2", exp.k2))}
    sides = {side: Evaluator(c, device) for side, c in eval_cfgs.items()}
    real = RealCheck(eval_cfgs["k25"], device, cfg.real_check) if cfg.real_check.num_prompts > 0 else None
    curve_knobs = knobs_of(cfg.curve.knobs)
    capture_world = world_of(Path(eval_cfgs["k25"].capture_dir))

    def finished(name: str, drafter_dir: Path, train_dir: Optional[Path], points_fn, meta: dict) -> None:
        path = runs_dir / f"{name}.json"
        key = _record_key(cfg, train_dir, {"drafter_sha256": fp.drafter_weights(drafter_dir)})
        if cached_record(path, key) is not None:
            print(f"[study] {name}: measurements reused from {path}", flush=True)
            return
        t = time.time()
        points = points_fn()
        final = final_measurements(sides["k25"].load(drafter_dir), sides["k2"].load(drafter_dir), sides, cfg, real)
        atomic_write_json(path, {"key": key, "name": name, **meta, "points": points, "final": final,
                                 "eval_seconds": time.time() - t, "machine": machine()})
        _log_wandb(cfg, json.loads(path.read_text()), out_dir)
        log.rows.append((f"study: measure {name}", time.time() - t, str(path)))
        save_timings(out_dir, t0, log.rows)  # an interrupted invocation keeps its times too

    ngram_baseline(cfg, sides["k25"], out_dir / f"{world_prefix(world)}{NGRAM_FILE}")
    zs = exp.k2_drafter
    finished(world_prefix(world) + ZERO_SHOT, zs, None, lambda: [{"step": 0, "tokens": 0, **sides["k25"].metrics(
        sides["k25"].load(zs), curve_knobs, cfg.curve.max_sequences)}],
        {"init": ZERO_SHOT, "seed": None, "world_seed": world, "world": capture_world})
    for seed in cfg.seeds:  # seeds outermost: an interrupted study still holds both inits of the first seeds
        for init in cfg.inits:
            over = train_overrides(cfg, exp.k25, init, seed, world)
            train_dir = log.run(f"study: train {run_name(init, seed, world)}", "train", over)
            train_cfg = to_schema(compose("train", over), TrainConfig)
            finished(run_name(init, seed, world), train_dir / "final", train_dir,
                     lambda: curve(train_cfg, sides["k25"], curve_knobs, cfg.curve.max_sequences),
                     {"init": init, "seed": seed, "world_seed": world, "world": world_of(train_dir),
                      "train_dir": str(train_dir)})
            if init == MISMATCH_INIT and cfg.image_mismatch:
                image_mismatch(cfg, exp, log, sides["k25"], seed, world, train_dir)


def image_mismatch(cfg, exp, log, ev: Evaluator, seed: int, world: int, fused_dir: Path) -> None:
    """The convention-mismatch cost for one seed (pipeline/study_images.py): the from-K2 run trained
    `placeholder` beside the study's own (`fused_dir`, auto = fused), both replayed under both conventions;
    nothing when the K2.5 validation split holds no image traffic."""
    record = json.loads((Path(cfg.out_dir) / RECORDS / f"{run_name(MISMATCH_INIT, seed, world)}.json").read_text())
    if not record["points"][-1].get("image_sequences"):
        print(f"[study] no image traffic in the K2.5 validation split: no convention-mismatch run", flush=True)
        return
    name = placeholder_run_name(seed, world_prefix(world))
    over = run_overrides(cfg, exp.k25, MISMATCH_INIT, seed, name, group=f"{MISMATCH_INIT}-placeholder",
                         extra=["image_embeddings=placeholder"])
    ph_dir = log.run(f"study: train {name}", "train", over)
    t = time.time()
    measure_mismatch(Path(cfg.out_dir), name, {"fused": fused_dir, "placeholder": ph_dir}, ev,
                     knobs_of(cfg.curve.knobs), cfg.curve.max_sequences,
                     {"seed": seed, "world_seed": world, "world": world_of(ph_dir)})
    log.rows.append((f"study: mismatch {name}", time.time() - t, str(ph_dir)))


def save_timings(out_dir: Path, t0: float, rows) -> None:
    """`<out_dir>/timings/<start>.json`: this invocation's stage times so far (the report lists every
    invocation's, so a study finished over several calls shows where all its time went)."""
    start = time.strftime("%Y%m%dT%H%M%S", time.gmtime(t0))
    atomic_write_json(out_dir / "timings" / f"{start}.json",
                      {"start": start, "rows": [list(r) for r in rows], "total_seconds": time.time() - t0})


def _log_wandb(cfg, record: dict, out_dir: Path) -> None:
    """One wandb run per measured drafter in the study's project, grouped by init: its curve against
    training tokens (x axis `tokens`), and its final measurements in the summary."""
    if cfg.wandb.mode == "disabled":
        return
    try:
        import wandb
    except ImportError:
        print("[study] wandb is not installed: measurements are in the run records only", flush=True)
        return
    try:
        run = wandb.init(project=cfg.wandb.project, group=record["init"], name=f"study-{record['name']}",
                         job_type="study-eval", mode=cfg.wandb.mode, dir=str(out_dir), reinit="finish_previous",
                         config={"init": record["init"], "seed": record["seed"]},
                         settings=wandb.Settings(console="off", x_disable_stats=True))
        run.define_metric("tokens")
        run.define_metric("study/*", step_metric="tokens")
        for p in record["points"]:
            row = {"tokens": p["tokens"], "study/acc_step0": p["acc_step0"], "study/acc_mean": p["acc_mean"]}
            row.update({f"study/tau {label}": v for label, v in p["tau"].items()})
            run.log(row)
        k2 = record["final"]["k2_traffic"]
        run.summary.update({"k2_traffic/acc_step0": k2["acc_step0"],
                            **{f"k2_traffic/tau {label}": v for label, v in k2["tau"].items()}})
        run.finish()
    except Exception as e:  # logging must never cost the study
        print(f"[study] wandb logging failed ({e}); the run records are on disk", flush=True)
