"""The learning-quality A/B (pipeline/learning_ab.py) through the train stage on the tiny toy world of
the train tests: two arms (the fast unroll vs the reference, both on the CPU here) x two seeds,
every budget evaluated by the eval stage's replay, the report's curves, interval and verdict; and
the verdict rule on hand-made records."""
import json
import time
from pathlib import Path

import pytest

from eagle3.config.conf import ConfigError, compose, to_schema
from eagle3.config.schema.learning_ab import REFERENCE_PATH, LearningABConfig


def test_config_defaults_and_refusals():
    cfg = to_schema(compose("learning_ab", ["demo_size=ci"]), LearningABConfig)
    assert [a.name for a in cfg.arms] == ["gpu_default", "reference"] and cfg.arms[1].train == REFERENCE_PATH
    assert cfg.bar == 0.01 and len(cfg.seeds) >= 2
    with pytest.raises(ConfigError, match="two distinct seeds"):
        to_schema(compose("learning_ab", ["seeds=[1]"]), LearningABConfig)
    with pytest.raises(ConfigError, match=r"\+train.seed is set by the learningab itself"):
        to_schema(compose("learning_ab", ["+train.seed=2"]), LearningABConfig)


def _rec(arm, seed, finals):
    pts = [{"step": s, "tokens": 100 * s, "acc": [a], "acc_step0": a, "acc_mean": a, "tau": {"2/1/3": t}}
           for s, (a, t) in enumerate(finals)]
    return {"arm": arm, "seed": seed, "points": pts, "numerics": {"unroll": arm}, "world": {"id": "w"}}


def test_verdict_rule_on_hand_made_curves():
    from pipeline.learning_ab import ab_summary

    same = {"a": [_rec("a", 0, [(0.1, 1.0), (0.5, 2.00)]), _rec("a", 1, [(0.1, 1.0), (0.5, 2.02)])],
            "b": [_rec("b", 0, [(0.1, 1.0), (0.5, 2.01)]), _rec("b", 1, [(0.1, 1.0), (0.5, 2.03)])]}
    s = ab_summary(same, "2/1/3", 0.95, 0.01)
    d = s["final_difference"]["sim tau 2/1/3"]
    assert d["diff"] == pytest.approx(0.01) and s["same_learning"] and s["verdict"].startswith("same learning")
    assert s["curves"]["a"]["sim tau 2/1/3"][1]["mean"] == pytest.approx(2.01)
    apart = {"a": same["a"], "b": [_rec("b", 0, [(0.1, 1.0), (0.5, 2.20)]), _rec("b", 1, [(0.1, 1.0), (0.5, 2.21)])]}
    s2 = ab_summary(apart, "2/1/3", 0.95, 0.01)
    assert not s2["same_learning"] and s2["verdict"].startswith("DIFFERENT") and "excludes 0" in s2["verdict"]


@pytest.mark.slow
def test_learning_ab_end_to_end_on_the_toy_world(tmp_path, tiny_k25_target, tiny_k2_target):
    from pipeline.demo import Experiment, StageLog
    from pipeline.learning_ab import RECORDS, load_ab_records, measure_arms, run_learning_ab, write_ab_report
    from tests.fixtures.train_world import TOY_TRAIN, write_world

    root = tmp_path / "root"
    k25 = write_world(root / "stages" / "k25_mini", tiny_k25_target, n_train=12, n_val=4, seed=0)
    exp = Experiment(k2=[], k25=[f"paths.root={root}", "target=k25_mini", f"target.path={tiny_k25_target}",
                                 f"target.k2_drafter={k25['old_drafter']}"],
                     k2_drafter=k25["old_drafter"], vocab_dir=k25["vocab"])
    train = TOY_TRAIN
    over = [f"paths.root={root}", "demo_size=ci", "train_steps=4", "curve.points=3", "wandb.mode=disabled",
            "num_threads=1", "+eval.ttt_length=3", "+eval.progress=false", "seeds=[0,1]",
            'arms=[{name:fast,train:["unroll=fast"]},{name:reference,train:["unroll=reference"]}]']
    over += [f"+train.{o}" for o in train]
    cfg = to_schema(compose("learning_ab", over), LearningABConfig)
    cfg.overrides.eval = cfg.overrides.eval[-2:]  # the ci preset's eval sizes are for the ci world
    measure_arms(cfg, exp, StageLog(threads=1))
    out = Path(cfg.out_dir)
    assert sorted(p.stem for p in (out / RECORDS).glob("*.json")) == [
        "fast-seed0", "fast-seed1", "reference-seed0", "reference-seed1"]
    rec = json.loads((out / RECORDS / "fast-seed1.json").read_text())
    assert rec["numerics"]["unroll"] == "fast" and [p["step"] for p in rec["points"]] == [0, 2, 4]
    assert json.loads((out / RECORDS / "reference-seed1.json").read_text())["numerics"]["unroll"] == "reference"
    write_ab_report(cfg, load_ab_records(out / RECORDS, cfg), out)
    rep = json.loads((out / "report.json").read_text())
    assert rep["arms"] == ["fast", "reference"] and set(rep["seeds"]["fast"]) == {0, 1}
    d = rep["final_difference"]["sim tau 2/1/3"]
    assert d["n_a"] == d["n_b"] == 2 and d["low"] <= d["diff"] <= d["high"]
    # the two code paths compute the same function: on this toy they learn the same within the bar
    assert rep["same_learning"], rep["verdict"]
    assert (out / rep["plot"]).is_file() and "Verdict" in (out / "report.md").read_text()
    # a rerun measures nothing again; report_only rebuilds the report from the records
    t = time.time()
    measure_arms(cfg, exp, StageLog(threads=1))
    cfg.report_only = True
    run_learning_ab(cfg)
    assert json.loads((out / "report.json").read_text())["final_difference"] == rep["final_difference"]
    assert time.time() - t < 600
