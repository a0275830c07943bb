"""The TTT unroll (eagle3/ttt/unroll.py) against a naive step-by-step reference written here: every
step recomputed from scratch over the concatenation of all earlier steps' inputs with an explicit
full attention mask (no TTT cache), teacher from the *full* target head, masks and weights from
docs/design.md "TTT": the formula evaluated position by position."""
import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3.drafter.attention import ttt_position_ids
from eagle3.ttt.unroll import TTTObjective, step_position_counts, ttt_unroll
from eagle3.drafter.vocab_map import ids_from_d2t
from tests.fixtures.unroll_batch import DV, H, V, tiny_batch, tiny_drafter


class ExplicitMaskCache:
    """Keeps every step's keys; step k's queries attend over [step 0 | step 1 | ... | step k] keys
    with a mask built entry by entry from the rule: step-0 key s visible iff s <= t; a step-j key
    (j >= 1) visible iff it is at the query's own position."""

    def __init__(self):
        self.ks, self.vs = [], []

    def attend(self, q, k, v):
        B, h, T, d = q.shape
        self.ks.append(k)
        self.vs.append(v)
        step = len(self.ks) - 1
        keys = torch.cat(self.ks, dim=2).repeat_interleave(h // k.shape[1], dim=1)  # [B,h,T*(step+1),d]
        vals = torch.cat(self.vs, dim=2).repeat_interleave(h // k.shape[1], dim=1)
        mask = torch.zeros(T, T * (step + 1), dtype=torch.bool)
        for t in range(T):
            for j in range(step + 1):
                for s in range(T):
                    mask[t, j * T + s] = (s <= t) if j == 0 else (s == t)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(d)
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vals


def naive_objective(model, batch, full_head, K, decay=0.8):
    """Weighted sum over steps of the per-step mean soft CE, and per-step (correct, count)."""
    ids, aux, last = batch["input_ids"], batch["aux"], batch["last"]
    lm, am = batch["loss_mask"], batch["target_argmax"]
    B, T = ids.shape
    draft_ids = ids_from_d2t(model.d2t)
    cache = ExplicitMaskCache()
    hidden = model.fc(aux)
    pos = torch.arange(T).expand(B, T)
    total = 0.0
    stats = []
    for k in range(K):
        step_ids = torch.zeros_like(ids)
        for t in range(T):
            if t + k + 1 < T:
                step_ids[:, t] = ids[:, t + k + 1]        # token x_{t+k+1}
        prenorm = model.step(step_ids, hidden, pos + k, cache)
        logits = model.logits(prenorm)
        ce_sum, n, correct = 0.0, 0, 0
        for b in range(B):
            for t in range(T):
                if t + k + 2 >= T:
                    continue
                if not (lm[b, t + k + 2] and model.t2d[am[b, t + k + 1]]):
                    continue
                p = torch.softmax((last[b, t + k + 1] @ full_head.t())[draft_ids], -1)
                ce_sum = ce_sum - (p * torch.log_softmax(logits[b, t], -1)).sum()
                n += 1
                top = int(logits[b, t].argmax())
                correct += int(top + int(model.d2t[top]) == int(am[b, t + k + 1]))
        if n:
            total = total + decay ** k * ce_sum / n
        stats.append((correct, n))
        hidden = prenorm
    return total, stats


@pytest.mark.parametrize("K", [1, 4])
def test_unroll_matches_naive_reference_loss_and_grads(K):
    model = tiny_drafter()
    batch, _ = tiny_batch(in_vocab=ids_from_d2t(model.d2t))
    full_head = torch.randn(V, H, generator=torch.Generator().manual_seed(3))
    ref_loss, ref_stats = naive_objective(model, batch, full_head, K)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    rows = full_head[ids_from_d2t(model.d2t)]
    out = ttt_unroll(model, batch["aux"], batch["input_ids"], batch["last"], batch["target_argmax"],
                     batch["loss_mask"], rows, K)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert out.correct.tolist() == [float(c) for c, _ in ref_stats]
    assert out.count.tolist() == [float(n) for _, n in ref_stats]
    assert all(n > 0 for _, n in ref_stats)  # the case exercises every step
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert model.embed_tokens.weight.grad is None  # frozen target embeddings
    # the cheap counter used for whole-optimizer-step normalisation agrees
    counts = step_position_counts(batch["loss_mask"], batch["target_argmax"], model.t2d, K)
    assert counts.tolist() == out.count.tolist()


def test_padding_does_not_change_a_sequence_loss():
    """A right-padded row gives the same per-step sums as the same sequence alone, unpadded."""
    model = tiny_drafter()
    batch, lengths = tiny_batch(in_vocab=ids_from_d2t(model.d2t))
    rows = torch.randn(DV, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        both = ttt_unroll(model, batch["aux"], batch["input_ids"], batch["last"], batch["target_argmax"],
                          batch["loss_mask"], rows, 3)
        n = lengths[1]
        one = {k: v[1:2, :n] for k, v in batch.items()}
        alone = ttt_unroll(model, one["aux"], one["input_ids"], one["last"], one["target_argmax"],
                           one["loss_mask"], rows, 3)
        first = {k: v[0:1] for k, v in batch.items()}
        row0 = ttt_unroll(model, first["aux"], first["input_ids"], first["last"], first["target_argmax"],
                          first["loss_mask"], rows, 3)
    torch.testing.assert_close(both.loss_sum, alone.loss_sum + row0.loss_sum, rtol=1e-5, atol=1e-5)
    assert both.count.tolist() == (alone.count + row0.count).tolist()


def test_step_denominators_normalise_over_the_optimizer_step():
    """Splitting a batch into two micro-batches with the global counts as denominators gives the
    same loss (and so the same gradient) as the whole batch at once."""
    model = tiny_drafter()
    batch, _ = tiny_batch(in_vocab=ids_from_d2t(model.d2t))
    rows = torch.randn(DV, H, generator=torch.Generator().manual_seed(5))
    K = 3
    obj = TTTObjective(model, ttt_length=K)
    whole = obj(batch, rows)
    denom = step_position_counts(batch["loss_mask"], batch["target_argmax"], model.t2d, K)
    parts = [obj({k: v[i:i + 1] for k, v in batch.items()}, rows, step_denominators=denom) for i in range(2)]
    torch.testing.assert_close(parts[0].loss + parts[1].loss, whole.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole.step_acc, whole.correct / whole.count)


def test_unroll_on_a_sequence_shorter_than_the_steps_is_finite():
    batch, _ = tiny_batch(T=3)
    rows = torch.randn(DV, H)
    model = tiny_drafter()
    out = ttt_unroll(model, batch["aux"], batch["input_ids"], batch["last"], batch["target_argmax"],
                     batch["loss_mask"], rows, 5)
    assert torch.isfinite(out.loss)
    assert out.count[1:].tolist() == [0.0] * 4  # t + k + 2 < 3 only for k = 0 at t = 0
    out.loss.backward()


def test_unroll_rejects_mismatched_shapes():
    batch, _ = tiny_batch()
    model = tiny_drafter()
    with pytest.raises(ValueError, match="shapes disagree"):
        ttt_unroll(model, batch["aux"][:, :5], batch["input_ids"], batch["last"], batch["target_argmax"],
                   batch["loss_mask"], torch.randn(DV, H), 2)


def test_the_two_unrolls_do_not_import_each_other():
    """unroll.py (reference + the TTTObjective dispatcher) imports fast_unroll.py; both share unroll_common.py,
    which imports neither, and fast_unroll imports nothing of unroll.py (at module or function level)."""
    def eagle3_imports(name):
        tree = ast.parse((Path(__file__).parents[1] / "eagle3" / "ttt" / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("eagle3")}
    assert "eagle3.ttt.unroll" not in eagle3_imports("fast_unroll") and "eagle3.ttt.unroll_common" in eagle3_imports("fast_unroll")
    assert not {"eagle3.ttt.unroll", "eagle3.ttt.fast_unroll"} & eagle3_imports("unroll_common")
