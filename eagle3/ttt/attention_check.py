"""A start-up check of the TTT attention kernel before training trusts it.

cuDNN's attention backward has given wrong gradients with a right forward and loss (inputs in a
layout it mishandles: eagle3/ttt/ttt_flash.py `kernel_inputs`), and the fast path's gradients are
nowhere else compared against anything during a run. So the first time a process would use cuDNN
for a (device, dtype, head_dim), `checked_attention_kernel` runs a small TTT chain through both
kernels (q/k/v as views of one packed projection, as the fast unroll makes them) and compares the
outputs and gradients. On a disagreement `auto` falls back to flash with a warning, and an
explicit `cudnn` is an error: never a silent wrong gradient. The check costs a few milliseconds,
once per process. Imports only torch (core code).
"""
from __future__ import annotations

import functools
import warnings

import torch

from eagle3.ttt.ttt_flash import DiagonalKeys, causal_attention, causal_plus_diagonal_attention, resolve_attention_kernel

TOLERANCE = 2e-2  # relative L2; two correct bf16 kernels differ by ~3e-3 (benchmarks/probe_attention_kernels.py)


def ttt_chain(kernel_name: str, leaves: list[torch.Tensor], heads: int, scale: float) -> list[torch.Tensor]:
    """TTT attention of len(leaves) steps; leaf k is step k's packed [B,T,3h,d] q/k/v projection."""
    qkv = [(x[:, :, :heads], x[:, :, heads:2 * heads], x[:, :, 2 * heads:]) for x in leaves]
    q0, k0, v0 = qkv[0]
    outs = [causal_attention(q0, k0, v0, scale, kernel_name)]
    diagonal = DiagonalKeys(len(leaves) - 1, q0)
    for q, k, v in qkv[1:]:
        diagonal.append(k, v)
        outs.append(causal_plus_diagonal_attention(q, k0, v0, diagonal, scale, False, kernel_name))
    return outs


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||a|| in fp32 (0 when both are zero)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / a.norm().clamp(min=1e-30))


def kernel_disagreement(a: str, b: str, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                        heads: int = 4, T: int = 256, steps: int = 3, seed: int = 0) -> float:
    """The worst relative L2 difference between kernels `a` and `b` over the outputs and the
    gradients of a `steps`-step TTT chain on random inputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.inference_mode(False):
        leaves = [torch.randn(1, T, 3 * heads, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
                  for _ in range(steps)]
        douts = [torch.randn(1, T, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in range(steps)]
    runs = []
    # callable from anywhere the unroll runs: under autocast, no_grad or inference_mode (validation)
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for name in (a, b):
            outs = ttt_chain(name, leaves, heads, head_dim ** -0.5)
            runs.append((outs, torch.autograd.grad(outs, leaves, douts)))
    (outs_a, grads_a), (outs_b, grads_b) = runs
    return max(relative_l2(x, y) for x, y in zip(list(outs_a) + list(grads_a), list(outs_b) + list(grads_b)))


@functools.lru_cache(maxsize=None)
def _cudnn_disagreement(device: str, dtype: torch.dtype, head_dim: int) -> float:
    return kernel_disagreement("flash", "cudnn", torch.device(device), dtype, head_dim)


def checked_attention_kernel(choice: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """`resolve_attention_kernel`, with cuDNN used only after it matched flash on this process's
    device for this dtype and head_dim (checked once, then cached)."""
    name = resolve_attention_kernel(choice, device, head_dim)
    if name != "cudnn" or dtype not in (torch.float16, torch.bfloat16):  # other dtypes never reach the kernel
        return name
    try:
        worst = _cudnn_disagreement(str(device), dtype, head_dim)
        problem = None if worst <= TOLERANCE else f"differs from flash by {worst:.2e} (relative L2, limit {TOLERANCE})"
    except Exception as e:  # a cuDNN build that rejects the shape or layout, or the check itself broke
        problem = f"failed: {type(e).__name__}: {e}"
    if problem is None:
        return name
    if choice == "cudnn":
        raise RuntimeError(f"attention_kernel=cudnn: cuDNN's TTT attention on {device} ({dtype}, head_dim "
                           f"{head_dim}) {problem}; use attention_kernel=flash")
    warnings.warn(f"attention_kernel=auto: cuDNN's TTT attention on {device} ({dtype}, head_dim {head_dim}) "
                  f"{problem}; using flash", RuntimeWarning, stacklevel=2)
    return "flash"
