"""Real tree speculative decoding (topk > 1): SGLang's draft tree verified by ONE target forward with
a tree attention mask. Greedy, batch 1.

Per cycle (x_q the last verified token; target cache = positions 0..q-1; drafter cache = the extend
pairs of 0..q-1 and its output at q-1):
  1. draft the tree with `eagle3.replay.accept_sim.build_sglang_tree`, the drafter attending to its cache
     plus each row's own path (eagle3/replay/drafter_session.BeamCache);
  2. verify [x_q, node_1..node_n]: node i sits at position q + depth(i) and attends to the whole
     prefix, the root and its own ancestors (a 4D additive mask, which transformers uses as given);
  3. walk from the root following the child whose token is the target's argmax, accept that path
     plus the bonus token; keep only the root's and the accepted nodes' entries in the target cache
     (a gather along the sequence dim of every layer), extend the drafter over the accepted pairs.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from eagle3.replay.accept_sim import build_sglang_tree
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.real_loop.chain import (PromptImages, SpecResult, TargetRunner, elapsed_ms, eos_ids, prefill_inputs,
                                    sync_device)
from eagle3.replay.drafter_session import BeamCache
from eagle3.target_model.target_io import AuxHiddenCapture
from eagle3.drafter.attention import KVCache


class LiveTreeDrafter:
    """StepDrafter over the live drafter cache (prefix) and the output at the last verified position."""

    def __init__(self, drafter, dcache: KVCache, h_last: torch.Tensor, q: int, topk: int):
        self.d, self.topk, self.position = drafter, topk, q
        self.rows = h_last.reshape(1, -1)                                           # [1, H]
        self.cache = BeamCache(dcache.k, dcache.v)

    def _top(self, out: torch.Tensor):
        p, i = torch.softmax(self.d.logits(out).float(), -1).topk(self.topk, dim=-1)
        return p.cpu(), self.d.draft_ids_to_target(i).cpu()

    @torch.no_grad()
    def __call__(self, src, tokens):
        if src is None:
            return self._top(self.rows)
        dev = self.rows.device
        src = src.to(dev)
        self.cache.reorder(src)
        pos = torch.full((src.numel(), 1), self.position, device=dev, dtype=torch.long)
        out = self.d.step(tokens.to(dev).long()[:, None], self.rows[src][:, None], pos, self.cache)[:, 0]
        self.rows, self.position = out, self.position + 1
        return self._top(out)


def tree_mask(parents: list[int], past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, 1+n, past+1+n] for [root, nodes]: everything in the past, the root, and
    each node's ancestors and itself (node i is column past+1+i; parents[i] = -1 means the root)."""
    n = len(parents)
    allow = torch.zeros(1 + n, past + 1 + n, dtype=torch.bool)
    allow[:, : past + 1] = True
    for i, p in enumerate(parents):
        j = i
        while j >= 0:
            allow[1 + i, past + 1 + j] = True
            j = parents[j]
    mask = torch.zeros(allow.shape, dtype=dtype)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def keep_cache_entries(cache, index: torch.Tensor) -> None:
    """Keep sequence positions `index` (Long [L']) in every layer of a transformers DynamicCache."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            idx = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


@torch.no_grad()
def tree_speculative_decode(target, drafter, prompt: torch.Tensor, max_new_tokens: int, knobs: SpecKnobs,
                            eos_token_id=None, images: Optional[PromptImages] = None) -> SpecResult:
    """Tree speculative decoding (module docstring). Lossless: its output is the target's greedy decode.
    images: the prompt's image rows (eagle3/real_loop/chain.py PromptImages)."""
    eos = eos_ids(eos_token_id)
    run = TargetRunner.for_drafter(target, drafter)
    dev = drafter.fc.weight.device
    dtype = run.decoder.embed_tokens.weight.dtype
    prompt = prompt.long().reshape(-1)
    L = prompt.numel()
    res = SpecResult(tokens=[], num_steps=knobs.num_steps, num_draft_tokens=knobs.num_draft_tokens)
    g, aux = run.forward(prompt, capture=True, images=images)                        # prefill
    res.tokens.append(int(g[-1]))
    dcache = KVCache()
    pairs, emb = prefill_inputs(drafter, prompt, res.tokens[0], images)
    h = drafter.step(pairs, drafter.project_aux(aux[None].to(dev)), torch.arange(L, device=dev)[None],
                     dcache, embeds=emb)[0, -1]
    q = L
    while len(res.tokens) < max_new_tokens and res.tokens[-1] not in eos:
        remaining = max_new_tokens - len(res.tokens)
        sync_device(dev)
        t0 = time.perf_counter()
        tree = build_sglang_tree(LiveTreeDrafter(drafter, dcache, h, q, knobs.topk), knobs)
        sync_device(dev)
        res.draft_ms.append(elapsed_ms(t0))
        toks, parents = tree.tokens.tolist(), tree.parents.tolist()

        t0 = time.perf_counter()
        ids = torch.tensor([res.tokens[-1]] + toks, device=run.device)[None]
        pos = torch.tensor([q] + [q + d for d in depths(parents)], device=run.device)[None]
        with AuxHiddenCapture(target, run.hf_indices) as cap:
            out = run.decoder(input_ids=ids, attention_mask=tree_mask(parents, q, dtype, run.device),
                              position_ids=pos, cache=run.cache, use_cache=True)
            vaux = cap.aux_concat(run.device)[0]                                    # [1+n, 3*Ht]
        g = run.head(out.last_hidden_state[0]).argmax(-1).tolist()                  # g[i]: target after node i
        sync_device(run.device)
        res.verify_ms.append(elapsed_ms(t0))

        children: dict[int, dict[int, int]] = {}
        for i, (t, p) in enumerate(zip(toks, parents)):
            children.setdefault(p, {}).setdefault(t, i)
        path, node = [], -1                                                          # accepted node indices
        while True:
            nxt = children.get(node, {}).get(g[0] if node < 0 else g[1 + node])
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        new = [toks[i] for i in path] + [g[0] if node < 0 else g[1 + node]]
        stop = [i for i, t in enumerate(new) if t in eos]
        if stop:
            new = new[: stop[0] + 1]
        new = new[:remaining]
        res.accepted.append(min(len(path), len(new)))
        res.emitted.append(len(new))
        res.tokens.extend(new)
        rows = [0] + [1 + i for i in path]                                           # verify rows kept, path order
        keep_cache_entries(run.cache, torch.cat([torch.arange(q), torch.tensor(rows) + q]))

        t0 = time.perf_counter()
        m = len(new)
        h = drafter.step(torch.tensor(new, device=dev)[None], drafter.project_aux(vaux[rows[:m]][None].to(dev)),
                         torch.arange(q, q + m, device=dev)[None], dcache)[0, -1]
        sync_device(dev)
        res.extend_ms.append(elapsed_ms(t0))
        q += m
    return res
