"""PNG plots of an eval report (matplotlib, Agg backend: no display needed).

Each function takes the report dict of eval/run.py (or parts of it) and writes one file; returns
its path, or None when there is nothing to draw (e.g. no training metrics for the curve).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from eagle3.formats.manifest import atomic_write_bytes  # noqa: E402


def save_png(fig, path: Path) -> Path:
    """Lay out, write atomically (PNG, 110 dpi) and close `fig`; every plot of eval/ goes through here."""
    import io

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def plot_accuracy_per_step(accuracy: dict, path: Path) -> Optional[Path]:
    acc, cond = accuracy.get("step_accuracy") or [], accuracy.get("conditional_accuracy") or []
    if not acc:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = list(range(len(acc)))
    ax.bar([i - 0.2 for i in x], acc, width=0.4, label="accuracy (teacher-forced)")
    ax.bar([i + 0.2 for i in x], cond, width=0.4, label="conditional (steps < k right)")
    ax.set_xticks(x)
    ax.set_xlabel("TTT step k")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Validation accuracy per TTT step")
    return save_png(fig, path)


def plot_accept_histograms(accept: dict, path: Path) -> Optional[Path]:
    """One panel per knob setting: share of cycles emitting 1, 2, ... tokens, drafter vs n-gram."""
    if not accept:
        return None
    fig, axes = plt.subplots(1, len(accept), figsize=(4 * len(accept), 3.4), squeeze=False)
    for ax, (label, entry) in zip(axes[0], accept.items()):
        for off, name in ((-0.2, "drafter"), (0.2, "ngram")):
            hist = entry.get(name, {}).get("emitted_histogram") or {}
            total = sum(hist.values()) or 1
            xs = [int(k) for k in hist]
            ax.bar([x + off for x in xs], [v / total for v in hist.values()], width=0.4,
                   label=f"{name} (tau {entry.get(name, {}).get('accept_length', float('nan')):.2f})")
        ax.set_title(f"{label} (steps/topk/draft tokens)")
        ax.set_xlabel("tokens emitted per verify cycle")
        ax.set_ylabel("share of cycles")
        ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_acceptance_by_position(accept: dict, path: Path) -> Optional[Path]:
    if not accept:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, entry in accept.items():
        for name, style in (("drafter", "-o"), ("ngram", "--x")):
            rates = entry.get(name, {}).get("acceptance_by_position") or []
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, style, label=f"{name} {label}")
    ax.set_xlabel("draft position (depth)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("P(accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title("Acceptance by draft position")
    return save_png(fig, path)


def read_training_curve(train_dir: Optional[str | Path]) -> dict[str, list[tuple[int, float]]]:
    """Validation series from `<train_dir>/metrics.jsonl` (train/metrics.py rows with kind "val"):
    `accept <knobs>` from its `accept_length` {label: value} and `step-k accuracy` from its `acc`
    list, against `step`. Unreadable lines are skipped."""
    if not train_dir:
        return {}
    path = Path(train_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    series: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or rec.get("kind") != "val" or "step" not in rec:
            continue
        step = int(rec["step"])
        for label, value in (rec.get("accept_length") or {}).items():
            if isinstance(value, (int, float)):
                series.setdefault(f"accept {label}", []).append((step, float(value)))
        for k, value in enumerate(rec.get("acc") or []):
            if isinstance(value, (int, float)) and k < 3:
                series.setdefault(f"step-{k} accuracy", []).append((step, float(value)))
    return series


def plot_training_curve(train_dir: Optional[str | Path], path: Path) -> Optional[Path]:
    series = read_training_curve(train_dir)
    if not series:
        return None
    fig, (ax_tau, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, pts in sorted(series.items()):
        pts.sort()
        ax = ax_tau if key.startswith("accept") else ax_acc
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=3, label=key)
    ax_tau.set_title("Simulated accept length over training")
    ax_acc.set_title("Validation accuracy over training")
    for ax in (ax_tau, ax_acc):
        ax.set_xlabel("training step")
        if ax.lines:
            ax.legend(fontsize=7)
    return save_png(fig, path)


def write_plots(report: dict, out_dir: Path, train_dir: Optional[str | Path] = None) -> dict[str, str]:
    """All plots of a report -> {name: file name}, only those that had data."""
    out_dir = Path(out_dir)
    made = {
        "accuracy_per_step": plot_accuracy_per_step(report.get("accuracy") or {}, out_dir / "accuracy_per_step.png"),
        "accept_histogram": plot_accept_histograms(report.get("accept") or {}, out_dir / "accept_histogram.png"),
        "acceptance_by_position": plot_acceptance_by_position(report.get("accept") or {},
                                                              out_dir / "acceptance_by_position.png"),
        "training_curve": plot_training_curve(train_dir, out_dir / "training_curve.png"),
    }
    return {k: p.name for k, p in made.items() if p is not None}
