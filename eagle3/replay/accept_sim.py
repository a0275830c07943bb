"""Accept-length replay in SGLang's convention (pure: tensors and callables in, numbers out).

What is simulated (docs/design.md "Accept length"): greedy (temperature 0) EAGLE speculative decoding
with SGLang's knobs `num_steps`, `topk`, `num_draft_tokens`. A verify *cycle* starts from the
last verified token; the drafter proposes a tree (a chain when topk == 1), the target checks it
in one forward pass, the longest root path matching the target's greedy tokens is accepted and
the target adds one token of its own (the bonus). Accept length = tokens emitted / cycles, bonus
included, so a drafter that is never right scores exactly 1.0.

Replay over a stored sequence x_0..x_{T-1} with the target's greedy choices g_t = target_argmax[t]
(the target's prediction of x_{t+1} given x_0..x_t):
  * A *segment* is a maximal run of positions t = a..b where x_{t+1} is an assistant token
    (loss_mask[t+1]) and the stored sequence is the target's greedy continuation (x_{t+1} == g_t).
    Inside a segment the stored sequence IS what greedy decoding would emit, so the target's
    verdict at every position is g_t. Where x_{t+1} != g_t the store no longer tells what the
    target would say after its own token, so the replay stops there and restarts at the next
    segment (counted as a mismatch; with target-regenerated data mismatches are rare ties).
  * x_{a+1} is the prefill's token (no cycle). Cycles start with the last verified token at
    q = a+1; a cycle at q judges draft depth j (1-based) against g_{q+j-1}; with k drafts
    accepted it emits min(k + 1, b + 1 - q) tokens (a cycle that runs into the segment end stops
    there, as a decode stops at its last token), and the next cycle starts at q + emitted.
  * Only the verdicts (g) and the drafter are needed: the drafter is a callable, so tests drive
    the replay with hand-made drafters and eval drives it with the real one (eagle3/replay/drafter_session.py).

Trees follow SGLang (speculative/eagle_utils.py `select_top_k_tokens`, `organize_draft_results`,
`build_tree_kernel_efficient`): step 0 keeps the top-k of the first distribution; each later step
expands every kept path by its top-k (cumulative score = product of draft probabilities), records
all topk*topk expansions as candidates and keeps the best topk paths; after num_steps steps the
num_draft_tokens-1 best candidates by cumulative score form the tree, each node's parent being the
candidate it was expanded from. Ties are broken towards the earlier candidate (so with equal
scores parents precede children); a node whose parent was not selected is unreachable, as in
SGLang's tree builder. Verification walks the tree greedily from the root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

from eagle3.engines.serve_launch import SpecKnobs


@dataclass
class DraftTree:
    """Draft nodes of one cycle (the verified token is the implicit root, index -1).
    tokens Long [n] target-vocab ids; parents Long [n] with parents[i] < i or -1."""
    tokens: torch.Tensor
    parents: torch.Tensor

    @staticmethod
    def chain(tokens: torch.Tensor) -> "DraftTree":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return DraftTree(tokens, torch.arange(tokens.numel(), dtype=torch.long) - 1)

    @property
    def depth(self) -> int:
        depth, d = 0, {}
        for i, p in enumerate(self.parents.tolist()):
            d[i] = 1 + (d[p] if p >= 0 else 0)
            depth = max(depth, d[i])
        return depth


class StepDrafter(Protocol):
    """One cycle's drafter, called by `build_sglang_tree`.

    `__call__(None, None)` -> (p [1, topk], ids [1, topk]): the distribution after the verified token.
    `__call__(src [b], tokens [b])` -> (p [b, topk], ids [b, topk]): row r continues row src[r] of the
    previous call with draft token tokens[r] (its own pre-norm hidden + that token's embedding).
    p are draft probabilities (descending per row), ids target-vocab token ids."""

    def __call__(self, src: Optional[torch.Tensor], tokens: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _topk_first(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values of 1-D x, ties to the lower index (torch.topk leaves ties open)."""
    order = torch.sort(-x.float(), stable=True).indices
    return order[:k]


def build_sglang_tree(drafter: StepDrafter, knobs: SpecKnobs) -> DraftTree:
    """Draft one cycle's tree as SGLang does (module docstring); returns nodes in candidate order."""
    k = knobs.topk
    p, ids = drafter(None, None)                      # [1, topk] each
    p, ids = p.reshape(-1)[:k].float(), ids.reshape(-1)[:k].long()
    cand_score, cand_token = [p], [ids]
    cand_parent = [torch.full((k,), -1, dtype=torch.long)]  # flat candidate index of the parent
    beam_flat = torch.arange(k)                        # flat indices of the kept paths' last nodes
    beam_score, beam_token = p, ids
    src = torch.zeros(k, dtype=torch.long)             # every first-step path continues the root state
    for step in range(1, knobs.num_steps):
        p, ids = drafter(src, beam_token)              # [k, topk]
        p, ids = p[:, :k].float(), ids[:, :k].long()
        expand = (beam_score[:, None] * p).reshape(-1)  # [k*k] cumulative scores
        base = k + (step - 1) * k * k
        cand_score.append(expand)
        cand_token.append(ids.reshape(-1))
        cand_parent.append(beam_flat.repeat_interleave(k))
        keep = _topk_first(expand, k)
        src = keep // k
        beam_flat, beam_score, beam_token = base + keep, expand[keep], ids.reshape(-1)[keep]
    scores, tokens, parents = torch.cat(cand_score), torch.cat(cand_token), torch.cat(cand_parent)
    chosen = torch.sort(_topk_first(scores, knobs.num_draft_tokens - 1)).values
    node_of = {int(c): i for i, c in enumerate(chosen.tolist())}
    node_parent = [node_of.get(int(parents[c]), -2) if int(parents[c]) >= 0 else -1 for c in chosen.tolist()]
    # -2: parent not selected -> unreachable; drop it (and, by order, its descendants).
    keep_nodes, remap = [], {-1: -1}
    for i, par in enumerate(node_parent):
        if par in remap:
            remap[i] = len(keep_nodes)
            keep_nodes.append((int(tokens[chosen[i]]), remap[par]))
    if not keep_nodes:
        return DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    t, par = zip(*keep_nodes)
    return DraftTree(torch.tensor(t, dtype=torch.long), torch.tensor(par, dtype=torch.long))


def greedy_tree_accept(tree: DraftTree, truth: torch.Tensor) -> int:
    """Number of draft tokens accepted: walk from the root, at depth d follow the child whose token
    equals truth[d] (the target's greedy token there); stop at a miss or after len(truth) steps."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        children.setdefault(par, {}).setdefault(tok, i)  # first sibling with that token wins
    node, accepted = -1, 0
    for want in truth.tolist():
        node = children.get(node, {}).get(want)
        if node is None:
            break
        accepted += 1
    return accepted


def greedy_segments(input_ids: torch.Tensor, loss_mask: torch.Tensor, target_argmax: torch.Tensor
                    ) -> tuple[list[tuple[int, int]], int, int]:
    """Segments (a, b) of positions whose next token is an assistant token and the target's greedy
    choice (module docstring). Returns (segments, assistant positions, mismatching positions)."""
    x, g = input_ids.long().reshape(-1), target_argmax.long().reshape(-1)
    m = loss_mask.bool().reshape(-1)
    if not (x.numel() == g.numel() == m.numel()):
        raise ValueError(f"greedy_segments: input_ids {x.numel()}, loss_mask {m.numel()}, "
                         f"target_argmax {g.numel()} differ in length")
    valid = m[1:]                                      # [T-1]: position t predicts an assistant token
    ok = (valid & (x[1:] == g[:-1])).tolist()
    segs, start = [], None
    for t, good in enumerate(ok + [False]):
        if good and start is None:
            start = t
        elif not good and start is not None:
            segs.append((start, t - 1))
            start = None
    n_valid = int(valid.sum())
    return segs, n_valid, n_valid - sum(ok)


def acceptance_by_position(accepted: Sequence[float], drafts: int) -> list[float]:
    """P(the draft at depth j+1 accepted) per depth: accepted counts over every draft (verify cycle), the
    rule of vLLM's per-position counters (num_accepted_tokens_per_pos / num_drafts). The one rule for the
    replay and the served figures alike, so the two columns compare like for like: a cycle cut short by
    the end of a sequence counts its undrafted depths as not accepted."""
    return [a / drafts if drafts else float("nan") for a in accepted]


@dataclass
class AcceptStats:
    """Counts of a replay; merge with `+=`. Depths are 1..max_depth (index 0 = depth 1)."""
    max_depth: int
    cycles: int = 0
    tokens: int = 0
    truncated_cycles: int = 0                # cycles that ran into a segment end
    emitted_hist: list[int] = field(default_factory=list)  # [max_depth+1]: cycles emitting 1..max_depth+1
    accepted: list[int] = field(default_factory=list)      # cycles where depth j was accepted
    segments: int = 0
    assistant_positions: int = 0
    mismatches: int = 0
    sequences: int = 0

    def __post_init__(self):
        n = self.max_depth
        self.emitted_hist = self.emitted_hist or [0] * (n + 1)
        self.accepted = self.accepted or [0] * n

    def add_cycle(self, accepted: int, remaining: int) -> int:
        emitted = min(accepted + 1, remaining)
        self.cycles += 1
        self.tokens += emitted
        self.truncated_cycles += int(remaining <= self.max_depth)
        self.emitted_hist[emitted - 1] += 1
        for j in range(min(self.max_depth, accepted, remaining)):  # the drafts this cycle emitted
            self.accepted[j] += 1
        return emitted

    def __iadd__(self, other: "AcceptStats") -> "AcceptStats":
        if other.max_depth != self.max_depth:
            raise ValueError(f"cannot merge replays of depth {self.max_depth} and {other.max_depth}")
        for name in ("cycles", "tokens", "truncated_cycles", "segments", "assistant_positions",
                     "mismatches", "sequences"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("emitted_hist", "accepted"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        return self

    @property
    def accept_length(self) -> float:
        return self.tokens / self.cycles if self.cycles else float("nan")

    def acceptance_by_position(self) -> list[float]:
        """P(draft at depth j accepted), the engines' rule (`acceptance_by_position` above)."""
        return acceptance_by_position(self.accepted, self.cycles)

    def conditional_acceptance(self) -> list[float]:
        """P(depth j accepted | depth j-1 accepted) (depth 1: unconditional)."""
        out, prev = [], None
        for a in self.accepted:
            base = self.cycles if prev is None else prev
            out.append(a / base if base else float("nan"))
            prev = a
        return out

    def to_dict(self) -> dict:
        return {"accept_length": self.accept_length, "cycles": self.cycles, "tokens": self.tokens,
                "truncated_cycles": self.truncated_cycles,
                "emitted_histogram": {str(i + 1): c for i, c in enumerate(self.emitted_hist)},
                "acceptance_by_position": self.acceptance_by_position(),
                "conditional_acceptance": self.conditional_acceptance(),
                "sequences": self.sequences, "segments": self.segments,
                "assistant_positions": self.assistant_positions, "mismatches": self.mismatches,
                "mismatch_rate": self.mismatches / self.assistant_positions if self.assistant_positions else 0.0}


# propose(q) -> the draft tree of the cycle whose last verified token is at position q
ProposeFn = Callable[[int], DraftTree]


def _replay(input_ids, loss_mask, target_argmax, accept_at: Callable[[int, int], int], max_depth: int,
            max_cycles: Optional[int]) -> AcceptStats:
    """The cycle loop over the greedy segments; accept_at(q, remaining) -> drafts accepted at q."""
    segs, n_valid, n_bad = greedy_segments(input_ids, loss_mask, target_argmax)
    stats = AcceptStats(max_depth, segments=len(segs), assistant_positions=n_valid, mismatches=n_bad, sequences=1)
    for a, b in segs:
        q = a + 1
        while q <= b and (max_cycles is None or stats.cycles < max_cycles):
            remaining = b + 1 - q                       # tokens x_{q+1}..x_{b+1} left in the segment
            q += stats.add_cycle(accept_at(q, remaining), remaining)
    return stats


def replay_sequence(input_ids: torch.Tensor, loss_mask: torch.Tensor, target_argmax: torch.Tensor,
                    propose: ProposeFn, max_depth: int, max_cycles: Optional[int] = None) -> AcceptStats:
    """Replay greedy speculative decoding over one stored sequence (module docstring).

    input_ids, loss_mask, target_argmax [T]; `propose(q)` drafts the cycle at q (it may only look at
    tokens 0..q and the target states of positions < q); max_depth = `SpecKnobs.max_depth`.
    """
    g = target_argmax.long().reshape(-1)

    def accept_at(q: int, remaining: int) -> int:
        tree = propose(q)
        if tree.depth > max_depth:
            raise ValueError(f"drafter proposed a tree of depth {tree.depth} > max_depth {max_depth}")
        return greedy_tree_accept(tree, g[q:q + remaining])

    return _replay(input_ids, loss_mask, target_argmax, accept_at, max_depth, max_cycles)


def replay_perfect(input_ids: torch.Tensor, loss_mask: torch.Tensor, target_argmax: torch.Tensor,
                   max_depth: int, max_cycles: Optional[int] = None) -> AcceptStats:
    """The ceiling of a store: the replay of a drafter whose every draft is the target's token, so each
    cycle emits max_depth + 1 tokens or what is left of its segment. Traffic whose greedy segments are
    short (sampled or guarded tokens break them) caps every drafter's accept length there."""
    return _replay(input_ids, loss_mask, target_argmax, lambda q, rem: min(max_depth, rem), max_depth, max_cycles)


def leading_hits(hits: torch.Tensor) -> torch.Tensor:
    """hits Bool [K, T] (hits[j, t]: depth j+1 of the chain rooted at t is the target's token) ->
    Long [T]: how many leading depths are right, i.e. the drafts a chain from t gets accepted."""
    return torch.cumprod(hits.long(), dim=0).sum(0)


def replay_chain_runs(input_ids: torch.Tensor, loss_mask: torch.Tensor, target_argmax: torch.Tensor,
                      runs: torch.Tensor, max_depth: int, max_cycles: Optional[int] = None) -> AcceptStats:
    """The chain replay when the accepted drafts per cycle are known up front: runs Long [T] with
    runs[q-1] = leading right drafts of the cycle at q (`leading_hits`); same counts as
    `replay_sequence` with the corresponding chains, without building them."""
    r = runs.tolist()
    return _replay(input_ids, loss_mask, target_argmax, lambda q, rem: min(r[q - 1], max_depth, rem),
                   max_depth, max_cycles)
