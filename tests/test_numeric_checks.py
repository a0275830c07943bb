"""tests/numeric_checks.py: the argmax check lets float noise decide a tie and nothing else."""
import pytest
import torch

from numeric_checks import assert_argmax_up_to_ties


def test_argmax_up_to_ties_allows_a_near_tie_and_refuses_a_wrong_choice():
    logits = torch.tensor([[1.0, 1.00005, 0.2], [0.0, 2.0, 1.0]])
    assert_argmax_up_to_ties(torch.tensor([1, 1]), logits, tol=1e-4)  # the argmax
    assert_argmax_up_to_ties(torch.tensor([0, 1]), logits, tol=1e-4)  # row 0: a tie within 1e-4
    with pytest.raises(AssertionError, match=r"positions \[1\]"):
        assert_argmax_up_to_ties(torch.tensor([1, 2]), logits, tol=1e-4)  # row 1: 1.0 below the largest
