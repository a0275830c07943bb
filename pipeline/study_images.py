"""The study's image-traffic columns (issue 34): every measured point carries the simulated accept length on
text vs image conversations (the eval report's `by_traffic`), and, per training seed, the convention-mismatch
cost of the from-K2 init: its run trained `fused` (auto = SGLang's, the study's own run) next to one trained
`placeholder` (the one extra training run per seed), each replayed under both conventions.

Mismatch records go to `<out_dir>/mismatch/<name>.json` (not `records/`: they are no learning curve), reused
while both train manifests are unchanged. The report gains two tables (`render_images`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from eagle3 import fingerprints as fp
from eagle3.formats.manifest import atomic_write_json
from pipeline.image_traffic import CONVENTIONS, MISMATCH_INIT, image_sequences, traffic_tau
from pipeline.study_stats import mean_std

MISMATCH = "mismatch"
TRAFFIC = ("text", "image")


def traffic_metrics(report: dict) -> dict:
    """{"tau_text": {label: tau}, "tau_image": {label: tau}, "image_sequences": n} of an evaluate_drafter
    report (NaN for a traffic the split does not hold)."""
    out: dict = {"image_sequences": image_sequences(report)}
    for tr in TRAFFIC:
        labels = (((report.get("by_traffic") or {}).get(tr) or {}).get("accept") or {})
        out[f"tau_{tr}"] = {label: traffic_tau(report, label, tr) for label in labels}
    return out


def placeholder_run_name(seed: int, world_prefix: str) -> str:
    return f"{world_prefix}{MISMATCH_INIT}-placeholder-seed{seed}"


def measure_mismatch(out_dir: Path, name: str, train_dirs: dict[str, Path], evaluator, knobs,
                     max_sequences: Optional[int], meta: dict) -> dict:
    """Replay each trained drafter ({convention: train dir}) under both conventions; write and return the record
    (a cached one when both train manifests are unchanged)."""
    path = Path(out_dir) / MISMATCH / f"{name}.json"
    key = {c: fp.stage_dir(Path(d)) for c, d in train_dirs.items()}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if old.get("key") == key:
                return old
        except (OSError, json.JSONDecodeError):
            pass
    pairs = {}
    for trained, d in train_dirs.items():
        drafter = evaluator.load(Path(d) / "final")
        for served in CONVENTIONS:
            pairs[f"{trained}/{served}"] = evaluator.metrics(drafter, knobs, max_sequences, image_embeddings=served)
    record = {"key": key, "name": name, **meta, "pairs": pairs}
    atomic_write_json(path, record)
    return record


def load_mismatch(out_dir: Path) -> list[dict]:
    recs = []
    for p in sorted((Path(out_dir) / MISMATCH).glob("*.json")):
        try:
            recs.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"[study] skipping unreadable mismatch record {p}: {e}", flush=True)
    return recs


def _pm(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    m, s = mean_std(xs)
    return f"{m:.3f}" if len(xs) < 2 else f"{m:.3f} ± {s:.3f}"


def render_images(groups: dict[str, list[dict]], mismatch: list[dict], knob: str, labels: dict) -> list[str]:
    """Markdown: final text vs image tau per drafter (mean ± std over runs), and the mismatch grid."""
    finals = {init: [r["points"][-1] for r in runs] for init, runs in groups.items()}
    if not any(p.get("image_sequences") for pts in finals.values() for p in pts):
        return []
    lines = [f"## Image traffic (final drafters, sim tau {knob}; image rows fed as SGLang feeds them: fused)", "",
             "| drafter | text | image | image sequences |", "|---|---|---|---|"]
    for init, pts in finals.items():
        cells = [_pm([p.get(f"tau_{tr}", {}).get(knob, float("nan")) for p in pts]) for tr in TRAFFIC]
        lines.append(f"| {labels.get(init, init)} | {cells[0]} | {cells[1]} | {pts[0].get('image_sequences', 0)} |")
    if mismatch:
        lines += ["", f"## Image rows: trained with one convention, served with the other ({labels.get(MISMATCH_INIT)},"
                  f" sim tau {knob} on image traffic, {len(mismatch)} seed(s))", "",
                  "| trained | served fused | served placeholder | lost served with the other |", "|---|---|---|---|"]
        for trained in CONVENTIONS:
            other = CONVENTIONS[1 - CONVENTIONS.index(trained)]
            cell = {s: [r["pairs"][f"{trained}/{s}"]["tau_image"].get(knob, float("nan")) for r in mismatch]
                    for s in CONVENTIONS}
            lost = [a - b for a, b in zip(cell[trained], cell[other])]
            lines.append(f"| {trained} | {_pm(cell['fused'])} | {_pm(cell['placeholder'])} | {_pm(lost)} |")
    return lines + [""]
