"""Training feeds the drafter what the serving engine feeds (issue 34): under image_embeddings=fused the store's
fused rows replace the token embedding at image positions, shifted by one like the ids (the replay's rule,
eagle3/drafter/image_embeddings.token_embeddings), in the reference and the fast unroll; under placeholder
embed(<|media_pad|>). A text-only store trains exactly as before under both. Checked on what the drafter's
layer receives (a forward pre-hook), in the objective and in a real train-stage step."""
import json

import pytest
import torch

from eagle3.config.conf import compose, to_schema
from eagle3.drafter.image_embeddings import CONFIG_KEY
from eagle3.drafter.model import DrafterLayer
from eagle3.config.schema.train import TrainConfig
from eagle3.formats.store import HiddenStateStore
from eagle3.ttt.unroll import TTTObjective, ttt_unroll
from tests.fixtures.train_world import IMAGE_AT, overrides, write_image_world, write_world
from train.batches import StoreSequences, collate
from train.stage import run_train
from train.model_setup import init_drafter

@pytest.fixture(scope="module")
def image_world(tmp_path_factory, tiny_k25_target):
    """The train toy world rewritten as an image capture (tests/fixtures/train_world.write_image_world)."""
    return write_image_world(tmp_path_factory.mktemp("train_images"), tiny_k25_target)


def config(world, out, **extra):
    return to_schema(compose("train", overrides(world, out, "scratch", **extra)), TrainConfig)


def batch_of(store, idx, max_length=40):
    seqs = StoreSequences(store, max_length)
    return collate([seqs[i] for i in idx])


def test_collate_keeps_the_image_rows_in_row_major_order_and_cuts_them_with_the_sequence(image_world):
    store = HiddenStateStore(image_world["capture"] / "train")
    b = batch_of(store, [0, 1])
    torch.testing.assert_close(b["image_embeds"], torch.cat([store[0]["image_embeds"], store[1]["image_embeds"]]))
    assert int((b["input_ids"] == image_world["pad"]).sum()) == b["image_embeds"].shape[0] == 6
    cut = batch_of(store, [0], max_length=6)  # the cut keeps 2 of the image's 3 positions: 2 rows
    torch.testing.assert_close(cut["image_embeds"], store[0]["image_embeds"][:2])


def layer_inputs(objective, batch, rows):
    """The `embeds` the drafter's layer receives at each TTT step (reference unroll), and the loss."""
    seen = []
    h = objective.drafter.midlayer.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    try:
        out = objective(batch, rows)
    finally:
        h.remove()
    return seen, out


@pytest.fixture(scope="module")
def drafter_and_rows(image_world, tmp_path_factory):
    cfg = config(image_world, tmp_path_factory.mktemp("d") / "run")
    from train.inputs import open_inputs
    from train.setup import stream_conf
    from train.model_setup import build_drafter

    drafter, report = build_drafter(cfg, open_inputs(cfg, stream_conf(cfg)))
    return drafter.float(), report["lm_head_rows"].float()


def test_the_objective_feeds_fused_rows_or_the_placeholder_at_image_rows_only(image_world, drafter_and_rows):
    drafter, rows = drafter_and_rows
    store = HiddenStateStore(image_world["capture"] / "train")
    batch = batch_of(store, [0, 1, 2])
    pad, K = image_world["pad"], 3
    table = drafter.embed_tokens.weight
    seen, losses = {}, {}
    for conv in ("fused", "placeholder"):
        obj = TTTObjective(drafter, K, impl="reference", image_embeddings=conv, image_token_id=pad)
        seen[conv], out = layer_inputs(obj, batch, rows)
        losses[conv] = out.loss.detach()
        assert len(seen[conv]) == K
    ids = batch["input_ids"]
    fused_rows = iter(batch["image_embeds"])
    want_fused = torch.stack([torch.stack([next(fused_rows) if t == pad else table[t] for t in row]) for row in ids])
    for k in range(K):
        nxt = torch.cat([ids[:, k + 1:], ids.new_zeros(ids.shape[0], k + 1)], 1)  # x_{t+k+1} at t
        img = nxt == pad
        assert img.any() and (~img).any()
        # text rows: embed(id) under both; image rows: the fused rows (shifted by k+1) vs embed(pad)
        torch.testing.assert_close(seen["fused"][k][~img], seen["placeholder"][k][~img])
        torch.testing.assert_close(seen["placeholder"][k][~img], table[nxt[~img]])
        torch.testing.assert_close(seen["placeholder"][k][img], table[pad].expand(int(img.sum()), -1))
        shifted = torch.cat([want_fused[:, k + 1:], want_fused[:, :0].new_zeros(ids.shape[0], k + 1, table.shape[1])], 1)
        torch.testing.assert_close(seen["fused"][k][img], shifted[img])
        assert not torch.allclose(seen["fused"][k][img], seen["placeholder"][k][img])
    assert not torch.equal(losses["fused"], losses["placeholder"])


@pytest.mark.parametrize("conv", ["fused", "placeholder"])
def test_the_fast_unroll_computes_the_same_loss_and_gradients(image_world, drafter_and_rows, conv):
    drafter, rows = drafter_and_rows
    batch = batch_of(HiddenStateStore(image_world["capture"] / "train"), [3, 4])
    batch = {**batch, "aux": batch["aux"].float(), "last": batch["last"].float()}
    out = {}
    for impl in ("reference", "fast"):
        drafter.zero_grad()
        res = TTTObjective(drafter, 3, impl=impl, image_embeddings=conv, image_token_id=image_world["pad"])(batch, rows)
        res.loss.backward()
        out[impl] = (res.loss.detach(), drafter.midlayer.self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(out["fast"][0], out["reference"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["fast"][1], out["reference"][1], rtol=1e-3, atol=1e-5)


def test_a_text_store_trains_exactly_as_before(tiny_k25_target, tmp_path):
    world = write_world(tmp_path / "text", tiny_k25_target, n_train=4, n_val=2)
    cfg = config(world, tmp_path / "run")
    drafter = init_drafter(cfg).float()
    from train.inputs import open_inputs
    from train.setup import stream_conf
    from train.model_setup import build_drafter

    _, report = build_drafter(cfg, open_inputs(cfg, stream_conf(cfg)))
    rows = report["lm_head_rows"].float()
    store = HiddenStateStore(world["capture"] / "train")
    assert store.image_token_id is None
    batch = batch_of(store, [0, 1])
    batch = {**batch, "aux": batch["aux"].float(), "last": batch["last"].float()}
    results = []
    for conv in ("fused", "placeholder", None):
        drafter.zero_grad()
        if conv is None:  # the unroll as called before the convention existed
            res = ttt_unroll(drafter, batch["aux"], batch["input_ids"], batch["last"], batch["target_argmax"],
                             batch["loss_mask"], rows, 3)
        else:
            res = TTTObjective(drafter, 3, impl="reference", image_embeddings=conv, image_token_id=None)(batch, rows)
        res.loss.backward()
        results.append((res.loss.detach(), drafter.fc.weight.grad.clone()))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])


def test_a_train_stage_step_feeds_the_convention_and_records_it(image_world, tmp_path):
    pad = image_world["pad"]
    seen: dict = {}
    for conv in ("fused", "placeholder"):
        calls = seen[conv] = []
        hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: calls.append(a[0].detach().float().clone()) if isinstance(m, DrafterLayer) else None)
        try:
            out = run_train(config(image_world, tmp_path / conv, image_embeddings=conv, max_steps=1,
                                   val_every=0, **{"data.max_tokens_per_batch": 40}))
        finally:
            hook.remove()
        assert json.loads((out / "final" / "config.json").read_text())[CONFIG_KEY] == conv
        assert json.loads((out / "manifest.json").read_text())["config"]["image_embeddings"] == conv
    table = init_drafter(config(image_world, tmp_path / "x")).embed_tokens.weight.float()
    assert len(seen["fused"]) == len(seen["placeholder"]) > 0
    differs = 0
    for a, b in zip(seen["fused"], seen["placeholder"]):
        rows = (a - b).abs().amax(-1) > 0                   # where the two runs fed the layer differently
        differs += int(rows.sum())
        # only at image rows: there the placeholder run fed embed(pad)
        torch.testing.assert_close(b[rows], table[pad].expand(int(rows.sum()), -1))
    assert differs > 0
