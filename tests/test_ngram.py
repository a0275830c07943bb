"""Prompt-lookup drafting (eagle3/replay/ngram.py) and its replay next to the drafter."""
import pytest
import torch

from eagle3.replay.accept_sim import replay_sequence
from eagle3.replay.ngram import ngram_propose, ngram_tree


def t(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_longest_suffix_match_wins():
    # suffix (2, 3) occurs at 1 (followed by 9, 9) ; suffix (3,) alone also at 5 (followed by 7)
    prefix = t(1, 2, 3, 9, 9, 3, 7, 2, 3)
    assert ngram_propose(prefix, 2, max_ngram=3).tolist() == [9, 9]
    assert ngram_propose(prefix, 2, max_ngram=1).tolist() == [7, 2]  # most recent earlier "3"


def test_recent_vs_first_and_short_continuation():
    prefix = t(5, 1, 5, 2, 5)
    assert ngram_propose(prefix, 3, max_ngram=1).tolist() == [2, 5]          # recent: after index 2
    assert ngram_propose(prefix, 3, max_ngram=1, prefer="first").tolist() == [1, 5, 2]


def test_no_match_and_bad_sizes():
    assert ngram_propose(t(1, 2, 3, 4), 2).numel() == 0
    assert ngram_propose(t(4), 2).numel() == 0
    with pytest.raises(ValueError, match="min_ngram"):
        ngram_propose(t(1, 2), 2, max_ngram=1, min_ngram=2)


def test_ngram_replay_on_a_repeating_sequence():
    # a periodic greedy sequence: after one period, prompt lookup is always right
    period = [3, 8, 1, 6, 4]
    ids = torch.tensor(period * 20)
    argmax = torch.cat([ids[1:], ids[:1]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    stats = replay_sequence(ids, mask, argmax, lambda q: ngram_tree(ids[: q + 1], 2), 2)
    # 98 tokens after the prefill token: 4 cycles inside the first period find nothing to look up,
    # then every cycle emits 3 (2 drafts + bonus): 31 * 3 = 93, and 1 token is left for the last cycle
    assert stats.emitted_hist == [5, 0, 31] and stats.tokens == 98
    # a sequence without repeats: never a proposal, exactly 1 token per cycle
    ids = torch.arange(50)
    argmax = torch.cat([ids[1:], t(0)])
    stats = replay_sequence(ids, mask[:50], argmax, lambda q: ngram_tree(ids[: q + 1], 2), 2)
    assert stats.accept_length == 1.0


@pytest.mark.parametrize("prefer", ["recent", "first"])
def test_incremental_lookup_equals_the_scan(prefer):
    from eagle3.replay.ngram import PromptLookup

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (80,), generator=g)  # a small alphabet: many repeats of every length
    look = PromptLookup(x, 3, max_ngram=3, prefer=prefer)
    for q in list(range(0, 80, 1)) + [5, 40]:     # increasing, then a restart from a shorter prefix
        assert look.propose(q) == ngram_propose(x[: q + 1], 3, max_ngram=3, prefer=prefer).tolist(), q
