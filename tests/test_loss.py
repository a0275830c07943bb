"""The objective's pure pieces on tiny hand-checked cases (eagle3/ttt/loss.py)."""
import math

import pytest
import torch

from eagle3.ttt.loss import (all_loss_positions, draft_accuracy, loss_positions, shift_left, soft_cross_entropy, step_weights,
                             teacher_logits)
from eagle3.drafter.vocab_map import ids_from_d2t


def test_teacher_logits_are_the_draft_vocab_columns_of_the_full_head():
    g = torch.Generator().manual_seed(0)
    V, H = 11, 4
    full_head = torch.randn(V, H, generator=g)
    d2t = torch.tensor([1, 2, 2, 5])           # draft ids 0..3 -> target ids 1, 3, 4, 8
    ids = ids_from_d2t(d2t)
    assert ids.tolist() == [1, 3, 4, 8]
    last = torch.randn(2, 3, H, generator=g).to(torch.bfloat16)
    got = teacher_logits(last, full_head[ids].to(torch.bfloat16))
    assert got.dtype == torch.float32 and got.shape == (2, 3, 4)
    full = last.float() @ full_head.to(torch.bfloat16).float().t()
    torch.testing.assert_close(got, full[..., ids])
    with pytest.raises(ValueError, match="hidden size"):
        teacher_logits(last, full_head[:, :3])


def test_soft_cross_entropy_hand_checked():
    # one valid position with p = softmax([0, ln 3]) = [1/4, 3/4], q = softmax([0, 0]) = [1/2, 1/2]
    # CE = -(1/4 ln 1/2 + 3/4 ln 1/2) = ln 2; the masked position (with an inf logit) is ignored.
    draft = torch.tensor([[[0.0, 0.0], [float("inf"), 0.0]]])
    teacher = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    mask = torch.tensor([[True, False]])
    total, count = soft_cross_entropy(draft, teacher, mask)
    assert count.item() == 1
    assert total.item() == pytest.approx(math.log(2.0), rel=1e-6)
    # CE against itself is the entropy: p = [1/4, 3/4] -> H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    total, _ = soft_cross_entropy(teacher[:, :1], teacher[:, :1], mask[:, :1])
    assert total.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel=1e-6)


def test_soft_cross_entropy_runs_in_fp32_and_checks_shapes():
    g = torch.Generator().manual_seed(1)
    d = torch.randn(2, 5, 7, generator=g)
    t = torch.randn(2, 5, 7, generator=g)
    m = torch.rand(2, 5, generator=g) > 0.3
    ref = -(torch.softmax(t, -1) * torch.log_softmax(d, -1)).sum(-1)[m].sum()
    total, count = soft_cross_entropy(d.to(torch.bfloat16), t, m)
    assert total.dtype == torch.float32 and count.item() == m.sum().item()
    torch.testing.assert_close(total, -(torch.softmax(t, -1) * torch.log_softmax(d.to(torch.bfloat16).float(), -1)
                                        ).sum(-1)[m].sum())
    assert abs(total.item() - ref.item()) < 0.05 * abs(ref.item())
    with pytest.raises(ValueError, match="teacher"):
        soft_cross_entropy(d, t[..., :6], m)
    with pytest.raises(ValueError, match="mask"):
        soft_cross_entropy(d, t, m[:, :4])


def test_loss_positions_follow_the_ttt_indexing():
    # T = 6, vocab of 4 target ids, draft vocab = {0, 2}
    t2d = torch.tensor([True, False, True, False])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.uint8)
    argmax = torch.tensor([[0, 2, 1, 0, 2, 0]])
    # step k, position t: loss_mask[t+k+2] & t2d[argmax[t+k+1]]
    for k in range(4):
        expect = []
        for t in range(6):
            if t + k + 2 >= 6:
                expect.append(False)
            else:
                expect.append(bool(loss_mask[0, t + k + 2]) and bool(t2d[argmax[0, t + k + 1]]))
        got = loss_positions(loss_mask, argmax, t2d, step=k)
        assert got.dtype == torch.bool and got[0].tolist() == expect, k
    # by hand, step 0: t=0 -> lm[2]=1 & t2d[2] -> T; t=1 -> lm[3] & t2d[1]=F; t=2 -> lm[4] & t2d[0] -> T;
    # t=3 -> lm[5] & t2d[2] -> T; t=4,5 past the end
    assert loss_positions(loss_mask, argmax, t2d)[0].tolist() == [True, False, True, True, False, False]


def test_all_loss_positions_are_every_steps_positions_from_one_check():
    g = torch.Generator().manual_seed(4)
    t2d = torch.rand(50, generator=g) < 0.6
    loss_mask = torch.rand(3, 11, generator=g) < 0.7
    argmax = torch.randint(0, 50, (3, 11), generator=g)
    got = all_loss_positions(loss_mask, argmax, t2d, 7)
    assert got.shape == (8, 3, 11) and got.dtype == torch.bool
    for j in range(8):
        assert torch.equal(got[j], loss_positions(loss_mask, argmax, t2d, step=j - 1)), j
    assert got[1:].any() and not got[1:].all()
    with pytest.raises(ValueError, match="t2d covers 50"):
        all_loss_positions(loss_mask, argmax + 50, t2d, 7)


def test_loss_positions_reject_ids_outside_t2d():
    with pytest.raises(ValueError, match="t2d covers 4"):
        loss_positions(torch.ones(1, 3), torch.tensor([[0, 9, 1]]), torch.ones(4, dtype=torch.bool))


def test_shift_left():
    x = torch.arange(10).view(2, 5)
    assert shift_left(x, 2, -1).tolist() == [[2, 3, 4, -1, -1], [7, 8, 9, -1, -1]]
    assert shift_left(x, 7, -1).tolist() == [[-1] * 5] * 2
    assert shift_left(x, 0) is x


def test_step_weights():
    w = step_weights(7)
    assert w.dtype == torch.float32 and w.shape == (7,)
    torch.testing.assert_close(w, torch.tensor([0.8 ** k for k in range(7)]))
    assert step_weights(3, decay=0.5).tolist() == [1.0, 0.5, 0.25]


def test_draft_accuracy_maps_draft_ids_through_d2t():
    d2t = torch.tensor([1, 2, 2, 5])                          # draft -> target ids 1, 3, 4, 8
    logits = torch.tensor([[[0., 5, 0, 0], [0, 0, 0, 9], [7, 0, 0, 0], [0, 0, 3, 0]]])  # argmax 1,3,0,2
    target = torch.tensor([[3, 8, 0, 4]])                      # right, right, wrong (1 != 0), right
    mask = torch.tensor([[True, True, True, False]])
    correct, count = draft_accuracy(logits, d2t, target, mask)
    assert (correct.item(), count.item()) == (2.0, 3.0)


def test_teacher_positions_are_step_masks_shifted():
    g = torch.Generator().manual_seed(2)
    lm = torch.rand(3, 10, generator=g) > 0.3
    am = torch.randint(0, 6, (3, 10), generator=g)
    t2d = torch.tensor([True, False, True, True, False, True])
    base = loss_positions(lm, am, t2d, step=-1)
    # by hand at one position: s=4 of row 0
    assert bool(base[0, 4]) == (bool(lm[0, 5]) and bool(t2d[am[0, 4]]))
    for k in range(5):
        assert torch.equal(loss_positions(lm, am, t2d, step=k), shift_left(base, k + 1, False))
    with pytest.raises(ValueError, match="step=-2"):
        loss_positions(lm, am, t2d, step=-2)
