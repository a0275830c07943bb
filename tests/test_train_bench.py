"""benchmarks/bench_train_step.py runs on CPU at tiny dims and reports every phase."""
import importlib.util

import torch

from eagle3 import REPO_ROOT


def test_bench_train_step_runs_tiny_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_train_step", REPO_ROOT / "benchmarks" / "bench_train_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "bench.json"
        res = bench.main(["--tiny", "--seq-lens", "16,32", "--iters", "1", "--warmup", "0", "--ttt", "3",
                          "--device", "cpu", "--json", str(out)])
    finally:
        torch.set_num_threads(n)
    assert [r["T"] for r in res] == [16, 32] and out.is_file()
    for r in res:
        assert r["step_s"] >= r["forward_loss_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        assert r["tokens_per_s"] > 0 and r["loss"] > 0
    # issue 9's FLOP formula at K2 dims: 6 x 1.0368e9 x T x 7 + 344,064 x T^2 (+ fc once per token)
    k2 = bench.K2
    T = 4096
    expect = 6 * 1.0368e9 * T * 7 + 344064 * T ** 2 + 6 * 3 * 7168 ** 2 * T
    assert abs(bench.step_flops(k2, T, 7, 1) - expect) / expect < 1e-3
