"""Process death: SIGKILL of a real stage process at seeded random points, then the same command again.
The result must equal an uninterrupted run, and what a kill leaves behind must never be readable as a
finished artifact (an export directory is either absent, the previous one, or complete and valid)."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import REPO_ROOT
from fault_helpers import export_config, train_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def export_overrides(pipeline, out: Path) -> list[str]:
    cfg = export_config(pipeline, pipeline["final"], out)
    return [f"paths.root={cfg.paths.root}", f"target.path={cfg.target.path}", f"checkpoint_dir={cfg.checkpoint_dir}",
            f"capture_dir={cfg.capture_dir}", f"eval_dir={cfg.eval_dir}", f"out_dir={out}",
            f"verify_sequences={cfg.verify_sequences}", f"verify_tokens={cfg.verify_tokens}"]


def files_of(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != "manifest.json" and p.name != "SERVE.md"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_export_never_leaves_a_partial_directory(pipeline, tmp_path, seed):
    from export.stage import run_export
    from export.directory import validate_format_dir
    from export.formats import FORMATS

    ref = run_export(export_config(pipeline, pipeline["final"], tmp_path / "ref"))
    out = tmp_path / "killed"
    rng = random.Random(seed)
    # the kill lands while the export writes: wait for its temp directory, then a seeded random delay
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "export" / "run.py"), *export_overrides(pipeline, out)],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not list(tmp_path.glob(".killed.tmp-*")):
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.4))
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.read()[-2000:]
    if out.exists():                       # it finished before the kill: then it is complete and valid
        kw = dict(vocab_size=512, max_position_embeddings=4096, hf_indices=pipeline["hf_indices"],
                  dtype="bfloat16", rope=None)
        assert validate_format_dir(out, FORMATS["sglang"], **kw) == [] and (out / "manifest.json").is_file()
    run_export(export_config(pipeline, pipeline["final"], out))          # the same command again
    assert files_of(out) == files_of(ref)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".killed.")]


@pytest.mark.parametrize("seed", [3, 4])
def test_killed_training_resumes_to_the_same_weights(pipeline, tmp_path, seed):
    """SIGKILL right after a seeded random optimizer step (the train.after_step hook), rerun."""
    from hooked_stage import hooked_command
    from tests.fixtures.train_world import overrides
    from train.stage import run_train

    steps, common = 6, dict(max_steps=6, epochs="null", checkpoint_every=2, keep_checkpoints=0)
    ref = run_train(train_config(pipeline, tmp_path / "ref", **common))
    kill_after = random.Random(seed).randint(1, steps - 1)
    out = tmp_path / "killed"
    cmd = hooked_command(f"kill_after_step={kill_after}", "train/run.py", overrides(pipeline, out, "scratch", **common))
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert not (out / "final").exists()
    done = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    assert done == list(range(2, kill_after + 1, 2))               # only complete checkpoints are there
    run_train(train_config(pipeline, out, **common))
    a, b = load_file(str(Path(ref) / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    assert json.loads((out / "manifest.json").read_text())["steps"] == steps


def test_death_between_the_two_renames_is_recovered(pipeline, tmp_path, monkeypatch):
    """The export replaces a previous directory in two renames (old aside, new in). Dying between them
    leaves no out_dir: the next run puts the previous, complete export back before anything else."""
    import eagle3.stage_dir as stage_dir_mod
    from export.stage import run_export

    out = run_export(export_config(pipeline, pipeline["final"], tmp_path / "e", "format=sglang"))
    before = files_of(out)
    real_replace = os.replace

    def dies_on_second(src, dst):     # the old directory went aside; the new one's rename never happens
        if Path(dst) == out and Path(src).name.startswith(".e.tmp-"):
            raise KeyboardInterrupt("killed between the renames")
        return real_replace(src, dst)

    monkeypatch.setattr(stage_dir_mod.os, "replace", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_export(export_config(pipeline, pipeline["final"], tmp_path / "e", "format=sglang", "dtype=float32"))
    monkeypatch.setattr(stage_dir_mod.os, "replace", real_replace)
    assert not out.exists() and list(tmp_path.glob(".e.old-*"))
    stage_dir_mod.StageDir(out, "export", whole=True)  # what the next export does first
    assert files_of(out) == before                                      # the previous export is back, whole
    run_export(export_config(pipeline, pipeline["final"], tmp_path / "e", "format=sglang", "dtype=float32"))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
