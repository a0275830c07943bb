"""The reduced demo (demo_size=ci): every stage of `make demo` through the same code path, on a
tiny mini world, end to end. Slow-ish (minutes on 2 cores) but it is the one test that proves the
stages fit together: each stage reads what the previous one wrote."""
import json
from pathlib import Path

import pytest

from eagle3.conf import compose, to_schema
from eagle3.schema.demo import DemoConfig


@pytest.mark.slow
def test_reduced_demo_runs_every_stage_end_to_end(tmp_path):
    from eval.demo import run_demo

    cfg = to_schema(compose("demo", [f"paths.root={tmp_path}", "demo_size=ci"]), DemoConfig)
    out = run_demo(cfg)
    report = json.loads((Path(out) / "report.json").read_text())
    names = [row["drafter"] for row in report["rows"]][:3]
    assert names == ["k2_zero_shot", "scratch", "aqmedai_k2"] and report["rows"][3]["drafter"].startswith("ngram")
    assert report["lossless"] is True
    for row in report["rows"]:
        for key, value in row.items():
            if key.startswith(("sim ", "real ")) and value == value:  # not NaN
                assert value >= 1.0, (row["drafter"], key, value)  # the bonus token is always emitted
    # the K2 drafter the demo built is an SGLang-layout directory, and the best one was exported
    k2 = tmp_path / "mini_world" / "aqmedai-k2-mini"
    assert (k2 / "config.json").is_file() and (k2 / "model.safetensors").is_file()
    assert json.loads((k2 / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (Path(report["export_dir"]) / "SERVE.md").is_file()
    assert report["best"] in names
    assert "| drafter |" in (Path(out) / "report.md").read_text()
    # a rerun reuses every finished stage
    again = run_demo(cfg)
    rerun = json.loads((Path(again) / "report.json").read_text())
    assert rerun["rows"] == report["rows"]
    assert rerun["total_seconds"] < report["total_seconds"]
