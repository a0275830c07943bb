"""The study's report from its run records (`<out_dir>/records/*.json`, written by pipeline/study.py):
curves with their spread over seeds, a table mean +- std per training budget, the derived answers,
what fine-tuning forgets, the knob search and a recommendation. Plots: matplotlib, Agg backend."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from eagle3.engines.serve_launch import SpecKnobs
from eagle3.config.conf import ConfigError
from eagle3.replay.knob_grid import knob_table
from eagle3.engines.serve_costs import FLAT_OF, resolve_preset
from eagle3.formats.manifest import atomic_write_bytes, atomic_write_json
from pipeline.study_stats import mean_std, token_saving_pairs, world_difference, world_spread

ZERO_SHOT = "k2_zero_shot"
RECORDS = "records"   # <out_dir>/records/<name>.json: one per measured drafter
NGRAM, NGRAM_FILE = "ngram", "ngram.json"   # n-gram prompt lookup over the knob grid (no drafter)
LABELS = {"scratch": "from scratch", "aqmedai_k2": "from the K2 drafter", ZERO_SHOT: "K2 drafter, zero-shot",
          NGRAM: "n-gram prompt lookup (no drafter)"}


def load_records(runs_dir: Path) -> list[dict]:
    recs = []
    for p in sorted(Path(runs_dir).glob("*.json")):
        try:
            recs.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"[study] skipping unreadable run record {p}: {e}", flush=True)
    return recs


def metric_names(records: list[dict]) -> list[tuple[str, str]]:
    """[(key, title)]: accuracy at step 0, mean accuracy, then the simulated accept length per knob."""
    labels = next((list(p["tau"]) for r in records for p in r["points"]), [])
    ttt = next((len(p["acc"]) for r in records for p in r["points"] if p["acc"]), 0)
    return [("acc_step0", "acc step 0"), ("acc_mean", f"acc mean ({ttt} steps)")] + \
        [(f"tau {label}", f"sim tau {label}") for label in labels]


def value(metrics: dict, key: str) -> float:
    return metrics["tau"].get(key[4:], float("nan")) if key.startswith("tau ") else metrics.get(key, float("nan"))


def world_seed(record: dict) -> int:
    """The world a record was measured in (records written before worlds were recorded: the default, 0)."""
    return record.get("world_seed", 0)


def check_worlds(records: list[dict]) -> dict[int, Optional[str]]:
    """{world seed: world fingerprint id} of the records. Records of one world seed whose fingerprints
    differ (a world rebuilt differently, records from another machine) are refused by name: pooling
    them would put world variance into the seed spread."""
    ids: dict[int, dict[str, list[str]]] = {}
    for r in records:
        fp = (r.get("world") or {}).get("id")
        ids.setdefault(world_seed(r), {}).setdefault(fp, []).append(r.get("name", "?"))
    for w, by_id in ids.items():
        known = {i: names for i, names in by_id.items() if i is not None}
        if len(known) > 1:
            desc = "; ".join(f"world {i}: {', '.join(sorted(n))}" for i, n in known.items())
            raise ConfigError(f"study records of world seed {w} come from different worlds ({desc}): the world "
                              "was rebuilt differently between runs; move the stale records out of "
                              "<out_dir>/records (or use a new out_dir) and rerun")
    return {w: next((i for i in by_id if i is not None), None) for w, by_id in ids.items()}


def by_init(records: list[dict], inits: list[str]) -> dict[str, list[dict]]:
    """{init: runs sorted by world, then seed}: the zero-shot K2 drafter first, then `inits` in their order."""
    order = [ZERO_SHOT] + list(inits)
    out: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: (order.index(r["init"]) if r["init"] in order else len(order),
                                            world_seed(r), r["seed"] if r["seed"] is not None else -1)):
        out.setdefault(r["init"], []).append(r)
    return out


def by_world(runs: list[dict], key: str) -> dict[int, list[float]]:
    """{world seed: final value of `key` per run}."""
    out: dict[int, list[float]] = {}
    for r in runs:
        out.setdefault(world_seed(r), []).append(value(r["points"][-1], key))
    return out


def series(runs: list[dict], key: str) -> list[list[tuple[float, float]]]:
    """One learning curve [(tokens, value)] per run."""
    return [[(float(p["tokens"]), value(p, key)) for p in r["points"]] for r in runs]


def _pm(xs: list[float], nd: int = 3) -> str:
    m, s = mean_std(xs)
    return "-" if m != m else f"{m:.{nd}f} ± {s:.{nd}f}"


def budget_table(groups: dict[str, list[dict]], inits: list[str], metrics: list[tuple[str, str]]) -> str:
    """Markdown: one row per budget (point index), mean ± std over seeds of each metric per init."""
    n = min((len(r["points"]) for i in inits for r in groups.get(i, [])), default=0)
    cols = ["step", "tokens (mean)"] + [f"{title}: {LABELS.get(i, i)}" for _, title in metrics for i in inits]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for b in range(n):
        pts = {i: [r["points"][b] for r in groups.get(i, [])] for i in inits}
        toks = [p["tokens"] for i in inits for p in pts[i]]
        step = next(p["step"] for i in inits for p in pts[i])
        cells = [str(step), f"{sum(toks) / len(toks):,.0f}"]
        cells += [_pm([value(p, k) for p in pts[i]]) for k, _ in metrics for i in inits]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(groups: dict[str, list[dict]], inits: list[str], metrics: list[tuple[str, str]], out_dir: Path,
                zero_shot: Optional[dict]) -> dict[str, str]:
    """One PNG per metric: mean over seeds against training tokens, shaded ± one std, thin lines per
    seed; the zero-shot K2 drafter as a dashed level."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    for key, title in metrics:
        fig, ax = plt.subplots(figsize=(5.6, 3.5))
        for i, color in zip(inits, ("tab:blue", "tab:orange", "tab:green")):
            curves = series(groups.get(i, []), key)
            if not curves:
                continue
            n = min(len(c) for c in curves)
            xs = [sum(c[b][0] for c in curves) / len(curves) for b in range(n)]
            stats = [mean_std([c[b][1] for c in curves]) for b in range(n)]
            for c in curves:
                ax.plot([p[0] for p in c], [p[1] for p in c], color=color, alpha=0.25, lw=0.8)
            ax.plot(xs, [m for m, _ in stats], "-o", ms=3, color=color, label=f"{LABELS.get(i, i)} (n={len(curves)})")
            ax.fill_between(xs, [m - s for m, s in stats], [m + s for m, s in stats], color=color, alpha=0.2)
        if zero_shot is not None:
            ax.axhline(value(zero_shot, key), color="gray", ls="--", lw=1, label=LABELS[ZERO_SHOT])
        ax.set_xlabel("training tokens")
        ax.set_ylabel(title)
        ax.set_title(f"{title} on held-out K2.5 traffic (mean ± std over seeds)", fontsize=9)
        ax.legend(fontsize=7)
        name = "curve_" + key.replace(" ", "_").replace("/", "-") + ".png"
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        atomic_write_bytes(out_dir / name, buf.getvalue())
        files[key] = name
    return files


def derived(groups: dict[str, list[dict]], metrics: list[tuple[str, str]], primary: str, confidence: float) -> dict:
    """The token saving of the K2 start on the primary accept length (run pairs within a world), the
    final difference (K2 start - scratch) of every metric with its interval (over worlds when there are
    several: pipeline/study_stats.world_difference), and each init's seed and world spread."""
    fast, slow = groups.get("aqmedai_k2", []), groups.get("scratch", [])
    tau = f"tau {primary}"
    pairs = [(f, s) for f, fr in zip(series(fast, tau), fast) for s, sr in zip(series(slow, tau), slow)
             if world_seed(fr) == world_seed(sr)]  # a pair compares runs of one world
    out = {"primary": primary, "saving": token_saving_pairs(pairs),
           "final_difference": {}, "spread": {}}
    for key, title in metrics:
        out["final_difference"][title] = world_difference(by_world(fast, key), by_world(slow, key), confidence)
        out["spread"][title] = {init: world_spread(by_world(runs, key)) for init, runs in groups.items()
                                if init != ZERO_SHOT}
    return out


def forgetting(groups: dict[str, list[dict]], primary: str) -> list[dict]:
    """Per drafter group: accuracy at step 0 and primary accept length on K2.5 and on
    K2 traffic."""
    rows = []
    for init, runs in groups.items():
        k25 = [r["points"][-1] for r in runs]
        k2 = [r["final"]["k2_traffic"] for r in runs]
        rows.append({"drafter": LABELS.get(init, init), "runs": len(runs),
                     "k25_acc0": [p["acc_step0"] for p in k25], "k2_acc0": [p["acc_step0"] for p in k2],
                     "k25_tau": [value(p, f"tau {primary}") for p in k25],
                     "k2_tau": [value(p, f"tau {primary}") for p in k2]})
    return rows


def ngram_group(out_dir: Path, worlds: list[int]) -> dict[str, list[dict]]:
    """The n-gram baseline's grid, one run per world (`[world<k>-]ngram.json`), as a group for
    knob_search ({} when it was not measured)."""
    runs = []
    for w in worlds:
        try:
            rec = json.loads((Path(out_dir) / (("" if w == 0 else f"world{w}-") + NGRAM_FILE)).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        runs.append({"final": {"grid_tau": rec["grid_tau"]}})
    return {NGRAM: runs} if runs else {}


def knob_search(groups: dict[str, list[dict]], lat, flat=None) -> dict[str, dict]:
    """Per drafter group: the grid's mean simulated accept length per setting priced by the cost model,
    the best setting by mean predicted speed-up, and that setting's speed-up per seed. `flat`: other
    latencies (the account's cycle as given, the same for every setting) whose best setting is reported
    beside, so the effect of the assumed per-step costs shows."""
    out = {}
    for init, runs in groups.items():
        grids = [r["final"]["grid_tau"] for r in runs]
        labels = list(grids[0]) if grids else []
        knobs = [SpecKnobs(*map(int, label.split("/"))) for label in labels]
        mean_tau = {label: mean_std([g[label] for g in grids])[0] for label in labels}
        table = knob_table(mean_tau, knobs, lat)
        if not table:
            continue
        best = max(table.values(), key=lambda e: e["speedup"])
        label = f"{best['num_steps']}/{best['topk']}/{best['num_draft_tokens']}"
        per_seed = [knob_table({label: g[label]}, [k for k in knobs if k.label == label], lat).get(label, {})
                    .get("speedup", float("nan")) for g in grids]
        chains = [e for e in table.values() if e["topk"] == 1]
        out[init] = {"table": table, "best": {**best, "label": label, "speedup_per_seed": per_seed},
                     "best_chain": max(chains, key=lambda e: e["speedup"]) if chains else None}
        if flat is not None:
            f = max(knob_table(mean_tau, knobs, flat).values(), key=lambda e: e["speedup"])
            out[init]["best_flat"] = {**f, "label": f"{f['num_steps']}/{f['topk']}/{f['num_draft_tokens']}"}
    return out


def recommendation(knobs: dict[str, dict], cfg) -> dict:
    """The drafter and setting with the highest mean predicted speed-up, and the SGLang command for the
    real models (paths from the export / target configs)."""
    from eagle3.config.conf import compose
    from eagle3.engines.serve_launch import ServeChoice, sglang_command, shell, tensor_parallel

    trained = {k: v for k, v in knobs.items() if k not in (ZERO_SHOT, NGRAM)}
    if not trained:
        return {}
    init = max(trained, key=lambda i: trained[i]["best"]["speedup"])
    best = trained[init]["best"]
    exp = compose("export", [f"paths.root={cfg.paths.root}", "target=kimi_k25", f"+init={init}"])
    target = SimpleNamespace(path=exp.target.path, layout=exp.target.layout,
                             trust_remote_code=exp.target.trust_remote_code)
    draft_dir = exp.out_dir
    choice = ServeChoice(best["num_steps"], best["topk"], best["num_draft_tokens"], "study knob search",
                         best["accept_length"], best["speedup"])
    cmd = sglang_command(target, draft_dir, choice, tensor_parallel(target, None), [])
    ngram = (knobs.get(NGRAM) or {}).get("best")
    return {"init": init, "setting": best, "wins": best["speedup"] > 1.0, "command": shell(cmd),
            "ngram_beats_it": bool(ngram and ngram["speedup"] > best["speedup"])}


def load_timings(out_dir: Path) -> list[dict]:
    """Every invocation's stage times (pipeline/study.py save_timings), oldest first."""
    out = []
    for p in sorted((Path(out_dir) / "timings").glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def write_report(cfg, records: list[dict], out_dir: Path) -> Path:
    from eval.report import latencies_from_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not records:
        raise ConfigError(f"no run records under {out_dir / RECORDS}: run the study first (report_only=false)")
    records = [r for r in records if world_seed(r) in cfg.world_seeds
               and (r["init"] == ZERO_SHOT or (r["init"] in cfg.inits and r["seed"] in cfg.seeds))]
    worlds = check_worlds(records)
    groups = by_init(records, cfg.inits)
    zs = groups.get(ZERO_SHOT, [None])[0]
    inits = [i for i in cfg.inits if i in groups]
    metrics = metric_names(records)
    lat = latencies_from_config(cfg.cost)
    result = {"derived": derived(groups, metrics, cfg.primary_knob, cfg.confidence),
              "forgetting": forgetting(groups, cfg.primary_knob),
              "knobs": knob_search({**groups, **ngram_group(out_dir, sorted(worlds))}, lat,
                                   resolve_preset(FLAT_OF.get(cfg.cost.preset))),
              "latencies": {k: getattr(lat, k) for k in ("baseline_token_ms", "verify_ms", "verify_ms_per_token",
                                                          "draft_step_ms", "draft_extend_ms", "source")},
              "plots": plot_curves(groups, inits, metrics, out_dir, zs["points"][0] if zs else None),
              "machine": measured_on(records), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "timings": load_timings(out_dir),
              "seeds": {i: sorted({r["seed"] for r in groups[i]}) for i in inits},
              "worlds": {str(w): fp for w, fp in sorted(worlds.items())}}
    from pipeline.study_images import load_mismatch, render_images

    mismatch = [m for m in load_mismatch(out_dir) if m.get("world_seed", 0) in cfg.world_seeds
                and m.get("seed") in cfg.seeds]
    result["images"] = render_images(groups, mismatch, cfg.primary_knob, LABELS)
    result["recommendation"] = recommendation(result["knobs"], cfg)
    result["table"] = budget_table(groups, inits, metrics)
    atomic_write_json(out_dir / "report.json", result)
    text = render(result, groups, cfg)
    atomic_write_bytes(out_dir / "report.md", text.encode())
    print("\n" + text, flush=True)
    return out_dir


def measured_on(records: list[dict]) -> str:
    """Where the records were measured (each record names its machine), and where this report was
    built when that differs (a report_only rebuild on another machine)."""
    here = machine()
    seen = sorted({r["machine"] for r in records if r.get("machine")})
    if not seen:
        return f"report built on {here}; the records do not name their machine"
    return "measured on " + " + ".join(seen) + ("" if seen == [here] else f"; report built on {here}")


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = platform.processor() or platform.machine()
    return f"{platform.node() or 'host'}: {cpu}" + (f", {gpu}" if gpu else ", CPU only")


def _ci(d: dict, nd: int = 3) -> str:
    if d["low"] != d["low"]:
        return f"{d['diff']:+.{nd}f} (no interval: fewer than 2 runs a side)"
    return f"{d['diff']:+.{nd}f} [{d['low']:+.{nd}f}, {d['high']:+.{nd}f}]"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _rule(n: int) -> str:
    return "|" + "---|" * n


def render_derived(d: dict, confidence: float) -> list[str]:
    sav = d["saving"]
    saving = ("not measurable" if not sav["ratios"] else
              f"{sav['mean']:.2f}x ± {sav['std']:.2f} (range {sav['min']:.2f}x-{sav['max']:.2f}x over "
              f"{len(sav['ratios'])} of {sav['pairs']} seed pairs, each pair within one world)")
    level = next((ci["level"] for ci in d["final_difference"].values()), "seeds (one world)")
    how = ("Welch interval over seeds; this covers ONE world: world-to-world variation is not in it"
           if level != "worlds" else "interval over worlds (Student t on the per-world differences, "
           "so world-to-world variation is in it)")
    lines = ["## Derived answers", "",
             f"- Token saving of the K2 start (sim tau {d['primary']}): scratch's final tokens / the tokens the K2 "
             f"start needs to first reach scratch's final value: **{saving}**; pairs never reached: "
             f"{sav['not_reached']}, reached at 0 tokens: {sav['at_start']}.",
             f"- Final difference, K2 start - scratch, with its {100 * confidence:.0f}% {how}:"]
    lines += [f"  - {title}: {_ci(ci)}" + ("" if ci["level"] != "worlds" else " (per world: " + ", ".join(
        f"{w}: {v:+.3f}" for w, v in ci["per_world"].items()) + ")") for title, ci in d["final_difference"].items()]
    spread = d.get("spread") or {}
    if spread:
        lines += ["", "Spread of the final values: seed = pooled std over seeds within a world, world = std of "
                  "the world means (- with one world).", "",
                  _row(["metric", "drafter", "mean", "seed spread", "world spread", "worlds x runs"]), _rule(6)]
        fmt = lambda v: "-" if v != v else f"{v:.3f}"  # noqa: E731
        for title, per_init in spread.items():
            for init, sp in per_init.items():
                lines.append(_row([title, LABELS.get(init, init), fmt(sp["mean"]), fmt(sp["seed_std"]),
                                   fmt(sp["world_std"]), f"{sp['worlds']} x {sp['runs']}"]))
    return lines


def render_forgetting(rows: list[dict], primary: str) -> list[str]:
    lines = ["## What fine-tuning forgets (final drafters; K2 traffic = the K2 side's held-out store, served "
             "with k2-mini)", "",
             _row(["drafter", "runs", "acc step 0 on K2.5", "acc step 0 on K2", f"sim tau {primary} on K2.5",
                   f"sim tau {primary} on K2"]), _rule(6)]
    return lines + [_row([r["drafter"], r["runs"], _pm(r["k25_acc0"]), _pm(r["k2_acc0"]), _pm(r["k25_tau"]),
                          _pm(r["k2_tau"])]) for r in rows]


def render_knobs(knobs: dict, rec: dict, lat: dict) -> list[str]:
    lines = [f"## Knobs (cost model: baseline {1000 / lat['baseline_token_ms']:.0f} tok/s, verify "
             f"{lat['verify_ms']:.1f} ms + {lat['verify_ms_per_token']:.2f} ms per verified token, draft step "
             f"{lat['draft_step_ms']:.2f} ms; {lat['source']})", "",
             _row(["drafter", "best setting", "sim tau", "predicted speed-up (mean ± std over seeds)",
                   "break-even tau", "best chain", "best at a flat cycle (the preset as given)"]), _rule(7)]
    for init, k in knobs.items():
        b, c, f = k["best"], k["best_chain"], k.get("best_flat")
        chain = "-" if c is None else f"{c['num_steps']}/1/{c['num_draft_tokens']}: tau {c['accept_length']:.2f}, " \
                                      f"{c['speedup']:.2f}x"
        flat = "-" if f is None else f"{f['label']}: tau {f['accept_length']:.2f}, {f['speedup']:.2f}x"
        lines.append(_row([LABELS.get(init, init), b["label"], f"{b['accept_length']:.3f}",
                           f"{_pm(b['speedup_per_seed'], 2)}x", f"{b['break_even_accept_length']:.2f}", chain, flat]))
    if rec:
        s = rec["setting"]
        verdict = ("predicted to beat plain decoding" if rec["wins"] else
                   "still predicted SLOWER than plain decoding: keep speculation off on this server")
        ngram = " n-gram prompt lookup is predicted faster still on these targets (table above)." \
            if rec.get("ngram_beats_it") else ""
        lines += ["", f"**Recommendation:** {LABELS.get(rec['init'], rec['init'])}, {s['label']} (steps/topk/draft "
                  f"tokens): sim tau {s['accept_length']:.2f}, predicted {s['speedup']:.2f}x ({verdict}; break-even "
                  f"tau {s['break_even_accept_length']:.2f}).{ngram}", "", "```bash", rec["command"], "```"]
    return lines


def render_real(groups: dict[str, list[dict]]) -> list[str]:
    real = [(r["name"], r["final"].get("real") or {}) for runs in groups.values() for r in runs]
    real = [(n, x) for n, x in real if x and "skipped" not in x]
    if not real:
        return []
    labels = list(real[0][1])
    lines = ["## Real speculative loop (final drafters, k25-mini)", "",
             _row(["drafter"] + [f"real / sim tau {label}" for label in labels] + ["lossless"]),
             _rule(len(labels) + 2)]
    for n, x in real:
        cells = [f"{x[label]['real_accept_length']:.3f} / {x[label]['sim_accept_length']:.3f}" for label in labels]
        lines.append(_row([n] + cells + [all(x[label]["lossless"] for label in labels)]))
    return lines


def render(result: dict, groups: dict[str, list[dict]], cfg) -> str:
    lines = [f"# Study: is the K2 drafter a better start for K2.5 than scratch? ({result['date']}, "
             f"{result['machine']})", "",
             f"Worlds (seed: fingerprint): {result.get('worlds')}; training seeds per init: {result['seeds']}; "
             f"x = real training tokens seen; spread = sample std over all runs (every world and seed).",
             "", "## Learning curves (held-out K2.5 traffic)", "", result["table"], ""]
    lines += [f"![{k}]({v})" for k, v in result["plots"].items()] + [""]
    lines += render_derived(result["derived"], cfg.confidence) + [""]
    lines += render_forgetting(result["forgetting"], cfg.primary_knob) + [""]
    lines += render_knobs(result["knobs"], result["recommendation"], result["latencies"]) + [""]
    lines += render_real(groups)
    lines += ([""] if result.get("images") else []) + list(result.get("images") or [])
    for t in result.get("timings") or []:
        lines += ["", f"| step (invocation started {t['start']} UTC) | seconds |", "|---|---|"]
        lines += [f"| {label} | {sec:.1f} |" for label, sec, _ in t["rows"]]
        lines.append(f"| total | {t['total_seconds']:.1f} |")
    return "\n".join(lines) + "\n"
