"""eagle3.drafter.vocab_map: hand-checked mapping cases, the d2t offset convention, tie breaking,
fill when too few tokens are seen, validation, counting and the comparison."""
import random
from collections import Counter

import pytest
import torch

from eagle3.drafter.vocab_map import (VocabMapError, compare_vocabs, coverage, d2t_from_ids, draft_index_from_t2d,
                                      ids_from_d2t, mapping_problems,
                                      masked_token_counts, order_problems, t2d_from_ids, top_n_vocab, validate_mapping)


def test_top_n_hand_checked_with_tie_broken_by_id():
    #                      id: 0  1  2  3  4  5
    counts = torch.tensor([5, 0, 3, 3, 9, 0])
    # 4 (9) and 0 (5) are in; 2 and 3 tie at 3: the lower id (2) wins. Result sorted by id.
    assert top_n_vocab(counts, 3).tolist() == [0, 2, 4]
    assert top_n_vocab(counts, 4).tolist() == [0, 2, 3, 4]
    assert top_n_vocab(counts, 1).tolist() == [4]
    assert top_n_vocab(counts, 3).dtype == torch.int64


def test_fewer_distinct_tokens_than_n_fills_with_lowest_unseen_ids():
    counts = torch.tensor([0, 7, 0, 0, 2, 0, 0])
    ids = top_n_vocab(counts, 4)
    assert ids.tolist() == [0, 1, 2, 4]  # seen {1, 4}, then the lowest unseen 0, 2
    cov = coverage(counts, ids)
    assert cov["vocab_entries_unseen"] == 2 and cov["distinct_tokens_seen"] == 2 and cov["coverage"] == 1.0


def test_top_n_against_naive_reference():
    rng = random.Random(0)
    counts = torch.tensor([rng.choice([0, 1, 2, 3, 50, rng.randint(0, 1000)]) for _ in range(300)])
    for n in (1, 17, 100, 300):
        naive = sorted(sorted(range(300), key=lambda i: (-int(counts[i]), i))[:n])
        assert top_n_vocab(counts, n).tolist() == naive


def test_d2t_offset_convention_matches_sglang_hot_token_ids():
    ids = torch.tensor([3, 7, 8, 20])
    d2t = d2t_from_ids(ids)
    assert d2t.tolist() == [3, 6, 6, 17]  # d2t[i] = ids[i] - i
    assert d2t.dtype == torch.int64
    # SGLang: hot_token_id = d2t + arange(len(d2t))
    assert (d2t + torch.arange(len(d2t))).tolist() == ids.tolist()
    assert ids_from_d2t(d2t).tolist() == ids.tolist()
    t2d = t2d_from_ids(ids, 25)
    assert t2d.dtype == torch.bool and t2d.shape == (25,)
    assert torch.nonzero(t2d).flatten().tolist() == [3, 7, 8, 20]
    assert validate_mapping(d2t, t2d, 25).tolist() == ids.tolist()
    index = draft_index_from_t2d(t2d)  # target id -> draft id: the inverse of ids_from_d2t
    assert index[ids].tolist() == [0, 1, 2, 3] and index.dtype == torch.int64
    assert int((index == -1).sum()) == 25 - 4 and index[ids_from_d2t(d2t)].tolist() == list(range(4))


def test_validation_catches_inconsistent_mappings():
    with pytest.raises(VocabMapError, match="strictly increasing"):
        d2t_from_ids(torch.tensor([1, 5, 5]))
    with pytest.raises(VocabMapError, match="strictly increasing"):
        validate_mapping(torch.tensor([4, 2, 0]))  # ids 4, 3, 2: not sorted
    ids = torch.tensor([1, 4, 6])
    t2d = t2d_from_ids(ids, 8)
    bad = t2d.clone()
    bad[4], bad[5] = False, True
    with pytest.raises(VocabMapError, match="False at target ids \\[4\\]"):
        validate_mapping(d2t_from_ids(ids), bad)
    extra = t2d.clone()
    extra[0] = True
    with pytest.raises(VocabMapError, match="marks 4 target ids, expected 3"):
        validate_mapping(d2t_from_ids(ids), extra)
    with pytest.raises(VocabMapError, match="outside"):
        validate_mapping(d2t_from_ids(ids), None, vocab_size=6)
    with pytest.raises(VocabMapError, match=r"t2d has shape \[8\], expected \[9\]"):
        validate_mapping(d2t_from_ids(ids), t2d, vocab_size=9)
    with pytest.raises(VocabMapError, match="must be in"):
        top_n_vocab(torch.tensor([1, 2]), 3)


def test_mapping_problems_is_the_one_check_of_meaning_and_order_is_separate():
    """The core check judges values (any integer / bool storage) and sizes; id order is order_problems'."""
    ids = torch.tensor([1, 4, 6])
    d2t, t2d = d2t_from_ids(ids), t2d_from_ids(ids, 8)
    assert mapping_problems(d2t, t2d, 3, 8) == [] and order_problems(d2t) == []
    assert mapping_problems(d2t.int(), t2d.to(torch.uint8), 3, 8) == []        # same ids, other storage
    shuffled = torch.tensor([4, 1, 6]) - torch.arange(3)                        # a valid set, not in id order
    assert mapping_problems(shuffled, t2d, 3, 8) == []
    assert any("strictly increasing" in p and "position 1 has 1 after 4" in p for p in order_problems(shuffled))
    with pytest.raises(VocabMapError, match="strictly increasing"):
        validate_mapping(shuffled, t2d)
    dup = torch.tensor([1, 0, 4])                                               # ids 1, 1, 6
    assert "d2t maps two draft ids to the same target id" in mapping_problems(dup)
    assert any("outside [0, 6)" in p for p in mapping_problems(d2t, None, vocab_size=6))
    assert mapping_problems(d2t, None) == []                                    # no vocab size: range unknown
    assert mapping_problems(d2t, t2d, 4, 8) == ["d2t has shape [3], expected [4] (draft_vocab_size)"]
    assert mapping_problems(d2t, t2d, 3, 9) == ["t2d has shape [8], expected [9] (the target vocab)"]
    assert mapping_problems(d2t[None], t2d) == ["d2t must be 1-D [draft_vocab_size], got shape [1, 3]"]
    assert order_problems(d2t[None]) == []                                      # shape is the core check's finding
    moved = t2d.clone()
    moved[4], moved[5] = False, True
    assert mapping_problems(d2t, moved) == ["t2d does not mark the target ids that d2t maps to "
                                            "(False at target ids [4])"]


def test_masked_counts_against_python_counter():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2000,), generator=g, dtype=torch.int32)
    mask = torch.rand(2000, generator=g) < 0.4
    counts = masked_token_counts(ids, mask.to(torch.uint8), 50)
    ref = Counter(int(i) for i, m in zip(ids, mask) if m)
    assert counts.tolist() == [ref.get(i, 0) for i in range(50)]
    assert counts.dtype == torch.int64
    with pytest.raises(VocabMapError, match="outside the target vocab"):
        masked_token_counts(torch.tensor([1, 60]), torch.tensor([1, 1]), 50)
    with pytest.raises(VocabMapError, match="differ in shape"):
        masked_token_counts(torch.tensor([1, 2]), torch.tensor([1]), 50)


def test_compare_vocabs_hand_checked():
    #                      id: 0  1  2  3  4  5  6  7
    counts = torch.tensor([10, 0, 6, 1, 8, 0, 3, 2])
    new = torch.tensor([0, 2, 4, 6])
    old = torch.tensor([0, 1, 4, 7])
    c = compare_vocabs(new, old, counts, top_k=10)
    assert (c["in_both"], c["only_new"], c["only_old"]) == (2, 2, 2)
    # d2t new [0,1,2,3], old [0,0,2,4]: positions 1 and 3 differ
    assert c["d2t_entries_differing"] == 2
    # tokens seen but absent from old: 2 (6), 6 (3), 3 (1); by count
    assert c["top_missing_from_old"] == [(2, 6), (6, 3), (3, 1)]
    assert c["loss_tokens_missing_from_old"] == 10
    assert c["old_coverage"] == pytest.approx(20 / 30) and c["new_coverage"] == pytest.approx(27 / 30)
    same = compare_vocabs(new, new, counts)
    assert same["d2t_entries_differing"] == 0 and same["only_new"] == same["only_old"] == 0
    # vocabularies of different sizes: the extra positions count as differing
    assert compare_vocabs(new, torch.tensor([0, 2]), counts)["d2t_entries_differing"] == 2
