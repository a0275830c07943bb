"""Plots and the console summary of an eval report (eval/plots.py, eval/summary.py)."""
import json

from eval.plots import read_training_curve, write_plots
from eval.summary import print_summary, verdict_lines

REPORT = {
    "name": "x", "drafter_dir": "/d",
    "accuracy": {"step_accuracy": [0.7, 0.5], "conditional_accuracy": [0.7, 0.6], "positions": [10, 9]},
    "accept": {"2/1/3": {"drafter": {"accept_length": 2.1, "cycles": 5, "emitted_histogram": {"1": 1, "2": 2, "3": 2},
                                     "acceptance_by_position": [0.8, 0.5], "mismatch_rate": 0.0},
                         "ngram": {"accept_length": 1.2, "cycles": 9, "emitted_histogram": {"1": 7, "2": 2, "3": 0},
                                   "acceptance_by_position": [0.2, 0.0], "mismatch_rate": 0.0}}},
    "cost": {"latencies": {"baseline_token_ms": 12.2, "verify_ms": 30.0, "source": "preset"},
             "by_knob": {"2/1/3": {"drafter": {"verdict": "SLOWER than no speculation: ...", "wins": False},
                                   "ngram": {"wins": False, "spec_tok_s": 40.0, "speedup": 0.49, "accept_length": 1.2}}}},
    "warnings": ["be careful"],
}


def test_plots_are_pngs_and_training_curve_reads_val_rows(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    rows = [{"step": 0, "kind": "val", "acc": [0.3, 0.1], "accept_length": {"2/1/3": 1.4}},
            {"step": 5, "kind": "train", "acc": [0.9]},
            {"step": 10, "kind": "val", "acc": [0.6, 0.4], "accept_length": {"2/1/3": 1.9}}]
    (train / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken")
    series = read_training_curve(train)
    assert series["accept 2/1/3"] == [(0, 1.4), (10, 1.9)] and series["step-0 accuracy"] == [(0, 0.3), (10, 0.6)]
    made = write_plots(REPORT, tmp_path / "out", train)
    assert set(made) == {"accuracy_per_step", "accept_histogram", "acceptance_by_position", "training_curve"}
    for name in made.values():
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "training_curve" not in write_plots(REPORT, tmp_path / "out2", tmp_path / "missing")


def test_summary_prints_tables_verdicts_and_warnings(capsys):
    from rich.console import Console

    print_summary(REPORT, Console(width=160))
    out = capsys.readouterr().out
    assert "2.10" in out and "1.20" in out and "SLOWER" in out and "be careful" in out
    assert verdict_lines(REPORT)[1].startswith("[2/1/3] n-gram: SLOWER")
