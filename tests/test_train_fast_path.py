"""The training loop's fast path and data feed, on CPU: `unroll=fast` trains to the same numbers as
`unroll=reference` through run_train (the CPU flash kernel stands in for CUDA's), the background
batch reader and the device prefetcher hand out exactly the planned batches and surface errors,
and the schema rejects unknown unroll / compile choices. GPU figures: BENCHMARKS.md (issue 9)."""
import json
import os
from pathlib import Path

import pytest
import torch

from eagle3.config.conf import ConfigError
from tests.fixtures.train_world import config_for, world  # noqa: F401  (session fixture)
from train.batches import BackgroundBatches, BatchStream, collate, make_loader
from train.stage import run_train
from train.prefetch import DevicePrefetcher
from eagle3.config import resolve


def _train_rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_fast_unroll_trains_like_the_reference_through_run_train(world, tmp_path):  # noqa: F811
    runs = {}
    for impl in ("reference", "fast"):
        out = tmp_path / impl
        cfg = config_for(world, out, "scratch", max_steps=6, epochs="null", log_every=1, val_every=0,
                         val_accept_sequences=0, unroll=impl, compile="false", **{"wandb.mode": "disabled"})
        run_train(cfg)
        runs[impl] = _train_rows(out)
    ref, fast = runs["reference"], runs["fast"]
    assert [r["step"] for r in ref] == [r["step"] for r in fast] == list(range(1, 7))
    for a, b in zip(ref, fast):  # the same batches, the same updates: losses agree to fp32 rounding
        assert b["loss_weighted"] == pytest.approx(a["loss_weighted"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-6)
    assert ref[-1]["loss_weighted"] < ref[0]["loss_weighted"]  # it did train


def test_clip_folded_into_a_fused_adamw_trains_like_the_separate_clip_through_run_train(world, tmp_path):  # noqa: F811
    """optim.fused=true on CPU: the trainer hands the clip factor to the fused AdamW (train/distributed.clip_gradients);
    the same run with the foreach AdamW clips in a separate pass through accelerate. Same updates, same norms."""
    runs = {}
    for fused in ("true", "false"):
        out = tmp_path / f"fused-{fused}"
        cfg = config_for(world, out, "scratch", max_steps=4, epochs="null", log_every=1, val_every=0,
                         val_accept_sequences=0, **{"optim.fused": fused, "optim.grad_clip": 0.05,
                                                    "wandb.mode": "disabled"})
        run_train(cfg)
        runs[fused] = _train_rows(out)
    folded, separate = runs["true"], runs["false"]
    assert len(folded) == len(separate) == 4
    assert all(r["grad_norm"] > 0.05 for r in separate)  # every step was clipped: the factor mattered
    for a, b in zip(separate, folded):
        assert b["loss_weighted"] == pytest.approx(a["loss_weighted"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_schema_rejects_unknown_unroll_compile_and_attention_kernel(world, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="unroll"):
        config_for(world, tmp_path, unroll="fastest")
    with pytest.raises(ConfigError, match="compile"):
        config_for(world, tmp_path, compile="maybe")
    with pytest.raises(ConfigError, match="attention_kernel"):
        config_for(world, tmp_path, attention_kernel="fa3")
    assert config_for(world, tmp_path, attention_kernel="flash").attention_kernel == "flash"


def test_compile_auto_means_gpu_only(world, tmp_path):  # noqa: F811
    cfg = config_for(world, tmp_path)
    assert resolve.compile_fast_path(cfg.compile, "cpu") is False
    assert resolve.compile_fast_path(cfg.compile, "cuda") is True
    assert resolve.compile_fast_path(config_for(world, tmp_path, compile="false").compile, "cuda") is False
    assert resolve.compile_fast_path(config_for(world, tmp_path, compile="true").compile, "cpu") is True


def test_train_autos_resolve_once_and_the_manifest_records_them(world, tmp_path):  # noqa: F811
    """On this CPU every auto of a train config takes its CPU value; the run's manifest records what it used."""
    cfg = config_for(world, tmp_path)
    got = resolve.train_choices(cfg)
    assert got == {"device": "cpu", "precision": "no", "unroll": "reference", "compile": False,
                   "image_embeddings": "fused", "loader_workers": 0}
    assert resolve.train_choices(config_for(world, tmp_path, unroll="fast", precision="bf16"))["unroll"] == "fast"


def _item(i: int, n: int) -> dict:
    return {"id": f"s{i}", "input_ids": torch.full((n,), i), "loss_mask": torch.ones(n, dtype=torch.bool),
            "target_argmax": torch.full((n,), i + 1), "aux": torch.full((n, 6), float(i)), "last": torch.ones(n, 2)}


def test_background_batches_yield_the_plan_in_order_then_stop():
    plan = [[0, 1], [2], [3, 4, 5]]
    batches = list(BackgroundBatches(lambda idx: collate([_item(i, 2 + i) for i in idx]), iter(plan), depth=2))
    assert [b["ids"] for b in batches] == [["s0", "s1"], ["s2"], ["s3", "s4", "s5"]]
    assert batches[2]["input_ids"].tolist() == [[3] * 5 + [0] * 2, [4] * 6 + [0], [5] * 7]  # right padding zeroed
    assert batches[2]["aux"][0, 5:].abs().sum() == 0 and not batches[2]["loss_mask"][0, 5:].any()


def test_background_batches_raise_the_readers_error_in_the_consumer():
    def make(idx):
        if idx == [1]:
            raise OSError("shard-00001.safetensors: unreadable")
        return collate([_item(i, 3) for i in idx])

    it = BackgroundBatches(make, iter([[0], [1], [2]]))
    assert next(it)["ids"] == ["s0"]
    with pytest.raises(OSError, match="shard-00001"):
        next(it)


def test_background_batches_close_stops_a_reader_blocked_on_a_full_queue():
    it = BackgroundBatches(lambda idx: collate([_item(i, 2) for i in idx]), ([i] for i in range(10**6)), depth=1)
    next(it)
    it.close()
    assert not it.thread.is_alive()


def test_device_prefetcher_on_cpu_hands_out_host_batches_once_each():
    batches = [{"x": torch.tensor([i]), "ids": [f"s{i}"]} for i in range(3)]
    pairs = list(DevicePrefetcher(iter(batches), torch.device("cpu"), depth=2))
    assert [h["ids"] for h, _ in pairs] == [["s0"], ["s1"], ["s2"]]
    assert all(h is d for h, d in pairs)
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher(iter(batches), torch.device("cpu"), depth=0)


def test_device_prefetcher_peeks_host_batches_in_order_without_losing_or_repeating_any():
    batches = [{"x": torch.tensor([i]), "ids": [f"s{i}"]} for i in range(7)]
    pre = DevicePrefetcher(iter(batches), torch.device("cpu"), depth=1)
    assert [h["ids"] for h in pre.peek_hosts(3)] == [["s0"], ["s1"], ["s2"]]
    assert len(pre.queue) == 1 and len(pre.pending) == 2  # only `depth` batches have device copies
    assert [h["ids"] for h in pre.peek_hosts(2)] == [["s0"], ["s1"]]  # peeking again pulls nothing new
    assert [next(pre)[0]["ids"] for _ in range(2)] == [["s0"], ["s1"]]
    assert [h["ids"] for h in pre.peek_hosts(4)] == [["s2"], ["s3"], ["s4"], ["s5"]]
    assert [h["ids"] for h, _ in pre] == [[f"s{i}"] for i in range(2, 7)]
    assert pre.peek_hosts(3) == []  # the end of the data


def test_make_loader_without_pinning_is_a_dataloader_over_the_same_plan(world):  # noqa: F811
    from eagle3.formats.store import HiddenStateStore

    store = HiddenStateStore(world["capture"] / "train")
    stream = BatchStream(store.lengths, max_tokens=160, max_length=40, seed=3)
    expected = [b for _, b in zip(range(4), (b for _, b in stream.iterate(0)))]
    got = [b for _, b in zip(range(4), make_loader(store, stream, 0, 40, num_workers=0, pin_memory=False))]
    assert [b["ids"] for b in got] == [[store.ids[i] for i in idx] for idx in expected]


def test_training_prefers_expandable_cuda_segments_unless_the_environment_chose(monkeypatch):
    from train.distributed import ALLOC_CONF, prefer_expandable_segments
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    prefer_expandable_segments()
    assert os.environ[ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(ALLOC_CONF, "max_split_size_mb:512")
    prefer_expandable_segments()
    assert os.environ[ALLOC_CONF] == "max_split_size_mb:512"
