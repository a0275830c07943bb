"""The reduced demo (demo_size=ci): every stage of `make demo` through the same code path, on a
tiny mini world, end to end. Slow-ish (minutes on 2 cores) but it is the one test that proves the
stages fit together: each stage reads what the previous one wrote."""
import json
from pathlib import Path

import pytest

from eagle3.config.conf import compose, to_schema
from eagle3.config.schema.demo import DemoConfig


@pytest.mark.slow
def test_reduced_demo_runs_every_stage_end_to_end(tmp_path):
    from pipeline.demo import run_demo

    cfg = to_schema(compose("demo", [f"paths.root={tmp_path}", "demo_size=ci"]), DemoConfig)
    out = run_demo(cfg)
    report = json.loads((Path(out) / "report.json").read_text())
    names = [row["drafter"] for row in report["rows"]][:3]
    assert names == ["k2_zero_shot", "scratch", "aqmedai_k2"] and report["rows"][3]["drafter"].startswith("ngram")
    assert report["lossless"] is True
    for side in ("k2", "k25"):  # issue 44: each side's prepared traffic measured
        f = report["traffic"][side]
        assert 0 < f["distinct"] <= f["loss_tokens"] and 0 < f["top5_share"] <= 1
    assert "Traffic (prepared loss tokens), k25:" in (Path(out) / "report.md").read_text()
    # ... and the K2 drafter on its own target's held-out traffic, beside the n-gram on the same sequences
    own = report["k2_own"]
    assert [r["drafter"] for r in own][0] == "K2 drafter on K2" and own[1]["drafter"].startswith("ngram")
    sim = own[0][next(k for k in own[0] if k.startswith("sim "))]
    assert (sim != sim or sim >= 1.0) and 0 <= own[0]["off argmax"] <= 1  # NaN: the ci K2 side holds out no segment
    assert (tmp_path / "stages" / "k2_mini" / "eval-k2_own" / "report.json").is_file()
    assert "## The K2 drafter on its own target" in (Path(out) / "report.md").read_text()
    ceiling = report["rows"][4]  # after the n-gram: a drafter always right, on the same segments
    assert ceiling["drafter"].startswith("ceiling")
    for row in report["rows"][:3]:  # the drafters (n-gram drafts num_draft_tokens - 1 deep, past a tree's depth)
        for key, value in row.items():
            if key.startswith(("sim ", "text ", "image ", "speedup ")) and value == value:
                assert value <= ceiling[key] + 1e-9, (row["drafter"], key, value, ceiling[key])
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
    # one world: every K2.5-side stage manifest carries the world prepare fingerprinted (eagle3/world.py)
    k25_dirs = (tmp_path / "stages" / "k25_mini").glob("*/manifest.json")
    manifests = {p.parent.name: json.loads(p.read_text()) for p in k25_dirs}
    assert {"prepare", "capture", "vocab", "train-scratch", "train-aqmedai_k2"} <= set(manifests)
    worlds = {name: (m.get("world") or {}).get("id") for name, m in manifests.items()}
    assert len(set(worlds.values())) == 1 and None not in worlds.values(), worlds
    export_manifest = json.loads((Path(report["export_dir"]) / "manifest.json").read_text())
    assert export_manifest["world"]["id"] == worlds["prepare"]
    assert "| drafter |" in (Path(out) / "report.md").read_text()
    # image traffic (k25-mini sees; its corpus holds image conversations): text vs image columns for every
    # drafter, and the convention-mismatch grid of the from-K2 init (trained fused / placeholder x served both)
    label = next(k for k in report["rows"][0] if k.startswith("sim "))[4:]
    assert all({f"text {label}", f"image {label}"} <= set(row) for row in report["rows"])
    assert report["image_sequences"] >= 1 and report["rows"][2][f"image {label}"] >= 1.0
    pairs = [(r["trained"], r["served"]) for r in report["mismatch"]]
    assert sorted(pairs) == sorted((t, s) for t in ("fused", "placeholder") for s in ("fused", "placeholder"))
    assert all(r[f"image {label}"] >= 1.0 for r in report["mismatch"])
    for r in report["mismatch"]:  # the text part is served identically under both conventions
        same = next(m for m in report["mismatch"] if m["trained"] == r["trained"] and m["served"] == r["trained"])
        assert r[f"text {label}"] == same[f"text {label}"]
    assert "train-aqmedai_k2-placeholder" in manifests
    assert json.loads((tmp_path / "stages" / "k25_mini" / "train-aqmedai_k2-placeholder" / "final" / "config.json")
                      .read_text())["eagle3_image_embeddings"] == "placeholder"
    assert "## Image rows: trained with one convention" in (Path(out) / "report.md").read_text()
    # issue 43: one short online run, its own producer filling a spool capped below the offline store
    on = report["online"]
    assert on["cap_bytes"] < on["offline_store_bytes"] and 0 < on["peak_bytes"]
    assert on["tokens_trained"] == on["reuse_per_sequence"] * on["tokens_captured"] > 0 and on["steps"] > 0
    assert "train-online" in manifests and not list((tmp_path / "stages" / "k25_mini" / "capture-online" /
                                                      "spool").glob("chunk-*"))  # every chunk freed
    assert "## Online: the from-K2 run through a capped spool" in (Path(out) / "report.md").read_text()
    # a rerun reuses every finished stage
    again = run_demo(cfg)
    rerun = json.loads((Path(again) / "report.json").read_text())
    assert rerun["rows"] == report["rows"]
    assert rerun["total_seconds"] < report["total_seconds"]


def test_pick_best_prefers_the_real_loop_and_breaks_ties_by_accuracy():
    from pipeline.demo import pick_best

    def rep(sim, real, acc):
        return {"accept": {"2/1/3": {"drafter": {"accept_length": sim}}},
                "real_loop": {"knobs": {"2/1/3": {"real_accept_length": real}}} if real is not None else {},
                "accuracy": {"step_accuracy": acc}}

    # equal simulated values (a short replay): the real loop decides
    assert pick_best({"a": rep(1.1, 1.5, [0.9]), "b": rep(1.1, 2.1, [0.1])}, "2/1/3") == "b"
    # no real loop: the simulated value decides, then accuracy
    assert pick_best({"a": rep(1.3, None, [0.1]), "b": rep(1.2, None, [0.9])}, "2/1/3") == "a"
    assert pick_best({"a": rep(1.2, None, [0.1]), "b": rep(1.2, None, [0.9])}, "2/1/3") == "b"


def test_stale_training_checkpoints_are_dropped_once_and_other_errors_kept(tmp_path):
    from types import SimpleNamespace

    from pipeline.demo import run_restarting_stale_training
    from eagle3.formats.checkpoints import CheckpointError

    out = tmp_path / "train-scratch"
    (out / "checkpoints" / "step-000040").mkdir(parents=True)
    calls = []

    def run(typed):  # refuses while the stale checkpoint is there, as run_train does
        calls.append(1)
        if (Path(typed.out_dir) / "checkpoints").exists():
            raise CheckpointError("written by a run with other settings")
        return typed.out_dir

    assert run_restarting_stale_training(run, SimpleNamespace(out_dir=str(out))) == str(out)
    assert len(calls) == 2 and not (out / "checkpoints").exists()

    def always_fails(typed):
        raise CheckpointError("cannot write step 3")

    with pytest.raises(CheckpointError, match="cannot write"):  # no checkpoints to drop: the error stands
        run_restarting_stale_training(always_fails, SimpleNamespace(out_dir=str(tmp_path / "none")))


def test_the_k2_drafter_trains_on_its_own_step_budget(tmp_path):
    """build_experiment trains aqmedai-k2-mini for k2_drafter_steps, apart from the K2.5 drafters' train_steps
    (the stages recorded, not run: a fake log whose mini world is a 8-layer k2-mini config)."""
    from pipeline.demo import build_experiment

    (tmp_path / "mini_world" / "k2-mini").mkdir(parents=True)
    (tmp_path / "mini_world" / "k2-mini" / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    calls = []

    class Log:
        def run(self, label, stage, overrides):
            calls.append((label, stage, overrides))
            return tmp_path / "mini_world" if stage == "mini_world" else tmp_path / stage

    cfg = to_schema(compose("demo", [f"paths.root={tmp_path}", "demo_size=ci", "train_steps=3",
                                     "k2_drafter_steps=7"]), DemoConfig)
    build_experiment(cfg, Log())
    trains = [over for _, stage, over in calls if stage == "train"]
    assert len(trains) == 1 and "target=k2_mini" in trains[0] and "max_steps=7" in trains[0]
    assert not any(o.startswith("max_steps=") and o != "max_steps=7" for o in trains[0])
