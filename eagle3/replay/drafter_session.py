"""The real drafter behind `eagle3.replay.accept_sim`'s StepDrafter protocol, over one stored sequence.

SGLang's draft at a cycle whose last verified token sits at position q:
  * context: the draft-extend has run the drafter over the verified prefix, pairs
    (fc(aux_t), x_{t+1}) at positions t = 0..q-1 (causal), leaving their keys/values in the cache;
    the output at t = q-1 (pair (aux_{q-1}, x_q), x_q the bonus token) gives draft 1's distribution;
  * draft step j >= 2: input = the drafter's own pre-norm output of step j-1 and its own draft token,
    at position q+j-2, attending over the prefix plus its own path (a tree: each kept path its own).
Because the extend is causal, the prefix pass over the WHOLE sequence once gives, for every q, the
same keys/values and outputs as an extend over the prefix 0..q-1 alone; each cycle then only runs
its draft steps. `BeamCache` is a duck-typed `eagle3.drafter.attention.KVCache` (`attend`) holding a shared prefix
and one path per tree row.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from eagle3.drafter.attention import KVCache, repeat_kv


class BeamCache:
    """Keys/values for draft rows that share a prefix: prefix [1, h_kv, q, d] + per-row path
    [b, h_kv, depth, d]. A new query of row r sees the prefix, row r's path and itself."""

    def __init__(self, k_prefix: torch.Tensor, v_prefix: torch.Tensor):
        self.kp, self.vp = k_prefix, v_prefix
        self.kpath: Optional[torch.Tensor] = None
        self.vpath: Optional[torch.Tensor] = None

    def reorder(self, src: torch.Tensor) -> None:
        """Row r of the next step continues row src[r] of the previous one."""
        if self.kpath is not None:
            self.kpath, self.vpath = self.kpath[src], self.vpath[src]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, tq, d = q.shape
        if tq != 1:
            raise ValueError(f"BeamCache: one new token per row, got {tq}")
        self.kpath = k if self.kpath is None else torch.cat([self.kpath, k], dim=2)
        self.vpath = v if self.vpath is None else torch.cat([self.vpath, v], dim=2)
        keys = torch.cat([self.kp.expand(b, -1, -1, -1), self.kpath], dim=2)    # [b, h_kv, q+depth, d]
        vals = torch.cat([self.vp.expand(b, -1, -1, -1), self.vpath], dim=2)
        return F.scaled_dot_product_attention(q, repeat_kv(keys, h), repeat_kv(vals, h))


class SequenceDrafter:
    """A drafter over one sequence: `at(q)` returns the StepDrafter of the cycle at q.

    model: an Eagle3Drafter (project_aux / step / logits / d2t). aux [T, 3*Ht], input_ids [T].
    """

    @torch.no_grad()
    def __init__(self, model, aux: torch.Tensor, input_ids: torch.Tensor, topk: int,
                 embeds: Optional[torch.Tensor] = None):
        """embeds [T, H]: the prefix's input embeddings when they are not embed_tokens(input_ids) (image rows
        under image_embeddings=fused: eagle3/drafter/image_embeddings.py); drafted tokens are always embedded."""
        dev = model.fc.weight.device
        T = input_ids.numel()
        if T < 2:
            raise ValueError("SequenceDrafter: a sequence needs at least 2 tokens")
        self.model, self.topk = model, topk
        ids = input_ids.long().to(dev)
        hidden = model.project_aux(aux[None, : T - 1].to(dev))                  # [1, T-1, H]
        cache = KVCache()
        pos = torch.arange(T - 1, device=dev)[None]
        pre = None if embeds is None else embeds[None, 1:].to(dev)               # shifted by one, as the ids
        self.prenorm = model.step(ids[None, 1:], hidden, pos, cache, embeds=pre)[0]  # [T-1, H]
        self.k, self.v = cache.k, cache.v                                       # [1, h_kv, T-1, d]
        probs = torch.softmax(model.logits(self.prenorm).float(), dim=-1)       # [T-1, draft_V]
        p, i = probs.topk(topk, dim=-1)
        self.root_p, self.root_ids = p.cpu(), model.draft_ids_to_target(i).cpu()  # [T-1, topk]

    def at(self, q: int) -> "CycleDrafter":
        return CycleDrafter(self, q)


class CycleDrafter:
    """StepDrafter (eagle3.replay.accept_sim) of the cycle whose last verified token is at position q."""

    def __init__(self, seq: SequenceDrafter, q: int):
        if not 1 <= q <= seq.prenorm.shape[0]:
            raise ValueError(f"cycle at position {q}: outside 1..{seq.prenorm.shape[0]}")
        self.seq, self.q = seq, q
        self.rows = seq.prenorm[q - 1: q]                                       # [1, H]
        self.cache = BeamCache(seq.k[:, :, :q], seq.v[:, :, :q])
        self.position = q                                                        # of the next draft step

    @torch.no_grad()
    def __call__(self, src, tokens):
        s = self.seq
        if src is None:
            return s.root_p[self.q - 1: self.q], s.root_ids[self.q - 1: self.q]
        dev = self.rows.device
        src = src.to(dev)
        self.cache.reorder(src)
        hidden = self.rows[src][:, None]                                         # [b, 1, H]
        pos = torch.full((src.numel(), 1), self.position, device=dev, dtype=torch.long)
        out = s.model.step(tokens.to(dev).long()[:, None], hidden, pos, self.cache)[:, 0]  # [b, H]
        self.rows, self.position = out, self.position + 1
        probs = torch.softmax(s.model.logits(out).float(), dim=-1)
        p, i = probs.topk(s.topk, dim=-1)
        return p.cpu(), s.model.draft_ids_to_target(i).cpu()
