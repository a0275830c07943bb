"""Probe (device): cuDNN vs flash SDPA kernels for the TTT attention's causal block 0, at Kimi
drafter dims (64 heads x 128, bf16, sequence-major [B,T,h,d] views). Checks that the cuDNN
backward given a *merged* out / lse (eagle3/ttt_flash.py's trick) equals the flash backward given
the same, and times forward + backward of each. Also times weight-gradient accumulation over 7
steps: mm then add vs addmm_ into the accumulator.

python3 benchmarks/probe_attention_kernels.py [--seq-lens 4096,8192] [--functions]
"""
import argparse
import time

import torch

A = torch.ops.aten


def flash_fwd(q, k, v, s):
    r = A._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=s)
    return r[0], r[1], r


def flash_bwd(do, q, k, v, o, lse, r, s):
    return A._scaled_dot_product_flash_attention_backward(do, q, k, v, o, lse, r[2], r[3], r[4], r[5], 0.0, True,
                                                          r[6], r[7], scale=s)


def cudnn_fwd(q, k, v, s):
    r = A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=s)
    return r[0], r[1], r


def cudnn_bwd(do, q, k, v, o, lse, r, s):
    return A._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, r[6], r[7], None, r[2], r[3], r[4],
                                                          r[5], 0.0, True, scale=s)


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
    p.add_argument("--functions", action="store_true", help="only check eagle3/ttt_flash.py's Functions, cuDNN vs flash")
    a = p.parse_args()
    if a.functions:
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
        of, lf, rf = flash_fwd(q, k, v, s)
        oc, lc, rc = cudnn_fwd(q, k, v, s)
        print(f"T={T}: lse flash {tuple(lf.shape)} {lf.dtype} stride {lf.stride()}; cudnn {tuple(lc.shape)} "
              f"{lc.dtype} stride {lc.stride()}; out strides flash {of.stride()} cudnn {oc.stride()}")
        lc_v = lc.reshape(lf.shape[0], lf.shape[1], -1)[..., :T]
        print(f"  fwd: max|out diff| {(of - oc).abs().max().item():.3e}, max|lse diff| "
              f"{(lf[..., :T] - lc_v).abs().max().item():.3e}")
        # merged: pretend extra columns raised the lse by a per-row amount, and the output changed
        bump = torch.rand(1, h, T, device=dev) * 0.7
        o_m = (of.float() * torch.exp(-bump)[..., None] + 0.1 * torch.randn_like(of, dtype=torch.float32)).to(of.dtype)
        o_m = o_m.transpose(1, 2).contiguous().transpose(1, 2)  # same layout as q
        lf_m = lf.clone(); lf_m[..., :T] += bump
        lc_m = lc.clone(); lc_m.view(lf.shape[0], lf.shape[1], -1)[..., :T] += bump
        gf = flash_bwd(do, q, k, v, o_m, lf_m, rf, s)
        gc = cudnn_bwd(do, q, k, v, o_m, lc_m, rc, s)
        for name, x, y in zip("qkv", gf, gc):
            rel = ((x.float() - y.float()).norm() / x.float().norm()).item()
            print(f"  bwd merged d{name}: rel L2 diff {rel:.3e}")
        # q / k as views of one packed [B,T,2h,d] projection (as the fast unroll's rope output is)
        qk = torch.cat([q.transpose(1, 2), k.transpose(1, 2)], dim=2)
        qp, kp = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
        oc2, lc2, rc2 = cudnn_fwd(qp, kp, v, s)
        gc2 = cudnn_bwd(do, qp, kp, v, oc2, lc2, rc2, s)
        gf2 = flash_bwd(do, q, k, v, of, lf, rf, s)
        print("  packed q/k views, cuDNN vs flash: fwd max|diff| %.3e; bwd rel L2 dq %.3e dk %.3e dv %.3e" % (
            (oc2 - of).abs().max().item(),
            *[((x.float() - y.float()).norm() / x.float().norm()).item() for x, y in zip(gf2, gc2)]))
        tf = timeit(lambda: flash_fwd(q, k, v, s))
        tc = timeit(lambda: cudnn_fwd(q, k, v, s))
        tbf = timeit(lambda: flash_bwd(do, q, k, v, of, lf, rf, s))
        tbc = timeit(lambda: cudnn_bwd(do, q, k, v, oc, lc, rc, s))
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


def check_functions(T: int, h: int = 8, d: int = 128, steps: int = 4) -> None:
    """This repo's autograd Functions (eagle3/ttt_flash.py) with cuDNN vs flash, q/k as views of one
    packed projection (as the fast unroll makes them): the worst relative L2 difference over the
    outputs and gradients of a 4-step TTT chain (eagle3/attention_check.py, the start-up check)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eagle3.attention_check import kernel_disagreement
    worst = kernel_disagreement("flash", "cudnn", torch.device("cuda"), torch.bfloat16, d, heads=h, T=T, steps=steps)
    print(f"  functions T={T}: {steps}-step TTT chain, cuDNN vs flash, worst rel L2 over outputs and grads {worst:.2e}",
          flush=True)


if __name__ == "__main__":
    main()
