"""The TTT unroll, fast: the same function as `eagle3.unroll.ttt_unroll`, computed with less work.

What differs from the reference unroll (which steps the drafter module as inference does):
  * Attention: step 0 is one causal call (cuDNN or flash, eagle3/ttt_flash.py); steps 1..6 are a causal
    call over the step-0 keys merged by log-sum-exp with the per-position diagonal keys: no
    T x T score matrix, no mask, and the attention FLOPs of a causal call per step.
  * The embedding half of q/k/v is computed once per batch. The layer's q/k/v read
    [input_layernorm(embed(x_{t+k+1})), hidden_norm(h_t)]; the first half at step k is step 0's
    shifted by k positions, so `W[:, :H] @ e` is one matmul over T + K - 1 positions (and one
    weight-gradient matmul over the summed shifted gradients) instead of K of each. This removes
    about 17% of the FLOPs of a Kimi-sized step.
  * q/k/v (hidden half) and gate/up are single matmuls over concatenated weights, cast to the
    compute dtype once per batch instead of once per use.
  * The loss is a chunked fused linear soft cross-entropy (eagle3/fused_ce.py): no fp32 logits
    are kept for backward.
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

from eagle3.fused_ce import linear_soft_cross_entropy
from eagle3.loss import loss_positions, step_weights
from eagle3.fast_kernels import kernel, rms_norm
from eagle3.model import check_aux_width, rope_cos_sin, rope_inv_freq
from eagle3.ttt import TTTCache
from eagle3.attention_check import checked_attention_kernel
from eagle3.ttt_flash import (DiagonalKeys, causal_attention, causal_plus_diagonal_attention, flash_supported,
                              kernel_inputs)
from eagle3.unroll_common import UnrollOutput, check_unroll_inputs, teacher_probs


def compute_dtype(reference: torch.Tensor) -> torch.dtype:
    """The matmul dtype: the autocast dtype where autocast is on for this device, else the weights'."""
    dev = reference.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return reference.dtype


class _Weights:
    """The layer's weights in compute dtype, split and concatenated for the fast step (per batch)."""

    def __init__(self, model: nn.Module, dt: torch.dtype):
        layer = model.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        H = model.config.hidden_size
        qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        self.qkv_embed = torch.cat([w[:, :H].to(dt) for w in qkv])    # [(h+2hkv)d, H]
        self.qkv_hidden = torch.cat([w[:, H:].to(dt) for w in qkv])   # [(h+2hkv)d, H]
        self.o = attn.o_proj.weight.to(dt)                             # [H, h d]
        self.gate_up = torch.cat([mlp.gate_proj.weight.to(dt), mlp.up_proj.weight.to(dt)])  # [2I, H]
        self.down = mlp.down_proj.weight.to(dt)                        # [H, I]
        self.lm_head = model.lm_head.weight.to(dt)                     # [draft_V, H]


def ttt_unroll_fast(model: nn.Module, aux: torch.Tensor, input_ids: torch.Tensor, last: torch.Tensor,
                    target_argmax: torch.Tensor, loss_mask: torch.Tensor, lm_head_rows: torch.Tensor,
                    ttt_length: int = 7, *, step_decay: float = 0.8,
                    attention_mask: Optional[torch.Tensor] = None,
                    position_ids: Optional[torch.Tensor] = None,
                    step_denominators: Optional[torch.Tensor] = None,
                    ce_chunk_rows: int = 8192, compiled: bool = False,
                    attention_kernel: str = "auto") -> UnrollOutput:
    """Same arguments and result as `eagle3.unroll.ttt_unroll` (see there). Right-padded batches
    only (`attention_mask` must be None); flash kernels need bf16/fp16 on CUDA (any float on CPU).
    compiled: run the memory-bound pieces through torch.compile (eagle3/fast_kernels.py).
    attention_kernel: the causal attention kernel, auto | flash | cudnn (eagle3/ttt_flash.py)."""
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
        masks = torch.stack([loss_positions(loss_mask, target_argmax, t2d, step=k) for k in range(K)])  # [K,B,T]
        count = masks.sum(dim=(1, 2)).to(torch.float32)
        # every step's loss rows (b * T + t) with one host sync here, so that the loop below queues
        # the whole forward without waiting for the GPU (a nonzero per step would idle it 7 times)
        k_b_t = masks.nonzero()
        step_rows = (k_b_t[:, 1] * T + k_b_t[:, 2]).split(count.long().tolist())
        denom = count if step_denominators is None else step_denominators.to(device=device, dtype=torch.float32)
        scales = weights / denom.clamp(min=1)
        teacher_p, row_of = teacher_probs(last, lm_head_rows, loss_mask, target_argmax, t2d)  # fp32 [M, V], [B*T]
        argmax_flat = target_argmax.reshape(-1).long()
        # x_{t+k+1} for k = 0..K-1 at t = 0..T-1 as one strip of T + K - 1 ids (0 past the end).
        ids_strip = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, K)], dim=1)  # [B, T+K-1]
        inv_freq = rope_inv_freq(cfg, device)

    dt = compute_dtype(model.fc.weight)
    kernel_name = checked_attention_kernel(attention_kernel, device, dt, d)  # cuDNN only once it matched flash here
    check_aux_width(aux, model.fc)
    hidden = F.linear(aux.to(dt), model.fc.weight.to(dt))                 # [B, T, H] (fc, in compute dtype)
    w = _Weights(model, dt)
    layer = model.midlayer
    embeds = model.embed_tokens(ids_strip).to(hidden.dtype)
    e_norm = rms_norm(embeds, layer.input_layernorm.weight, layer.input_layernorm.eps, dt)
    qkv_embed = F.linear(e_norm, w.qkv_embed)                              # [B, T+K-1, (h+2hkv)d]
    scale = 1.0 / math.sqrt(d)
    k0 = v0 = diagonal = None
    fallback = TTTCache()
    sums, corrects = [], []
    pre, post = kernel("attention_inputs", compiled), kernel("attention_output_and_mlp", compiled)
    final_norm = kernel("loss_rows_norm", compiled)
    for k in range(K):
        cos, sin = rope_cos_sin(inv_freq, position_ids + k, dt)
        cos, sin = cos[:, :, None], sin[:, :, None]                           # [B, T, 1, d]
        q, key, val = pre(hidden, qkv_embed[:, k:k + T], layer.hidden_norm.weight, w.qkv_hidden, cos, sin,
                          layer.hidden_norm.eps, h, hkv, d)                   # [B, T, h|hkv, d]
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
                diagonal.append(key, val)
                attn = causal_plus_diagonal_attention(q, k0, v0, diagonal, scale, compiled, kernel_name)
        prenorm = post(attn, hidden, w.o, layer.post_attention_layernorm.weight, w.gate_up, w.down,
                       layer.post_attention_layernorm.eps)                    # [B, T, H]
        flat = step_rows[k]
        src = flat + (k + 1)
        x = final_norm(prenorm, flat, model.norm.weight, model.norm.eps, dt)  # [N, H]
        loss_k, top = linear_soft_cross_entropy(x, w.lm_head, teacher_p, row_of[src], ce_chunk_rows, compiled)
        sums.append(loss_k)
        with torch.no_grad():
            corrects.append(((top + d2t[top]) == argmax_flat[src]).sum().to(torch.float32))
        hidden = prenorm
    loss_sum = torch.stack(sums)
    loss = (scales * loss_sum).sum()
    return UnrollOutput(loss=loss, loss_sum=loss_sum.detach(), correct=torch.stack(corrects), count=count)
