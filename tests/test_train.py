"""The train stage end to end on a tiny learnable world (tests/fixtures/train_world.py): metrics and
wandb offline run, the loss falls, both init choices through the same config, reuse of a finished
run, extension of a finished run from its last checkpoint, the composed config on the CLI."""
import json
import os
import subprocess
import sys

import pytest
import torch

from eagle3 import REPO_ROOT
from eagle3.config.conf import compose, to_schema
from eagle3.drafter.drafter_io import load_drafter_dir
from eagle3.config.schema.train import TrainConfig
from tests.fixtures.train_world import config_for, overrides, rows, world  # noqa: F401 (fixture)
from train.stage import run_train


def test_run_writes_metrics_wandb_offline_and_a_final_drafter(world, tmp_path):
    out = tmp_path / "run"
    cfg = config_for(world, out, "scratch", max_steps=24, epochs="null", **{"wandb.mode": "offline"})
    assert run_train(cfg) == out
    train, val = rows(out, "train"), rows(out, "val")
    assert [r["step"] for r in train] == list(range(2, 25, 2))
    for r in train:
        assert len(r["loss"]) == len(r["acc"]) == 3
        assert {"lr", "grad_norm", "tokens_per_s", "loss_weighted", "padding_efficiency"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    # learnable toy: the loss falls and step-0 validation accuracy rises above the init's own
    assert train[-1]["loss_weighted"] < 0.8 * train[0]["loss_weighted"]
    assert [r["step"] for r in val] == [0, 24]
    assert val[-1]["acc"][0] > val[0]["acc"][0] + 0.3
    # warmup then cosine to 0
    assert train[0]["lr"] == pytest.approx(3e-3) and train[-1]["lr"] == pytest.approx(0.0, abs=1e-9)
    # wandb offline run under out_dir/wandb, with its data file
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    # the final drafter is a drafter directory in the shared layout with the vocab stage's mapping
    drafter = load_drafter_dir(out / "final")
    from safetensors.torch import load_file

    vocab = load_file(str(world["vocab"] / "vocab.safetensors"))
    assert torch.equal(drafter.d2t, vocab["d2t"]) and torch.equal(drafter.t2d, vocab["t2d"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "train" and manifest["steps"] == 24
    assert set(manifest["inputs"]) == {"capture", "vocab"}
    assert manifest["val_end"]["acc"] == val[-1]["acc"]
    assert manifest["resolved"] == {"device": "cpu", "precision": "no", "unroll": "reference", "compile": False,
                                    "image_embeddings": "fused", "loader_workers": 0}  # the autos, as the run used them
    assert not list(out.glob(".*.tmp-*"))  # final/ was staged and published: no staging left
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-000020", "step-000024"]


def test_aqmedai_init_remaps_and_trains_and_a_rerun_is_reused_or_extended(world, tmp_path, capsys):
    out = tmp_path / "aq"
    cfg = config_for(world, out, "aqmedai_k2", max_steps=8, epochs="null", **{"data.num_workers": 1})
    run_train(cfg)  # (also exercises the DataLoader worker path)
    manifest = json.loads((out / "manifest.json").read_text())
    remap = manifest["init_report"]["lm_head_remap"]
    assert manifest["init_report"]["init"] == "aqmedai_k2" and remap["n_shared"] > 0 and remap["n_fresh"] > 0
    train = rows(out, "train")
    assert train[-1]["loss_weighted"] < train[0]["loss_weighted"]
    final_bytes = (out / "final" / "model.safetensors").read_bytes()
    capsys.readouterr()

    run_train(cfg)  # same config and inputs: reused, nothing retrained
    assert "reused" in capsys.readouterr().out
    assert (out / "final" / "model.safetensors").read_bytes() == final_bytes

    longer = config_for(world, out, "aqmedai_k2", max_steps=12, epochs="null", **{"data.num_workers": 1})
    run_train(longer)  # extended: continues from the step-8 checkpoint
    log = capsys.readouterr().out
    assert "resuming from" in log and "step-000008" in log
    steps = [r["step"] for r in rows(out, "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 12 and 8 in steps
    assert json.loads((out / "manifest.json").read_text())["steps"] == 12


def test_changed_settings_refuse_to_resume_a_foreign_checkpoint(world, tmp_path):
    from eagle3.formats.checkpoints import CheckpointError

    out = tmp_path / "x"
    run_train(config_for(world, out, "scratch", max_steps=4, epochs="null"))
    (out / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="ttt_length"):
        run_train(config_for(world, out, "scratch", max_steps=6, epochs="null", ttt_length=2))


def test_cli_prints_the_composed_config():
    env = {**os.environ, "EAGLE3_ROOT": "/tmp/eagle3-cfg-test"}
    res = subprocess.run([sys.executable, str(REPO_ROOT / "train" / "run.py"), "+init=aqmedai_k2", "--cfg", "job",
                          "--resolve"], capture_output=True, text=True, env=env, timeout=120, cwd="/")
    assert res.returncode == 0, res.stderr
    assert "name: aqmedai_k2" in res.stdout and "ttt_length: 7" in res.stdout
    assert "out_dir: /tmp/eagle3-cfg-test/stages/k25_mini/train-aqmedai_k2" in res.stdout
    assert "lr: 5.0e-05" in res.stdout and "max_tokens_per_batch:" in res.stdout


def test_schema_rejects_bad_settings(world, tmp_path):
    from eagle3.config.conf import ConfigError

    with pytest.raises(ConfigError, match="precision"):
        config_for(world, tmp_path, precision="fp8")
    with pytest.raises(ConfigError, match="max_length"):
        config_for(world, tmp_path, **{"data.max_length": 400, "data.max_tokens_per_batch": 100})
    from omegaconf import open_dict

    cfg = compose("train", overrides(world, tmp_path))
    with open_dict(cfg):
        cfg.pop("init")
    with pytest.raises(ConfigError, match=r"\+init=aqmedai_k2 or \+init=scratch"):
        to_schema(cfg, TrainConfig)
