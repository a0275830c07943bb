"""Attention over draft steps: the training-time-test (TTT) pattern and the inference KV cache.

TTT (docs/design.md "TTT"): the drafter is unrolled for K steps over a whole sequence at once. At step k,
query position t attends to
  * the step-0 keys of positions 0..t (causal), and
  * its *own* position's keys from steps 1..k (one key per step: the diagonal).
This is exactly what happens at inference for a draft chain started at position t: the KV cache
holds the prefix (written by the draft "extend" over the verified tokens, i.e. step 0), and each
draft step appends one entry for the new draft token. So step k of the unroll trains every
position t as if it were the k-th draft token of a chain rooted at t (tested in
tests/test_model.py against the KVCache path).

Shapes: q [B, h, T, d], k/v [B, h_kv, T, d] (grouped-query heads: h = g * h_kv), already rotated.
Position ids are the caller's: at step k position t is at sequence position t + k (see
`ttt_position_ids`), which is where SGLang puts the k-th draft token of a chain rooted at t.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def ttt_attention_mask(seq_len: int, step: int) -> torch.Tensor:
    """Naive reference mask: bool [T, T*(step+1)], True = may attend.

    Column block j (columns j*T .. (j+1)*T-1) holds the keys written at step j. Block 0 is the
    causal lower triangle; blocks 1..step are the identity (a position sees only its own key).
    """
    T = seq_len
    blocks = [torch.ones(T, T, dtype=torch.bool).tril()]
    blocks += [torch.eye(T, dtype=torch.bool) for _ in range(step)]
    return torch.cat(blocks, dim=1)


def ttt_position_ids(position_ids: torch.Tensor, step: int) -> torch.Tensor:
    """Position ids for TTT step `step`: the step-0 positions shifted by `step`.

    Same as SpecForge (`position_ids + len(cache)`) and as SGLang inference, where the k-th
    draft token of a chain rooted at position t sits at sequence position t + k."""
    return position_ids + step


def _group(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, h, T, d] -> [B, h_kv, g, T, d] so grouped-query keys need no repetition."""
    B, h, T, d = q.shape
    if h % num_kv_heads:
        raise ValueError(f"{h} query heads are not a multiple of {num_kv_heads} KV heads")
    return q.view(B, num_kv_heads, h // num_kv_heads, T, d)


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Grouped-query keys/values for a kernel that wants one per query head: [B, h_kv, L, d] -> [B, h, L, d]
    (a view-expand; only copies when h_kv < h). Used by every cache's `attend` (here,
    eagle3/replay/drafter_session.py)."""
    B, hkv, L, d = x.shape
    if hkv == num_heads:
        return x
    return x[:, :, None].expand(B, hkv, num_heads // hkv, L, d).reshape(B, num_heads, L, d)


class TTTCache:
    """Keys/values of the TTT unroll of one batch.

    `attention_mask` [B, T] bool (True = a real token) masks padded *keys* of the step-0 block.
    With right padding, causality alone already keeps real queries off padded keys; the mask is
    for left padding. A query always keeps its own diagonal key, so no softmax row is empty
    (padded queries produce finite values that the loss mask drops).
    """

    IMPLS = ("auto", "explicit", "sdpa_mask")

    def __init__(self, attention_mask: Optional[torch.Tensor] = None, impl: str = "auto"):
        """impl (steps >= 1; step 0 is always one causal SDPA call):
        - "explicit": scores against step-0 keys as one T x T block plus one column per later step
          (per-position dot products), one fp32 softmax over the T + k columns. The softmax of the
          T x T block is kept for backward, per step.
        - "sdpa_mask": one fused SDPA call over the concatenated keys of all steps [T*(k+1)] with
          the TTT bool mask (T x T*(k+1) bools, shared by batch and heads). On CUDA this runs the
          memory-efficient kernel: no score matrix is stored, at the price of (k+1)x the attention
          FLOPs of a causal call.
        - "auto": sdpa_mask on CUDA, explicit elsewhere.
        Both compute the same function (tests/test_ttt.py); their time and memory: BENCHMARKS.md,
        "TTT attention: explicit vs sdpa_mask"."""
        if impl not in self.IMPLS:
            raise ValueError(f"TTTCache impl={impl!r}: expected one of {self.IMPLS}")
        self.impl = impl
        self.attention_mask = attention_mask
        self.k0: Optional[torch.Tensor] = None  # [B, h_kv, T, d] step-0 keys
        self.v0: Optional[torch.Tensor] = None
        self.k_diag: list[torch.Tensor] = []  # step i >= 1: [B, h_kv, T, d]
        self.v_diag: list[torch.Tensor] = []

    @property
    def num_steps(self) -> int:
        """Number of steps already attended (the next call is step `num_steps`)."""
        return 0 if self.k0 is None else 1 + len(self.k_diag)

    def _step0_mask(self, T: int, device) -> torch.Tensor:
        """bool [B or 1, 1, T, T]: causal, padded keys off, own key always on."""
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        if self.attention_mask is None:
            return causal[None, None]
        keys = self.attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]  # [B,1,1,T]
        eye = torch.eye(T, dtype=torch.bool, device=device)
        return (causal & keys) | eye

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One step: store this step's k/v, return attention output [B, h, T, d]."""
        B, h, T, d = q.shape
        if self.attention_mask is not None and tuple(self.attention_mask.shape) != (B, T):
            raise ValueError(f"TTTCache attention_mask is {tuple(self.attention_mask.shape)}, queries are [{B}, {T}]")
        if self.k0 is None:
            self.k0, self.v0 = k, v
            kr, vr = repeat_kv(k, h), repeat_kv(v, h)
            if self.attention_mask is None:
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            return F.scaled_dot_product_attention(q, kr, vr, attn_mask=self._step0_mask(T, q.device))
        if k.shape != self.k0.shape:
            raise ValueError(f"TTT step {self.num_steps}: keys {tuple(k.shape)} differ from step 0's {tuple(self.k0.shape)}")
        self.k_diag.append(k)
        self.v_diag.append(v)
        impl = self.impl if self.impl != "auto" else ("sdpa_mask" if q.is_cuda else "explicit")
        if impl == "sdpa_mask":
            return self._attend_sdpa_mask(q)
        hkv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax in fp32 (fp64 stays fp64)
        qg = _group(q, hkv)  # [B, hkv, g, T, d]
        # The T x T block against step-0 keys (the only quadratic part).
        s0 = torch.einsum("bngtd,bnsd->bngts", qg, self.k0).to(acc) * scale  # [B,hkv,g,T,T]
        s0 = s0.masked_fill(~self._step0_mask(T, q.device)[:, :, None], float("-inf"))
        kd = torch.stack(self.k_diag, dim=2)  # [B, hkv, k, T, d]
        vd = torch.stack(self.v_diag, dim=2)
        sd = torch.einsum("bngtd,bnktd->bngtk", qg, kd).to(acc) * scale  # [B,hkv,g,T,k]
        p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1).to(q.dtype)  # one softmax over T + k keys
        out = torch.einsum("bngts,bnsd->bngtd", p[..., :T], self.v0)
        out = out + torch.einsum("bngtk,bnktd->bngtd", p[..., T:], vd)
        return out.reshape(B, h, T, d)

    def _attend_sdpa_mask(self, q: torch.Tensor) -> torch.Tensor:
        """All steps' keys in one SDPA call under the TTT mask [T, T*(k+1)]."""
        B, h, T, d = q.shape
        steps = len(self.k_diag)
        keys = repeat_kv(torch.cat([self.k0] + self.k_diag, dim=2), h)  # [B, h, T*(k+1), d]
        values = repeat_kv(torch.cat([self.v0] + self.v_diag, dim=2), h)
        block0 = self._step0_mask(T, q.device)  # [B or 1, 1, T, T]
        eye = torch.eye(T, dtype=torch.bool, device=q.device).expand(block0.shape[0], 1, T, T)
        mask = torch.cat([block0] + [eye] * steps, dim=-1)  # [B or 1, 1, T, T*(k+1)]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class KVCache:
    """Inference cache: plain causal attention over everything cached plus the new entries.

    Keys/values [B, h_kv, L, d]; every row of the batch has the same length L. New queries at
    cache indices L..L+Tq-1 see all cached entries and the new ones causally. After a verify,
    `truncate(n)` drops the rejected tail; `keep(index)` keeps chosen entries (e.g. the accepted
    path of a tree)."""

    def __init__(self):
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {length}")
        if length == 0:
            self.k = self.v = None
        else:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def keep(self, index: torch.Tensor) -> None:
        """Keep entries `index` (long [L'], cache order) and drop the rest."""
        if self.k is None:
            raise ValueError("KVCache.keep on an empty cache")
        index = index.to(self.k.device, torch.long)
        if index.numel() and (index.min() < 0 or index.max() >= self.length):
            raise ValueError(f"KVCache.keep: index outside [0, {self.length})")
        self.k, self.v = self.k.index_select(2, index), self.v.index_select(2, index)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, h, Tq, d = q.shape
        past = self.length
        if self.k is None:
            self.k, self.v = k, v
        else:
            if k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
                raise ValueError(f"KVCache: new keys {tuple(k.shape)} do not match cached {tuple(self.k.shape)}")
            self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        L = self.length
        # query i (cache index past+i) sees keys 0..past+i
        mask = torch.arange(L, device=q.device)[None, :] <= (past + torch.arange(Tq, device=q.device))[:, None]
        return F.scaled_dot_product_attention(q, repeat_kv(self.k, h), repeat_kv(self.v, h), attn_mask=mask)
