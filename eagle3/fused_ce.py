"""Linear layer + soft cross-entropy fused and chunked: the drafter's lm_head and its loss in one
autograd node that never keeps a [N, draft_V] fp32 tensor alive.

loss = sum_n -sum_v p[n, v] log softmax(x[n] @ W^T)_v, with p = teacher_probs[rows[n]].
Since the loss is a plain sum, its gradients are known in the forward pass:
  dlogits = softmax(logits) * sum_v p - p,   dx = dlogits @ W,   dW = dlogits^T @ x,
so the forward walks the rows in chunks (logits of one chunk at a time, the softmax in fp32, each
chunk's dlogits kept in x's dtype), then computes dx and dW with one matmul each over all rows
(the GEMM accumulates in fp32 and rounds once; no fp32 [V, H] accumulator and no per-chunk adds),
and keeps only dx and dW (x's dtype) for the backward, which scales them by the incoming gradient.
Memory: the dlogits of all N rows, N x V in x's dtype (bf16: 0.5 GB at N = 8192, V = 32000), where
fp32 logits kept for backward would take twice that per TTT step.
Numerics match `eagle3.loss.soft_cross_entropy_rows(x @ W^T, p)`: the logits are rounded
to x's dtype first (what a bf16 lm_head produces), then everything is fp32 (fp64 inputs stay fp64,
where soft_cross_entropy_rows drops to fp32). Without grad mode the gradient matmuls are skipped.

Imports only torch (core code).
"""
from __future__ import annotations

import torch

from eagle3.fast_kernels import kernel


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, teacher_probs, rows, chunk_rows: int, compiled: bool, want_grad: bool):
        N = x.shape[0]
        acc = torch.promote_types(x.dtype, torch.float32)
        loss = torch.zeros((), dtype=acc, device=x.device)
        top = torch.empty(N, dtype=torch.long, device=x.device)
        chunk = kernel("soft_ce_chunk", compiled)
        grads = []  # dloss/dlogits of each chunk, x's dtype
        for start in range(0, N, chunk_rows):
            part, g, top[start:start + chunk_rows] = chunk(x[start:start + chunk_rows] @ weight.t(), teacher_probs,
                                                           rows[start:start + chunk_rows])
            loss = loss + part
            if want_grad:  # validation (no grad) skips the two gradient matmuls
                grads.append(g)
        if want_grad:  # one matmul each over all N rows (fp32 accumulation inside the GEMM, one rounding)
            if len(grads) > 1:
                g = torch.cat(grads)
            else:  # one chunk (no copy), or no rows at all
                g = grads[0] if grads else x.new_zeros((0, weight.shape[0]))
            dx, dw = g @ weight, g.t() @ x
        else:
            dx = dw = x.new_zeros(())
        ctx.save_for_backward(dx, dw)
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, grad_loss, grad_top):
        dx, dw = ctx.saved_tensors
        return dx * grad_loss.to(dx.dtype), dw * grad_loss.to(dw.dtype), None, None, None, None, None


def linear_soft_cross_entropy(x: torch.Tensor, weight: torch.Tensor, teacher_probs: torch.Tensor,
                              rows: torch.Tensor, chunk_rows: int = 8192,
                              compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (normalised hidden, compute dtype), weight [V, H] (same dtype), teacher_probs fp32
    [M, V], rows Long [N] (teacher row of each x row). Returns (summed soft CE, fp32 or wider
    scalar, differentiable in x and weight; argmax of the logits, Long [N]). compiled: the chunk's
    elementwise math through torch.compile (eagle3/fast_kernels.soft_ce_chunk)."""
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
    # grad mode is off inside Function.forward: decide here whether the gradient matmuls are needed
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _LinearSoftCE.apply(x, weight, teacher_probs, rows, int(chunk_rows), bool(compiled), want_grad)
