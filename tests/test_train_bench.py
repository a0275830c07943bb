"""benchmarks/bench_train_step.py runs on CPU at tiny dims and reports every phase."""
import json

import pytest
import torch

from tests.fixtures.benchmarks import load_benchmark


def load_bench():
    return load_benchmark("bench_train_step")


def test_bench_train_step_runs_tiny_on_cpu(tmp_path):
    bench = load_bench()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "bench.json"
        res = bench.main(["--tiny", "--seq-lens", "16,32", "--iters", "1", "--warmup", "0", "--ttt", "3",
                          "--device", "cpu", "--check-seq-len", "24", "--store-seq-lens", "16@0.65", "--store-steps", "2",
                          "--store-dir", str(tmp_path / "store"), "--anchor", "--floor", "--json", str(out)])
    finally:
        torch.set_num_threads(n)
    timed = [r for r in res if r["impl"] in ("fast", "reference")]
    # the main rows at the default share, then the in-memory twin of the store row at its own share
    assert [(r["impl"], r["T"], r["share"]) for r in timed] == [
        ("fast", 16, 1.0), ("fast", 32, 1.0), ("reference", 16, 1.0), ("reference", 32, 1.0), ("fast", 16, 0.65)]
    for r in timed:
        assert r["step_s"] >= r["forward_loss_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        assert r["tokens_per_s"] > 0 and r["loss"] > 0
    report = json.loads(out.read_text())
    # the fast path matched the fp32 reference (on CPU both are fp32: near-exact), and was fed from a real store
    assert report["check"]["fast"]["loss_rel_err"] < 1e-5 and not report["check"]["worse_than_reference"]
    assert max(report["check"]["fast"]["grad_rel_err"].values()) < 1e-4
    assert set(report["speedups"]) == {"16", "32"}
    (store_row,) = [r for r in res if r["impl"] == "fast-from-store"]
    assert (store_row["T"], store_row["share"]) == (16, 0.65)
    assert store_row["tokens_per_s"] > 0 and store_row["loader_alone_batches_per_s"] > 0 and store_row["vs_in_memory"] > 0
    from eagle3.formats.store import HiddenStateStore

    store = HiddenStateStore(tmp_path / "store" / "T16-share0.65")
    mask = store[0]["loss_mask"]  # a prompt (out of the loss), then the reply: round(16 x 0.35) = 6 positions out
    assert mask.tolist() == [False] * 6 + [True] * 10
    # the SpecForge anchor needs CUDA (its loss is a Triton kernel): on CPU each pair is a reported skip, not a row
    anchor = [r for r in res if r["impl"] == "specforge"]
    assert [(r["T"], r["share"]) for r in anchor] == [(16, 1.0), (32, 1.0), (16, 0.65)]
    assert all("CUDA" in r["skipped"] and "tokens_per_s" not in r for r in anchor)
    assert [(a["T"], a["share"], a["anchor_tokens_per_s"], a["fast_vs_anchor"]) for a in report["anchor"]] == [
        (16, 1.0, None, None), (32, 1.0, None, None), (16, 0.65, None, None)]
    assert report["anchor"][2]["store_tokens_per_s"] == store_row["tokens_per_s"]
    # --floor: the step's GEMMs + attention alone at every (T, share) of the fast rows, beside the measured step
    floors = [r for r in res if r["impl"] == "floor"]
    assert [(r["T"], r["share"]) for r in floors] == [(16, 1.0), (32, 1.0), (16, 0.65)]
    for r, a in zip(floors, report["anchor"]):
        assert r["gemm_s"] > 0 and r["attention_s"] > 0 and r["n_gemms"] == 3 * 15 + 5
        assert a["floor_tokens_per_s"] == r["tokens_per_s"] and a["floor_vs_anchor"] is None
        assert a["fast_vs_floor"] == pytest.approx(a["fast_tokens_per_s"] / r["tokens_per_s"], abs=1e-3)
    # issue 9's FLOP formula at K2 dims: 6 x 1.0368e9 x T x 7 + 344,064 x T^2 (+ fc once per token)
    k2 = bench.K2
    T = 4096
    expect = 6 * 1.0368e9 * T * 7 + 344064 * T ** 2 + 6 * 3 * 7168 ** 2 * T
    assert abs(bench.step_flops(k2, T, 7, 1) - expect) / expect < 1e-3


def test_anchor_summary_pairs_rows_by_length_and_share():
    """The same-run ratios pair this project's rows with SpecForge's at the same (T, loss share) only."""
    bench = load_bench()
    rows = [{"impl": "fast", "T": 4096, "share": 1.0, "tokens_per_s": 13000.0},
            {"impl": "reference", "T": 4096, "share": 1.0, "tokens_per_s": 7000.0},
            {"impl": "fast", "T": 4096, "share": 0.65, "tokens_per_s": 15000.0},
            {"impl": "fast-from-store", "T": 4096, "share": 0.65, "tokens_per_s": 14000.0},
            {"impl": "fast", "T": 8192, "share": 1.0, "oom": True},
            {"impl": "specforge", "T": 4096, "share": 0.65, "tokens_per_s": 10000.0},
            {"impl": "specforge", "T": 4096, "share": 1.0, "tokens_per_s": 9000.0}]
    assert bench.anchor_pairs(rows) == [(4096, 1.0), (4096, 0.65)]
    long = rows + [{"impl": "fast", "T": 32768, "share": 1.0, "tokens_per_s": 11000.0}]
    assert bench.anchor_pairs(long, max_seq_len=8192) == [(4096, 1.0), (4096, 0.65)]  # the anchor skips T=32768
    assert bench.anchor_summary(long)[-1]["fast_vs_anchor"] is None                    # ... and its row has no ratio
    full, mix = bench.anchor_summary(rows)
    assert (full["fast_vs_anchor"], full["store_vs_anchor"]) == (round(13000 / 9000, 3), None)
    assert (mix["fast_vs_anchor"], mix["store_vs_anchor"]) == (1.5, 1.4)


def test_anchor_summary_takes_the_median_over_rounds():
    """--rounds / --anchor-rounds: each tool's tokens/s is the median of its rounds (one slow anchor round
    no longer sets the ratio), and the anchor's rounds are listed."""
    bench = load_bench()
    rows = [{"impl": "fast", "T": 4096, "share": 1.0, "tokens_per_s": v, "round": i}
            for i, v in enumerate((14000.0, 14400.0, 14300.0))]
    rows += [{"impl": "specforge", "T": 4096, "share": 1.0, "tokens_per_s": v, "round": i}
             for i, v in enumerate((9000.0, 9500.0, 9400.0))]
    (row,) = bench.anchor_summary(rows)
    assert (row["fast_tokens_per_s"], row["anchor_tokens_per_s"]) == (14300.0, 9400.0)
    assert row["fast_vs_anchor"] == round(14300 / 9400, 3)
    assert row["anchor_rounds"] == [9000.0, 9500.0, 9400.0]
    # fast / reference too: medians of both (a first round that ran cold does not set it); T without both: absent
    rows += [{"impl": "reference", "T": 4096, "share": 1.0, "tokens_per_s": v, "round": i}
             for i, v in enumerate((5000.0, 7000.0, 7100.0))]
    assert bench.fast_vs_reference(rows, [4096, 8192], 1.0) == {4096: round(14300 / 7000, 3)}


def test_store_entry_parsing():
    bench = load_bench()
    assert bench.parse_store_entry("4096", 1.0) == (4096, 1.0)
    assert bench.parse_store_entry("4096@0.65", 1.0) == (4096, 0.65)
    for bad in ("4096@x", "4096@1.5", "0@0.5", "abc"):
        with pytest.raises(SystemExit, match="--store-seq-lens entry"):
            bench.parse_store_entry(bad, 1.0)


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
    # ranges over kernels are not kernels (the optimizer's range once counted the AdamW kernel twice)
    assert bench.is_range("Optimizer.step#TritonAdamW.step") and bench.is_range("## Call CompiledFxGraph abc ##")
    assert not bench.is_range("adamw_kernel") and not bench.is_range("triton_poi_fused_mul_silu_split_0")


def test_timeline_probe_counts_busy_time_once_and_finds_the_gaps():
    """Overlapping kernels (two streams) count once; gaps between them and at the ends are reported."""
    probe = load_benchmark("probe_step_timeline")
    iv = [(10.0, 20.0, "a", 1), (15.0, 25.0, "b", 2), (40.0, 50.0, "c", 3)]
    busy, gaps = probe.idle_gaps(iv, 0.0, 60.0, min_us=1.0)
    assert busy == 25.0
    assert [(g0, g) for g0, g, _, _ in gaps] == [(0.0, 10.0), (25.0, 15.0), (50.0, 10.0)]
    assert gaps[1][2][2] == "b" and gaps[1][3][2] == "c"


def test_memory_probe_replays_the_allocator_to_its_peak():
    probe = load_benchmark("probe_step_memory")
    trace = [{"action": "alloc", "addr": 1, "size": 10}, {"action": "alloc", "addr": 2, "size": 5},
             {"action": "free_requested", "addr": 1, "size": 10}, {"action": "alloc", "addr": 3, "size": 8}]
    peak, at, live = probe.live_at_peak(trace)
    assert (peak, at, sorted(live)) == (15, 1, [1, 2])
