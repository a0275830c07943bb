"""N-gram (prompt-lookup) drafting: the model-free alternative every report shows next to the drafter.

At a cycle whose verified prefix is x_0..x_q: for n = max_ngram down to min_ngram, take the last n
tokens as the query, find an earlier occurrence of those n tokens in the prefix, and propose the
tokens that followed it (up to `num_draft`). The *most recent* earlier occurrence wins (local
repetition is what prompt lookup exploits; Hugging Face's prompt-lookup takes the first one,
`prefer="first"` does that). No match: no draft, the cycle emits only the target's own token.

Pure: a token tensor in, a token tensor out.
"""
from __future__ import annotations

import torch

from eagle3.accept_sim import DraftTree


def ngram_propose(prefix: torch.Tensor, num_draft: int, max_ngram: int = 3, min_ngram: int = 1,
                  prefer: str = "recent") -> torch.Tensor:
    """prefix Long [L] (the verified tokens, last = the newest); returns Long [<= num_draft]."""
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"ngram sizes: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
    if prefer not in ("recent", "first"):
        raise ValueError(f"ngram prefer={prefer!r}: expected 'recent' or 'first'")
    x = prefix.long().reshape(-1)
    L = x.numel()
    empty = x.new_zeros(0)
    if num_draft < 1:
        return empty
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = x.unfold(0, n, 1)[: L - n]           # [L-n, n]: every earlier window (not the query itself)
        hits = (windows == x[L - n:]).all(dim=1).nonzero().reshape(-1)
        if hits.numel():
            start = int(hits[-1] if prefer == "recent" else hits[0]) + n
            return x[start:start + num_draft].clone()   # start <= L-1: at least one token follows
    return empty


def ngram_tree(prefix: torch.Tensor, num_draft: int, max_ngram: int = 3, min_ngram: int = 1,
               prefer: str = "recent") -> DraftTree:
    """The proposal as a chain tree for `eagle3.accept_sim.replay_sequence`."""
    return DraftTree.chain(ngram_propose(prefix, num_draft, max_ngram, min_ngram, prefer))
