"""The real speculative-decoding loop (eagle3/real_loop/chain.py) on the tiny Kimi-K2.5-layout target:
lossless against the target's own greedy decode, and its accept length equal to the replay's
(eagle3/real_loop/check.py) for a drafter fitted in a few steps to the target's greedy outputs."""
import pytest
import torch

from eagle3.engines.serve_launch import SpecKnobs
from eagle3.real_loop.chain import eos_ids, greedy_decode, speculative_decode
from eagle3.real_loop.check import real_vs_simulated
from eagle3.target_model.target_io import load_target
from tests.fixtures.real_loop import fitted_drafter, new_drafter, prompts


@pytest.fixture(scope="module")
def target(tiny_k25_target):
    model, _ = load_target(tiny_k25_target, "kimi_k25", dtype="float32")
    return model


@pytest.mark.parametrize("steps,draft_tokens", [(2, 3), (3, 4), (3, 3)])
def test_speculative_decode_is_lossless_with_a_random_drafter(target, tiny_k25_target, steps, draft_tokens):
    d = new_drafter(tiny_k25_target).eval()
    p = prompts(1)[0]
    base = greedy_decode(target, p, 16)
    spec = speculative_decode(target, d, p, 16, steps, draft_tokens)
    assert spec.tokens == base.tokens and len(spec.tokens) == 16
    assert sum(spec.emitted) == 15 and len(spec.verify_ms) == len(spec.emitted)


@pytest.mark.parametrize("knobs,fit", [(SpecKnobs(3, 2, 6), True), (SpecKnobs(2, 3, 5), False)])
def test_tree_speculative_decode_is_lossless(target, tiny_k25_target, fitted, knobs, fit):
    from eagle3.real_loop.tree import tree_speculative_decode

    ps, fitted_drafter_ = fitted
    d = fitted_drafter_ if fit else new_drafter(tiny_k25_target).eval()
    base = greedy_decode(target, ps[1], 16)
    spec = tree_speculative_decode(target, d, ps[1], 16, knobs)
    assert spec.tokens == base.tokens and sum(spec.emitted) == 15
    if fit:  # the fitted drafter's tree paths get accepted: the cache surgery is exercised
        assert max(spec.accepted) >= 2


def test_speculative_decode_stops_at_eos_like_greedy(target, tiny_k25_target, fitted):
    ps, d = fitted
    base = greedy_decode(target, ps[0], 24)
    eos = base.tokens[5]  # pretend a token the target emits early is the EOS
    base_eos = greedy_decode(target, ps[0], 24, eos_token_id=[eos])
    spec = speculative_decode(target, d, ps[0], 24, 3, 4, eos_token_id=eos)
    assert spec.tokens == base_eos.tokens and spec.tokens[-1] == eos and len(spec.tokens) <= 6


@pytest.fixture(scope="module")
def fitted(target, tiny_k25_target):
    ps = prompts(2)
    seqs = [(torch.cat([p, torch.tensor(greedy_decode(target, p, 24).tokens)]), p.numel()) for p in ps]
    return ps, fitted_drafter(tiny_k25_target, target, seqs, steps=40)


def test_fitted_drafter_is_lossless_and_real_equals_simulated(target, fitted):
    ps, d = fitted
    rep = real_vs_simulated(target, d, ps, [SpecKnobs(2, 1, 3), SpecKnobs(3, 1, 4), SpecKnobs(3, 2, 6)], 24)
    assert rep["skipped_knobs"] == []
    for label in ("2/1/3", "3/1/4", "3/2/6"):
        r = rep["knobs"][label]
        assert r["lossless"]
        assert r["real_accept_length"] > 1.5  # the check is not vacuous: drafts do get accepted
        assert abs(r["real_accept_length"] - r["sim_accept_length"]) <= 0.05
        assert r["cycles"] == r["sim_cycles"]
        assert r["verify_ms"] > 0 and r["prediction_from_measured"]["spec_tok_s"] > 0


def test_eos_ids_reads_every_form_hf_allows():
    assert eos_ids(None) == set() and eos_ids(7) == {7} and eos_ids([7, 9]) == {7, 9}
