"""The pure pieces of one fast TTT step, written so `torch.compile` can fuse them.

Between the big matmuls a drafter step is a chain of small memory-bound ops (RMSNorm in fp32,
casts, rope, residual adds, SiLU*up, the diagonal merge of the TTT attention). Eagerly each is a
separate pass over a [T, 7168] or [T, 64, 128] tensor, and at Kimi dimensions they cost a third of
the step. Each function here is exactly the eager math (same casts, same order); `kernel(name,
compiled)` returns it as is or compiled by Inductor (one graph for every T: only the sizes that
vary are symbols, VARYING_DIMS), which fuses the elementwise chains between the matmuls into
single kernels.

Shapes: B batch, T positions, h query heads, hkv KV heads, d head dim, H hidden, I MLP width.
Imports only torch (core code).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """eagle3.drafter.model.RMSNorm then a cast to the matmul dtype: weight * normalise_fp32(x).to(x.dtype)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(out_dtype)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `rms_norm(x, weight, eps, d_out.dtype)` for d_out: (dx in x's dtype, dweight in
    weight's dtype, summed over the leading dims), with autograd's casts: the gradient of the
    normalised x is rounded to x's dtype where the forward rounded it."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = (xf * r).to(x.dtype)
    prod = torch.promote_types(weight.dtype, x.dtype)  # the dtype of weight * n in the forward
    g = d_out.to(prod)
    d_weight = (g * n.to(prod)).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
    du = (g * weight).to(x.dtype).to(acc)
    dx = r * du - xf * (r ** 3) * (du * xf).mean(-1, keepdim=True)
    return dx.to(x.dtype), d_weight


def norm_weight_grads(product: torch.Tensor, w: torch.Tensor,
                      weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For y = rms_norm(x, weight) @ w^T and product = dy^T normalise(x) (summed over positions, [out, in]):
    (the gradient of w, product * weight per column; the gradient of weight, sum over out of product * w),
    in product's dtype / weight's dtype. Where x takes no gradient this replaces the dy @ w GEMM that
    `rms_norm_backward` needs (sum_r (dy @ w)[r, j] n[r, j] = sum_o (dy^T n)[o, j] w[o, j])."""
    d_w = product * weight.to(product.dtype)
    d_weight = (product * w.to(product.dtype)).sum(0).to(weight.dtype)
    return d_w, d_weight


def rope(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., d] as the two halves of each head, (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
    which is x * cos + rotate_half(x) * sin for cos/sin = cat(c, c) / cat(s, s); c/s [..., d/2] broadcast."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos_half - x2 * sin_half, x2 * cos_half + x1 * sin_half), dim=-1)


def rope_qkv(qkv_hidden: torch.Tensor, qkv_embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             heads: int, kv_heads: int, head_dim: int):
    """q/k/v of one step from the two halves of the q/k/v projection, qkv_hidden + qkv_embed
    [B,T,(h+2hkv)d], with rope (cos/sin [B,T,1,d]) on q and k. Returns q [B,T,h,d], k, v [B,T,hkv,d],
    each its own dense sequence-major tensor (the layout the attention kernels take without a copy;
    compiled, each is written once by the fused kernel)."""
    B, T, _ = qkv_hidden.shape
    qkv = qkv_hidden + qkv_embed
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    c, s = cos[..., : head_dim // 2], sin[..., : head_dim // 2]  # [B,T,1,d/2]
    q = rope(qkv[..., :q_end].view(B, T, heads, head_dim), c, s)
    k = rope(qkv[..., q_end:k_end].view(B, T, kv_heads, head_dim), c, s)
    v = qkv[..., k_end:].contiguous().view(B, T, kv_heads, head_dim)
    return q, k, v


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2I] = cat(gate, up): [..., I] in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(gate_up: torch.Tensor, d_act: torch.Tensor) -> torch.Tensor:
    """The gradient of `swiglu` at gate_up [..., 2I] for d_act [..., I]: cat(d gate, d up), gate_up's
    dtype (the math in fp32 or wider)."""
    acc = _acc(gate_up.dtype)
    gate, up = (t.to(acc) for t in gate_up.chunk(2, dim=-1))
    d = d_act.to(acc)
    sig = torch.sigmoid(gate)
    d_gate = d * up * sig * (1 + gate * (1 - sig))
    d_up = d * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


def loss_rows_norm(prenorm: torch.Tensor, flat_rows: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The drafter's final norm at the loss positions: rows flat_rows (Long [N], b * T + t) of
    prenorm [B,T,H] -> model.norm -> the matmul dtype, [N,H] (compiled: gather and norm one kernel)."""
    return rms_norm(prenorm.reshape(-1, prenorm.shape[-1])[flat_rows], weight, eps, out_dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def diagonal_merge_forward(q: torch.Tensor, o0: torch.Tensor, lse0: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge causal block 0 (o0 [B,T,h,d], lse0 [B,T,h]) with the per-position keys/values of the
    later steps, keys/values [S,B,T,h,d]: returns (out [B,T,h,d] in o0's dtype, lse [B,T,h] fp32 or
    wider). lse = logsumexp(lse0, s_1..s_S), s_j = q.k_j * scale;
    out = e^(lse0-lse) o0 + sum_j e^(s_j-lse) v_j."""
    acc = _acc(q.dtype)
    s = (q.to(acc)[None] * keys.to(acc)).sum(-1) * scale               # [S,B,T,h]
    lse0 = lse0.to(acc)
    lse = torch.logsumexp(torch.cat([lse0[None], s]), dim=0)
    out = torch.exp(lse0 - lse)[..., None] * o0.to(acc)
    out = out + (torch.exp(s - lse)[..., None] * values.to(acc)).sum(0)
    return out.to(o0.dtype), lse


def diagonal_merge_backward(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            dq_block0: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """Gradients of the diagonal terms given the merged out / lse (eagle3/ttt/ttt_flash.py), all
    [B,T,h,d] / [B,T,h] / [S,B,T,h,d]: returns (dq = dq_block0 + sum_j ds_j k_j scale,
    dkeys [S,...], dvalues [S,...]) in the inputs' dtypes."""
    acc = _acc(q.dtype)
    do = dout.to(acc)
    qf = q.to(acc)
    kf = keys.to(acc)
    D = (do * out.to(acc)).sum(-1)                                       # [B,T,h]
    p = torch.exp((qf[None] * kf).sum(-1) * scale - lse)                 # [S,B,T,h]
    dvalues = (p[..., None] * do).to(values.dtype)
    ds = p * ((do[None] * values.to(acc)).sum(-1) - D) * scale
    dq = dq_block0.to(acc) + (ds[..., None] * kf).sum(0)
    dkeys = (ds[..., None] * qf).to(keys.dtype)
    return dq.to(q.dtype), dkeys, dvalues


def soft_ce_chunk(logits: torch.Tensor, teacher_probs: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor):
    """One chunk of eagle3/ttt/fused_ce.py: logits [n,V] (compute dtype), teacher_probs fp32 [M,V],
    rows Long [n], scale fp32 0-dim. Returns (summed soft CE, d(scale * loss)/dlogits [n,V] in logits'
    dtype, argmax Long [n])."""
    acc = _acc(logits.dtype)
    lf = logits.to(acc)
    p = teacher_probs[rows].to(acc)
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    loss = (p * (lse - lf)).sum()
    g = (torch.exp(lf - lse) * p.sum(-1, keepdim=True) - p) * scale.to(acc)
    return loss, g.to(logits.dtype), lf.argmax(dim=-1)


_FUNCTIONS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "rope_qkv": rope_qkv,
    "rms_norm_backward": rms_norm_backward,
    "swiglu": swiglu,
    "swiglu_backward": swiglu_backward,
    "loss_rows_norm": loss_rows_norm,
    "diagonal_merge_forward": diagonal_merge_forward,
    "diagonal_merge_backward": diagonal_merge_backward,
    "soft_ce_chunk": soft_ce_chunk,
    "norm_weight_grads": norm_weight_grads,
}
# The (argument, dim) of each function's tensors that change from call to call: T (positions; the
# diagonal steps' [S,B,T,h,d] buffers have T at dim 2), N (loss rows of a chunk), S (diagonal steps
# so far), M (teacher rows). Only these are compiled as symbols: every other size (H, heads, head_dim,
# I, V, B) stays a constant, which is what makes Inductor's index arithmetic cheap. Compiled with
# every size symbolic (dynamic=True) the rope / SwiGLU kernels ran 3-8x slower on an H200 (BENCHMARKS.md).
VARYING_DIMS: dict[str, tuple[tuple[int, int], ...]] = {
    "rms_norm": ((0, 1),),
    "rope_qkv": ((0, 1), (1, 1), (2, 1), (3, 1)),
    "rms_norm_backward": ((0, 1), (3, 1)),
    "swiglu": ((0, 1),),
    "swiglu_backward": ((0, 1), (1, 1)),
    "loss_rows_norm": ((0, 1), (1, 0)),
    "diagonal_merge_forward": ((0, 1), (1, 1), (2, 1), (3, 0), (3, 2), (4, 0), (4, 2)),
    "diagonal_merge_backward": ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 0), (5, 2), (6, 0), (6, 2)),
    "soft_ce_chunk": ((0, 0), (1, 0), (2, 0)),
    "norm_weight_grads": (),  # weight-sized: no dim varies
}
_COMPILED: dict[str, Callable] = {}


def _marking_varying_dims(compiled: Callable, dims: tuple[tuple[int, int], ...]) -> Callable:
    def call(*args):
        for arg, dim in dims:
            torch._dynamo.maybe_mark_dynamic(args[arg], dim)  # a size-1 dim stays specialised (no error)
        return compiled(*args)
    return call


def kernel(name: str, compiled: bool) -> Callable:
    """The function `name`, eager or compiled with Inductor (compiled once per process; one graph
    for every T, N and S: VARYING_DIMS). EAGLE3_COMPILE_DYNAMIC=0 compiles per shape instead (benchmarks)."""
    fn = _FUNCTIONS[name]
    if not compiled:
        return fn
    if name not in _COMPILED:
        if os.environ.get("EAGLE3_COMPILE_DYNAMIC", "1") == "0":
            _COMPILED[name] = torch.compile(fn, dynamic=False)
        else:
            _COMPILED[name] = _marking_varying_dims(torch.compile(fn, dynamic=None), VARYING_DIMS[name])
    return _COMPILED[name]
