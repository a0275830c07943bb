"""The eval stage end to end (eval/stage.py:run_eval) on the tiny Kimi-K2.5-layout target: a
validation store captured here from the target's greedy continuations, a random drafter saved in
the SGLang layout; report, plots, manifest, reuse, and the bad-input errors."""
import json

import pytest
import torch

from eagle3.engines.serve_launch import SpecKnobs
from eagle3.config.conf import ConfigError, compose, to_schema
from eagle3.drafter.drafter_io import save_drafter_dir
from eagle3.real_loop.chain import greedy_decode
from eagle3.real_loop.check import capture_sequence
from eagle3.replay.evaluate import EvalInputError
from eagle3.config.schema.eval import EvalConfig
from eagle3.formats.store import HiddenStateWriter
from eagle3.target_model.target_io import load_target
from eval.report import latencies_from_config
from eval.stage import run_eval
from tests.fixtures.real_loop import AUX_H, new_drafter, prompts
from tests.fixtures.tiny import TINY_TARGET_HIDDEN


@pytest.fixture(scope="module")
def world(tiny_k25_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_world")
    target, _ = load_target(tiny_k25_target, "kimi_k25", dtype="float32")
    w = HiddenStateWriter(root / "capture" / "validation", hidden_size=TINY_TARGET_HIDDEN,
                          target_hidden_size=TINY_TARGET_HIDDEN, hf_indices=AUX_H, dtype="float32", shard_tokens=64)
    for n, p in enumerate(prompts(2, L=5, seed=1)):
        ids = torch.cat([p, torch.tensor(greedy_decode(target, p, 16).tokens)])
        aux, argmax = capture_sequence(target, ids, AUX_H)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[p.numel():] = True
        w.add(f"v{n}", ids, mask, aux, torch.zeros(ids.numel(), TINY_TARGET_HIDDEN), argmax)
    w.finish()
    drafter_dir = save_drafter_dir(new_drafter(tiny_k25_target), root / "drafter", dtype="float32")
    return root, drafter_dir


def eval_config(root, target_path, drafter_dir, *extra):
    cfg = compose("eval", [f"paths.root={root}", f"target.path={target_path}", f"drafter_dir={drafter_dir}",
                           "name=tiny", f"capture_dir={root}/capture", "wandb.mode=disabled", "progress=false",
                           "ttt_length=3", "real_loop.num_prompts=1", "real_loop.max_new_tokens=8",
                           "knobs=[{num_steps:2,topk:1,num_draft_tokens:3},{num_steps:2,topk:2,num_draft_tokens:4}]",
                           *extra])
    return to_schema(cfg, EvalConfig)


def test_run_eval_writes_report_plots_manifest_and_reuses(world, tiny_k25_target, capsys):
    root, drafter_dir = world
    out = run_eval(eval_config(root, tiny_k25_target, drafter_dir))
    assert out == root / "stages" / "k25_mini" / "eval-tiny"
    report = json.loads((out / "report.json").read_text())
    assert set(report["accept"]) == {"2/1/3", "2/2/4"}
    for entry in report["accept"].values():
        assert entry["drafter"]["cycles"] > 0 and entry["ngram"]["cycles"] > 0
        # the store holds the target's own greedy output: no mismatch, except that on another CPU a tie
        # within float noise may go the other way at one position (the cached decode vs the full forward)
        assert entry["drafter"]["mismatches"] <= 1 and entry["drafter"]["assistant_positions"] >= 16
        # the store's ceiling (a drafter always right, same segments): above the drafter, within a full cycle
        ceiling = entry["ceiling"]
        assert ceiling["segments"] == entry["drafter"]["segments"] and ceiling["tokens"] == entry["drafter"]["tokens"]
        assert entry["drafter"]["accept_length"] <= ceiling["accept_length"] <= entry["knobs"]["num_steps"] + 1
    assert len(report["accuracy"]["step_accuracy"]) == 3
    real = report["real_loop"]["knobs"]["2/1/3"]
    assert real["lossless"] and abs(real["real_accept_length"] - real["sim_accept_length"]) <= 0.05
    tree = report["real_loop"]["knobs"]["2/2/4"]
    assert tree["lossless"] and abs(tree["real_accept_length"] - tree["sim_accept_length"]) <= 0.05
    assert report["best"]["label"] in ("2/1/3", "2/2/4") and report["best"]["wins"] is False
    ceiling = report["cost"]["by_knob"]["2/1/3"]["ceiling"]  # the most any drafter could gain on this store
    assert ceiling["speedup"] >= report["cost"]["by_knob"]["2/1/3"]["drafter"]["speedup"]
    verdict = report["cost"]["by_knob"]["2/1/3"]["drafter"]
    assert verdict["baseline_tok_s"] == pytest.approx(82.0) and verdict["break_even_accept_length"] > 2.4
    for name in ("accuracy_per_step.png", "accept_histogram.png", "acceptance_by_position.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "eval" and manifest["eval_inputs"]["drafter_sha256"]
    printed = capsys.readouterr().out
    assert "Simulated accept length" in printed and "break-even" in printed and "does NOT beat" in printed
    before = (out / "report.json").stat().st_mtime_ns
    run_eval(eval_config(root, tiny_k25_target, drafter_dir))
    assert "reusing" in capsys.readouterr().out and (out / "report.json").stat().st_mtime_ns == before


def test_run_eval_bad_inputs(world, tiny_k25_target, tmp_path):
    root, drafter_dir = world
    with pytest.raises(ConfigError, match="no drafter"):
        run_eval(eval_config(root, tiny_k25_target, tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="capture-hidden"):
        run_eval(eval_config(root, tiny_k25_target, drafter_dir, f"capture_dir={tmp_path}"))
    other = json.loads((drafter_dir / "config.json").read_text())
    other["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
    bad = tmp_path / "bad_drafter"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(other))
    (bad / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
    with pytest.raises(EvalInputError, match=r"drafter reads hidden states h = \[0, 2, 5\]"):
        run_eval(eval_config(root, tiny_k25_target, bad, "name=bad"))


def test_cost_falls_back_to_the_teacher_forced_estimate_without_cycles():
    from eagle3.engines.serve_costs import ACCOUNT_8GPU_PCIE
    from eval.report import best_setting, cost_section

    knobs = [SpecKnobs(2, 1, 3)]
    nan = float("nan")
    report = {"accept": {"2/1/3": {"drafter": {"accept_length": nan}, "ngram": {"accept_length": nan}}},
              "accuracy": {"chain_estimate": {"2/1/3": 2.6}}}
    report["cost"] = cost_section(report, knobs, ACCOUNT_8GPU_PCIE)
    pred = report["cost"]["by_knob"]["2/1/3"]["drafter"]
    assert pred["accept_length"] == 2.6 and pred["wins"] and "teacher-forced" in pred["accept_length_source"]
    assert "ngram" not in report["cost"]["by_knob"]["2/1/3"]
    assert best_setting(report, knobs)["label"] == "2/1/3"


def test_config_defaults_and_cost_overrides(tmp_path):
    cfg = to_schema(compose("eval", [f"paths.root={tmp_path}", "+init=aqmedai_k2"]), EvalConfig)
    assert cfg.name == "aqmedai_k2" and cfg.drafter_dir.endswith("k25_mini/train-aqmedai_k2/final")
    assert [(k.num_steps, k.topk, k.num_draft_tokens) for k in cfg.knobs][:2] == [(2, 1, 3), (3, 1, 4)]
    lat = latencies_from_config(cfg.cost)
    assert lat.baseline_token_ms == pytest.approx(1000 / 82) and lat.verify_ms == 30.0
    cfg = to_schema(compose("eval", [f"paths.root={tmp_path}", "cost.verify_ms=12", "cost.draft_step_ms=1.5"]),
                    EvalConfig)
    lat = latencies_from_config(cfg.cost)
    assert cfg.name == "drafter" and lat.verify_ms == 12 and lat.draft_step_ms == 1.5
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        to_schema(compose("eval", [f"paths.root={tmp_path}", "knobs=[{num_steps:2,topk:1,num_draft_tokens:5}]"]),
                  EvalConfig)
