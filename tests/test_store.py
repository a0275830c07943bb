"""The hidden-state store: round trip, sharding, resume after a crash, mismatch refusal,
corruption named on read, non-finite states refused, multi-part merge reads like one store."""
import json
import os

import pytest
import torch

from eagle3.formats.store import (HiddenStateStore, HiddenStateWriter, NonFiniteHiddenStateError, StoreError,
                                  StoreMismatchError, merge_stores)

H = 4
HF = [2, 30, 58]  # Kimi's aux hidden states h


def make_seq(i, T):
    g = torch.Generator().manual_seed(i)
    return dict(seq_id=f"s{i}", input_ids=torch.randint(0, 100, (T,), generator=g),
                loss_mask=torch.randint(0, 2, (T,), generator=g).bool(),
                aux=torch.randn(T, 3 * H, generator=g), last=torch.randn(T, H, generator=g),
                target_argmax=torch.randint(0, 100, (T,), generator=g))


LENGTHS = [5, 3, 7, 2, 6, 4, 1, 8]


def writer(d, **kw):
    args = dict(hidden_size=H, target_hidden_size=H, hf_indices=HF, shard_tokens=10,
                meta={"target": "abc"})
    args.update(kw)
    return HiddenStateWriter(d, **args)


def write_all(d, seqs=None, **kw):
    w = writer(d, **kw)
    for i, T in enumerate(LENGTHS) if seqs is None else seqs:
        if f"s{i}" not in w.done_ids:
            w.add(**make_seq(i, T))
    return w.finish()


def shard_bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.startswith("shard-")}


@pytest.mark.parametrize("background", [False, True])
def test_round_trip_values_and_metadata(tmp_path, background):
    m = write_all(tmp_path, background=background)
    store = HiddenStateStore(tmp_path, verify="sha256")
    assert len(store) == len(LENGTHS) and store.lengths == LENGTHS
    assert store.ids == [f"s{i}" for i in range(len(LENGTHS))]
    assert store.num_tokens == sum(LENGTHS) == m["num_tokens"]
    assert store.hf_indices == HF and store.hidden_size == H
    # a shard holds at most 10 tokens: 5+3 | 7+2 | 6+4 | 1+8
    assert [s["lengths"] for s in m["shards"]] == [[5, 3], [7, 2], [6, 4], [1, 8]]
    for i in [7, 0, 4, 3]:  # random access across shards
        ref, got = make_seq(i, LENGTHS[i]), store[i]
        assert got["id"] == ref["seq_id"]
        assert got["aux"].dtype == torch.bfloat16 and got["aux"].shape == (LENGTHS[i], 3 * H)
        torch.testing.assert_close(got["aux"], ref["aux"].bfloat16(), rtol=0, atol=0)
        torch.testing.assert_close(got["last"], ref["last"].bfloat16(), rtol=0, atol=0)
        assert got["input_ids"].dtype == torch.long and torch.equal(got["input_ids"], ref["input_ids"])
        assert got["loss_mask"].dtype == torch.bool and torch.equal(got["loss_mask"], ref["loss_mask"])
        assert torch.equal(got["target_argmax"], ref["target_argmax"])
    assert store[-1]["id"] == "s7"
    with pytest.raises(IndexError):
        store[8]


def test_float32_dtype_is_exact(tmp_path):
    write_all(tmp_path, dtype="float32")
    store = HiddenStateStore(tmp_path)
    assert store.dtype == "float32"
    assert torch.equal(store[2]["aux"], make_seq(2, LENGTHS[2])["aux"])


@pytest.mark.parametrize("background", [False, True])
def test_resume_after_kill_is_byte_identical(tmp_path, background):
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    write_all(ref_dir, background=background)
    # A "killed" run: 5 sequences added (one shard committed, the next buffered), plus the debris a
    # kill can leave: a temp file mid-write and a renamed shard the manifest never listed.
    w = writer(crash_dir)
    for i in range(5):
        w.add(**make_seq(i, LENGTHS[i]))
    w._wait()
    del w
    (crash_dir / ".shard-00002.safetensors.abc.tmp").write_bytes(b"partial")
    (crash_dir / "shard-00002.safetensors").write_bytes(b"renamed but not listed")
    with pytest.raises(StoreError, match="incomplete"):
        HiddenStateStore(crash_dir)
    partial = HiddenStateStore(crash_dir, allow_incomplete=True)
    assert partial.ids == ["s0", "s1", "s2", "s3"]  # only the committed shards are visible
    w2 = writer(crash_dir)
    assert w2.done_ids == {"s0", "s1", "s2", "s3"}
    assert not (crash_dir / "shard-00002.safetensors").exists()
    assert not list(crash_dir.glob(".*.tmp"))
    write_all(crash_dir)
    assert shard_bytes(crash_dir) == shard_bytes(ref_dir)
    assert (crash_dir / "manifest.json").read_bytes() == (ref_dir / "manifest.json").read_bytes()


def test_resume_with_other_settings_refuses_to_mix(tmp_path):
    write_all(tmp_path)
    with pytest.raises(StoreMismatchError, match="hf_indices"):
        writer(tmp_path, hf_indices=[1, 2, 3])
    with pytest.raises(StoreMismatchError, match="meta"):
        writer(tmp_path, meta={"target": "other"})


def test_corrupt_shard_is_named(tmp_path):
    write_all(tmp_path)
    path = tmp_path / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))
    store = HiddenStateStore(tmp_path, verify="size")  # size still matches
    store[0]
    strict = HiddenStateStore(tmp_path, verify="sha256")
    strict[0]  # shard 0 is fine
    with pytest.raises(StoreError, match="shard-00001.safetensors.*sha256"):
        strict[3]
    with pytest.raises(StoreError, match="shard-00001"):
        HiddenStateStore(tmp_path).verify_all()
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(StoreError, match="shard-00001.safetensors.*bytes"):
        HiddenStateStore(tmp_path)
    os.unlink(path)
    with pytest.raises(StoreError, match="shard-00001.safetensors.*missing"):
        HiddenStateStore(tmp_path)


def test_non_finite_state_is_refused_naming_the_sequence(tmp_path):
    w = writer(tmp_path, dtype="float16")
    bad = make_seq(0, 4)
    bad["last"][2, 1] = float("nan")
    with pytest.raises(NonFiniteHiddenStateError, match="'s0'.*last"):
        w.add(**bad)
    big = make_seq(1, 3)
    big["aux"][0, 0] = 1e6  # finite in fp32, inf once cast to the fp16 store dtype
    with pytest.raises(NonFiniteHiddenStateError, match="'s1'.*aux"):
        w.add(**big)
    w.skip("s0", "non-finite")
    w.add(**make_seq(2, 3))
    m = w.finish()
    assert m["skipped"] == [{"id": "s0", "reason": "non-finite"}]
    assert HiddenStateStore(tmp_path).ids == ["s2"]
    assert "s0" in writer(tmp_path, dtype="float16").done_ids


def test_bad_shapes_and_duplicates_are_errors(tmp_path):
    w = writer(tmp_path)
    s = make_seq(0, 4)
    w.add(**s)
    with pytest.raises(StoreError, match="added twice"):
        w.add(**s)
    s2 = make_seq(1, 4)
    s2["aux"] = s2["aux"][:, :H]
    with pytest.raises(StoreError, match="'s1'.*aux.*shape"):
        w.add(**s2)


def test_multi_part_store_reads_like_one_store(tmp_path):
    one = tmp_path / "one"
    write_all(one)
    merged = tmp_path / "merged"
    for rank in range(2):  # rank-strided slices, each with the global order key
        w = writer(merged / f"part-{rank}")
        for i in range(rank, len(LENGTHS), 2):
            w.add(**make_seq(i, LENGTHS[i]), order=i)
        w.finish()
    m = merge_stores(merged, [merged / "part-0", merged / "part-1"])
    assert m["num_tokens"] == sum(LENGTHS)
    a, b = HiddenStateStore(one, verify="sha256"), HiddenStateStore(merged, verify="sha256")
    assert a.ids == b.ids and a.lengths == b.lengths and a.num_tokens == b.num_tokens
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["id"] == y["id"]
        for k in ("input_ids", "loss_mask", "aux", "last", "target_argmax"):
            assert torch.equal(x[k], y[k]), (i, k)


def test_merge_refuses_incomplete_or_mismatched_parts(tmp_path):
    w = writer(tmp_path / "part-0")
    w.add(**make_seq(0, 3))
    w._flush()
    with pytest.raises(StoreError, match="part-0.*not complete"):
        merge_stores(tmp_path, [tmp_path / "part-0"])
    w.finish()
    w1 = writer(tmp_path / "part-1", dtype="float32")
    w1.add(**make_seq(1, 3))
    w1.finish()
    with pytest.raises(StoreMismatchError, match="dtype"):
        merge_stores(tmp_path, [tmp_path / "part-0", tmp_path / "part-1"])
    assert json.loads((tmp_path / "part-0" / "manifest.json").read_text())["complete"]


def test_shards_are_standard_safetensors(tmp_path):
    """The streaming shard writer produces files safetensors' own loader accepts, with the
    documented columns, dtypes and offsets."""
    from safetensors.torch import load_file

    write_all(tmp_path)
    t = load_file(tmp_path / "shard-00000.safetensors")
    assert {k: v.dtype for k, v in t.items()} == {"aux": torch.bfloat16, "last": torch.bfloat16,
                                                  "input_ids": torch.int32, "loss_mask": torch.uint8,
                                                  "target_argmax": torch.int32, "offsets": torch.int64}
    assert t["aux"].shape == (8, 3 * H) and t["offsets"].tolist() == [0, 5, 8]
    assert torch.equal(t["input_ids"][5:8].long(), make_seq(1, 3)["input_ids"])


def test_a_store_locked_by_another_process_is_refused(tmp_path):
    import fcntl

    with open(tmp_path / ".lock", "a+") as other:  # flock is per open file: this stands in for another process
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StoreError, match="another process is writing"):
            writer(tmp_path)
    w = writer(tmp_path)
    w.add(**make_seq(0, 3))
    w.finish()
    assert not (tmp_path / ".lock").exists()  # a complete store carries no lock file
    writer(tmp_path).finish()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
@pytest.mark.parametrize("background", [False, True])
def test_cuda_states_go_through_pinned_async_copies_exactly(tmp_path, background):
    """GPU tensors are copied into pinned shard buffers on a side stream while the GPU keeps
    working and the sources are freed: the store must still hold exactly the values added."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = writer(tmp_path, dtype="bfloat16", shard_tokens=4096, hidden_size=256, target_hidden_size=256,
               background=background)
    expect, lengths = {}, [3000, 1500, 5000, 700, 2048, 1, 4096, 2500]  # 5000 > shard_tokens: buffer grows
    for i, T in enumerate(lengths):
        aux = torch.randn(T, 3 * 256, device=dev, generator=g).bfloat16()
        last = torch.randn(T, 256, device=dev, generator=g).bfloat16()
        ids = torch.randint(0, 1000, (T,))
        expect[f"s{i}"] = (aux.cpu(), last.cpu(), ids)
        w.add(f"s{i}", ids, torch.ones(T, dtype=torch.bool), aux, last, ids)
        del aux, last
        junk = torch.randn(4096, 4096, device=dev)  # reuse freed memory while copies may be in flight
        junk = junk @ junk
    w.finish()
    store = HiddenStateStore(tmp_path, verify="sha256")
    assert store.lengths == lengths
    for i in range(len(store)):
        rec = store[i]
        aux, last, ids = expect[rec["id"]]
        assert torch.equal(rec["aux"], aux) and torch.equal(rec["last"], last) and torch.equal(rec["input_ids"], ids)


def test_a_store_from_a_newer_format_version_is_refused_by_reader_and_writer(tmp_path):
    d = tmp_path / "s"
    write_all(d)
    path = d / "manifest.json"
    m = json.loads(path.read_text())
    assert m["version"] == 1
    assert len(HiddenStateStore(d)) > 0
    m["version"] = 2  # e.g. a future aux encoding this reader would misread
    path.write_text(json.dumps(m))
    with pytest.raises(StoreError, match="version 2, this code reads up to 1"):
        HiddenStateStore(d)
    with pytest.raises(StoreError, match="version 2"):
        writer(d)  # resuming into it is refused too, before anything is deleted
    assert json.loads(path.read_text())["version"] == 2 and shard_bytes(d)
