"""The diagonal merge of the fast TTT attention (eagle3/fast_kernels.diagonal_merge_forward /
diagonal_merge_backward) as two Triton kernels, for CUDA.

Each (position, head) row merges the causal block's output with that position's own keys/values of
the later TTT steps, keys/values [S,B,T,h,d] with S <= 6. Compiled by Inductor, the math splits into
several kernels (reductions over d, then over S), which read the S keys/values two or three times;
here one program takes a block of rows through all S steps in registers: keys/values are read once
and dkeys/dvalues written once. Same math in fp32 as the eager functions, with two differences of
rounding only: the forward folds the steps into the log-sum-exp one at a time (online softmax), and
the backward adds each step's dq term to the causal block's dq in turn.

`usable(q)` says whether these kernels take a call (CUDA, Triton importable, d a power of two);
eagle3/ttt_flash.py uses them there when the fast path is compiled, and the compiled functions
elsewhere. tests/test_triton_merge.py (CUDA only) checks both against the eager functions.

Imports torch; Triton only when a kernel is first used.
"""
from __future__ import annotations

import functools

import torch

BLOCK_ROWS = 32  # rows (position, head) per program: 32 x d=128 fp32 values per operand in registers


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def usable(q: torch.Tensor) -> bool:
    """Whether the Triton kernels take queries q [B,T,h,d]: CUDA, Triton present, d a power of two."""
    d = q.shape[-1]
    return q.is_cuda and d >= 16 and d & (d - 1) == 0 and _triton_available()


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_forward_kernel(q_ptr, o0_ptr, lse0_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, R, S, slot, scale,
                             BLOCK_R: tl.constexpr, D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        offs = rows[:, None] * D + tl.arange(0, D)[None, :]
        m2 = rmask[:, None]
        q = tl.load(q_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        acc = tl.load(o0_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        m = tl.load(lse0_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        l = tl.full([BLOCK_R], 1.0, tl.float32)
        for j in range(S):
            base = j.to(tl.int64) * slot
            k = tl.load(k_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
            s = tl.sum(q * k, axis=1) * scale
            m_new = tl.maximum(m, s)
            a = tl.exp(m - m_new)
            b = tl.exp(s - m_new)
            acc = acc * a[:, None] + b[:, None] * v
            l = l * a + b
            m = m_new
        tl.store(out_ptr + offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=m2)
        tl.store(lse_ptr + rows, m + tl.log(l), mask=rmask)

    @triton.jit
    def merge_backward_kernel(do_ptr, q_ptr, out_ptr, lse_ptr, dq0_ptr, k_ptr, v_ptr, dq_ptr, dk_ptr, dv_ptr,
                              R, S, slot, scale, BLOCK_R: tl.constexpr, D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        offs = rows[:, None] * D + tl.arange(0, D)[None, :]
        m2 = rmask[:, None]
        do = tl.load(do_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        delta = tl.sum(do * tl.load(out_ptr + offs, mask=m2, other=0.0).to(tl.float32), axis=1)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        dq = tl.load(dq0_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        for j in range(S):
            base = j.to(tl.int64) * slot
            k = tl.load(k_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
            p = tl.exp(tl.sum(q * k, axis=1) * scale - lse)
            tl.store(dv_ptr + base + offs, (p[:, None] * do).to(dv_ptr.dtype.element_ty), mask=m2)
            ds = p * (tl.sum(do * v, axis=1) - delta) * scale
            dq += ds[:, None] * k
            tl.store(dk_ptr + base + offs, (ds[:, None] * q).to(dk_ptr.dtype.element_ty), mask=m2)
        tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=m2)

    return merge_forward_kernel, merge_backward_kernel


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    if keys.shape[1:] != q.shape or values.shape != keys.shape:
        raise ValueError(f"diagonal merge: keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit "
                         f"queries {tuple(q.shape)} (want [S, *q.shape])")


def _grid(rows: int) -> tuple[int]:
    return (max(1, -(-rows // BLOCK_ROWS)),)


def merge_forward(q: torch.Tensor, o0: torch.Tensor, lse0: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`fast_kernels.diagonal_merge_forward` (same arguments and results: out in o0's dtype, lse fp32)."""
    _check(q, keys, values)
    q, o0, lse0, keys, values = (_dense(x) for x in (q, o0, lse0, keys, values))
    out = torch.empty_like(o0)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    rows, d = q.numel() // q.shape[-1], q.shape[-1]
    fwd, _ = _kernels()
    fwd[_grid(rows)](q, o0, lse0, keys, values, out, lse, rows, keys.shape[0], q.numel(), float(scale),
                     BLOCK_R=BLOCK_ROWS, D=d, num_warps=8)
    return out, lse


def merge_backward(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dq_block0: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fast_kernels.diagonal_merge_backward` (same arguments and results: dq, dkeys, dvalues)."""
    _check(q, keys, values)
    dout, q, out, lse, dq_block0, keys, values = (_dense(x) for x in (dout, q, out, lse, dq_block0, keys, values))
    dq = torch.empty_like(q)
    dkeys, dvalues = torch.empty_like(keys), torch.empty_like(values)
    rows, d = q.numel() // q.shape[-1], q.shape[-1]
    _, bwd = _kernels()
    bwd[_grid(rows)](dout, q, out, lse, dq_block0, keys, values, dq, dkeys, dvalues, rows, keys.shape[0], q.numel(),
                     float(scale), BLOCK_R=BLOCK_ROWS, D=d, num_warps=8)
    return dq, dkeys, dvalues
