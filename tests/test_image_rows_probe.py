"""benchmarks/image_rows_probe.py through its real path on the toy image world (tests/fixtures/train_world.py): a
finished training run's manifest is the recipe, both conventions are trained again and every drafter is replayed
over the image sequences with fused, placeholder and another picture's fused rows; the other-image view really
swaps the rows (same count, another sequence's), and a second call reuses the finished runs."""
import json

import pytest
import torch

from eagle3.formats.store import HiddenStateStore
from tests.fixtures.benchmarks import load_benchmark
from tests.fixtures.train_world import config_for, write_image_world
from train.stage import run_train


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_k25_target):
    root = tmp_path_factory.mktemp("rows_probe")
    world = write_image_world(root, tiny_k25_target)
    out = root / "train-from"
    run_train(config_for(world, out, max_steps=2))
    return world, out


def test_other_image_view_swaps_in_another_sequences_rows(finished_run):
    bench = load_benchmark("image_rows_probe")
    world, _ = finished_run
    store = HiddenStateStore(world["capture"] / "validation")
    items = bench.image_items(store)
    assert items == list(range(len(store))) and len(items) == 4  # every toy validation sequence holds an image
    swap, alone = bench.other_image_swap(store, items)
    assert alone == 0 and sorted(swap) == [0, 1, 2, 3] and all(swap[a] != a for a in swap)
    view = bench.StoreView(store, items, swap)
    for a, donor in swap.items():
        got = view[a]
        torch.testing.assert_close(got["image_embeds"], store[items[donor]]["image_embeds"])
        assert not torch.equal(got["image_embeds"], store[items[a]]["image_embeds"])
        assert torch.equal(got["input_ids"], store[items[a]]["input_ids"])  # only the rows move
    plain = bench.StoreView(store, items)
    assert torch.equal(plain[1]["image_embeds"], store[items[1]]["image_embeds"])
    assert view.image_token_id == store.image_token_id and len(view) == 4


def test_probe_trains_both_conventions_and_replays_every_feed(finished_run, tmp_path, monkeypatch):
    bench = load_benchmark("image_rows_probe")
    _, train_dir = finished_run
    args = ["--train-dir", str(train_dir), "--steps", "3", "--out", str(tmp_path / "probe"),
            "--json", str(tmp_path / "p.jsonl")]
    lines = bench.main(args)
    assert [(x["steps"], x["trained"]) for x in lines] == [(3, "fused"), (3, "placeholder")]
    for x in lines:
        assert set(x["served"]) == {"fused", "placeholder", "other-image"} and x["image_sequences"] == 4
        for got in x["served"].values():
            assert got["tau"] >= 1.0 and 0 <= got["acc0"] <= 1 and got["target_logp"] < 0
        own, others = x["served"][x["trained"]], [v for k, v in x["served"].items() if k != x["trained"]]
        assert "tv" not in own  # the trained feed is the reference
        # the toy rows are random and 3x the unit scale: swapping them moves the step-0 distribution
        assert all(0 < v["tv"] <= 1 and 0 <= v["argmax_flips"] <= 1 for v in others)
        assert any(v["target_logp"] != own["target_logp"] for v in others)
        man = json.loads((tmp_path / "probe" / f"train-3-{x['trained']}" / "manifest.json").read_text())
        assert man["config"]["image_embeddings"] == x["trained"] and man["config"]["max_steps"] == 3
        assert man["config"]["optim"]["lr"] == 3e-3  # the finished run's recipe, not the schema's default
    assert [json.loads(x)["trained"] for x in (tmp_path / "p.jsonl").read_text().splitlines()] == \
        ["fused", "placeholder"]
    # a second call reuses the finished runs: no training
    monkeypatch.setattr("train.stage.run_train", lambda cfg: pytest.fail(f"retrained {cfg.out_dir}"))
    again = bench.main(args)
    assert [x["served"] for x in again] == [x["served"] for x in lines]
    on_train = bench.main([*args, "--split", "train"])  # the training split: 12 image sequences, same drafters
    assert [(x["split"], x["image_sequences"]) for x in on_train] == [("train", 12)] * 2
    assert lines[0]["split"] == "validation"


def test_step0_logprobs_are_the_replays_step_0(finished_run):
    """The probe's step-0 read agrees with the replay's teacher-forced unroll (eagle3/replay/evaluate.py): same
    positions, and the replay's hits are where the probe's argmax is the target's token (except at a float tie of the top two)."""
    from eagle3.drafter.drafter_io import load_drafter_dir
    from eagle3.replay.evaluate import sequence_embeds, teacher_forced_hits
    from eagle3.target_model.target_io import load_embed_tokens

    bench = load_benchmark("image_rows_probe")
    world, train_dir = finished_run
    man = json.loads((train_dir / "manifest.json").read_text())["config"]
    model = load_drafter_dir(train_dir / "final", embed_tokens=load_embed_tokens(man["target"]["path"],
                                                                                   man["target"]["layout"]))
    store = HiddenStateStore(world["capture"] / "validation")
    for i in range(len(store)):
        s = store[i]
        emb = sequence_embeds(model, store, s, "fused")
        logp, tgt = bench.step0_logprobs(model, s, emb)
        hits, valid = teacher_forced_hits(model, s["aux"], s["input_ids"], s["target_argmax"], s["loss_mask"], 1, emb)
        assert logp.shape[0] == tgt.shape[0] == int(valid[0].sum()) > 0
        assert torch.allclose(logp.exp().sum(-1), torch.ones(len(logp)), atol=1e-4)
        top2 = logp.topk(2, dim=-1).values
        near_tie = (top2[:, 0] - top2[:, 1]) < 1e-4  # float noise may decide these either way
        assert ((logp.argmax(-1) == tgt) == hits[0][valid[0]])[~near_tie].all()
