"""Probe (device): cuDNN vs flash SDPA kernels for the TTT attention's causal block 0, at Kimi
drafter dims (64 heads x 128, bf16, sequence-major [B,T,h,d] views). Checks that the cuDNN
backward given a *merged* out / lse (eagle3/ttt/ttt_flash.py's trick) equals the flash backward given
the same, and times forward + backward of each. Also times weight-gradient accumulation over 7
steps: mm then add vs addmm_ into the accumulator.

python3 benchmarks/probe_attention_kernels.py [--seq-lens 4096,8192] [--functions]
"""
import argparse
import time

import torch

from eagle3.ttt.attention_check import (_cudnn_disagreement, checked_attention_kernel, kernel_disagreement,
                                        relative_l2)
from eagle3.ttt.ttt_flash import _causal_backward, _causal_forward  # (the kernels as training calls them)


def timeit(fn, iters=10):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq-lens", default="4096,8192")
    p.add_argument("--functions", action="store_true", help="only check eagle3/ttt/ttt_flash.py's Functions, cuDNN vs flash")
    a = p.parse_args()
    if a.functions:
        time_startup_check()
        for T in (1024, 4096):
            check_functions(T)
        return
    torch.manual_seed(0)
    dev = "cuda"
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
    h, d = 64, 128
    s = d ** -0.5
    for T in [int(x) for x in a.seq_lens.split(",")]:
        mk = lambda: torch.randn(1, T, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
        q, k, v, do = mk(), mk(), mk(), mk()
        of, lf, sf = _causal_forward(q, k, v, s, "flash")
        oc, lc, sc = _causal_forward(q, k, v, s, "cudnn")
        print(f"T={T}: lse flash {tuple(lf.shape)} {lf.dtype} stride {lf.stride()}; cudnn {tuple(lc.shape)} "
              f"{lc.dtype} stride {lc.stride()}; out strides flash {of.stride()} cudnn {oc.stride()}")
        print(f"  fwd: max|out diff| {(of - oc).abs().max().item():.3e}, max|lse diff| "
              f"{(lf[..., :T] - lc[..., :T]).abs().max().item():.3e}")
        # merged: pretend extra columns raised the lse by a per-row amount, and the output changed
        bump = torch.rand(1, h, T, device=dev) * 0.7
        o_m = (of.float() * torch.exp(-bump)[..., None] + 0.1 * torch.randn_like(of, dtype=torch.float32)).to(of.dtype)
        o_m = o_m.transpose(1, 2).contiguous().transpose(1, 2)  # same layout as q
        lf_m = lf.clone(); lf_m[..., :T] += bump
        lc_m = lc.clone(); lc_m[..., :T] += bump
        gf = _causal_backward(do, q, k, v, o_m, lf_m, sf, s, "flash")
        gc = _causal_backward(do, q, k, v, o_m, lc_m, sc, s, "cudnn")
        for name, x, y in zip("qkv", gf, gc):
            print(f"  bwd merged d{name}: rel L2 diff {relative_l2(x, y):.3e}")
        # q / k as views of one packed [B,T,2h,d] projection (as the fast unroll's rope output is)
        qk = torch.cat([q.transpose(1, 2), k.transpose(1, 2)], dim=2)
        qp, kp = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
        oc2, lc2, sc2 = _causal_forward(qp, kp, v, s, "cudnn")
        gc2 = _causal_backward(do, qp, kp, v, oc2, lc2, sc2, s, "cudnn")
        gf2 = _causal_backward(do, q, k, v, of, lf, sf, s, "flash")
        print("  packed q/k views, cuDNN vs flash: fwd max|diff| %.3e; bwd rel L2 dq %.3e dk %.3e dv %.3e" % (
            (oc2 - of).abs().max().item(), *[relative_l2(x, y) for x, y in zip(gf2, gc2)]))
        tf = timeit(lambda: _causal_forward(q, k, v, s, "flash"))
        tc = timeit(lambda: _causal_forward(q, k, v, s, "cudnn"))
        tbf = timeit(lambda: _causal_backward(do, q, k, v, of, lf, sf, s, "flash"))
        tbc = timeit(lambda: _causal_backward(do, q, k, v, oc, lc, sc, s, "cudnn"))
        fl = 4 * T * T * h * d / 2
        print(f"  fwd flash {tf*1e3:.2f} ms ({fl/tf/1e12:.0f} TF/s), cudnn {tc*1e3:.2f} ms ({fl/tc/1e12:.0f} TF/s); "
              f"bwd flash {tbf*1e3:.2f} ms ({2.5*fl/tbf/1e12:.0f}), cudnn {tbc*1e3:.2f} ms ({2.5*fl/tbc/1e12:.0f}); "
              f"x7 steps fwd+bwd: flash {7*(tf+tbf)*1e3:.1f} ms, cudnn {7*(tc+tbc)*1e3:.1f} ms")
        # weight-gradient accumulation over 7 steps for the gate_up matrix [2*18432, 7168]
        x = torch.randn(T, 7168, device=dev, dtype=torch.bfloat16)
        g = torch.randn(T, 36864, device=dev, dtype=torch.bfloat16)
        acc = torch.zeros(36864, 7168, device=dev, dtype=torch.bfloat16)

        def sep():
            a_ = g.t() @ x
            for _ in range(6):
                a_ = a_ + g.t() @ x
            return a_

        def fused():
            torch.mm(g.t(), x, out=acc)
            for _ in range(6):
                acc.addmm_(g.t(), x)
            return acc
        t1, t2 = timeit(sep, 5), timeit(fused, 5)
        print(f"  gate_up weight grad x7: mm+add {t1*1e3:.2f} ms, addmm_ {t2*1e3:.2f} ms "
              f"(GEMM floor at 755 TF/s {7*2*T*36864*7168/755e12*1e3:.2f} ms)")


def time_startup_check() -> None:
    """The cost of training's start-up cuDNN check (eagle3/ttt/attention_check.py) as a fresh process pays
    it: the first call (which also builds cuDNN's execution plans) and a cached one."""
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the CUDA context is not the check's cost
    t = time.perf_counter()
    name = checked_attention_kernel("auto", dev, torch.bfloat16, 128)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    t = time.perf_counter()
    checked_attention_kernel("auto", dev, torch.bfloat16, 128)
    cached = time.perf_counter() - t
    print(f"  start-up check -> {name}: first call {first:.3f} s, cached {cached * 1e6:.0f} us, disagreement "
          f"{_cudnn_disagreement(str(dev), torch.bfloat16, 128):.2e}", flush=True)


def check_functions(T: int, h: int = 8, d: int = 128, steps: int = 4) -> None:
    """This repo's autograd Functions (eagle3/ttt/ttt_flash.py) with cuDNN vs flash, q/k as views of one
    packed projection (as the fast unroll makes them): the worst relative L2 difference over the
    outputs and gradients of a 4-step TTT chain (eagle3/ttt/attention_check.py, the start-up check)."""
    worst = kernel_disagreement("flash", "cudnn", torch.device("cuda"), torch.bfloat16, d, heads=h, T=T, steps=steps)
    print(f"  functions T={T}: {steps}-step TTT chain, cuDNN vs flash, worst rel L2 over outputs and grads {worst:.2e}",
          flush=True)


if __name__ == "__main__":
    main()
