"""TTT attention without a T x T score matrix: a fused causal kernel plus a log-sum-exp merge.

At TTT step k (eagle3/ttt.py) query t attends to the step-0 keys 0..t (causal) and to its own
position's keys of steps 1..k (one key per step). The softmax over those T + k columns splits into
  * block 0: causal attention over the step-0 keys, done by a flash kernel that returns its
    output o0 [B,h,T,d] and log-sum-exp lse0 [B,h,T] (natural log, fp32), and
  * the diagonal: k per-position dot products s_j = q_t . k_j,t * scale [B,h,T],
merged exactly:  lse = logsumexp(lse0, s_1..s_k),  out = e^(lse0-lse) o0 + sum_j e^(s_j-lse) v_j
(eagle3/fast_kernels.py: diagonal_merge_forward / diagonal_merge_backward).

Backward (the trick ring attention uses): the gradient of block 0's share of a softmax it shares
with other columns is what the flash backward computes when given the *merged* output and the
*merged* lse instead of its own: it rebuilds P = exp(S - lse) (block 0's share of the global
softmax) and D = rowsum(dout * out) (the global row term), so dS = P (dP - D) is exact. The
diagonal terms' gradients are elementwise: p_j = e^(s_j - lse), dv_j = p_j dout,
ds_j = p_j (dout . v_j - D), dq += ds_j k_j scale, dk_j = ds_j q scale.

Kernels: CUDA (bf16/fp16) `aten._scaled_dot_product_flash_attention` and its backward; CPU (any
float dtype, used by the tests) `aten._scaled_dot_product_flash_attention_for_cpu`. The merge
math is in fp32 (fp64 stays fp64). Imports only torch (core code).
"""
from __future__ import annotations

import torch

from eagle3.fast_kernels import kernel


def flash_supported(q: torch.Tensor) -> bool:
    """Whether this module's kernels take these queries (CUDA: fp16/bf16 only; CPU: any float)."""
    if q.is_cuda:
        return q.dtype in (torch.float16, torch.bfloat16)
    return q.device.type == "cpu" and q.is_floating_point()


def _causal_forward(q, k, v, scale: float):
    """q/k/v [B,h,T,d] -> (out [B,h,T,d], lse fp32 [B,h,T...], state for the backward)."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return r[0], r[1], tuple(r[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _causal_backward(dout, q, k, v, out, lse, state: tuple, scale: float):
    """(dq, dk, dv) of causal block 0, given the merged out / lse (see the module docstring)."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, rng, unused = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale)


class DiagonalKeys:
    """The own-position keys/values of TTT steps 1..K-1, written into preallocated [K-1,B,T,h,d]
    buffers so that step k's merge reads slots [:k] as one tensor (no per-step stacking). A slot
    is written once and never again, so earlier steps' views stay valid for their backward."""

    def __init__(self, max_steps: int, like: torch.Tensor):
        self.keys = like.new_empty((max_steps,) + tuple(like.shape))
        self.values = like.new_empty((max_steps,) + tuple(like.shape))
        self.inputs: list[torch.Tensor] = []  # the autograd inputs: k_1, v_1, k_2, v_2, ...
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.n >= self.keys.shape[0]:
            raise ValueError(f"DiagonalKeys holds {self.keys.shape[0]} steps; step {self.n + 1} does not fit")
        for name, x in (("key", k), ("value", v)):
            if x.shape != self.keys.shape[1:] or x.dtype != self.keys.dtype:
                raise ValueError(f"DiagonalKeys.append: {name} {tuple(x.shape)} {x.dtype} != the step-0 queries' "
                                 f"{tuple(self.keys.shape[1:])} {self.keys.dtype}")
        with torch.no_grad():
            self.keys[self.n].copy_(k)
            self.values[self.n].copy_(v)
        self.inputs += [k, v]
        self.n += 1


class _CausalPlusDiagonal(torch.autograd.Function):
    """Tensors [B,T,h,d] (sequence-major). inputs: scale, compiled, keys [S,...], values [S,...]
    (buffer views, read only), q, k0, v0, k_1, v_1, ..., k_S, v_S (for the gradients)."""

    @staticmethod
    def forward(ctx, scale: float, compiled: bool, keys, values, q, k0, v0, *diag):
        o0, lse0, state = _causal_forward(q.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2), scale)
        T = q.shape[1]
        out, lse = kernel("diagonal_merge_forward", compiled)(q, o0.transpose(1, 2), lse0[..., :T].transpose(1, 2),
                                                              keys, values, scale)
        lse_full = lse0.clone()    # same shape as the kernel's lse (it may be padded past T)
        lse_full[..., :T] = lse.transpose(1, 2).to(lse_full.dtype)
        ctx.scale, ctx.compiled, ctx.state = scale, compiled, state
        ctx.keys, ctx.values = keys, values  # buffer views: slots [:S] are never written again
        ctx.save_for_backward(q, k0, v0, out, lse_full)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse_full = ctx.saved_tensors
        t = lambda x: x.transpose(1, 2)  # noqa: E731  [B,T,h,d] <-> [B,h,T,d] views
        dq0, dk0, dv0 = _causal_backward(t(dout), t(q), t(k0), t(v0), t(out), lse_full, ctx.state, ctx.scale)
        lse = lse_full[..., :q.shape[1]].transpose(1, 2)
        dq, dkeys, dvalues = kernel("diagonal_merge_backward", ctx.compiled)(dout, q, out, lse, t(dq0), ctx.keys,
                                                                             ctx.values, ctx.scale)
        diag = [g for pair in zip(dkeys.unbind(0), dvalues.unbind(0)) for g in pair]
        return (None, None, None, None, dq, t(dk0), t(dv0), *diag)


def causal_plus_diagonal_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diagonal: DiagonalKeys,
                                   scale: float, compiled: bool = False) -> torch.Tensor:
    """TTT attention of one step, sequence-major: q [B,T,h,d] against the step-0 keys/values
    k0, v0 [B,T,h,d] (causal) and the own-position keys/values of the later steps held by
    `diagonal` (all appended so far). Grouped-query callers repeat k/v to h heads first.
    Returns [B,T,h,d] in q's dtype. compiled: the merge math through torch.compile."""
    if diagonal.n == 0:
        raise ValueError("causal_plus_diagonal_attention: no diagonal keys (step 0 is plain causal attention)")
    for name, x in (("k0", k0), ("v0", v0), ("diagonal keys", diagonal.keys[0])):
        if x.shape != q.shape:
            raise ValueError(f"causal_plus_diagonal_attention: {name} {tuple(x.shape)} != queries {tuple(q.shape)}")
    if not flash_supported(q):
        raise ValueError(f"causal_plus_diagonal_attention: no flash kernel for {q.dtype} on {q.device}")
    n = diagonal.n
    return _CausalPlusDiagonal.apply(float(scale), bool(compiled), diagonal.keys[:n], diagonal.values[:n],
                                     q, k0, v0, *diagonal.inputs)
