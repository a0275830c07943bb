"""Storage faults: truncated and bit-flipped shards, checkpoints, vocab files and exports; writes that
fail partway (an injected ENOSPC). Nothing partial or corrupt may be read as valid, and the error
must name the file and say what to do; a rerun after a failed write completes."""
import contextlib
import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from fault_helpers import (copy_tree, export_config, file_size_limit, flip_byte, flip_in_tensor, train_config,
                           truncate)


def open_train_inputs(config):
    from train.inputs import open_inputs
    from train.setup import stream_conf

    return open_inputs(config, stream_conf(config))


def first_shard(store_dir: Path) -> Path:
    m = json.loads((store_dir / "manifest.json").read_text())
    return store_dir / m["shards"][0]["file"]


# ------------------------------------------------------------------ the hidden-state store

def test_truncated_shard_is_named_by_training_and_export(pipeline, tmp_path):
    from export.stage import ExportError, run_export
    from train.inputs import TrainInputError

    world = {**pipeline, "capture": copy_tree(pipeline["capture"], tmp_path / "capture")}
    shard = first_shard(world["capture"] / "train")
    truncate(shard)
    with pytest.raises(TrainInputError, match=rf"{shard.name}.*(truncated|corrupt)"):
        open_train_inputs(train_config(world, tmp_path / "t"))
    vshard = first_shard(world["capture"] / "validation")
    truncate(vshard)
    with pytest.raises(ExportError, match=rf"{vshard.name}.*(truncated|corrupt)"):
        run_export(export_config(world, pipeline["final"], tmp_path / "e"))


def test_bit_flipped_shard_is_named_when_hashes_are_checked(pipeline, tmp_path):
    from eagle3.formats.store import HiddenStateStore, StoreError
    from train.inputs import TrainInputError

    world = {**pipeline, "capture": copy_tree(pipeline["capture"], tmp_path / "capture")}
    shard = first_shard(world["capture"] / "train")
    flip_byte(shard, offset_from_end=101)
    with pytest.raises(StoreError, match=rf"{shard.name}: sha256 mismatch"):
        HiddenStateStore(world["capture"] / "train", verify="sha256").verify_all()
    inputs = open_train_inputs(train_config(world, tmp_path / "t", **{"data.verify": "sha256"}))
    with pytest.raises(StoreError, match=rf"{shard.name}: sha256 mismatch.*rerun capture"):
        for i in range(len(inputs.train)):
            inputs.train[i]
    del TrainInputError


def test_bit_flipped_shard_is_caught_with_default_train_settings(pipeline, tmp_path):
    world = {**pipeline, "capture": copy_tree(pipeline["capture"], tmp_path / "capture")}
    flip_byte(first_shard(world["capture"] / "train"), offset_from_end=101)
    with pytest.raises(Exception, match="shard"):
        inputs = open_train_inputs(train_config(world, tmp_path / "t"))
        for i in range(len(inputs.train)):
            inputs.train[i]


def test_corrupt_store_and_stage_manifests_are_named(pipeline, tmp_path):
    from train.inputs import TrainInputError

    world = {**pipeline, "capture": copy_tree(pipeline["capture"], tmp_path / "capture")}
    truncate(world["capture"] / "train" / "manifest.json")
    with pytest.raises(TrainInputError, match=r"train/manifest.json.*unreadable"):
        open_train_inputs(train_config(world, tmp_path / "t"))
    (world["capture"] / "manifest.json").write_text('{"stage": "capt')
    with pytest.raises(TrainInputError, match=r"capture/manifest.json: not valid JSON"):
        open_train_inputs(train_config(world, tmp_path / "t"))


def test_write_failing_partway_keeps_finished_shards_and_a_rerun_completes(tmp_path):
    """The disk fills while a shard is being written (a real EFBIG from the kernel, partway through the
    file): the partial temp file is never listed, a reader sees only finished shards, a consumer refuses
    the unfinished store, and reopening the writer redoes exactly the lost sequences."""
    from eagle3.formats.store import HiddenStateStore, HiddenStateWriter, StoreError

    lengths = [8] * 6 + [60] * 3          # small shards first, then shards too big for the "disk"

    def seqs():
        g = torch.Generator().manual_seed(0)
        for i, T in enumerate(lengths):
            yield (f"s{i}", torch.randint(0, 50, (T,), generator=g), torch.ones(T, dtype=torch.bool),
                   torch.randn(T, 24, generator=g), torch.randn(T, 8, generator=g), torch.randint(0, 50, (T,), generator=g))

    def write(d, limit=None):
        w = HiddenStateWriter(d, hidden_size=8, target_hidden_size=8, hf_indices=[2, 3, 4],
                              dtype="float32", shard_tokens=16)
        with file_size_limit(limit) if limit else contextlib.nullcontext():
            for s in seqs():
                if s[0] not in w.done_ids:
                    w.add(*s)
            w.finish()

    write(tmp_path / "ref")
    sizes = sorted(p.stat().st_size for p in (tmp_path / "ref").glob("shard-*"))
    with pytest.raises(OSError) as err:
        write(tmp_path / "full", limit=(sizes[0] + sizes[-1]) // 2)
    assert err.value.errno in (errno.EFBIG, errno.ENOSPC)
    partial = HiddenStateStore(tmp_path / "full", allow_incomplete=True)
    assert 0 < len(partial) < len(lengths)
    assert [partial[i]["id"] for i in range(len(partial))] == [f"s{i}" for i in range(len(partial))]
    with pytest.raises(StoreError, match="incomplete"):
        HiddenStateStore(tmp_path / "full")
    write(tmp_path / "full")              # the same command again, disk space back
    files = lambda d: {p.name: p.read_bytes() for p in Path(d).glob("shard-*")}  # noqa: E731
    assert files(tmp_path / "full") == files(tmp_path / "ref")
    assert not [p.name for p in (tmp_path / "full").iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------ checkpoints and drafter dirs

def test_truncated_or_flipped_training_checkpoint_is_refused_on_resume(pipeline, tmp_path):
    from eagle3.formats.checkpoints import CheckpointError
    from train.stage import run_train

    out = copy_tree(pipeline["train_out"], tmp_path / "train")
    for p in ("final", "manifest.json"):                  # make it an unfinished run that must resume
        shutil.rmtree(out / p) if (out / p).is_dir() else (out / p).unlink()
    last = sorted((out / "checkpoints").iterdir())[-1]
    flip_byte(last / "training_state.pt", offset_from_end=64)
    with pytest.raises(CheckpointError, match=rf"{last.name}/training_state.pt.*checksum.*delete"):
        run_train(train_config(pipeline, out, max_steps=6))


def test_truncated_drafter_dir_is_named_by_the_loader(pipeline, tmp_path):
    from eagle3.drafter.drafter_io import DrafterLoadError, load_drafter_dir

    d = copy_tree(pipeline["final"], tmp_path / "final")
    truncate(d / "model.safetensors", 0.9)
    with pytest.raises(DrafterLoadError, match="model.safetensors"):
        load_drafter_dir(d)


def test_truncated_final_drafter_is_named_by_the_export(pipeline, tmp_path):
    from export.stage import ExportError, run_export

    d = copy_tree(pipeline["final"], tmp_path / "final")
    truncate(d / "model.safetensors", 0.9)
    with pytest.raises(ExportError, match=r"final/model.safetensors: unreadable .*truncated or corrupt"):
        run_export(export_config(pipeline, d, tmp_path / "e"))


def test_bit_flipped_final_drafter_is_not_exported(pipeline, tmp_path):
    from export.stage import ExportError, run_export

    out = copy_tree(pipeline["train_out"], tmp_path / "train")
    flip_in_tensor(out / "final" / "model.safetensors", "midlayer.mlp.down_proj.weight")
    with pytest.raises(ExportError):
        run_export(export_config(pipeline, out / "final", tmp_path / "e"))


def test_corrupt_vocab_file_is_named_by_training(pipeline, tmp_path):
    from train.inputs import TrainInputError

    world = {**pipeline, "vocab": copy_tree(pipeline["vocab"], tmp_path / "vocab")}
    truncate(world["vocab"] / "vocab.safetensors")
    with pytest.raises(TrainInputError, match=r"vocab.safetensors: unreadable.*rerun the vocab stage"):
        open_train_inputs(train_config(world, tmp_path / "t"))


# ------------------------------------------------------------------ the export directory

def test_corrupted_export_is_detected_and_rewritten_on_rerun(pipeline, tmp_path):
    """A served directory damaged after the export (bit flip in a weight) is not reused as up to date."""
    from export.stage import run_export
    from export.directory import validate_format_dir
    from export.formats import FORMATS

    cfg = export_config(pipeline, pipeline["final"], tmp_path / "e", "format=sglang")
    out = run_export(cfg)
    good = (out / "model.safetensors").read_bytes()
    data = bytearray(good)
    header_len = int.from_bytes(data[:8], "little")
    # turn the first fc weight into NaN (bf16 0x7fc0): non-finite, caught from disk
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    meta = json.loads(bytes(data[8:8 + header_len]))
    start = 8 + header_len + meta["fc.weight"]["data_offsets"][0]
    data[start:start + 2] = b"\xc0\x7f"
    (out / "model.safetensors").write_bytes(bytes(data))
    assert "fc.weight" in names
    kw = dict(vocab_size=512, max_position_embeddings=4096, hf_indices=pipeline["hf_indices"],
              dtype="bfloat16", rope=None)
    assert any("non-finite" in p for p in validate_format_dir(out, FORMATS["sglang"], **kw))
    run_export(cfg)                                         # not reused: rewritten
    assert (out / "model.safetensors").read_bytes() == good


def test_disk_full_while_exporting_keeps_the_previous_export(pipeline, tmp_path):
    """fp32 weights are twice the bf16 ones: with the per-file limit at the bf16 size they cannot be written."""
    from export.stage import ExportError, run_export

    out = run_export(export_config(pipeline, pipeline["final"], tmp_path / "e", "format=sglang"))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    weights = (out / "model.safetensors").stat().st_size
    with file_size_limit(weights), pytest.raises(ExportError, match=r"(?s)writing the sglang directory failed.*File too large.*untouched"):
        run_export(export_config(pipeline, pipeline["final"], tmp_path / "e", "format=sglang", "dtype=float32"))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not list(tmp_path.glob(".e.*"))
    run_export(export_config(pipeline, pipeline["final"], tmp_path / "e", "format=sglang", "dtype=float32"))
    assert (out / "model.safetensors").stat().st_size > weights


def test_disk_full_during_a_training_checkpoint_loses_nothing_finished(pipeline, tmp_path):
    """A checkpoint write fails partway (EFBIG): no step directory is half there, and the same command
    with space back resumes from the last complete checkpoint to the uninterrupted run's weights."""
    from safetensors.torch import load_file
    from eagle3.formats.checkpoints import list_checkpoints
    from train.stage import run_train

    ref = run_train(train_config(pipeline, tmp_path / "ref", max_steps=6))
    state = sorted((Path(ref) / "checkpoints").iterdir())[0] / "training_state.pt"
    out = tmp_path / "full"
    from eagle3.formats.checkpoints import CheckpointError

    # RELIABILITY.md F4 (fixed): the failed write is named, with its likely cause
    with file_size_limit(state.stat().st_size // 2), pytest.raises(CheckpointError, match=r"step-\d+.*disk full"):
        run_train(train_config(pipeline, out, max_steps=6))
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == []
    assert not (out / "final").exists()
    run_train(train_config(pipeline, out, max_steps=6))
    a, b = load_file(str(Path(ref) / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
