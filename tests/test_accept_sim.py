"""Accept-length replay on hand-made drafters and hand-checked trees (eagle3/replay/accept_sim.py)."""
import pytest
import torch

from eagle3.replay.accept_sim import (AcceptStats, DraftTree, build_sglang_tree, greedy_segments,
                                      greedy_tree_accept, replay_sequence)
from eagle3.engines.serve_launch import SpecKnobs


def greedy_world(T=40, prompt=5, seed=0, vocab=50):
    """A sequence that is its own target's greedy continuation: argmax[t] == ids[t+1]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (T,), generator=g)
    argmax = torch.cat([ids[1:], torch.randint(0, vocab, (1,), generator=g)])
    mask = torch.zeros(T, dtype=torch.bool)
    mask[prompt:] = True
    return ids, mask, argmax


class OracleChain:
    """A chain drafter that is right for its first `right` depths, then wrong (token -1)."""

    def __init__(self, argmax, q, right):
        self.argmax, self.q, self.right, self.depth = argmax, q, right, 0

    def __call__(self, src, tokens):
        d = self.depth
        self.depth += 1
        b = 1 if src is None else src.numel()
        pos = self.q + d
        tok = int(self.argmax[pos]) if d < self.right and pos < len(self.argmax) else -1
        return torch.ones(b, 1), torch.full((b, 1), tok)


def replay_oracle(ids, mask, argmax, knobs, right):
    return replay_sequence(ids, mask, argmax,
                           lambda q: build_sglang_tree(OracleChain(argmax, q, right), knobs), knobs.max_depth)


def expected_chain_tokens(n_tokens, per_cycle):
    """Cycles a decode of `n_tokens` after the prefill token needs when every cycle emits `per_cycle`."""
    cycles, left = 0, n_tokens
    while left > 0:
        left -= min(per_cycle, left)
        cycles += 1
    return cycles


@pytest.mark.parametrize("knobs", [SpecKnobs(2, 1, 3), SpecKnobs(3, 1, 4)])
def test_chain_hand_made_drafters(knobs):
    T, prompt = 40, 5
    ids, mask, argmax = greedy_world(T, prompt)
    # one segment: positions prompt-1 .. T-2 predict assistant tokens; the first is the prefill token
    n_tokens = (T - 2) - (prompt - 1)  # tokens produced by cycles
    never = replay_oracle(ids, mask, argmax, knobs, right=0)
    assert never.accept_length == 1.0 and never.cycles == n_tokens
    first = replay_oracle(ids, mask, argmax, knobs, right=1)
    assert first.cycles == expected_chain_tokens(n_tokens, 2)
    assert first.accept_length == pytest.approx(n_tokens / first.cycles)
    assert first.emitted_hist[1] == n_tokens // 2  # all full cycles emit exactly 2
    always = replay_oracle(ids, mask, argmax, knobs, right=99)
    assert always.cycles == expected_chain_tokens(n_tokens, knobs.num_steps + 1)
    assert always.emitted_hist[knobs.num_steps] == n_tokens // (knobs.num_steps + 1)
    # every draft is accepted, except the depths the last cycle, cut by the segment end, never drafted:
    # they count against it (accepted / drafts, the engines' rule)
    last = n_tokens % (knobs.num_steps + 1) or knobs.num_steps + 1
    assert always.acceptance_by_position() == [
        (always.cycles - int(j >= last)) / always.cycles for j in range(knobs.num_steps)]


def test_chain_rates_without_truncation_are_exact():
    # a segment much longer than a cycle: the steady-state value dominates
    ids, mask, argmax = greedy_world(T=2003, prompt=1)
    knobs = SpecKnobs(2, 1, 3)
    n_tokens = 2001 - 0
    assert replay_oracle(ids, mask, argmax, knobs, 1).accept_length == pytest.approx(2.0, abs=2e-3)
    always = replay_oracle(ids, mask, argmax, knobs, 99)
    assert always.tokens == n_tokens and always.accept_length == pytest.approx(3.0, abs=2e-3)


def test_divergence_stops_and_restarts_the_replay():
    ids, mask, argmax = greedy_world(T=30, prompt=5)
    argmax = argmax.clone()
    argmax[14] = (ids[15] + 1) % 50  # the store's token 15 is not the target's greedy choice
    segs, n_valid, n_bad = greedy_segments(ids, mask, argmax)
    assert segs == [(4, 13), (15, 28)] and n_valid == 25 and n_bad == 1
    stats = replay_oracle(ids, mask, argmax, SpecKnobs(2, 1, 3), right=99)
    # cycles never cross position 14: tokens = (13-4) + (28-15) segment tokens after each prefill
    assert stats.tokens == 9 + 13 and stats.mismatches == 1
    assert stats.to_dict()["mismatch_rate"] == pytest.approx(1 / 25)


def test_multi_turn_segments_follow_the_loss_mask():
    ids, mask, argmax = greedy_world(T=30, prompt=3)
    mask[12:18] = False  # a user turn in the middle
    segs, _, _ = greedy_segments(ids, mask, argmax)
    assert segs == [(2, 10), (17, 28)]


def test_empty_and_short_sequences():
    ids, mask, argmax = greedy_world(T=6, prompt=6)  # no assistant token
    stats = replay_oracle(ids, mask, argmax, SpecKnobs(), right=99)
    assert stats.cycles == 0 and stats.to_dict()["mismatch_rate"] == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        greedy_segments(ids, mask[:-1], argmax)


class TableDrafter:
    """A tree drafter from a hand-written table: path of draft tokens -> (probs, ids)."""

    def __init__(self, table):
        self.table, self.paths = table, None

    def __call__(self, src, tokens):
        if src is None:
            self.paths = [()]
        else:
            self.paths = [self.paths[s] + (int(t),) for s, t in zip(src.tolist(), tokens.tolist())]
        rows = [self.table[p] for p in self.paths]
        return (torch.tensor([r[0] for r in rows], dtype=torch.float),
                torch.tensor([r[1] for r in rows], dtype=torch.long))


# topk=2: root -> {10: .6, 11: .3}; 10 -> {20: .5, 21: .4}; 11 -> {22: .9, 23: .05};
# step 2 candidates: 10.20=.30, 10.21=.24, 11.22=.27, 11.23=.015 -> keep 10.20 (.30) and 11.22 (.27)
# step 3 (from 10.20 {30:.9, 31:.1}; from 11.22 {32:.5, 33:.5}): .27, .03, .135, .135
TABLE = {(): ([.6, .3], [10, 11]), (10,): ([.5, .4], [20, 21]), (11,): ([.9, .05], [22, 23]),
         (10, 20): ([.9, .1], [30, 31]), (11, 22): ([.5, .5], [32, 33])}


def test_sglang_tree_hand_checked():
    # candidates (flat): 0:10 .6, 1:11 .3 | 2:20 .30, 3:21 .24, 4:22 .27, 5:23 .015 | 6:30 .27, 7:31 .03, 8:32 .135, 9:33 .135
    tree = build_sglang_tree(TableDrafter(TABLE), SpecKnobs(3, 2, 6))
    # best 5 scores: .6(0) .3(2, tie broken to lower index first) ... : 0, 1(.3), 2(.30), 4(.27), 6(.27)
    assert tree.tokens.tolist() == [10, 11, 20, 22, 30]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2]
    assert greedy_tree_accept(tree, torch.tensor([11, 22, 32])) == 2
    assert greedy_tree_accept(tree, torch.tensor([10, 20, 30])) == 3
    assert greedy_tree_accept(tree, torch.tensor([10, 21, 30])) == 1
    assert greedy_tree_accept(tree, torch.tensor([12, 20])) == 0
    assert greedy_tree_accept(tree, torch.tensor([10, 20])) == 2  # cut at the segment end


def test_sglang_tree_budget_smaller_than_candidates():
    tree = build_sglang_tree(TableDrafter(TABLE), SpecKnobs(3, 2, 4))
    assert tree.tokens.tolist() == [10, 11, 20] and tree.parents.tolist() == [-1, -1, 0]


def test_child_never_outranks_its_parent():
    # 11 has a low score but its child 22 is certain: 22 inherits .05 and ties lose to the earlier 11
    table = {(): ([.9, .05], [10, 11]), (10,): ([.5, .5], [20, 21]), (11,): ([1.0, 0.0], [22, 23])}
    tree = build_sglang_tree(TableDrafter(table), SpecKnobs(2, 2, 4))
    assert tree.tokens.tolist() == [10, 20, 21] and tree.parents.tolist() == [-1, 0, 0]


def test_unselected_parent_makes_node_unreachable():
    # scores that are not probabilities (p > 1) let a child outrank its parent: it is dropped, as
    # SGLang's tree builder leaves a node without a selected parent out of the tree
    table = {(): ([.5, .1], [10, 11]), (10,): ([.1, .1], [20, 21]), (11,): ([9.0, 0.0], [22, 23])}
    tree = build_sglang_tree(TableDrafter(table), SpecKnobs(2, 2, 3))
    assert tree.tokens.tolist() == [10] and tree.parents.tolist() == [-1]


def test_chain_tree_equals_plain_chain():
    table = {(): ([.6], [10]), (10,): ([.5], [20]), (10, 20): ([.9], [30])}
    tree = build_sglang_tree(TableDrafter(table), SpecKnobs(3, 1, 4))
    assert tree.tokens.tolist() == [10, 20, 30] and tree.parents.tolist() == [-1, 0, 1]
    assert DraftTree.chain(torch.tensor([10, 20, 30])).parents.tolist() == tree.parents.tolist()


def test_tree_replay_beats_chain_when_second_choice_is_right():
    """Each cycle's target token is the drafter's SECOND choice: a chain never gains, a topk=2 tree does."""
    ids, mask, argmax = greedy_world(T=60, prompt=2)

    class SecondChoice:
        def __init__(self, q):
            self.q, self.depth = q, 0

        def __call__(self, src, tokens):
            pos = self.q + self.depth
            self.depth += 1
            b = 1 if src is None else src.numel()
            right = int(argmax[pos]) if pos < len(argmax) else -5
            return torch.tensor([[.6, .4]] * b), torch.tensor([[-7, right]] * b)

    chain = replay_sequence(ids, mask, argmax, lambda q: build_sglang_tree(SecondChoice(q), SpecKnobs(2, 1, 3)), 2)
    tree = replay_sequence(ids, mask, argmax, lambda q: build_sglang_tree(SecondChoice(q), SpecKnobs(2, 2, 5)), 2)
    assert chain.accept_length == 1.0
    # candidates: -7 .6, r .4 | (-7,-7) .36, (-7,r) .24, (r,-7) .24, (r,r) .16 -> top 4: .6,.4,.36,.24(first)
    # the (r, r) path is not in the tree, so exactly one draft is accepted per full cycle
    assert tree.emitted_hist[1] == tree.cycles - tree.emitted_hist[0]
    assert tree.accept_length > 1.9


def test_knob_validation_and_merge():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecKnobs(2, 1, 4)
    assert SpecKnobs(3, 1, 3).max_depth == 2
    a, b = AcceptStats(2), AcceptStats(2)
    a.add_cycle(2, 10), b.add_cycle(0, 10)
    a += b
    assert a.accept_length == 2.0 and a.acceptance_by_position() == [0.5, 0.5]
    assert a.conditional_acceptance() == [0.5, 1.0]
    with pytest.raises(ValueError, match="merge"):
        a += AcceptStats(3)


def test_chain_runs_replay_equals_tree_replay():
    from eagle3.replay.accept_sim import leading_hits, replay_chain_runs

    hits = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    assert leading_hits(hits).tolist() == [2, 1, 0, 3, 1]
    ids, mask, argmax = greedy_world(T=50, prompt=4, seed=2)
    g = torch.Generator().manual_seed(3)
    hits = torch.rand(3, 50, generator=g) < 0.7
    knobs = SpecKnobs(3, 1, 4)

    def propose(q):  # the chain that is right exactly where `hits` says
        d = min(3, 50 - q)
        return DraftTree.chain(torch.where(hits[:d, q - 1], argmax[q:q + d], torch.full((d,), -1)))

    tree = replay_sequence(ids, mask, argmax, propose, knobs.max_depth)
    runs = replay_chain_runs(ids, mask, argmax, leading_hits(hits), knobs.max_depth)
    assert runs.to_dict() == tree.to_dict() and 1.5 < runs.accept_length < 4


def test_per_position_divides_by_every_draft_as_the_engines_do():
    """A cycle cut short by the end of its sequence still counts as a draft at every depth (vLLM's
    num_accepted_tokens_per_pos / num_drafts): depths it could not emit are not accepted."""
    s = AcceptStats(3)
    s.add_cycle(3, 10)  # full cycle, all three drafts accepted
    s.add_cycle(3, 2)   # the sequence ends after 2 tokens: depths 1-2 emitted, depth 3 never
    assert s.acceptance_by_position() == [1.0, 1.0, 0.5]
    assert s.conditional_acceptance() == [1.0, 1.0, 0.5]


@pytest.mark.parametrize("knobs", [SpecKnobs(2, 1, 3), SpecKnobs(3, 1, 4)])
def test_the_ceiling_is_the_always_right_drafter_and_no_drafter_beats_it(knobs):
    from eagle3.replay.accept_sim import replay_perfect

    ids, mask, argmax = greedy_world(T=60, prompt=4, seed=5)
    argmax = argmax.clone()
    for t in (9, 11, 30, 31, 47):  # stored tokens off the target's argmax break the segments
        argmax[t] = (ids[t + 1] + 1) % 50
    ceiling = replay_perfect(ids, mask, argmax, knobs.max_depth)
    oracle = replay_oracle(ids, mask, argmax, knobs, right=99)
    assert ceiling.to_dict() == oracle.to_dict()
    assert 1.0 < ceiling.accept_length < knobs.max_depth + 1  # short segments cap it below a full cycle
    for right in (0, 1, 2):
        assert replay_oracle(ids, mask, argmax, knobs, right).accept_length <= ceiling.accept_length
    # one segment per break, so the breaks are what the ceiling measures: fewer breaks, a higher ceiling
    whole = replay_perfect(ids, mask, greedy_world(T=60, prompt=4, seed=5)[2], knobs.max_depth)
    assert whole.accept_length > ceiling.accept_length
