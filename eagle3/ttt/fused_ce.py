"""Linear layer + soft cross-entropy fused and chunked: the drafter's lm_head and its loss in one
autograd node that never keeps a [N, draft_V] fp32 tensor alive.

loss = scale * sum_n -sum_v p[n, v] log softmax(x[n] @ W^T)_v, with p = teacher_probs[rows[n]].
Since the loss is a plain sum, its gradients are known in the forward pass:
  dlogits = scale * (softmax(logits) * sum_v p - p),   dx = dlogits @ W,   dW = dlogits^T @ x,
so the forward walks the rows in chunks (logits of one chunk at a time, the softmax in fp32), and
per chunk writes its rows of dx (x's dtype) and adds dlogits^T x to an fp32 sum of dW through a
GEMM with beta = 1 (eagle3/ttt/wgrad.py): only one chunk's dlogits exist at a time (at N = 32768,
V = 32000 all rows' bf16 dlogits would take 2 GB). The backward scales dx by the incoming gradient;
dW is either kept here and scaled the same way, or (the fast unroll) left in the caller's
`WeightGrads`, which scales it when it hands the sums to the parameters.
Numerics match `scale * eagle3.ttt.loss.soft_cross_entropy_rows(x @ W^T, p)`: the logits are rounded
to x's dtype first (what a bf16 lm_head produces), then everything is fp32 (fp64 inputs stay fp64,
where soft_cross_entropy_rows drops to fp32). Without grad mode the gradient matmuls are skipped.

Imports only torch (core code).
"""
from __future__ import annotations

from typing import Optional

import torch

from eagle3.ttt import triton_kernels
from eagle3.ttt.fast_kernels import kernel
from eagle3.ttt.wgrad import WeightGrads


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, teacher_probs, rows, scale, chunk_rows: int, compiled: bool, want_grad: bool,
                grads: Optional[WeightGrads], name: str):
        N = x.shape[0]
        acc = torch.promote_types(x.dtype, torch.float32)
        loss = torch.zeros((), dtype=acc, device=x.device)
        top = torch.empty(N, dtype=torch.long, device=x.device)
        # the chunk's math: on CUDA, compiled, the Triton kernel (eagle3/ttt/triton_kernels.py); else the function, maybe compiled
        chunk = triton_kernels.soft_ce_chunk if compiled and triton_kernels.usable(x) else kernel("soft_ce_chunk", compiled)
        own = grads is None
        grads = WeightGrads() if own else grads
        dx = torch.empty_like(x) if want_grad else x.new_zeros(())
        for start in range(0, N, chunk_rows):
            end = min(start + chunk_rows, N)
            part, g, top[start:end] = chunk(x[start:end] @ weight.t(), teacher_probs, rows[start:end], scale)
            loss = loss + part
            if want_grad:  # validation (no grad) skips the two gradient matmuls
                torch.mm(g, weight, out=dx[start:end])
                grads.add(name, g, x[start:end])
        if want_grad and N == 0:
            grads.add(name, x.new_zeros((0, weight.shape[0])), x)  # a zero gradient, not a missing one
        ctx.grads, ctx.name, ctx.own, ctx.weight_dtype = grads, name, own, weight.dtype
        ctx.save_for_backward(dx)
        scaled = loss * scale.to(acc)
        ctx.mark_non_differentiable(top, loss)
        return scaled, loss, top

    @staticmethod
    def backward(ctx, grad_loss, grad_raw, grad_top):
        (dx,) = ctx.saved_tensors
        c = grad_loss  # never None: autograd materialises an unused output's gradient as zeros
        if ctx.own:
            dw = ctx.grads.take(ctx.name)
            dw = None if dw is None else (dw * c.to(dw.dtype)).to(ctx.weight_dtype)
        else:
            ctx.grads.set_upstream(ctx.name, c)
            dw = None
        return dx * c.to(dx.dtype), dw, None, None, None, None, None, None, None, None


def _check(x, weight, teacher_probs, rows, chunk_rows) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_soft_cross_entropy: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"must be [N, H] and [V, H]")
    if teacher_probs.shape[-1] != weight.shape[0] or rows.shape != (x.shape[0],):
        raise ValueError(f"linear_soft_cross_entropy: teacher probs {tuple(teacher_probs.shape)} / rows "
                         f"{tuple(rows.shape)} do not fit x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear_soft_cross_entropy: x is {x.dtype}, weight {weight.dtype}")
    if not teacher_probs.is_floating_point() or teacher_probs.dtype.itemsize < 4 or rows.dtype != torch.long:
        raise ValueError(f"linear_soft_cross_entropy: teacher probs must be fp32 or wider (got {teacher_probs.dtype}) "
                         f"and rows Long (got {rows.dtype})")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows}: must be >= 1")


def scaled_linear_soft_cross_entropy(x: torch.Tensor, weight: torch.Tensor, teacher_probs: torch.Tensor,
                                     rows: torch.Tensor, scale: torch.Tensor, chunk_rows: int = 8192,
                                     compiled: bool = False, grads: Optional[WeightGrads] = None,
                                     name: str = "lm_head") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] (normalised hidden, compute dtype), weight [V, H] (same dtype), teacher_probs fp32
    [M, V], rows Long [N] (teacher row of each x row), scale a 0-dim tensor (the step's loss weight).
    Returns (scale * summed soft CE, differentiable in x and weight; the summed soft CE itself, detached;
    argmax of the logits, Long [N]); both sums fp32 or wider. grads: where weight's gradient goes
    (eagle3/ttt/wgrad.py, under `name`; weight is then a `shared_weights` copy and gets no gradient of
    its own); None: weight gets its gradient through autograd. compiled: the chunk's elementwise
    math through torch.compile (eagle3/ttt/fast_kernels.soft_ce_chunk)."""
    _check(x, weight, teacher_probs, rows, chunk_rows)
    if scale.dim() != 0:
        raise ValueError(f"linear_soft_cross_entropy: scale must be a 0-dim tensor, got {tuple(scale.shape)}")
    # grad mode is off inside Function.forward: decide here whether the gradient matmuls are needed
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _LinearSoftCE.apply(x, weight, teacher_probs, rows, scale.to(device=x.device, dtype=torch.float32),
                               int(chunk_rows), bool(compiled), want_grad, grads, name)


def linear_soft_cross_entropy(x: torch.Tensor, weight: torch.Tensor, teacher_probs: torch.Tensor,
                              rows: torch.Tensor, chunk_rows: int = 8192,
                              compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed soft CE of x @ weight^T against teacher_probs[rows] (see
    scaled_linear_soft_cross_entropy, scale 1): (loss, differentiable in x and weight; argmax Long [N])."""
    one = torch.ones((), dtype=torch.float32, device=x.device)
    loss, _, top = scaled_linear_soft_cross_entropy(x, weight, teacher_probs, rows, one, chunk_rows, compiled)
    return loss, top
