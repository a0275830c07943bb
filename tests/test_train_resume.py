"""Resume: a training process killed with SIGKILL between checkpoints, rerun with the same
command, ends with the same weights as an uninterrupted run; checkpoint files are atomic and a
corrupt checkpoint is refused with its file named."""
import json
import os
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import hooks
from eagle3.formats.checkpoints import CheckpointError
from hooked_stage import hooked_command
from tests.fixtures.train_world import config_for, overrides, rows, world  # noqa: F401  (fixture)
from train.stage import run_train


def test_killed_run_resumes_to_the_same_weights(world, tmp_path, capsys):
    common = dict(max_steps=10, epochs="null", checkpoint_every=4, keep_checkpoints=0)
    ref = tmp_path / "uninterrupted"
    run_train(config_for(world, ref, "scratch", **common))

    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = hooked_command("kill_after_step=6", "train/run.py", overrides(world, out, "scratch", **common))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-000004"]            # killed after step 6: steps 5-6 are lost work
    assert not (out / "final").exists() and not (out / "manifest.json").exists()
    assert max(r["step"] for r in rows(out, "train")) == 6

    seen = []  # the hook point the kill used fires once per applied step, from the resumed one on
    with hooks.installed(hooks.TRAIN_AFTER_STEP, lambda step: seen.append(step)):
        run_train(config_for(world, out, "scratch", **common))  # the same command again (in-process: faster)
    log = capsys.readouterr().out
    assert "resuming from" in log and "step-000004" in log
    assert seen == [5, 6, 7, 8, 9, 10]

    a, b = load_file(str(ref / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    # the metrics of the lost steps were replaced, not duplicated
    steps = [r["step"] for r in rows(out, "train")]
    assert steps == [2, 4, 6, 8, 10]
    ref_last, got_last = rows(ref, "train")[-1], rows(out, "train")[-1]
    assert got_last["loss"] == pytest.approx(ref_last["loss"], rel=1e-4)
    m = json.loads((out / "manifest.json").read_text())
    assert m["steps"] == 10 and m["tokens_seen"] == json.loads((ref / "manifest.json").read_text())["tokens_seen"]


def test_corrupt_checkpoint_is_named_and_not_used(world, tmp_path):
    out = tmp_path / "c"
    run_train(config_for(world, out, "scratch", max_steps=4, epochs="null"))
    weights = out / "checkpoints" / "step-000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0xFF                          # one flipped bit pattern inside a tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-000004/model.safetensors.*checksum"):
        run_train(config_for(world, out, "scratch", max_steps=6, epochs="null"))


def test_leftover_partial_checkpoint_is_removed(world, tmp_path, capsys):
    out = tmp_path / "p"
    run_train(config_for(world, out, "scratch", max_steps=4, epochs="null"))
    partial = out / "checkpoints" / ".tmp-step-000008-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    run_train(config_for(world, out, "scratch", max_steps=8, epochs="null"))
    assert not partial.exists() and ".tmp-step-000008-999" in capsys.readouterr().out
    assert (out / "checkpoints" / "step-000008").is_dir()
