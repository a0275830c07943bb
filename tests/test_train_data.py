"""Batch planning (token budget, seeded order, rank shards, resumable stream), the LR schedule
and atomic checkpoints: the pure parts of the train stage."""
import math

import pytest
import torch

from train import checkpointing as ckpt
from train.batches import BatchStream, collate, plan_epoch, shard_for_rank
from train.schedule import resolve_warmup, warmup_cosine
from train.validate import validation_plan


def random_lengths(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 600, (n,), generator=g).tolist()


def test_plan_covers_every_sequence_once_within_the_budget():
    lengths = random_lengths()
    batches = plan_epoch(lengths, max_tokens=2048, max_length=512, seed=3, epoch=0, bucket_window=64)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(min(lengths[i], 512) for i in b) <= 2048
    # length bucketing: little padding compared with a random split of the same batch count
    real = sum(min(n, 512) for n in lengths)
    padded = sum(len(b) * max(min(lengths[i], 512) for i in b) for b in batches)
    assert real / padded > 0.85


def test_plan_is_seeded_and_changes_with_the_epoch():
    lengths = random_lengths()
    a = plan_epoch(lengths, 2048, 512, seed=3, epoch=0)
    assert a == plan_epoch(lengths, 2048, 512, seed=3, epoch=0)
    assert a != plan_epoch(lengths, 2048, 512, seed=3, epoch=1)
    assert a != plan_epoch(lengths, 2048, 512, seed=4, epoch=0)


def test_plan_rejects_a_length_over_the_budget_and_empty_stores():
    with pytest.raises(ValueError, match="max_length=4096 exceeds"):
        plan_epoch([10], 2048, 4096, 0, 0)
    with pytest.raises(ValueError, match="no sequences"):
        plan_epoch([], 2048, 512, 0, 0)


def test_rank_shards_are_equal_and_cover_the_epoch():
    batches = [[i] for i in range(7)]
    shards = [shard_for_rank(batches, r, 3) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    got = [b[0] for s in shards for b in s]
    assert set(got) == set(range(7)) and len(got) == 9   # 2 wrapped around to even the ranks
    assert shard_for_rank(batches, 0, 1) == batches
    # one process with grad_accum=W takes, per step, exactly the batches W ranks take in that step
    stream1 = BatchStream(random_lengths(40), 1024, 256, seed=1)
    b1 = stream1.epoch_batches(0)
    b2 = [BatchStream(random_lengths(40), 1024, 256, seed=1, rank=r, world_size=2).epoch_batches(0) for r in range(2)]
    n = len(b1) // 2
    assert [b for pair in zip(b2[0][:n], b2[1][:n]) for b in pair] == b1[: 2 * n]


def test_stream_resumes_at_any_position_across_epochs():
    s = BatchStream(random_lengths(30), 1024, 256, seed=2)
    per_epoch = s.batches_per_epoch()
    it = s.iterate(0)
    full = [next(it) for _ in range(3 * per_epoch)]
    for start in (0, 1, per_epoch - 1, per_epoch, 2 * per_epoch + 1):
        it = s.iterate(start)
        assert [next(it) for _ in range(len(full) - start)] == full[start:]
    assert full[per_epoch][0] == 1 and full[0][0] == 0  # epoch numbers


def test_collate_right_pads():
    items = [{"id": "a", "input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([0, 1, 1]).bool(),
              "target_argmax": torch.tensor([2, 3, 4]), "aux": torch.ones(3, 6, dtype=torch.bfloat16),
              "last": torch.ones(3, 2, dtype=torch.bfloat16)},
             {"id": "b", "input_ids": torch.tensor([7]), "loss_mask": torch.tensor([1]).bool(),
              "target_argmax": torch.tensor([8]), "aux": torch.ones(1, 6, dtype=torch.bfloat16),
              "last": torch.ones(1, 2, dtype=torch.bfloat16)}]
    b = collate(items)
    assert b["input_ids"].tolist() == [[1, 2, 3], [7, 0, 0]]
    assert b["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert b["aux"].dtype == torch.bfloat16 and b["aux"][1, 1:].abs().sum() == 0
    assert b["lengths"].tolist() == [3, 1] and b["ids"] == ["a", "b"]


def test_validation_plan_pads_ranks_without_double_counting():
    lengths = random_lengths(25)
    plans = [validation_plan(lengths, 1024, 256, r, 3, None) for r in range(3)]
    assert len({len(p) for p in plans}) == 1
    counted = sorted(i for p in plans for b, c in p if c for i in b)
    assert counted == list(range(25))


def test_warmup_cosine():
    assert [warmup_cosine(s, 10, 2) for s in (0, 1)] == [0.5, 1.0]
    assert warmup_cosine(2, 10, 2) == pytest.approx(1.0)
    assert warmup_cosine(6, 10, 2) == pytest.approx(0.5)            # half-way through the cosine
    assert warmup_cosine(10, 10, 2, min_ratio=0.1) == pytest.approx(0.1)
    assert warmup_cosine(3, 10, 0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))
    assert resolve_warmup(100, None, 0.02) == 2 and resolve_warmup(5, 10, 0.0) == 5


def test_checkpoints_are_atomic_pruned_and_verified(tmp_path):
    root = tmp_path / "checkpoints"

    def writer(d):
        (d / "model.safetensors").write_bytes(b"weights")

    for step in (1, 2, 3):
        ckpt.save_checkpoint(root, step, writer, {"step": step}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    assert ckpt.load_training_state(root / "step-000003")["step"] == 3

    def failing(d):
        (d / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(ckpt.CheckpointError, match=r"step-000004 failed \(disk full\)"):  # the path is named
        ckpt.save_checkpoint(root, 4, failing, {"step": 4}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]       # nothing partial became a checkpoint
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    (root / "step-000003" / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(ckpt.CheckpointError, match="step-000003/model.safetensors"):
        ckpt.load_training_state(root / "step-000003")
