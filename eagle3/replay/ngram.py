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

from eagle3.replay.accept_sim import DraftTree
from eagle3.config.choices import NGRAM_PREFER


def ngram_propose(prefix: torch.Tensor, num_draft: int, max_ngram: int = 3, min_ngram: int = 1,
                  prefer: str = "recent") -> torch.Tensor:
    """prefix Long [L] (the verified tokens, last = the newest); returns Long [<= num_draft]."""
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"ngram sizes: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
    if prefer not in NGRAM_PREFER:
        raise ValueError(f"ngram prefer={prefer!r}: expected one of {NGRAM_PREFER}")
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
    """The proposal as a chain tree for `eagle3.replay.accept_sim.replay_sequence`."""
    return DraftTree.chain(ngram_propose(prefix, num_draft, max_ngram, min_ngram, prefer))


class PromptLookup:
    """Incremental prompt lookup over one sequence whose prefix grows (the replay's cycles visit
    q in increasing order): n-gram -> start index tables, so each proposal costs O(max_ngram)
    instead of a scan of the prefix. Proposes exactly what `ngram_propose(tokens[:q+1], ...)` does."""

    def __init__(self, tokens: torch.Tensor, num_draft: int, max_ngram: int = 3, min_ngram: int = 1,
                 prefer: str = "recent"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        if prefer not in NGRAM_PREFER:
            raise ValueError(f"ngram prefer={prefer!r}: expected one of {NGRAM_PREFER}")
        self.x = tokens.long().reshape(-1).tolist()
        self.num_draft, self.sizes, self.recent = num_draft, range(max_ngram, min_ngram - 1, -1), prefer == "recent"
        self._reset()

    def _reset(self) -> None:
        self.tables: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.indexed_len = 0  # windows of every prefix shorter than this are in the tables

    def propose(self, q: int) -> list[int]:
        L = q + 1                                      # the prefix is x[0..q]
        if L < self.indexed_len:
            self._reset()
        x = self.x
        # a window starting at i is "earlier" for prefix length L when i + n <= L - 1
        for n, table in self.tables.items():
            for i in range(max(0, self.indexed_len - 1 - n), L - n):
                key = tuple(x[i:i + n])
                if self.recent:
                    table[key] = i
                else:
                    table.setdefault(key, i)
        self.indexed_len = L
        if self.num_draft < 1:
            return []
        for n in self.sizes:
            if n > L - 1:
                continue
            start = self.tables[n].get(tuple(x[L - n:L]))
            if start is not None:
                return x[start + n:min(start + n + self.num_draft, L)]
        return []

    def tree(self, q: int) -> DraftTree:
        return DraftTree.chain(torch.tensor(self.propose(q), dtype=torch.long))
