"""The study's image-traffic columns (pipeline/study_images.py): text / image accept length from an eval report,
the convention-mismatch record (2 trained x 2 served, reused while both train runs are unchanged), and the
report's tables."""
import json

from pipeline.study_images import load_mismatch, measure_mismatch, render_images, traffic_metrics


def report(text: float, image: float, image_seqs: int = 3) -> dict:
    part = lambda tau, n: {"sequences": n, "accept": {"2/1/3": {"drafter": {"accept_length": tau}}}}  # noqa: E731
    return {"by_traffic": {"text": part(text, 5), "image": part(image, image_seqs)}}


def test_traffic_metrics_read_the_eval_split_and_nan_for_absent_traffic():
    m = traffic_metrics(report(2.0, 1.5))
    assert m == {"image_sequences": 3, "tau_text": {"2/1/3": 2.0}, "tau_image": {"2/1/3": 1.5}}
    none = traffic_metrics(report(2.0, 1.5, image_seqs=0))
    assert none["image_sequences"] == 0 and none["tau_image"]["2/1/3"] != none["tau_image"]["2/1/3"]


class FakeEvaluator:
    """Serves a drafter dir's convention: tau 2.0 when served as trained, 1.4 otherwise."""

    def __init__(self):
        self.calls = []

    def load(self, path):
        return json.loads((path / "conv.json").read_text())

    def metrics(self, drafter, knobs, max_sequences, image_embeddings=None):
        self.calls.append((drafter, image_embeddings))
        return traffic_metrics(report(2.5, 2.0 if drafter == image_embeddings else 1.4))


def test_mismatch_record_is_measured_once_per_pair_and_reused(tmp_path):
    dirs = {}
    for conv in ("fused", "placeholder"):
        d = tmp_path / f"train-{conv}"
        (d / "final").mkdir(parents=True)
        (d / "final" / "conv.json").write_text(json.dumps(conv))
        (d / "manifest.json").write_text(json.dumps({"conv": conv}))
        dirs[conv] = d
    ev = FakeEvaluator()
    rec = measure_mismatch(tmp_path / "out", "aqmedai_k2-placeholder-seed0", dirs, ev, [], None, {"seed": 0})
    assert sorted(ev.calls) == [("fused", "fused"), ("fused", "placeholder"), ("placeholder", "fused"),
                                ("placeholder", "placeholder")]
    assert rec["pairs"]["fused/placeholder"]["tau_image"]["2/1/3"] == 1.4
    measure_mismatch(tmp_path / "out", "aqmedai_k2-placeholder-seed0", dirs, ev, [], None, {"seed": 0})
    assert len(ev.calls) == 4  # reused: both train runs unchanged
    (dirs["placeholder"] / "manifest.json").write_text(json.dumps({"conv": "retrained"}))
    measure_mismatch(tmp_path / "out", "aqmedai_k2-placeholder-seed0", dirs, ev, [], None, {"seed": 0})
    assert len(ev.calls) == 8
    assert [r["name"] for r in load_mismatch(tmp_path / "out")] == ["aqmedai_k2-placeholder-seed0"]


def test_report_tables_show_text_vs_image_and_the_mismatch_cost():
    point = lambda t, i, n=2: {"points": [{**traffic_metrics(report(t, i, n))}]}  # noqa: E731
    groups = {"k2_zero_shot": [point(1.2, 1.1)], "aqmedai_k2": [point(2.4, 2.0), point(2.6, 2.2)]}
    ev = FakeEvaluator()
    pairs = {f"{t}/{s}": ev.metrics(t, [], None, s) for t in ("fused", "placeholder") for s in ("fused", "placeholder")}
    lines = render_images(groups, [{"pairs": pairs}], "2/1/3", {"aqmedai_k2": "from the K2 drafter"})
    text = "\n".join(lines)
    assert "| from the K2 drafter | 2.500 ± 0.141 | 2.100 ± 0.141 | 2 |" in text
    assert "| k2_zero_shot | 1.200 | 1.100 | 2 |" in text
    assert "| fused | 2.000 | 1.400 | 0.600 |" in text and "| placeholder | 1.400 | 2.000 | 0.600 |" in text
    assert render_images({"scratch": [point(2.0, 1.0, n=0)]}, [], "2/1/3", {}) == []
