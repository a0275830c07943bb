"""The study (pipeline/study.py): its statistics on hand-checked numbers, and a reduced study (2 seeds,
tiny budgets) through the same code path as `make study` on the tiny toy world of the train tests:
both inits trained per seed by the train stage, every checkpoint evaluated, forgetting on a second
(K2-side) store, the knob grid, the real loop, the report and a rebuild of it from the run records."""
import json
import time
from pathlib import Path

import pytest

from eagle3.config.conf import ConfigError, compose, to_schema
from eagle3.config.schema.study import StudyConfig


def test_knob_grid_and_budgets():
    from eagle3.replay.knob_grid import knob_grid
    from pipeline.study import checkpoint_every

    cfg = to_schema(compose("study", ["demo_size=ci"]), StudyConfig)
    labels = [k.label for k in knob_grid(cfg.knob_grid)]
    assert labels == ["1/1/2", "2/1/3", "2/2/4", "3/1/4", "3/2/4"]  # 1/2/4 cannot be built: 1 step drafts 2 tokens
    assert len(labels) == len(set(labels))
    assert checkpoint_every(40, 8) == 6 and checkpoint_every(500, 8) == 72 and checkpoint_every(8, 5) == 2


def test_config_refuses_what_cannot_give_a_spread():
    with pytest.raises(ConfigError, match="two distinct seeds"):
        to_schema(compose("study", ["seeds=[0]"]), StudyConfig)
    with pytest.raises(ConfigError, match="primary_knob"):
        to_schema(compose("study", ["primary_knob=9/1/10"]), StudyConfig)
    with pytest.raises(ConfigError, match="inits"):
        to_schema(compose("study", ["inits=[scratch,other]"]), StudyConfig)
    with pytest.raises(ConfigError, match="train_steps"):
        to_schema(compose("study", ["train_steps=3", "curve.points=8"]), StudyConfig)


def test_train_overrides_group_by_init_and_keep_every_budget(tmp_path):
    from eagle3.config.schema.train import TrainConfig
    from pipeline.study import train_overrides

    cfg = to_schema(compose("study", ["demo_size=ci", f"paths.root={tmp_path}"]), StudyConfig)
    over = train_overrides(cfg, [f"paths.root={tmp_path}", "target=k25_mini"], "aqmedai_k2", 1)
    train = to_schema(compose("train", over), TrainConfig)
    assert train.seed == 1 and train.keep_checkpoints == 0 and train.checkpoint_every == 2
    assert train.max_steps == cfg.train_steps and train.val_every == 0
    assert train.wandb.group == "aqmedai_k2" and train.wandb.project == cfg.wandb.project
    assert Path(train.out_dir).name == "train-aqmedai_k2-seed1"


def test_scratch_init_depends_on_the_seed(tiny_k25_target):
    """The seed sets every random initialisation: two seeds give two scratch drafters, one seed the same."""
    import torch

    from eagle3.drafter.initial import build_training_drafter

    ids = torch.arange(8, 40)
    a, _ = build_training_drafter("scratch", None, tiny_k25_target, "kimi_k25", ids, seed=0)
    b, _ = build_training_drafter("scratch", None, tiny_k25_target, "kimi_k25", ids, seed=1)
    c, _ = build_training_drafter("scratch", None, tiny_k25_target, "kimi_k25", ids, seed=1)
    assert not torch.equal(a.fc.weight, b.fc.weight)
    assert torch.equal(b.fc.weight, c.fc.weight) and torch.equal(b.midlayer.mlp.up_proj.weight,
                                                                   c.midlayer.mlp.up_proj.weight)


def test_evaluate_without_ngram_scores_the_drafter_the_same(tmp_path, tiny_k25_target):
    """ngram=None (the study's curve points) leaves the drafter's numbers as they are and n-gram out."""
    from eagle3.engines.serve_launch import SpecKnobs
    from eagle3.drafter.drafter_io import load_drafter_dir
    from eagle3.formats.store import HiddenStateStore
    from eagle3.target_model.target_io import load_embed_tokens
    from eagle3.replay.evaluate import evaluate_drafter, simulate_accept_length
    from tests.fixtures.train_world import write_world

    w = write_world(tmp_path, tiny_k25_target, n_train=1, n_val=3)
    store = HiddenStateStore(w["capture"] / "validation")
    drafter = load_drafter_dir(w["old_drafter"], embed_tokens=load_embed_tokens(tiny_k25_target, "kimi_k25"),
                               dtype="float32")
    knobs = [SpecKnobs(2, 1, 3), SpecKnobs(2, 2, 4)]
    both = evaluate_drafter(drafter, store, knobs=knobs, ttt_length=3, progress=False)
    alone = evaluate_drafter(drafter, store, knobs=knobs, ttt_length=3, ngram=None, progress=False)
    assert alone["accuracy"] == both["accuracy"]
    for label in ("2/1/3", "2/2/4"):
        assert "ngram" not in alone["accept"][label] and "ngram" in both["accept"][label]
        same = (json.dumps(alone["accept"][label]["drafter"], sort_keys=True)  # NaN-safe comparison
                == json.dumps(both["accept"][label]["drafter"], sort_keys=True))
        assert same
    sims = simulate_accept_length(drafter, store, knobs=knobs, ngram=None, progress=False)
    assert set(sims["2/2/4"]) == {"drafter", "ceiling"}  # the store's ceiling does not need the n-gram


@pytest.mark.slow
def test_reduced_study_end_to_end(tmp_path, tiny_k25_target, tiny_k2_target):
    from pipeline.demo import Experiment, StageLog
    from pipeline.study import study_on
    from tests.fixtures.train_world import TOY_TRAIN, write_world

    root = tmp_path / "root"
    k25 = write_world(root / "stages" / "k25_mini", tiny_k25_target, n_train=12, n_val=4, seed=0)
    write_world(root / "stages" / "k2_mini", tiny_k25_target, n_train=1, n_val=3, seed=5)  # the K2-like traffic
    exp = Experiment(k2=[f"paths.root={root}", "target=k2_mini", f"target.path={tiny_k2_target}"],
                     k25=[f"paths.root={root}", "target=k25_mini", f"target.path={tiny_k25_target}",
                          f"target.k2_drafter={k25['old_drafter']}"],
                     k2_drafter=k25["old_drafter"], vocab_dir=k25["vocab"])
    # the stage settings go in as a user types them on the study's command line (+train.*, +eval.*)
    train = TOY_TRAIN
    over = [f"paths.root={root}", "demo_size=ci", "train_steps=4", "curve.points=3", "wandb.mode=disabled",
            "num_threads=1", "knob_grid.num_steps=[1,2]", "+eval.ttt_length=3", "+eval.progress=false"]
    over += [f"+train.{o}" for o in train]

    def config(*extra):
        cfg = to_schema(compose("study", over + list(extra)), StudyConfig)
        cfg.overrides.eval = cfg.overrides.eval[-2:]  # the ci preset's eval sizes are for the ci world
        assert cfg.overrides.train[-len(train):] == train  # after the preset's: they win
        return cfg

    cfg = config()
    out = study_on(cfg, {0: exp}, StageLog(threads=1), time.time())

    runs = sorted(p.stem for p in (out / "records").glob("*.json"))
    assert runs == ["aqmedai_k2-seed0", "aqmedai_k2-seed1", "k2_zero_shot", "scratch-seed0", "scratch-seed1"]
    rec = json.loads((out / "records" / "scratch-seed1.json").read_text())
    assert [p["step"] for p in rec["points"]] == [0, 2, 4]
    tokens = [p["tokens"] for p in rec["points"]]
    assert tokens[0] == 0 and tokens[1] > 0 and tokens[2] > tokens[1]
    for p in rec["points"]:
        assert len(p["acc"]) == 3 and set(p["tau"]) == {"2/1/3", "3/1/4", "3/2/6"}
        assert all(t >= 1.0 for t in p["tau"].values())  # the bonus token is always emitted
        # text vs image traffic: this toy world is text only, so image is NaN and no mismatch run is made
        assert p["image_sequences"] == 0 and p["tau_text"] == p["tau"] and all(t != t for t in p["tau_image"].values())
    assert set(rec["final"]["grid_tau"]) == {"1/1/2", "2/1/3", "2/2/4"}
    assert rec["final"]["real"]["2/1/3"]["lossless"] is True
    assert len(rec["final"]["k2_traffic"]["acc"]) == 3
    # every run trained its own drafter: seeds differ in data order (tokens per budget) and weights
    keys = {json.loads((out / "records" / f"{n}.json").read_text())["key"]["drafter_sha256"] for n in runs}
    assert len(keys) == len(runs)
    s0 = json.loads((out / "records" / "scratch-seed0.json").read_text())
    assert [p["tokens"] for p in s0["points"]] != tokens

    report = json.loads((out / "report.json").read_text())
    assert report["seeds"] == {"scratch": [0, 1], "aqmedai_k2": [0, 1]} and list(report["worlds"]) == ["0"]
    assert rec["world_seed"] == 0
    assert set(report["plots"]) == {"acc_step0", "acc_mean", "tau 2/1/3", "tau 3/1/4", "tau 3/2/6"}
    assert all((out / f).is_file() for f in report["plots"].values())
    fd = report["derived"]["final_difference"]["sim tau 2/1/3"]
    assert fd["n_a"] == fd["n_b"] == 2 and (fd["low"] <= fd["diff"] <= fd["high"])
    assert report["derived"]["saving"]["pairs"] == 4
    assert {r["drafter"] for r in report["forgetting"]} == {"K2 drafter, zero-shot", "from scratch",
                                                            "from the K2 drafter"}
    assert set(report["knobs"]) == {"k2_zero_shot", "scratch", "aqmedai_k2", "ngram"}  # n-gram: the no-drafter row
    assert report["recommendation"]["init"] in ("scratch", "aqmedai_k2")
    assert report["images"] == [] and not (out / "mismatch").exists()
    rec_cmd = report["recommendation"]["command"]
    assert "--speculative-algorithm EAGLE3" in rec_cmd and "--speculative-num-steps" in rec_cmd
    assert any(row[0] == "study: train scratch-seed1" for t in report["timings"] for row in t["rows"])
    md = (out / "report.md").read_text()
    assert "± " in md and "Welch interval" in md and "sglang.launch_server" in md
    assert "covers ONE world" in md and "seed spread" in md

    # a rerun measures nothing again; report_only rebuilds the same answers from the records
    (out / "report.json").unlink()
    again = study_on(cfg, {0: exp}, StageLog(threads=1), time.time())
    assert json.loads((again / "report.json").read_text())["derived"] == report["derived"]
    from pipeline.study import run_study

    run_study(config("report_only=true"))
    assert json.loads((out / "report.json").read_text())["table"] == report["table"]


def test_report_refuses_records_of_one_world_seed_from_two_worlds():
    from pipeline.study_report import check_worlds

    def rec(name, world_seed, world_id):
        return {"name": name, "init": "scratch", "seed": 0, "world_seed": world_seed,
                "world": None if world_id is None else {"id": world_id}}

    assert check_worlds([rec("a", 0, "x"), rec("b", 0, "x"), rec("c", 1, "y"), rec("old", 0, None)]) == {0: "x", 1: "y"}
    with pytest.raises(ConfigError, match="world seed 0 come from different worlds.*world x: a.*world z: b"):
        check_worlds([rec("a", 0, "x"), rec("b", 0, "z")])


def test_world_seeds_name_runs_and_roots_apart(tmp_path):
    from pipeline.demo import world_root
    from pipeline.study import run_name, train_overrides

    assert world_root(tmp_path, 0) == tmp_path and world_root(tmp_path, 3) == tmp_path / "world-seed3"
    assert run_name("scratch", 1) == "scratch-seed1" and run_name("scratch", 1, 3) == "world3-scratch-seed1"
    cfg = to_schema(compose("study", ["demo_size=ci", f"paths.root={tmp_path}", "world_seeds=[0,3]"]), StudyConfig)
    over = train_overrides(cfg, [], "scratch", 1, 3)
    assert any(o.endswith("/train-world3-scratch-seed1") and o.startswith("out_dir=") for o in over)
    with pytest.raises(ConfigError, match="world_seeds"):
        to_schema(compose("study", ["world_seeds=[1,1]"]), StudyConfig)
    with pytest.raises(ConfigError, match=r"\+train.seed is set by the study itself"):
        to_schema(compose("study", ["+train.seed=4"]), StudyConfig)


def test_report_names_where_records_were_measured():
    from pipeline.study_report import machine, measured_on

    here = machine()
    assert measured_on([{"machine": here}]) == f"measured on {here}"
    assert measured_on([{"machine": "gpu-box: x86_64, NVIDIA H200"}, {}]) == \
        f"measured on gpu-box: x86_64, NVIDIA H200; report built on {here}"
    assert "do not name their machine" in measured_on([{}])
