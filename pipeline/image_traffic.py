"""Image traffic in the demo and the study: accept length on text vs image conversations (the eval report's
`by_traffic`), and the cost of serving a drafter with the other image-row convention than it was trained with
(issue 34: SGLang feeds the target's fused rows, vLLM embeds `<|media_pad|>`; eagle3/drafter/image_embeddings.py).

The mismatch grid is cheap on purpose: one extra training run (the from-K2 init trained `placeholder`; the
demo's own from-K2 run is the `fused` one, auto = SGLang's), and three extra replays (the demo's own from-K2 eval is train fused / serve fused) without the real loop
(train fused / serve placeholder, train placeholder / serve placeholder, train placeholder / serve fused).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from eagle3.drafter.image_embeddings import CONVENTIONS

NAN = float("nan")
MISMATCH_INIT = "aqmedai_k2"  # the init the mismatch grid trains (the account's question: from the K2 drafter)


def traffic_tau(report: dict, label: str, traffic: str, who: str = "drafter") -> float:
    """Simulated accept length at knob `label` on `traffic` (text | image); NaN where that traffic is absent."""
    part = (report.get("by_traffic") or {}).get(traffic) or {}
    if not part.get("sequences"):
        return NAN
    return float(((part.get("accept") or {}).get(label) or {}).get(who, {}).get("accept_length", NAN))


def image_sequences(report: dict) -> int:
    return int(((report.get("by_traffic") or {}).get("image") or {}).get("sequences") or 0)


def traffic_columns(report: dict, label: str, who: str = "drafter") -> dict:
    """{"text {label}": tau, "image {label}": tau}: the demo table's image-traffic columns."""
    return {f"text {label}": traffic_tau(report, label, "text", who),
            f"image {label}": traffic_tau(report, label, "image", who)}


def run_mismatch(log, k25: list[str], train_args: list[str], eval_args: list[str], fused_train_dir: Path,
                 fused_report: dict) -> dict:
    """Train the from-K2 init `placeholder` next to the demo's `fused` run (`fused_train_dir`, whose eval
    `fused_report` read its image rows fused: auto = SGLang's), replay both under the other conventions (the
    real loop off: the replay is the measure), and return {(trained, served): eval report}. `log` is the
    demo's StageLog."""
    if fused_report.get("image_embeddings") != "fused":
        raise ValueError(f"the from-K2 eval read image rows as {fused_report.get('image_embeddings')!r}, not fused")
    dirs = {"fused": Path(fused_train_dir),
            "placeholder": Path(fused_train_dir).parent / f"train-{MISMATCH_INIT}-placeholder"}
    log.run(f"k25: train +init={MISMATCH_INIT} image_embeddings=placeholder", "train",
            k25 + [f"+init={MISMATCH_INIT}", "image_embeddings=placeholder", f"out_dir={dirs['placeholder']}"]
            + train_args)
    reports = {("fused", "fused"): fused_report}
    for trained, served in [("fused", "placeholder"), ("placeholder", "placeholder"), ("placeholder", "fused")]:
        name = f"{MISMATCH_INIT}-{trained}-served-{served}"
        out = log.run(f"k25: eval trained {trained}, served {served}", "eval",
                      k25 + [f"name={name}", f"drafter_dir={dirs[trained]}/final", f"train_dir={dirs[trained]}",
                             f"image_embeddings={served}"] + eval_args + ["real_loop.enabled=false"])
        reports[(trained, served)] = json.loads((Path(out) / "report.json").read_text())
    return reports


def mismatch_rows(reports: dict, label: str) -> list[dict]:
    """One row per (trained, served) pair: image and text tau at `label`, image step-0 accuracy, and the
    image tau lost against serving with the trained convention."""
    rows = []
    for (trained, served), rep in reports.items():
        image = traffic_tau(rep, label, "image")
        matched = traffic_tau(reports[(trained, trained)], label, "image")
        acc = ((((rep.get("by_traffic") or {}).get("image") or {}).get("accuracy") or {}).get("step_accuracy")
               or [NAN])[0]
        rows.append({"trained": trained, "served": served, f"image {label}": image,
                     f"text {label}": traffic_tau(rep, label, "text"), "image acc step0": float(acc),
                     "image tau lost": matched - image if not (math.isnan(image) or math.isnan(matched)) else NAN})
    return rows


def mismatch_note(rows: list[dict]) -> str:
    """Whether each convention's drafter scores worse served with the other, in one line."""
    lost = {r["trained"]: r["image tau lost"] for r in rows if r["trained"] != r["served"]}
    parts = [f"trained {t}: {'worse' if v > 0 else 'not worse'} served with the other ({v:+.3f} image tau lost)"
             for t, v in lost.items() if not math.isnan(v)]
    return "; ".join(parts) if parts else "no image traffic in the validation split: no mismatch measured"
