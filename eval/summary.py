"""The console summary of an eval report (rich tables), plus the plain-text verdict lines."""
from __future__ import annotations

import math


def _f(x, nd=2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def verdict_lines(report: dict) -> list[str]:
    """Per knob setting: the drafter's (and n-gram's, and the ceiling's) predicted speed on the configured server."""
    lines = []
    for label, entry in (report.get("cost") or {}).get("by_knob", {}).items():
        d = entry.get("drafter")
        if d:
            note = "" if d.get("accept_length_source", "replay") == "replay" else f" [from the {d['accept_length_source']}]"
            lines.append(f"[{label}] drafter: {d['verdict']}{note}")
        n = entry.get("ngram")
        if n:
            lines.append(f"[{label}] n-gram: {'FASTER' if n['wins'] else 'SLOWER'} ({n['spec_tok_s']:.1f} tok/s, "
                         f"{n['speedup']:.2f}x at accept length {n['accept_length']:.2f})")
        c = entry.get("ceiling")
        if c:  # a drafter always right on this store: when even it loses, the traffic, not the drafter, decides
            lines.append(f"[{label}] ceiling (a drafter always right): {c['speedup']:.2f}x at accept length "
                         f"{c['accept_length']:.2f}")
    return lines


def print_summary(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    import sys

    from rich.markup import escape

    console = console or Console(width=None if sys.stdout.isatty() else 140)
    console.rule(f"eval {report.get('name', '')}: {report.get('drafter_dir', '')}")
    acc = report.get("accuracy")
    if acc:
        t = Table(title="Validation accuracy per TTT step (teacher-forced)")
        t.add_column("")
        for k in range(len(acc["step_accuracy"])):
            t.add_column(f"step {k}", justify="right")
        t.add_row("accuracy", *[_f(a, 3) for a in acc["step_accuracy"]])
        t.add_row("conditional", *[_f(a, 3) for a in acc["conditional_accuracy"]])
        t.add_row("positions", *[str(n) for n in acc["positions"]])
        console.print(t)
        if acc.get("chain_estimate"):
            console.print("Teacher-forced chain estimate 1 + sum_k prod_j<=k cond_acc_j: " + ", ".join(
                f"{label} {tau:.2f}" for label, tau in acc["chain_estimate"].items()))
    t = Table(title="Simulated accept length (SGLang convention: tokens per verify cycle, bonus included)")
    for col in ("steps/topk/draft", "drafting", "accept length", "cycles", "P(accept) by position", "mismatch"):
        t.add_column(col, justify="right" if col in ("accept length", "cycles", "mismatch") else "left")
    for label, entry in (report.get("accept") or {}).items():
        for name in ("drafter", "ngram", "ceiling"):  # ceiling: a drafter always right on the same segments
            s = entry.get(name)
            if s:
                t.add_row(label, name, _f(s["accept_length"]), str(s["cycles"]),
                          " ".join(_f(a) for a in s["acceptance_by_position"]), f"{100 * s['mismatch_rate']:.1f}%")
    console.print(t)
    traffic = report.get("by_traffic") or {}
    if (traffic.get("image") or {}).get("sequences"):  # only a store with image traffic gets the split table
        t = Table(title=f"By traffic (image rows fed as image_embeddings={report.get('image_embeddings')})")
        for col in ("traffic", "sequences", "step-0 accuracy",
                    *[f"{label} drafter tau" for label in (report.get("accept") or {})]):
            t.add_column(col, justify="right")
        for name, part in traffic.items():
            step0 = ((part.get("accuracy") or {}).get("step_accuracy") or [None])[0]
            t.add_row(name, str(part["sequences"]), _f(step0, 3),
                      *[_f(e["drafter"]["accept_length"]) for e in part["accept"].values()])
        console.print(t)
    real = report.get("real_loop")
    if real and real.get("knobs"):
        t = Table(title=f"Real speculative decoding ({real['prompts']} prompts, <= {real['max_new_tokens']} tokens)")
        for col in ("knobs", "lossless", "real tau", "simulated tau", "verify ms", "draft step ms", "tok/s",
                    "baseline tok/s", "predicted tok/s"):
            t.add_column(col, justify="right")
        for label, r in real["knobs"].items():
            pred = (r.get("prediction_from_measured") or {}).get("spec_tok_s")
            t.add_row(label, "yes" if r["lossless"] else "NO", _f(r["real_accept_length"]), _f(r["sim_accept_length"]),
                      _f(r["verify_ms"], 1), _f(r["draft_step_ms"], 2), _f(r["measured_spec_tok_s"], 1),
                      _f(r["measured_baseline_tok_s"], 1), _f(pred, 1))
        console.print(t)
    if report.get("vocab_coverage") is not None:
        console.print(f"Draft-vocab coverage of the target's greedy tokens: {100 * report['vocab_coverage']:.1f}%")
    cost = report.get("cost") or {}
    if cost:
        lat = cost.get("latencies", {})
        console.print(f"Cost model ({lat.get('source', '')}: baseline {1000 / lat['baseline_token_ms']:.1f} tok/s, "
                      f"verify {lat['verify_ms']:.1f} ms):")
        lines = verdict_lines(report)
        for line in lines:
            console.print("  " + escape(line))
        if not lines:
            console.print("  no verdict: no accept length could be measured on this split")
    best = report.get("best")
    if best:
        console.print(f"[bold]Verdict:[/] best setting {best['label']} (steps/topk/draft tokens): "
                      f"{'beats' if best['wins'] else 'does NOT beat'} no speculation "
                      f"({best['predicted_tok_s']:.1f} vs {best['baseline_tok_s']:.1f} tok/s predicted, "
                      f"{best['speedup']:.2f}x); to win it needs accept length > {best['break_even_accept_length']:.2f}, "
                      f"it has {best['accept_length']:.2f}")
    for w in report.get("warnings") or []:
        console.print(f"[bold yellow]warning:[/] {escape(w)}")
