"""The bench-serve stage: `run_bench_serve(config)` (eval/run_bench_serve.py, tests).

1. Probe every server (never start one): unreachable -> one line with its launch command each, then
   a BenchServeError; speculation not as configured -> refused (eval/serve_measure.py).
2. Send the same held-out prompts (token ids from the capture's split) to each, concurrency 1, resuming
   from <out_dir>/requests/<server>.jsonl.
3. Replay each speculative server's own generations with its knobs (eval/serve_compare.py): predicted vs
   served accept length per knob and per position, and the verdict of each checkable cause of a gap.
4. Fit the cost split from the timings (eagle3/replay/cost_fit.py), write <out_dir>/cost_preset.json (eval and
   study take cost.preset=measured:<file>), replay the knob grid on the baseline's generations and price
   it: the knobs to serve with.
5. report.json, plots, manifest.json, the table; wandb offline like the other stages.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from eagle3.engines import aux_layers
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.config.conf import ConfigError
from eagle3.replay.cost_fit import CostFitError, fit_cycle_costs
from eagle3.engines.serve_costs import MEASURED_PREFIX, preset_file_body
from eagle3.formats.manifest import MANIFEST, atomic_write_json, write_manifest
from eagle3.config.schema.bench_serve import BenchServeConfig
from eval import serve_report as rep
from eagle3.engines.serve_protocol import server_info_speculation
from eval.wandb_log import log_run
from eval.serve_client import Unreachable, sglang_server_info
from eagle3 import fingerprints as fp
from eagle3.config import resolve
from eval.serve_measure import BenchServeError, RequestLog, launch_line, measure, probe, prompts_key

REPORT, PRESET = "report.json", "cost_preset.json"


def load_prompts(cfg: BenchServeConfig) -> list[list[int]]:
    from eagle3.formats.store import HiddenStateStore
    from eval.report import prompts_from_store

    store_dir = Path(cfg.capture_dir) / cfg.split
    if not (store_dir / MANIFEST).is_file():
        raise ConfigError(f"no {cfg.split} store at {store_dir}: the prompts come from it (run `make capture-hidden`)")
    prompts = [p.tolist() for p in prompts_from_store(HiddenStateStore(store_dir), cfg.request.num_prompts)]
    if not prompts:
        raise ConfigError(f"{store_dir}: no sequence has a prompt before its first assistant token")
    return prompts


def _progress(cfg, total: int, desc: str):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)


def run_measurements(cfg: BenchServeConfig, everyone: list, prompts: list[list[int]]) -> tuple[dict, dict, list]:
    """Probe and measure each server that still has requests to do (and is listed in `only`, when given).
    A server whose log is complete needs not be running: one GPU machine serves one setting at a time.
    Returns (measured, probes, servers not measured yet)."""
    logs, todo, skipped = {}, [], []
    for s in everyone:
        key = {"url": s.url, "engine": s.engine, "label": s.label, "prompts": prompts_key(prompts),
               "max_new_tokens": cfg.request.max_new_tokens, "temperature": cfg.request.temperature}
        selected = not cfg.only or s.name in cfg.only
        logs[s.name] = RequestLog(Path(cfg.out_dir) / "requests" / f"{s.name}.jsonl", key, cfg.force and selected,
                                  readonly=not selected)
        if len(logs[s.name].done) < len(prompts):
            (todo if selected else skipped).append(s)
    probes, down = {}, []
    for s in todo:
        try:
            probes[s.name] = probe(cfg, s)
            logs[s.name].save_probe(probes[s.name])
        except Unreachable as e:
            down.append(s)
            print(f"bench-serve: {s.name} unreachable at {s.url} ({e}); start it with: {launch_line(cfg, s)}")
    if down:
        raise BenchServeError(f"{len(down)} of {len(todo)} servers to measure unreachable "
                              f"({', '.join(s.name for s in down)}): start them with the launch lines above (or "
                              f"measure one at a time: only=[<name>]); bench-serve never starts a server")
    for s in todo:
        bar = _progress(cfg, len(prompts), s.name)
        if bar is not None:
            bar.update(len(logs[s.name].done))
        measure(cfg, s, prompts, logs[s.name], probes[s.name], bar)
        if bar is not None:
            bar.close()
        if s.engine == "sglang" and s.speculative:  # the server's own cumulative figure, after our requests
            info = sglang_server_info(s.url.rstrip("/"), cfg.request.timeout_s)
            probes[s.name]["avg_spec_accept_length_after"] = (
                None if info is None else server_info_speculation(info)["avg_spec_accept_length"])
            logs[s.name].save_probe(probes[s.name])
    measured = {}
    for s in everyone:
        rlog = logs[s.name]
        probes.setdefault(s.name, rlog.saved_probe())
        measured[s.name] = {"records": [dict(rlog.done[i], prompt_len=len(prompts[i])) for i in sorted(rlog.done)],
                            "attempts": rlog.all_records()}
    return measured, probes, skipped


def _load_replay(cfg: BenchServeConfig):
    from eagle3.drafter.drafter_io import load_drafter_dir
    from eagle3.target_model.target_io import load_embed_tokens, load_target, read_text_config
    from eval.serve_compare import GenerationReplay

    device = resolve.device(cfg.compare.device)
    embed = load_embed_tokens(cfg.target.path, cfg.target.layout)
    drafter = load_drafter_dir(cfg.drafter_dir, embed_tokens=embed, device=device, dtype=cfg.compare.dtype).eval()
    target, _ = load_target(cfg.target.path, cfg.target.layout, cfg.target.dtype, cfg.target.device_map,
                            cfg.target.trust_remote_code)
    if cfg.target.device_map is None:
        target.to(device)
    text = read_text_config(cfg.target.path, cfg.target.layout)
    h = drafter.config.aux_hf_indices or aux_layers.sglang_default_hf_indices(text["num_hidden_layers"])
    return GenerationReplay(target, drafter, h), drafter


def _think_ids(cfg) -> list[int]:
    from eagle3.target_model.target_io import TargetError, load_tokenizer

    try:
        tok = load_tokenizer(cfg.target)
    except TargetError:  # no tokenizer here: the check says unchecked
        return []
    ids = [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
    return [i for i in ids if isinstance(i, int) and i != tok.unk_token_id]


def compare_and_search(cfg: BenchServeConfig, servers: list, measured: dict, prompts, probes, report: dict) -> None:
    from eval.serve_compare import compare_server, gap_causes
    from eagle3.replay.knob_grid import knob_grid

    replay, drafter = _load_replay(cfg)
    report["compare"] = {}
    for s in servers:
        recs = measured[s.name]["records"]
        if recs:
            report["compare"][s.name] = compare_server(replay, prompts, recs, SpecKnobs(s.num_steps, s.topk,
                                                                                        s.num_draft_tokens),
                                                       cfg.compare.gap_sigmas)
    report["causes"] = gap_causes(cfg, drafter, probes, servers, {n: m["records"] for n, m in measured.items()},
                                  report["compare"], _think_ids(cfg))
    lat = report.get("_latencies")
    if lat is None:
        return
    grid = {k.label: k for k in knob_grid(cfg.knob_grid)}
    grid.update({s.label: SpecKnobs(s.num_steps, s.topk, s.num_draft_tokens) for s in servers})
    base = measured[cfg.baseline.name]["records"]
    taus = {}
    for label, k in grid.items():
        st = None
        for r in base:
            one = replay.stats(prompts[r["i"]], r["output_ids"], k)
            st = one if st is None else st.__iadd__(one)
        taus[label] = st.accept_length if st is not None else float("nan")
    report["knob_search"] = rep.knob_search(taus, list(grid.values()), lat,
                                            rep.measured_speedups(report["servers"], cfg.baseline.name))


def fit_costs(cfg: BenchServeConfig, servers: list, measured: dict, report: dict) -> None:
    points = []
    for s in [cfg.baseline, *servers]:
        if s.speculative or cfg.anchor_baseline:
            points += rep.cycle_points(s, measured[s.name]["records"])
    base_pts = rep.cycle_points(cfg.baseline, measured[cfg.baseline.name]["records"])
    if not base_pts:
        report["cost_fit"] = {"error": "the baseline gave no timed decode step"}
        return
    try:
        fit = fit_cycle_costs(points)
    except CostFitError as e:
        report["cost_fit"] = {"error": str(e)}
        return
    base_ms = sum(p.ms for p in base_pts) / len(base_pts)
    path = Path(cfg.out_dir) / PRESET
    lat = rep.measured_latencies(fit, base_ms, f"measured by make bench-serve ({path})")
    report["cost_fit"] = {k: v for k, v in fit.to_dict().items() if k != "residuals_ms"}
    report["cost_fit"]["points"] = len(points)
    report["latencies"] = rep.latencies_dict(lat)
    report["_latencies"] = lat
    report["cost_preset"] = f"{MEASURED_PREFIX}{path}"
    atomic_write_json(path, preset_file_body(lat, fit=report["cost_fit"], partial=report["status"] != "complete",
                                             servers={s.name: s.label for s in [cfg.baseline, *servers]},
                                             written=time.strftime("%Y-%m-%d %H:%M:%S")))


def _log_wandb(cfg: BenchServeConfig, report: dict, out_dir: Path) -> object:
    flat = {}
    for name, s in report["servers"].items():
        flat[f"serve/{name}/decode_tok_s"] = s["decode_tok_s_pooled"]
        flat[f"serve/{name}/ttft_ms"] = s["ttft_ms_mean"]
        for k, v in (s.get("accept_length") or {}).items():
            if isinstance(v, float):
                flat[f"serve/{name}/accept_length/{k}"] = v
    for name, c in (report.get("compare") or {}).items():
        flat[f"serve/{name}/replay_accept_length"] = c["replay_pooled"]
    return log_run(cfg, f"bench-serve-{cfg.name}", flat, report.get("plots", {}), out_dir)


def run_bench_serve(cfg: BenchServeConfig, console=None) -> Path:
    out_dir = Path(cfg.out_dir)
    if not (Path(cfg.drafter_dir) / "config.json").is_file():
        raise ConfigError(f"no drafter at {cfg.drafter_dir} (no config.json): pass drafter_dir=<the directory the "
                          f"speculative servers load>")
    prompts = load_prompts(cfg)
    servers = list(cfg.servers)
    everyone = [cfg.baseline, *servers]
    t0 = time.time()
    measured, probes, skipped = run_measurements(cfg, everyone, prompts)
    report = {"name": cfg.name, "prompts": len(prompts), "baseline_name": cfg.baseline.name,
              "launch": {s.name: launch_line(cfg, s) for s in everyone},
              "probes": probes, "warnings": [w for p in probes.values() for w in p.get("warnings", [])],
              "servers": {s.name: {"label": s.label, "engine": s.engine, "url": s.url,
                                   **rep.aggregate(measured[s.name]["records"], len(prompts), measured[s.name]["attempts"])}
                          for s in everyone}}
    for s in servers:
        avg = probes.get(s.name, {}).get("avg_spec_accept_length_after")
        if avg is not None and report["servers"][s.name].get("accept_length"):
            report["servers"][s.name]["accept_length"]["server_avg_cumulative"] = avg
    partial = [n for n, s in report["servers"].items() if s["partial"]]
    report["status"] = "complete" if not partial else f"PARTIAL ({', '.join(partial)} missing requests)"
    if skipped:
        report["warnings"].append(f"not measured in this run (only={list(cfg.only)}): "
                                  f"{', '.join(s.name for s in skipped)}; run again with them up")
    fit_costs(cfg, servers, measured, report)
    if cfg.compare.enabled:
        compare_and_search(cfg, servers, measured, prompts, probes, report)
    report.pop("_latencies", None)
    report["seconds"] = time.time() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = rep.write_plots(report, out_dir)
    report["wandb"] = _log_wandb(cfg, report, out_dir)
    atomic_write_json(out_dir / REPORT, report)
    inputs = {"capture": Path(cfg.capture_dir)} if (Path(cfg.capture_dir) / MANIFEST).is_file() else {}
    write_manifest(out_dir, "bench_serve", cfg, inputs, counts={"prompts": len(prompts)},
                   summary={n: s.get("accept_length", {}).get("decode_pooled") for n, s in report["servers"].items()},
                   drafter_sha256=fp.drafter_dir(Path(cfg.drafter_dir)))
    text = rep.render(report)
    (console.print if console is not None else print)(text)
    if report.get("cost_preset"):
        print(f"use it: make eval ARGS=\"cost.preset={report['cost_preset']}\"; make study ARGS=\"cost.preset="
              f"{report['cost_preset']}\"")
    return out_dir
