"""The real drafter inside the replay (eagle3/replay/drafter_session.py) and the evaluation function
(eagle3/replay/evaluate.py), on a tiny random drafter and hand-built stores."""
import pytest
import torch

from eagle3.replay.accept_sim import build_sglang_tree
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.drafter.model import Eagle3Drafter
from eagle3.replay.drafter_session import SequenceDrafter
from eagle3.replay.evaluate import EvalInputError, evaluate_drafter, simulate_accept_length, teacher_forced_correct
from eagle3.formats.store import HiddenStateStore, HiddenStateWriter
from eagle3.drafter.attention import KVCache
from eagle3.ttt.unroll import ttt_unroll
from tests.fixtures.unroll_batch import HT, H, V
from tests.fixtures.unroll_batch import tiny_drafter as unroll_drafter

DV = 24  # a larger draft vocab than the unroll tests' (V, H, HT are theirs)


def tiny_drafter(seed=0, hf_indices=(2, 3, 4)) -> Eagle3Drafter:
    return unroll_drafter(seed, draft_vocab=DV, hf_indices=hf_indices, initializer_range=0.3).eval()


@torch.no_grad()
def naive_draft(model, aux, ids, q, path):
    """Reference: fresh KV cache, extend over pairs 0..q-1, then one step per token of `path`;
    returns the draft distribution (probs over the draft vocab) after the path."""
    cache = KVCache()
    out = model.step(ids[None, 1:q + 1], model.project_aux(aux[None, :q]), torch.arange(q)[None], cache)
    h = out[:, -1:]
    for j, tok in enumerate(path):
        h = model.step(torch.tensor([[tok]]), h, torch.tensor([[q + j]]), cache)
    return torch.softmax(model.logits(h)[0, -1].float(), -1)


class NaiveStepDrafter:
    """StepDrafter recomputing every row from scratch (no shared caches)."""

    def __init__(self, model, aux, ids, q, topk):
        self.args, self.topk, self.paths = (model, aux, ids, q), topk, None

    def __call__(self, src, tokens):
        self.paths = [()] if src is None else [self.paths[s] + (int(t),) for s, t in zip(src.tolist(), tokens.tolist())]
        model = self.args[0]
        probs = torch.stack([naive_draft(*self.args, p) for p in self.paths])
        p, i = probs.topk(self.topk, -1)
        return p, model.draft_ids_to_target(i)


def random_seq(T=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 3 * HT, generator=g), torch.randint(0, V, (T,), generator=g)


@pytest.mark.parametrize("knobs", [SpecKnobs(3, 1, 4), SpecKnobs(3, 2, 6), SpecKnobs(2, 3, 7)])
def test_session_tree_equals_naive_recompute(knobs):
    model = tiny_drafter()
    aux, ids = random_seq()
    seq = SequenceDrafter(model, aux, ids, knobs.topk)
    for q in (1, 7, 22):
        fast = build_sglang_tree(seq.at(q), knobs)
        ref = build_sglang_tree(NaiveStepDrafter(model, aux, ids, q, knobs.topk), knobs)
        assert fast.tokens.tolist() == ref.tokens.tolist() and fast.parents.tolist() == ref.parents.tolist()
        assert fast.tokens.numel() == knobs.num_draft_tokens - 1


def test_teacher_forced_accuracy_matches_training_unroll():
    model = tiny_drafter()
    aux, ids = random_seq(T=20)
    g = torch.Generator().manual_seed(5)
    in_vocab = (model.d2t + torch.arange(DV))
    argmax = in_vocab[torch.randint(0, DV, (20,), generator=g)]
    mask = torch.rand(20, generator=g) > 0.2
    correct, valid = teacher_forced_correct(model, aux, ids, argmax, mask, 4)
    out = ttt_unroll(model, aux[None], ids[None], torch.randn(1, 20, H), argmax[None], mask[None],
                     torch.randn(DV, H), 4)
    assert correct.sum(1).float().tolist() == out.correct.tolist()
    assert valid.sum(1).float().tolist() == out.count.tolist()


@torch.no_grad()
def self_consistent_sequence(model, T=40, seed=0):
    """A sequence the drafter's first draft always gets right: x_{t+2} = its prediction at t."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(T, 3 * HT, generator=g)
    ids = torch.zeros(T, dtype=torch.long)
    ids[:2] = torch.randint(0, V, (2,), generator=g)
    for t in range(T - 2):
        out = model.step(ids[None, 1:t + 2], model.project_aux(aux[None, :t + 1]), torch.arange(t + 1)[None])
        ids[t + 2] = model.draft_ids_to_target(model.logits(out)[0, -1].argmax())
    argmax = torch.cat([ids[1:], ids[:1]])
    return aux, ids, argmax


def write_store(path, seqs, hf_indices=(2, 3, 4), prompt=3):
    w = HiddenStateWriter(path, hidden_size=H, target_hidden_size=HT, hf_indices=list(hf_indices), dtype="float32",
                          shard_tokens=64)
    for n, (aux, ids, argmax) in enumerate(seqs):
        mask = torch.ones(ids.numel(), dtype=torch.bool)
        mask[:prompt] = False
        w.add(f"s{n}", ids, mask, aux, torch.zeros(ids.numel(), H), argmax)
    w.finish()
    return HiddenStateStore(path)


def test_evaluate_drafter_on_a_self_consistent_store(tmp_path):
    model = tiny_drafter()
    store = write_store(tmp_path / "val", [self_consistent_sequence(model, seed=s) for s in range(2)])
    rep = evaluate_drafter(model, store, knobs=[SpecKnobs(2, 1, 3), SpecKnobs(3, 2, 6)], ttt_length=3, progress=False)
    chain = rep["accept"]["2/1/3"]["drafter"]
    assert chain["acceptance_by_position"][0] == 1.0 and chain["accept_length"] >= 2.0 - 1e-9
    assert rep["accept"]["3/2/6"]["drafter"]["accept_length"] >= chain["accept_length"] - 0.35
    assert rep["mismatch_rate"] == 0.0 and rep["warnings"] == []
    assert rep["accept"]["2/1/3"]["ngram"]["accept_length"] >= 1.0
    # step-0 teacher-forced accuracy: the store is built from the drafter's own step-0 choices
    in_vocab_steps = rep["accuracy"]["step_accuracy"]
    assert in_vocab_steps[0] == 1.0 and rep["accuracy"]["conditional_accuracy"][0] == 1.0
    cond = rep["accuracy"]["conditional_accuracy"]
    assert rep["accuracy"]["chain_estimate"] == {"2/1/3": pytest.approx(1 + cond[0] + cond[0] * cond[1])}


def test_mismatching_store_warns_and_bad_pairs_fail(tmp_path):
    model = tiny_drafter()
    aux, ids = random_seq(T=30)
    argmax = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(9))
    argmax[10:16] = ids[11:17]  # one greedy stretch among the mismatches
    store = write_store(tmp_path / "val", [(aux, ids, argmax)])
    rep = evaluate_drafter(model, store, knobs=[SpecKnobs()], ttt_length=2, progress=False)
    assert rep["mismatch_rate"] > 0.5 and any("not the target's greedy choice" in w for w in rep["warnings"])
    ceiling = rep["accept"]["2/1/3"]["ceiling"]  # the warning says how low the store caps any drafter
    assert ceiling["cycles"] > 0 and any(f"no drafter could score above {ceiling['accept_length']:.2f} at 2/1/3" in w
                                         for w in rep["warnings"])
    with pytest.raises(EvalInputError, match=r"drafter reads hidden states h = \[3, 4, 5\], the store holds"):
        evaluate_drafter(tiny_drafter(hf_indices=(3, 4, 5)), store, knobs=[SpecKnobs()], progress=False)
    empty = HiddenStateWriter(tmp_path / "empty", hidden_size=H, target_hidden_size=HT, hf_indices=[2, 3, 4],
                              dtype="float32")
    empty.finish()
    with pytest.raises(EvalInputError, match="no sequences"):
        evaluate_drafter(model, HiddenStateStore(tmp_path / "empty"), progress=False)


@pytest.mark.parametrize("knobs", [SpecKnobs(2, 1, 3), SpecKnobs(3, 1, 4), SpecKnobs(3, 1, 3)])
def test_chain_from_teacher_forced_unroll_equals_step_by_step_drafting(tmp_path, knobs):
    """The fast chain replay (read off one TTT unroll) against drafting every cycle step by step."""
    model = tiny_drafter()
    # a store where the drafter is right often at depth 1 and sometimes deeper, plus a random one
    seqs = [self_consistent_sequence(model, T=48, seed=s) for s in range(2)]
    aux, ids = random_seq(T=30)
    seqs.append((aux, ids, torch.cat([ids[1:], ids[:1]])))
    store = write_store(tmp_path / "val", seqs)
    fast = simulate_accept_length(model, store, [knobs], progress=False)[knobs.label]["drafter"]
    slow = simulate_accept_length(model, store, [knobs], progress=False, method="sequential")[knobs.label]["drafter"]
    assert fast.to_dict() == slow.to_dict()
    assert fast.accepted[0] > 0 and fast.cycles > 20


@pytest.mark.parametrize("knobs", [SpecKnobs(3, 2, 6), SpecKnobs(2, 3, 7), SpecKnobs(4, 2, 5)])
def test_batched_trees_equal_cycle_by_cycle_trees(knobs):
    from eagle3.replay.tree_batch import all_cycle_trees

    model = tiny_drafter()
    aux, ids = random_seq(T=20)
    seq = SequenceDrafter(model, aux, ids, knobs.topk)
    trees = all_cycle_trees(model, aux, ids, knobs, chunk_rows=16)  # several chunks
    assert len(trees) == 20
    for q in range(1, 20):
        ref = build_sglang_tree(seq.at(q), knobs)
        assert trees[q].tokens.tolist() == ref.tokens.tolist(), q
        assert trees[q].parents.tolist() == ref.parents.tolist(), q


def test_tree_replay_batched_equals_sequential(tmp_path):
    model = tiny_drafter()
    seqs = [self_consistent_sequence(model, T=40, seed=s) for s in range(2)]
    store = write_store(tmp_path / "val", seqs)
    knobs = [SpecKnobs(3, 2, 6), SpecKnobs(2, 3, 5)]
    fast = simulate_accept_length(model, store, knobs, progress=False)
    slow = simulate_accept_length(model, store, knobs, progress=False, method="sequential")
    for k in knobs:
        assert fast[k.label]["drafter"].to_dict() == slow[k.label]["drafter"].to_dict()
        assert fast[k.label]["drafter"].accept_length > 1.5


def test_foreign_vocab_mapping_and_token_range_are_reported(tmp_path):
    model = tiny_drafter()
    store = write_store(tmp_path / "val", [self_consistent_sequence(model, seed=0)])
    ok = evaluate_drafter(model, store, knobs=[SpecKnobs()], ttt_length=1, progress=False)
    assert ok["vocab_coverage"] == 1.0
    other = tiny_drafter(seed=7)  # another random draft vocab: covers ~DV/V of the target's tokens
    rep = evaluate_drafter(other, store, knobs=[SpecKnobs()], ttt_length=1, progress=False)
    assert rep["vocab_coverage"] < 0.9 and any("vocab mapping" in w for w in rep["warnings"])
    aux, ids = random_seq(T=10)
    ids[3] = V + 5
    bad = write_store(tmp_path / "bad", [(aux, ids, torch.cat([ids[1:], ids[:1]]))])
    with pytest.raises(EvalInputError, match="vocab_size"):
        evaluate_drafter(model, bad, knobs=[SpecKnobs()], progress=False)
