"""Two CPU processes (gloo DDP, launched like `accelerate launch` / torchrun) train exactly like one
process with grad_accum=2: the same global batches in the same order (rank shards interleave),
and the loss is normalised over the whole optimizer step, so the trajectories and final weights
agree to float tolerance."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import REPO_ROOT
from tests.fixtures.train_world import config_for, overrides, rows, world  # noqa: F401  (fixture)
from tests.fixtures.ports import free_port  # noqa: F401 (also used by other tests)
from train.stage import run_train




@pytest.mark.slow
@pytest.mark.parametrize("unroll,fused", [("auto", False), ("fast", True)])
def test_two_process_ddp_matches_one_process_with_accumulation(world, tmp_path, unroll, fused):
    """fast: weight gradients handed over by eagle3/ttt/wgrad.py's node; fused: a fused AdamW with the clip
    folded into its step (train/distributed.clip_gradients), clipping every step (grad_clip 0.05)."""
    common = dict(max_steps=6, epochs="null", checkpoint_every=3, unroll=unroll)
    if fused:
        common.update({"optim.fused": "true", "optim.grad_clip": 0.05})
    one = tmp_path / "one"
    run_train(config_for(world, one, "scratch", grad_accum=2, **common))

    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "train" / "run.py"), *overrides(world, two, "scratch", grad_accum=1, **common)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "on 2 process(es)" in res.stdout and "MULTI_CPU" in res.stdout  # DDP over gloo

    if fused:
        assert all(r["grad_norm"] > 0.05 for r in rows(one, "train"))  # the folded clip acted on every logged step
    for r1, r2 in zip(rows(one, "train"), rows(two, "train"), strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)
        assert r2["acc"] == pytest.approx(r1["acc"], abs=1e-6)
    a, b = load_file(str(one / "final" / "model.safetensors")), load_file(str(two / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert m1["tokens_seen"] == m2["tokens_seen"]           # counted over all ranks
    assert m2["val_end"]["positions"] == m1["val_end"]["positions"]  # validation shards counted once
