"""SGLang draft trees for EVERY cycle position of a sequence at once (batched over positions).

A cycle's tree depends only on its start q (the verified prefix), not on earlier cycles, so the
trees of all q = 1..T-1 can be drafted together: rows = (q, beam), each row attending to the prefix
keys 0..q-1 (one shared prefix pass, masked per row) plus its own path's keys. The tree-building
rules are eagle3/replay/accept_sim.py's `build_sglang_tree` (SGLang's select_top_k_tokens /
organize_draft_results), vectorised over q; tests check both give the same trees. The replay then
reads the trees of the q it visits. ~T/tau times more drafting than needed, but batched: far
faster than drafting cycle by cycle.
"""
from __future__ import annotations

import math

from typing import Optional

import torch

from eagle3.replay.accept_sim import DraftTree
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.drafter.attention import KVCache


def _stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lower index."""
    return torch.sort(-x.float(), dim=-1, stable=True).indices[..., :k]


class PrefixPathCache:
    """attend() for rows that each see a prefix of one shared key sequence plus their own path.
    Prefix K/V [1, h_kv, S, d]; row r sees prefix keys s < limit[r]; paths [B, h_kv, depth, d]."""

    def __init__(self, k_prefix: torch.Tensor, v_prefix: torch.Tensor, limit: torch.Tensor):
        self.kp, self.vp = k_prefix[0], v_prefix[0]                      # [h_kv, S, d]
        S = self.kp.shape[1]
        self.prefix_mask = torch.arange(S, device=limit.device)[None, :] < limit[:, None]  # [B, S]
        self.kpath = self.vpath = None

    def reorder(self, index: torch.Tensor) -> None:
        if self.kpath is not None:
            self.kpath, self.vpath = self.kpath[index], self.vpath[index]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, h, tq, d = q.shape
        hkv = k.shape[1]
        self.kpath = k if self.kpath is None else torch.cat([self.kpath, k], dim=2)
        self.vpath = v if self.vpath is None else torch.cat([self.vpath, v], dim=2)
        qg = q.view(B, hkv, h // hkv, tq, d)
        scale = 1.0 / math.sqrt(d)
        s_pre = torch.einsum("bngqd,nsd->bngqs", qg, self.kp).float() * scale          # [B,hkv,g,1,S]
        s_pre = s_pre.masked_fill(~self.prefix_mask[:, None, None, None, :], float("-inf"))
        s_path = torch.einsum("bngqd,bnsd->bngqs", qg, self.kpath).float() * scale     # [B,hkv,g,1,depth]
        p = torch.softmax(torch.cat([s_pre, s_path], dim=-1), dim=-1).to(q.dtype)
        S = self.kp.shape[1]
        out = torch.einsum("bngqs,nsd->bngqd", p[..., :S], self.vp)
        out = out + torch.einsum("bngqs,bnsd->bngqd", p[..., S:], self.vpath)
        return out.reshape(B, h, tq, d)


def _organize(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int) -> list[DraftTree]:
    """Per row: the n best candidates (ties to the earlier), in candidate order, as a DraftTree."""
    chosen = torch.sort(_stable_topk(scores, n), dim=-1).values                     # [Q, n]
    toks = torch.gather(tokens, 1, chosen).tolist()
    pars = torch.gather(parents, 1, chosen).tolist()
    out = []
    for ch, tk, pa in zip(chosen.tolist(), toks, pars):
        node_of = {c: i for i, c in enumerate(ch)}
        remap, keep = {-1: -1}, []
        for i, (t, p) in enumerate(zip(tk, pa)):
            par = node_of.get(p, -2) if p >= 0 else -1
            if par in remap:          # parent not selected (-2): unreachable, dropped with its subtree
                remap[i] = len(keep)
                keep.append((t, remap[par]))
        t, p = zip(*keep) if keep else ((), ())
        out.append(DraftTree(torch.tensor(t, dtype=torch.long), torch.tensor(p, dtype=torch.long)))
    return out


@torch.no_grad()
def all_cycle_trees(model, aux: torch.Tensor, input_ids: torch.Tensor, knobs: SpecKnobs,
                    chunk_rows: int = 2048, embeds: Optional[torch.Tensor] = None) -> list[DraftTree]:
    """trees[q] for q = 1..T-1 (trees[0] is an empty placeholder). aux [T, 3*Ht], input_ids [T]; embeds [T, H]
    the prefix's input embeddings when not embed_tokens(input_ids) (eagle3/drafter/image_embeddings.py)."""
    dev = model.fc.weight.device
    T, k = input_ids.numel(), knobs.topk
    ids = input_ids.long().to(dev)
    cache = KVCache()
    pre = None if embeds is None else embeds[None, 1:].to(dev)
    prenorm = model.step(ids[None, 1:], model.project_aux(aux[None, : T - 1].to(dev)),
                         torch.arange(T - 1, device=dev)[None], cache, embeds=pre)[0]  # [T-1, H]
    trees = [DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))]
    per_chunk = max(1, chunk_rows // k)
    for lo in range(1, T, per_chunk):
        qs = torch.arange(lo, min(T, lo + per_chunk), device=dev)                   # cycle starts
        Q = qs.numel()
        probs = torch.softmax(model.logits(prenorm[qs - 1]).float(), -1)            # [Q, draft_V]
        p, i = probs.topk(k, dim=-1)
        beam_score, beam_tok = p, model.draft_ids_to_target(i)                      # [Q, k]
        cand_s, cand_t = [beam_score], [beam_tok]
        cand_p = [torch.full((Q, k), -1, dtype=torch.long, device=dev)]
        beam_flat = torch.arange(k, device=dev).expand(Q, k)
        hidden = prenorm[qs - 1][:, None].expand(Q, k, -1)                           # [Q, k, H]
        pc = PrefixPathCache(cache.k, cache.v, qs.repeat_interleave(k))
        for step in range(1, knobs.num_steps):
            pos = (qs + step - 1).repeat_interleave(k)[:, None]                      # [Q*k, 1]
            out = model.step(beam_tok.reshape(-1, 1), hidden.reshape(Q * k, 1, -1), pos, pc)[:, 0]  # [Q*k, H]
            pr = torch.softmax(model.logits(out).float(), -1)
            p, i = pr.topk(k, dim=-1)                                                # [Q*k, k]
            expand = (beam_score[:, :, None] * p.view(Q, k, k)).reshape(Q, k * k)
            toks = model.draft_ids_to_target(i).view(Q, k * k)
            base = k + (step - 1) * k * k
            cand_s.append(expand)
            cand_t.append(toks)
            cand_p.append(beam_flat.repeat_interleave(k, dim=1))
            keep = _stable_topk(expand, k)                                           # [Q, k]
            src = keep // k
            rows = (torch.arange(Q, device=dev)[:, None] * k + src).reshape(-1)     # rows continued
            pc.reorder(rows)
            hidden = out.view(Q, k, -1).gather(1, src[..., None].expand(-1, -1, out.shape[-1]))
            beam_flat, beam_score = base + keep, expand.gather(1, keep)
            beam_tok = toks.gather(1, keep)
        trees += _organize(torch.cat(cand_s, 1).cpu(), torch.cat(cand_t, 1).cpu(), torch.cat(cand_p, 1).cpu(),
                           knobs.num_draft_tokens - 1)
    return trees
