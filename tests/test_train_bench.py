"""benchmarks/bench_train_step.py runs on CPU at tiny dims and reports every phase."""
import importlib.util
import json

import torch

from eagle3 import REPO_ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train_step", REPO_ROOT / "benchmarks" / "bench_train_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_train_step_runs_tiny_on_cpu(tmp_path):
    bench = load_bench()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "bench.json"
        res = bench.main(["--tiny", "--seq-lens", "16,32", "--iters", "1", "--warmup", "0", "--ttt", "3",
                          "--device", "cpu", "--check-seq-len", "24", "--store-seq-lens", "16", "--store-steps", "2",
                          "--store-dir", str(tmp_path / "store"), "--json", str(out)])
    finally:
        torch.set_num_threads(n)
    timed = [r for r in res if r["impl"] in ("fast", "reference")]
    assert [(r["impl"], r["T"]) for r in timed] == [("fast", 16), ("fast", 32), ("reference", 16), ("reference", 32)]
    for r in timed:
        assert r["step_s"] >= r["forward_loss_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        assert r["tokens_per_s"] > 0 and r["loss"] > 0
    report = json.loads(out.read_text())
    # the fast path matched the fp32 reference (on CPU both are fp32: near-exact), and was fed from a real store
    assert report["check"]["fast"]["loss_rel_err"] < 1e-5 and not report["check"]["worse_than_reference"]
    assert max(report["check"]["fast"]["grad_rel_err"].values()) < 1e-4
    assert set(report["speedups"]) == {"16", "32"}
    (store_row,) = [r for r in res if r["impl"] == "fast-from-store"]
    assert store_row["T"] == 16 and store_row["tokens_per_s"] > 0 and store_row["loader_alone_batches_per_s"] > 0
    assert (tmp_path / "store" / "T16" / "manifest.json").is_file()
    # issue 9's FLOP formula at K2 dims: 6 x 1.0368e9 x T x 7 + 344,064 x T^2 (+ fc once per token)
    k2 = bench.K2
    T = 4096
    expect = 6 * 1.0368e9 * T * 7 + 344064 * T ** 2 + 6 * 3 * 7168 ** 2 * T
    assert abs(bench.step_flops(k2, T, 7, 1) - expect) / expect < 1e-3


def test_profile_kernel_categories():
    """The benchmark's profile groups CUDA kernels by name: attention (cuDNN / flash, before the GEMM names
    that cuDNN's sm90 kernels also carry), GEMMs, compiled Triton kernels, copies, eager elementwise."""
    bench = load_bench()
    assert bench.kernel_kind("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NTN") == "gemm"
    assert bench.kernel_kind("triton_poi_fused_add_mul_neg_slice_slice_backward_view_0") == "compiled (triton)"
    assert bench.kernel_kind("Memcpy DtoD (Device -> Device)") == "copy / fill"
    assert bench.kernel_kind("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<"
                             "c10::BFloat16>>") == "elementwise (eager)"
    assert bench.kernel_kind("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>") == "attention"
    assert bench.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert bench.kernel_kind("some_new_kernel") == "other"
