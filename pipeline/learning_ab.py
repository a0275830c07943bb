"""`make learning-ab`: does a training code path learn as well as the reference? (the A/B every
change to training numerics cites).

One world (the demo size's, world seed `world_seed`), one init, the same seeds and the same steps,
trained once per *arm* (by default the GPU defaults, i.e. the fast unroll compiled with the Triton
AdamW, against `unroll=reference compile=false optim.fused=false`). Every arm's run keeps a
checkpoint at each budget; each is replayed by the eval stage's `evaluate_drafter` (pipeline/study.py's
Evaluator and curve), so the two learning curves are measured the same way. The report gives each
arm's curve (mean ± std over seeds per budget), the final difference B - A of every metric with its
Welch interval over seeds, and the verdict: the same learning when the interval of the primary
accept length covers 0 or |difference| < `bar`.

Records go to `<out_dir>/records/<arm>-seed<k>.json` as they finish (reused on a rerun while the
train run is unchanged); the numerics each arm really ran (resolved unroll, compile, optimizer,
device) come from its train manifest, so a "fast" arm that silently ran the reference shows.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from eagle3.config import resolve
from eagle3.config.conf import compose, to_schema
from eagle3 import fingerprints as fp
from eagle3.formats.manifest import atomic_write_bytes, atomic_write_json, read_manifest
from pipeline.study import Evaluator, cached_record, curve, knobs_of, run_overrides, world_of
from pipeline.study_report import load_records, machine, measured_on, metric_names, value
from pipeline.study_stats import mean_std, welch_interval

RECORDS = "records"


def run_label(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def arm_overrides(cfg, k25: list[str], arm, seed: int) -> list[str]:
    """The train stage's overrides for one run: the size preset's training settings (+ forwarded
    `+train.*`), the arm's, then the A/B's own (pipeline/study.run_overrides), grouped by arm on wandb."""
    return run_overrides(cfg, k25, cfg.init, seed, run_label(arm.name, seed), group=arm.name, extra=arm.train)


def run_learning_ab(cfg) -> Path:
    """Run the A/B of the module docstring; returns the report directory."""
    from pipeline.demo import build_experiment, stage_log

    if not cfg.report_only:
        log = stage_log(cfg, "learning-ab")
        measure_arms(cfg, build_experiment(cfg, log, cfg.world_seed), log)
    return write_ab_report(cfg, load_ab_records(Path(cfg.out_dir) / RECORDS, cfg), Path(cfg.out_dir))


def measure_arms(cfg, exp, log) -> None:
    """Train every (seed, arm) on the built experiment (pipeline/demo.py `Experiment`) and record its curve."""
    from eagle3.config.schema.eval import EvalConfig
    from eagle3.config.schema.train import TrainConfig

    out_dir = Path(cfg.out_dir)
    device = resolve.device(cfg.eval_device)
    ev = Evaluator(to_schema(compose("eval", exp.k25 + list(cfg.overrides.eval)), EvalConfig), device)
    knobs = knobs_of(cfg.curve.knobs)
    for seed in cfg.seeds:  # seeds outermost: an interrupted A/B holds both arms of its first seeds
        for arm in cfg.arms:
            over = arm_overrides(cfg, exp.k25, arm, seed)
            label = run_label(arm.name, seed)
            train_dir = log.run(f"learning-ab: train {label}", "train", over)
            path = out_dir / RECORDS / f"{label}.json"
            key = {"train_manifest_sha256": fp.stage_dir(train_dir),
                   "curve": [cfg.curve.points, cfg.curve.max_sequences, [k.label for k in knobs]]}
            if cached_record(path, key) is not None:
                print(f"[learning-ab] {label}: measurements reused from {path}", flush=True)
                continue
            t = time.time()
            points = curve(to_schema(compose("train", over), TrainConfig), ev, knobs, cfg.curve.max_sequences)
            m = read_manifest(train_dir, "train")
            atomic_write_json(path, {"key": key, "arm": arm.name, "seed": seed, "world_seed": cfg.world_seed,
                                     "world": world_of(train_dir), "numerics": m.get("numerics"),
                                     "train_wall_s": m.get("wall_s"), "points": points,
                                     "eval_seconds": time.time() - t, "machine": machine()})


def load_ab_records(records_dir: Path, cfg) -> dict[str, list[dict]]:
    """{arm: records sorted by seed} for the configured arms and seeds; one world only (refused otherwise)."""
    from eagle3.config.conf import ConfigError

    by_arm: dict[str, list[dict]] = {a.name: [] for a in cfg.arms}
    worlds = set()
    for r in load_records(records_dir):
        if r.get("arm") in by_arm and r.get("seed") in cfg.seeds:
            by_arm[r["arm"]].append(r)
            worlds.add((r.get("world") or {}).get("id"))
    if len(worlds - {None}) > 1:
        raise ConfigError(f"A/B records under {records_dir} come from {len(worlds - {None})} different worlds: an A/B "
                          "compares code paths in one world; use a new out_dir")
    if not all(by_arm.values()):
        raise ConfigError(f"no records for arm(s) {[a for a, rs in by_arm.items() if not rs]} under {records_dir}: "
                          "run the A/B first (report_only=false)")
    return {a: sorted(rs, key=lambda r: r["seed"]) for a, rs in by_arm.items()}


def ab_summary(by_arm: dict[str, list[dict]], primary: str, confidence: float, bar: float) -> dict:
    """Per arm the curve (tokens, mean ± std per budget) of every metric; the final difference
    (second arm - first) with its Welch interval; the verdict on the primary accept length."""
    (a_name, a_runs), (b_name, b_runs) = list(by_arm.items())[:2]
    records = a_runs + b_runs
    metrics = metric_names(records)
    n = min(len(r["points"]) for r in records)
    curves = {arm: {title: [{"step": runs[0]["points"][i]["step"],
                             "tokens": mean_std([r["points"][i]["tokens"] for r in runs])[0],
                             **dict(zip(("mean", "std"), mean_std([value(r["points"][i], key) for r in runs])))}
                            for i in range(n)] for key, title in metrics}
              for arm, runs in by_arm.items()}
    final = {title: welch_interval([value(r["points"][n - 1], key) for r in b_runs],
                                   [value(r["points"][n - 1], key) for r in a_runs], confidence)
             for key, title in metrics}
    p = final[f"sim tau {primary}"]
    covers = p["low"] == p["low"] and p["low"] <= 0 <= p["high"]
    same = covers or abs(p["diff"]) < bar
    return {"arms": [a_name, b_name], "primary": primary, "bar": bar, "curves": curves, "final_difference": final,
            "same_learning": same, "verdict": ("same learning" if same else "DIFFERENT learning") +
            f": {b_name} - {a_name} = {p['diff']:+.4f} sim tau {primary}, "
            f"{100 * confidence:.0f}% interval [{p['low']:+.4f}, {p['high']:+.4f}] "
            f"({'covers 0' if covers else 'excludes 0'}; bar |diff| < {bar})",
            "numerics": {arm: sorted({json.dumps(r.get("numerics"), sort_keys=True) for r in runs})
                         for arm, runs in by_arm.items()},
            "train_wall_s": {arm: mean_std([r.get("train_wall_s") or float("nan") for r in runs])[0]
                             for arm, runs in by_arm.items()},
            "seeds": {arm: [r["seed"] for r in runs] for arm, runs in by_arm.items()},
            "world": next(((r.get("world") or {}).get("id") for r in records if r.get("world")), None),
            "machine": measured_on(records)}


def render_ab(s: dict) -> str:
    a, b = s["arms"]
    key = f"sim tau {s['primary']}"
    lines = [f"# Learning-quality A/B: {b} vs {a}", "",
             f"World {s['world']}; seeds {s['seeds'][a]}; {s['machine']}; mean ± sample std over seeds per budget.",
             "",
             f"**Verdict: {s['verdict']}.**", "",
             f"| step | tokens | {key}: {a} | {key}: {b} | acc mean: {a} | acc mean: {b} |", "|---|---|---|---|---|---|"]
    acc = next(t for t in s["curves"][a] if t.startswith("acc mean"))
    for pa, pb, qa, qb in zip(s["curves"][a][key], s["curves"][b][key], s["curves"][a][acc], s["curves"][b][acc]):
        lines.append(f"| {pa['step']} | {pa['tokens']:,.0f} | {pa['mean']:.4f} ± {pa['std']:.4f} | "
                     f"{pb['mean']:.4f} ± {pb['std']:.4f} | {qa['mean']:.4f} ± {qa['std']:.4f} | "
                     f"{qb['mean']:.4f} ± {qb['std']:.4f} |")
    lines += ["", f"Final difference ({b} - {a}), Welch interval over seeds:"]
    for title, d in s["final_difference"].items():
        lines.append(f"- {title}: {d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]")
    lines += ["", "Numerics each arm ran (from its train manifests):"]
    lines += [f"- {arm}: {'; '.join(v)} (train wall {s['train_wall_s'][arm]:.1f} s per run)"
              for arm, v in s["numerics"].items()]
    return "\n".join(lines) + "\n"


def plot_ab(s: dict, out_dir: Path) -> str:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = f"sim tau {s['primary']}"
    fig, ax = plt.subplots(figsize=(5.6, 3.5))
    for arm, color in zip(s["arms"], ("tab:blue", "tab:orange")):
        pts = s["curves"][arm][key]
        xs, ms, sd = [p["tokens"] for p in pts], [p["mean"] for p in pts], [p["std"] for p in pts]
        ax.plot(xs, ms, "-o", ms=3, color=color, label=arm)
        ax.fill_between(xs, [m - e for m, e in zip(ms, sd)], [m + e for m, e in zip(ms, sd)], color=color, alpha=0.2)
    ax.set_xlabel("training tokens")
    ax.set_ylabel(key)
    ax.set_title("learning-quality A/B (mean ± std over seeds)", fontsize=9)
    ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    name = "ab_curve.png"
    atomic_write_bytes(Path(out_dir) / name, buf.getvalue())
    return name


def write_ab_report(cfg, by_arm: dict[str, list[dict]], out_dir: Path) -> Path:
    s = ab_summary(by_arm, cfg.primary_knob, cfg.confidence, cfg.bar)
    s["plot"] = plot_ab(s, out_dir)
    atomic_write_json(out_dir / "report.json", s)
    text = render_ab(s) + f"\n![{s['primary']}]({s['plot']})\n"
    atomic_write_bytes(out_dir / "report.md", text.encode())
    print("\n" + text, flush=True)
    return out_dir
