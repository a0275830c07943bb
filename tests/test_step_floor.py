"""benchmarks/step_floor.py lists exactly the GEMMs the fast unroll runs, and its replay runs (CPU, tiny dims)."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3.ttt.fast_unroll import ttt_unroll_fast
from eagle3.ttt.loss import all_loss_positions
from tests.fixtures.benchmarks import load_benchmark as load


class GemmShapes(TorchDispatchMode):
    """(m, k, n) of every matrix product dispatched: mm / addmm / addmm_ in any overload."""

    def __init__(self):
        super().__init__()
        self.shapes = Counter()
        self.attention = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.shapes[(a.shape[0], a.shape[1], b.shape[1])] += 1
        elif "attention" in name:
            self.attention["backward" if name.endswith("backward") else "forward"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("share,chunk", [(1.0, 8192), (0.65, 10)])
def test_step_gemms_are_the_fast_unrolls_gemms(share, chunk):
    bench, floor = load("bench_train_step"), load("step_floor")
    dims, T, K = dict(bench.TINY), 40, 3
    objective, rows, ids = bench.build(dims, K, torch.device("cpu"), bf16=False)
    batch = bench.make_batch(dims, 1, T, ids, "cpu", dtype=torch.float32, mask_frac=share)
    drafter = objective.drafter
    with GemmShapes() as seen:
        out = ttt_unroll_fast(drafter, batch["aux"], batch["input_ids"], batch["last"], batch["target_argmax"],
                              batch["loss_mask"], rows.float(), K, ce_chunk_rows=chunk)
        out.loss.backward()
    counts = all_loss_positions(batch["loss_mask"], batch["target_argmax"], drafter.t2d, K).sum((1, 2)).tolist()
    listed = floor.step_gemms(dims, T, K, counts[1:], counts[0], ce_chunk_rows=chunk)
    assert Counter((g.m, g.k, g.n) for g in listed) == seen.shapes
    ops = floor.step_ops(dims, T, K, counts[1:], counts[0], ce_chunk_rows=chunk)
    assert ops.count(floor.ATTENTION_FORWARD) == ops.count(floor.ATTENTION_BACKWARD) == K
    assert seen.attention == {"forward": K, "backward": K}  # on CPU the diagonal merge is elementwise
    if share < 1.0:  # chunks of 10 rows: several lm_head chunks per step
        assert sum(1 for g in listed if g.name == "lm_head" and g.kind == "linear") > K


def test_step_ops_rejects_wrong_row_counts():
    floor = load("step_floor")
    with pytest.raises(ValueError, match="3 step row counts for 7 TTT steps"):
        floor.step_ops(load("bench_train_step").TINY, 64, 7, [10, 10, 10], 12)


def test_time_floor_runs_on_cpu():
    bench, floor = load("bench_train_step"), load("step_floor")
    dims, T, K = dict(bench.TINY), 32, 3
    r = floor.time_floor(dims, T, K, [30, 29, 28], 31, torch.device("cpu"), torch.float32, "flash", iters=2, warmup=1)
    assert r["step_s"] > 0 and r["gemm_s"] > 0 and r["attention_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(T / r["step_s"], rel=0.05)  # step_s is rounded to 10 us
    flops = sum(g.flops for g in floor.step_gemms(dims, T, K, [30, 29, 28], 31))
    assert r["gemm_tflop"] == pytest.approx(flops / 1e12, abs=1e-3)
    assert r["n_gemms"] == 3 * 15 + 5
