"""The weight-gradient GEMM of one TTT step at Kimi-K2 size (gate/up: [2I, T] @ [T, H]), three ways:
bf16 out (what autograd's per-step weight gradient is), fp32 out, and fp32 accumulated in place
with beta = 1 (eagle3/ttt/wgrad.matmul_accumulate), beside bf16 out + a bf16 add (autograd's sum over
steps). Checks that the in-place form writes the buffer it was given.

    python benchmarks/probe_wgrad_gemm.py --tokens 4096
"""
from __future__ import annotations

import argparse
import time

import torch

from eagle3.ttt.wgrad import matmul_accumulate


def timed(fn, n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rows", type=int, default=36864, help="output rows (gate/up: 2 x 18432)")
    p.add_argument("--cols", type=int, default=7168)
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(args.rows, args.tokens, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(args.tokens, args.cols, device="cuda", dtype=torch.bfloat16, generator=g)
    acc = matmul_accumulate(None, a, b, torch.float32)
    once = acc.clone()
    out = matmul_accumulate(acc, a, b, torch.float32)
    err = float((acc - 2 * once).abs().max() / once.abs().max())
    print(f"in place: {out.data_ptr() == acc.data_ptr()}, relative error of the sum {err:.2e}")
    prev = torch.mm(a, b)
    acc16 = prev.clone()
    a2, b2 = torch.cat([a, a], dim=1), torch.cat([b, b])  # two steps' dY^T / X side by side: K = 2T
    flops = 2 * args.rows * args.tokens * args.cols
    for name, fn in (("bf16 out", lambda: torch.mm(a, b)),
                     ("fp32 out", lambda: torch.mm(a, b, out_dtype=torch.float32)),
                     ("fp32 accumulated in place (beta=1)", lambda: matmul_accumulate(acc, a, b, torch.float32)),
                     ("bf16 accumulated in place (beta=1)", lambda: matmul_accumulate(acc16, a, b, torch.bfloat16)),
                     ("bf16 out + bf16 add", lambda: torch.mm(a, b).add_(prev)),
                     ("two steps as one GEMM (K=2T) / 2", lambda: torch.mm(a2, b2, out_dtype=torch.float32))):
        ms = timed(fn) / (2 if "K=2T" in name else 1)
        print(f"{name:36s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
