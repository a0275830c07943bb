"""The replay feeds the drafter the image_embeddings convention's inputs at image rows (eagle3/drafter/image_embeddings.py):
under `fused` the store's fused rows (the projector output), under `placeholder` embed(placeholder id); text rows
are embed(id) under both. Checked on what the drafter's layer actually receives, in every replay path."""
import json

import pytest
import torch

from eagle3.drafter import image_embeddings
from eagle3.engines.serve_launch import default_for_engine
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.replay.evaluate import evaluate_drafter, simulate_accept_length
from eagle3.formats.store import HiddenStateStore, HiddenStateWriter
from tests.fixtures.unroll_batch import HT, H, V
from tests.fixtures.unroll_batch import tiny_drafter

PAD = 7  # the image row id of this tiny world (K2.5's is 163605)


@pytest.fixture(scope="module")
def image_store(tmp_path_factory):
    """Two sequences: one with an image of 4 rows at positions 3..6 of its prompt, one text-only."""
    g = torch.Generator().manual_seed(0)
    w = HiddenStateWriter(tmp_path_factory.mktemp("img_store") / "s", hidden_size=H, target_hidden_size=HT,
                          hf_indices=[2, 3, 4], dtype="float32", image_token_id=PAD)
    ids = torch.randint(8, V, (20,), generator=g)
    ids[3:7] = PAD
    fused = torch.randn(4, H, generator=g) * 3
    for sid, x, rows in (("img", ids, fused), ("text", torch.randint(8, V, (16,), generator=g), None)):
        T = x.numel()
        mask = torch.zeros(T, dtype=torch.bool)
        mask[9:] = True
        argmax = torch.cat([x[1:], x[:1]])  # greedy-consistent: the replay has cycles to run
        w.add(sid, x, mask, torch.randn(T, 3 * HT, generator=g), torch.zeros(T, H), argmax, image_embeds=rows)
    w.finish()
    return HiddenStateStore(w.dir), fused


def layer_inputs(model):
    """The `embeds` argument of every call of the drafter's layer."""
    seen = []
    handle = model.midlayer.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    return seen, handle


@pytest.mark.parametrize("knobs,method", [(SpecKnobs(3, 1, 4), "auto"),        # chain: the TTT unroll
                                          (SpecKnobs(2, 2, 4), "auto"),        # trees: all_cycle_trees
                                          (SpecKnobs(2, 2, 4), "sequential")])  # SequenceDrafter
def test_replay_feeds_fused_rows_or_the_placeholder_embedding(image_store, knobs, method):
    store, fused = image_store
    model = tiny_drafter(draft_vocab=24, initializer_range=0.3).eval()
    ids = store[0]["input_ids"]
    image_rows = (ids[1:] == PAD).nonzero().squeeze(1)  # prefix step: row t embeds token t+1 (shift by one)
    text_rows = (ids[1:] != PAD).nonzero().squeeze(1)
    table = model.embed_tokens.weight
    got = {}
    for conv in ("fused", "placeholder"):
        seen, handle = layer_inputs(model)
        try:
            simulate_accept_length(model, store, [knobs], ngram=None, progress=False, method=method,
                                   image_embeddings=conv, max_sequences=1)
        finally:
            handle.remove()
        prefix = seen[0][0]  # the first call: the whole prefix, [T-1, H] (the TTT unroll's step 0: [T, H])
        assert prefix.shape[0] in (ids.numel() - 1, ids.numel())
        prefix = prefix[: ids.numel() - 1]
        torch.testing.assert_close(prefix[text_rows], table[ids[1:][text_rows]])
        got[conv] = prefix[image_rows]
    torch.testing.assert_close(got["fused"], fused)
    torch.testing.assert_close(got["placeholder"], table[PAD].expand(len(image_rows), -1))


def test_text_sequences_replay_the_same_under_both_conventions(image_store):
    store, _ = image_store
    model = tiny_drafter(draft_vocab=24, initializer_range=0.3).eval()
    reports = {c: evaluate_drafter(model, store, knobs=[SpecKnobs(3, 1, 4)], ttt_length=3, ngram=None,
                                   progress=False, image_embeddings=c) for c in ("fused", "placeholder")}
    assert reports["fused"]["image_embeddings"] == "fused"
    with torch.no_grad():  # the text sequence alone: identical under both
        text = [simulate_accept_length(model, _Only(store, 1), [SpecKnobs(3, 1, 4)], ngram=None, progress=False,
                                       image_embeddings=c)["3/1/4"]["drafter"].to_dict()
                for c in ("fused", "placeholder")]
    assert json.dumps(text[0]) == json.dumps(text[1])  # (NaN-safe)


class _Only:
    """One sequence of a store, as a store."""

    def __init__(self, store, i):
        self.store, self.i, self.image_token_id = store, i, store.image_token_id

    def __len__(self):
        return 1

    def __getitem__(self, j):
        return self.store[self.i]


def test_engine_defaults_and_bad_inputs():
    assert default_for_engine("sglang") == "fused"
    assert default_for_engine("vllm") == "placeholder"
    with pytest.raises(ValueError, match="expected one of"):
        image_embeddings.check_convention("clamped")
    emb = torch.nn.Embedding(10, 4)
    ids = torch.tensor([1, 7, 7, 2])
    assert image_embeddings.token_embeddings(emb, ids, "placeholder", 7, None) is None
    with pytest.raises(ValueError, match="2 image rows need 2 fused embeddings, got None"):
        image_embeddings.token_embeddings(emb, ids, "fused", 7, None)
    out = image_embeddings.token_embeddings(emb, ids, "fused", 7, torch.ones(2, 4))
    assert torch.equal(out[1:3], torch.ones(2, 4)) and torch.equal(out[0], emb.weight[1])
