"""The TTT unroll, fast: the same function as `eagle3.ttt.unroll.ttt_unroll`, computed with less work.

What differs from the reference unroll (which steps the drafter module as inference does):
  * Attention: step 0 is one causal call (cuDNN or flash, eagle3/ttt/ttt_flash.py); steps 1..6 are a causal
    call over the step-0 keys merged by log-sum-exp with the per-position diagonal keys: no
    T x T score matrix, no mask, and the attention FLOPs of a causal call per step.
  * The embedding half of q/k/v is computed once per batch. The layer's q/k/v read
    [input_layernorm(embed(x_{t+k+1})), hidden_norm(h_t)]; the first half at step k is step 0's
    shifted by k positions, so `W[:, :H] @ e` is one matmul over T + K - 1 positions (and one
    weight-gradient matmul over the summed shifted gradients) instead of K of each. This removes
    about 17% of the FLOPs of a Kimi-sized step. The embeddings are frozen, so that half runs no
    input-gradient matmul: input_layernorm's weight gradient comes from the weight-gradient product.
  * q/k/v (hidden half) and gate/up are single matmuls over concatenated weights, cast to the
    compute dtype once per batch instead of once per use.
  * The loss is a chunked fused linear soft cross-entropy (eagle3/ttt/fused_ce.py): no fp32 logits
    are kept for backward.
  * Weight gradients are summed over the steps in fp32 inside the GEMMs (eagle3/ttt/wgrad.py), not by
    autograd adding bf16 tensors; the SwiGLU product is recomputed in the backward (_SwiGLUDown)
    instead of being kept for every step.
The module's parameters are used as they are (SGLang names): nothing about the checkpoint changes.
tests/test_fast_unroll.py checks loss, per-step counts/accuracy and every gradient against
`ttt_unroll`; benchmarks/bench_train_step.py measures both in one process.

Imports only torch (core code).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.ttt.fused_ce import scaled_linear_soft_cross_entropy
from eagle3.ttt.loss import all_loss_positions, step_weights
from eagle3.ttt.fast_kernels import kernel
from eagle3.drafter.model import check_aux_width, rope_cos_sin, rope_inv_freq
from eagle3.drafter.attention import TTTCache
from eagle3.ttt.attention_check import checked_attention_kernel
from eagle3.ttt.ttt_flash import (DiagonalKeys, causal_attention, causal_plus_diagonal_attention, flash_supported,
                                  kernel_inputs)
from eagle3.ttt.unroll_common import UnrollOutput, check_unroll_inputs, embedding_strip, teacher_probs
from eagle3.ttt.wgrad import ALL, WeightGrads, linear, shared_weights


def compute_dtype(reference: torch.Tensor) -> torch.dtype:
    """The matmul dtype: the autocast dtype where autocast is on for this device, else the weights'."""
    dev = reference.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return reference.dtype


def _shared_weights(model: nn.Module, grads: WeightGrads, dt: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's matrices in compute dtype, split and concatenated for the fast step (per batch);
    their gradients are summed in fp32 over the steps by `grads` (eagle3/ttt/wgrad.py)."""
    layer = model.midlayer
    attn, mlp = layer.self_attn, layer.mlp
    H = model.config.hidden_size
    qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    return shared_weights(grads, {
        "fc": [(model.fc.weight, ALL, ALL)],                                  # [H, 3 H_target]
        "qkv_embed": [(w, ALL, slice(None, H)) for w in qkv],                 # [(h+2hkv)d, H]
        "qkv_hidden": [(w, ALL, slice(H, None)) for w in qkv],                # [(h+2hkv)d, H]
        "o": [(attn.o_proj.weight, ALL, ALL)],                                # [H, h d]
        "gate_up": [(mlp.gate_proj.weight, ALL, ALL), (mlp.up_proj.weight, ALL, ALL)],  # [2I, H]
        "down": [(mlp.down_proj.weight, ALL, ALL)],                           # [H, I]
        "lm_head": [(model.lm_head.weight, ALL, ALL)],                        # [draft_V, H]
    }, dt)


class _NormLinear(torch.autograd.Function):
    """rms_norm(x) @ W^T with the norm recomputed in the backward: keeps x (which the step keeps
    anyway: the residual stream) instead of the normalised copy, H values per position and use less
    (14 KB per position per TTT step at Kimi-K2 size, two uses per step: 6 GB at T = 32768)."""

    @staticmethod
    def forward(ctx, grads: WeightGrads, name: str, compiled: bool, eps: float, x, norm_weight, w):
        ctx.grads, ctx.name, ctx.compiled, ctx.eps = grads, name, compiled, eps
        ctx.save_for_backward(x, norm_weight, w)
        return F.linear(kernel("rms_norm", compiled)(x, norm_weight, eps, w.dtype), w)

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, w = ctx.saved_tensors
        if not ctx.needs_input_grad[4]:
            # x takes no gradient (the frozen embeddings of q/k/v's embedding half): the norm weight's
            # gradient comes from dy^T normalise(x), the product w's gradient needs anyway, and the
            # dy @ w GEMM (one over every position) is not run (fast_kernels.norm_weight_grads)
            n = kernel("rms_norm", ctx.compiled)(x, torch.ones_like(norm_weight), ctx.eps, w.dtype)
            d_w, d_norm = kernel("norm_weight_grads", ctx.compiled)(ctx.grads.product(dy, n), w, norm_weight)
            ctx.grads.add_product(ctx.name, d_w)
            return None, None, None, None, None, d_norm, None
        ctx.grads.add(ctx.name, dy, kernel("rms_norm", ctx.compiled)(x, norm_weight, ctx.eps, w.dtype))
        dx, d_norm = kernel("rms_norm_backward", ctx.compiled)(x, norm_weight, ctx.eps, dy @ w)
        return None, None, None, None, dx, d_norm, None


def _norm_linear(grads: WeightGrads, name: str, x: torch.Tensor, norm: nn.Module, w: torch.Tensor,
                 compiled: bool) -> torch.Tensor:
    """norm(x) @ w^T in w's dtype, norm an RMSNorm module (weight, eps); w a `shared_weights` copy."""
    return _NormLinear.apply(grads, name, compiled, float(norm.eps), x, norm.weight, w)


class _SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(gate) * up) from gate_up [B,T,2I]. Keeps only gate_up for the backward and
    recomputes the [B,T,I] product there (one elementwise pass), which saves I values per position
    and TTT step (at Kimi-K2 size 36 KB per position per step: 8 GB at T = 32768)."""

    @staticmethod
    def forward(ctx, grads: WeightGrads, compiled: bool, gate_up, w_down):
        ctx.grads, ctx.compiled = grads, compiled
        ctx.save_for_backward(gate_up, w_down)
        return F.linear(kernel("swiglu", compiled)(gate_up), w_down)

    @staticmethod
    def backward(ctx, dy):
        gate_up, w_down = ctx.saved_tensors
        ctx.grads.add("down", dy, kernel("swiglu", ctx.compiled)(gate_up))
        return None, None, kernel("swiglu_backward", ctx.compiled)(gate_up, dy @ w_down), None


def ttt_unroll_fast(model: nn.Module, aux: torch.Tensor, input_ids: torch.Tensor, last: torch.Tensor,
                    target_argmax: torch.Tensor, loss_mask: torch.Tensor, lm_head_rows: torch.Tensor,
                    ttt_length: int = 7, *, step_decay: float = 0.8,
                    attention_mask: Optional[torch.Tensor] = None,
                    position_ids: Optional[torch.Tensor] = None,
                    step_denominators: Optional[torch.Tensor] = None,
                    ce_chunk_rows: int = 8192, compiled: bool = False,
                    attention_kernel: str = "auto", input_embeds: Optional[torch.Tensor] = None) -> UnrollOutput:
    """Same arguments and result as `eagle3.ttt.unroll.ttt_unroll` (see there). Right-padded batches
    only (`attention_mask` must be None); flash kernels need bf16/fp16 on CUDA (any float on CPU).
    compiled: run the memory-bound pieces through torch.compile (eagle3/ttt/fast_kernels.py).
    attention_kernel: the causal attention kernel, auto | flash | cudnn (eagle3/ttt/ttt_flash.py)."""
    B, T = input_ids.shape
    check_unroll_inputs("ttt_unroll_fast", aux, input_ids, last, target_argmax, loss_mask, ttt_length)
    if attention_mask is not None:
        raise ValueError("ttt_unroll_fast takes right-padded batches only (attention_mask=None); use ttt_unroll "
                         "for left padding")
    cfg = model.config
    K = ttt_length
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    device = input_ids.device
    d2t, t2d = model.d2t, model.t2d
    if position_ids is None:
        position_ids = torch.arange(T, device=device).expand(B, T)
    weights = step_weights(K, step_decay).to(device)

    with torch.no_grad():
        masks = all_loss_positions(loss_mask, target_argmax, t2d, K)  # [K+1,B,T]: teacher rows, then steps 0..K-1
        counts = masks.sum(dim=(1, 2))
        # the teacher rows and every step's loss rows (b * T + t) with two host syncs here (the id check,
        # the nonzero; the counts' copy then finds the GPU idle), so that the loop below queues the
        # whole forward without waiting for the GPU (a nonzero per step would idle it 7 times)
        j_b_t = masks.nonzero()
        teacher_rows, *step_rows = (j_b_t[:, 1] * T + j_b_t[:, 2]).split(counts.tolist())
        count = counts[1:].to(torch.float32)
        denom = count if step_denominators is None else step_denominators.to(device=device, dtype=torch.float32)
        scales = weights / denom.clamp(min=1)
        teacher_p, row_of = teacher_probs(last, lm_head_rows, loss_mask, target_argmax, t2d,
                                          flat=teacher_rows)  # fp32 [M, V], [B*T]
        argmax_flat = target_argmax.reshape(-1).long()
        # x_{t+k+1} for k = 0..K-1 at t = 0..T-1 as one strip of T + K - 1 ids (0 past the end).
        ids_strip = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, K)], dim=1)  # [B, T+K-1]
        inv_freq = rope_inv_freq(cfg, device)

    dt = compute_dtype(model.fc.weight)
    kernel_name = checked_attention_kernel(attention_kernel, device, dt, d)  # cuDNN only once it matched flash here
    check_aux_width(aux, model.fc)
    grads = WeightGrads()
    w = _shared_weights(model, grads, dt)
    layer = model.midlayer
    hidden = linear(grads, "fc", aux.to(dt), w["fc"])                      # [B, T, H] (fc, in compute dtype)
    embeds = embedding_strip(model.embed_tokens(ids_strip), input_embeds).to(hidden.dtype)  # (image rows: fused)
    qkv_embed = _norm_linear(grads, "qkv_embed", embeds, layer.input_layernorm, w["qkv_embed"],
                             compiled)                                     # [B, T+K-1, (h+2hkv)d]
    scale = 1.0 / math.sqrt(d)
    k0 = v0 = diagonal = None
    fallback = TTTCache()
    scaled, sums, corrects = [], [], []
    rope_qkv, final_norm = kernel("rope_qkv", compiled), kernel("loss_rows_norm", compiled)
    for k in range(K):
        cos, sin = rope_cos_sin(inv_freq, position_ids + k, dt)
        cos, sin = cos[:, :, None], sin[:, :, None]                           # [B, T, 1, d]
        q, key, val = rope_qkv(_norm_linear(grads, "qkv_hidden", hidden, layer.hidden_norm, w["qkv_hidden"], compiled),
                               qkv_embed[:, k:k + T], cos, sin, h, hkv, d)  # [B, T, h|hkv, d]
        if not flash_supported(q):  # e.g. fp32 on CUDA: the reference attention, the rest stays fast
            attn = fallback.attend(q.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2)).transpose(1, 2)
        else:
            if hkv != h:
                key, val = key.repeat_interleave(h // hkv, dim=2), val.repeat_interleave(h // hkv, dim=2)
            if k == 0:
                k0, v0 = kernel_inputs(kernel_name, key, val)  # densified once for the 7 steps' calls
                attn = causal_attention(q, k0, v0, scale, kernel_name)
                diagonal = DiagonalKeys(K - 1, q)
            else:
                diagonal.append(key, val, release=True)  # no backward reads them: only the buffer copy stays
                attn = causal_plus_diagonal_attention(q, k0, v0, diagonal, scale, compiled, kernel_name)
            del key, val
        h1 = hidden + linear(grads, "o", attn.reshape(B, T, -1), w["o"])
        gate_up = _norm_linear(grads, "gate_up", h1, layer.post_attention_layernorm, w["gate_up"], compiled)
        prenorm = h1 + _SwiGLUDown.apply(grads, compiled, gate_up, w["down"])
        flat = step_rows[k]
        src = flat + (k + 1)
        xn = final_norm(prenorm, flat, model.norm.weight, model.norm.eps, dt)  # [N, H]
        loss_k, sum_k, top = scaled_linear_soft_cross_entropy(xn, w["lm_head"], teacher_p, row_of[src], scales[k],
                                                              ce_chunk_rows, compiled, grads, "lm_head")
        scaled.append(loss_k)
        sums.append(sum_k)
        with torch.no_grad():
            corrects.append(((top + d2t[top]) == argmax_flat[src]).sum().to(torch.float32))
        hidden = prenorm
    # one sum of the steps' scaled losses: every step's loss gets the same upstream gradient (WeightGrads)
    loss = torch.stack(scaled).sum()
    return UnrollOutput(loss=loss, loss_sum=torch.stack(sums), correct=torch.stack(corrects), count=count)
