"""Numbers, table and plots of `make bench-serve`: per-server aggregates (tok/s, TTFT, accept length
pooled and per-request, labelled), the cost split fitted from the timings, the knob search under it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from eagle3.engines import serve_protocol as sp
from eagle3.replay.accept_sim import acceptance_by_position
from eagle3.replay.cost_fit import CostFit, CyclePoint
from eagle3.engines.serve_costs import Latencies

ACCEPT_LABELS = {
    "engine_pooled": "completion tokens / verify steps over all requests (SGLang's spec_accept_length, pooled; "
                     "counts the prefill's token)",
    "decode_pooled": "(completion tokens - 1) / verify steps over all requests (the replay's convention, pooled)",
    "drafts_pooled": "1 + accepted drafts / verify steps over all requests (vLLM's mean acceptance length)",
    "server_avg_cumulative": "SGLang /get_server_info avg_spec_accept_length after the run: the server's own pooled "
                             "figure, cumulative since it started (warm-up and other traffic included); SGLang refreshes it "
                             "only every 40 decode batches (--decode-log-interval), so it can lag the last requests, "
                             "and leaves it out before the first 40 (then this row is absent)",
    "decode_per_request_mean": "mean over requests of (completion tokens - 1) / verify steps (SpecForge's "
                               "benchmark averages this way)",
}


def _mean(xs) -> float:
    return sp.mean_finite(list(xs))


def aggregate(records: list[dict], expected: int, attempts: list[dict]) -> dict:
    """Per server: request counts (partial?), timings and, with speculation, accept lengths."""
    ok = [r for r in records if r.get("ok")]
    toks = sum(r["completion_tokens"] for r in ok)
    out = {"requests_ok": len(ok), "requests_expected": expected, "partial": len(ok) < expected,
           "attempts": sum(a.get("attempts", 0) for a in attempts), "timeouts": sum(a.get("timeouts", 0) for a in attempts),
           "retries": sum(max(a.get("attempts", 1) - 1, 0) for a in attempts),
           "failed_requests": sum(1 for a in attempts if not a.get("ok")),
           "completion_tokens": toks,
           "output_tok_s_pooled": 1000.0 * toks / sum(r["e2e_ms"] for r in ok) if ok else float("nan"),
           "output_tok_s_per_request_mean": _mean(1000.0 * r["completion_tokens"] / r["e2e_ms"] for r in ok),
           "decode_tok_s_pooled": (1000.0 * sum(r["completion_tokens"] - 1 for r in ok) /
                                   sum(r["decode_ms"] for r in ok)) if ok and sum(r["decode_ms"] for r in ok) > 0
           else float("nan"),
           "ttft_ms_mean": _mean(r["ttft_ms"] for r in ok),
           "ttft_ms_median": sorted(r["ttft_ms"] for r in ok)[len(ok) // 2] if ok else float("nan")}
    specs = [sp.SpecCounts(**r["spec"]) for r in ok if r.get("spec")]
    if specs:
        p = sp.pooled(specs)
        out["accept_length"] = {
            "engine_pooled": p.engine_accept_length, "decode_pooled": p.decode_tokens_per_verify,
            "drafts_pooled": p.drafts_accept_length,
            "decode_per_request_mean": _mean(c.decode_tokens_per_verify for c in specs),
            "engine_per_request_mean": _mean(c.engine_accept_length for c in specs),
            "labels": ACCEPT_LABELS, "naming": p.naming, "verify_steps": p.verify_steps}
        out["acceptance_by_position"] = (acceptance_by_position(p.per_position, p.verify_steps)
                                         if p.per_position and p.verify_steps else None)
    return out


def cycle_points(server, records: list[dict]) -> list[CyclePoint]:
    """Per request: ms per verify cycle (speculative) or per decode token (baseline), from the stream's
    first-to-last token time."""
    pts = []
    for r in records:
        if not r.get("ok") or r["decode_ms"] <= 0:
            continue
        if server.speculative:
            steps = (r.get("spec") or {}).get("verify_steps") or 0
            if steps:
                pts.append(CyclePoint(server.num_draft_tokens, server.num_steps, r["decode_ms"] / steps, server.label))
        elif r["completion_tokens"] > 1:
            pts.append(CyclePoint(1, 0, r["decode_ms"] / (r["completion_tokens"] - 1), "baseline"))
    return pts


def measured_latencies(fit: CostFit, baseline_token_ms: float, source: str) -> Latencies:
    return Latencies(baseline_token_ms=baseline_token_ms, verify_ms=max(fit.verify_ms, 1e-6),
                     verify_ms_per_token=max(fit.verify_ms_per_token, 0.0),
                     draft_step_ms=max(fit.draft_step_ms, 0.0), draft_extend_ms=0.0, source=source)


def knob_search(taus: dict, knobs: list, lat: Latencies, measured: dict) -> dict:
    """Every replayed setting priced by the measured costs; the best; measured speed-up where served."""
    from eagle3.replay.knob_grid import knob_table

    table = knob_table(taus, knobs, lat)
    for label, e in table.items():
        e["measured_speedup"] = measured.get(label)
    best = max(table.values(), key=lambda e: e["speedup"]) if table else None
    if best is not None:
        best = {**best, "label": f"{best['num_steps']}/{best['topk']}/{best['num_draft_tokens']}"}
    return {"table": table, "best": best}


def _f(v, spec=".2f") -> str:
    return "-" if v is None or v != v else format(v, spec)


def render(report: dict) -> str:
    lines = [f"bench-serve {report['name']}: {report['status']}", "",
             f"{'server':<14}{'knobs':<9}{'req':>7}{'tok/s':>9}{'dec tok/s':>11}{'TTFT ms':>9}"
             f"{'tau pooled':>12}{'tau/req':>9}{'replay':>9}{'gap':>8}  finding"]
    for name, s in report["servers"].items():
        a, c = s.get("accept_length") or {}, (report.get("compare") or {}).get(name) or {}
        lines.append(f"{name:<14}{s['label']:<9}{s['requests_ok']:>3}/{s['requests_expected']:<3}"
                     f"{_f(s['output_tok_s_pooled'], '.1f'):>9}{_f(s['decode_tok_s_pooled'], '.1f'):>11}"
                     f"{_f(s['ttft_ms_mean'], '.1f'):>9}{_f(a.get('decode_pooled')):>12}"
                     f"{_f(a.get('decode_per_request_mean')):>9}{_f(c.get('replay_pooled')):>9}{_f(c.get('gap'), '+.2f'):>8}"
                     f"  {'' if not c else ('YES' if c['finding'] else 'no')}")
    lines += ["", "tau pooled = " + ACCEPT_LABELS["decode_pooled"], "tau/req = " + ACCEPT_LABELS["decode_per_request_mean"]]
    if report.get("causes"):
        lines += ["", "Causes of a served-vs-predicted gap:"]
        lines += [f"  {c['cause']:<32}{c['verdict']:<10}{c['detail']}" for c in report["causes"]]
    fit = report.get("cost_fit")
    if fit and "error" not in fit:
        lines += ["", f"Cost split (fitted, rms residual {fit['rms_ms']:.2f} ms): verify {fit['verify_ms']:.2f} ms + "
                      f"{fit['verify_ms_per_token']:.2f} ms per verified token + {fit['draft_step_ms']:.2f} ms per draft "
                      f"step; plain decode step {report['latencies']['baseline_token_ms']:.2f} ms"
                      + (f"; held at 0: {fit['clamped']}" if fit.get("clamped") else "")]
        lines += [f"  {lab:<10} n={e['num_draft_tokens']} s={e['num_steps']}: measured {e['measured_ms']:.2f} ms, "
                  f"fitted {e['fitted_ms']:.2f} ms, residual {e['residual_ms']:+.2f} ms" for lab, e in fit["by_label"].items()]
        lines.append(f"Cost preset: {report['cost_preset']}")
    elif fit:
        lines += ["", f"Cost split not fitted: {fit['error']}"]
    ks = report.get("knob_search")
    if ks and ks.get("best"):
        b = ks["best"]
        if b["speedup"] <= 1.0:
            lines += ["", f"No searched setting beats plain decoding under the measured costs: serve WITHOUT "
                          f"speculation (best {b['label']}: predicted {b['speedup']:.2f}x at accept length "
                          f"{b['accept_length']:.2f})"]
        else:
            lines += ["", f"Serve with {b['label']} (--speculative-num-steps {b['num_steps']} --speculative-eagle-topk "
                      f"{b['topk']} --speculative-num-draft-tokens {b['num_draft_tokens']}): predicted {b['speedup']:.2f}x "
                      f"at accept length {b['accept_length']:.2f}"
                      + (f", measured {b['measured_speedup']:.2f}x" if b.get("measured_speedup") else "")]
        for label, e in sorted(ks["table"].items(), key=lambda kv: -kv[1]["speedup"])[:8]:
            lines.append(f"  {label:<8} tau {e['accept_length']:.2f}  predicted {e['speedup']:.2f}x"
                         + (f"  measured {e['measured_speedup']:.2f}x" if e.get("measured_speedup") else ""))
    for w in report.get("warnings", []):
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)


def write_plots(report: dict, out_dir: Path) -> dict:
    from eval.plots import save_png  # first: it selects the Agg backend
    import matplotlib.pyplot as plt

    plots = {}
    rows = [(n, s) for n, s in report["servers"].items() if s["label"] != "baseline"]
    table = (report.get("knob_search") or {}).get("table") or {}
    if rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [s["decode_tok_s_pooled"] for _, s in rows], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [(table.get(s["label"]) or {}).get("spec_tok_s", float("nan")) for _, s in rows],
               0.4, label="predicted (fitted costs x replayed accept length)")
        base = report["servers"].get(report.get("baseline_name", ""), {}).get("decode_tok_s_pooled")
        if base:
            ax.axhline(base, color="k", ls="--", label="baseline")
        ax.set_xticks(list(xs), [s["label"] for _, s in rows])
        ax.set_ylabel("decode tok/s")
        ax.legend(fontsize=7)
        plots["tok_s"] = save_png(fig, out_dir / "tok_s_measured_vs_predicted.png").name
    cmp_ = report.get("compare") or {}
    if cmp_:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, c in cmp_.items():
            if c.get("served_by_position"):
                ax.plot(range(1, len(c["served_by_position"]) + 1), c["served_by_position"], "o-", label=f"{name} served")
            ax.plot(range(1, len(c["replay_by_position"]) + 1), c["replay_by_position"], "x--", label=f"{name} replay")
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted)")
        ax.legend(fontsize=7)
        plots["acceptance_by_position"] = save_png(fig, out_dir / "acceptance_by_position.png").name
    return plots


def measured_speedups(servers: dict, baseline_name: str) -> dict:
    base = servers[baseline_name]["decode_tok_s_pooled"]
    return {s["label"]: s["decode_tok_s_pooled"] / base for n, s in servers.items()
            if n != baseline_name and base and base == base}


def latencies_dict(lat: Optional[Latencies]) -> Optional[dict]:
    return None if lat is None else dict(lat.__dict__)
