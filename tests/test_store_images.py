"""An image store's rows (eagle3/formats/store.py): fused rows in fp8 with their scales when the store is fp8 (read back
in the store dtype within e4m3's precision), and a store with image_rows="none" (a vLLM capture) that keeps no
fused rows, refuses them, and cannot be resumed or merged with a store that keeps them; an fp8 HF image capture
keeps its fused rows within e4m3's precision of the fp32 capture's."""
import json

import pytest
import torch

from eagle3.formats.store import HiddenStateStore, HiddenStateWriter, StoreError, StoreMismatchError
from tests.fixtures.images import media_tokenizer, seeing_k25_target  # noqa: F401 (fixtures)
from tests.fixtures.vllm_images import image_capture_config, image_hf_store, image_prepared  # noqa: F401

H = 32
PAD = 9
FP8 = "float8_e4m3fn"


def seq(i, T=6, n_image=3):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(10, 50, (T,), generator=g)
    ids[1:1 + n_image] = PAD
    rows = torch.randn(n_image, H, generator=g) * torch.logspace(-2, 2, n_image).view(-1, 1)  # per-row magnitudes
    return dict(seq_id=f"s{i}", input_ids=ids, loss_mask=torch.zeros(T, dtype=torch.bool),
                aux=torch.randn(T, 3 * H, generator=g), last=torch.randn(T, H, generator=g),
                target_argmax=torch.randint(0, 50, (T,), generator=g)), rows


def writer(d, **kw):
    return HiddenStateWriter(d, hidden_size=H, target_hidden_size=H, hf_indices=[1, 2, 3], shard_tokens=10,
                             image_token_id=PAD, **kw)


def test_fp8_store_keeps_image_rows_in_fp8_with_scales_and_reads_them_back(tmp_path):
    w, originals = writer(tmp_path / "s", dtype="float32", aux_dtype=FP8), {}
    for i, n in enumerate([3, 0, 2, 4]):
        item, rows = seq(i, n_image=n)
        w.add(**item, image_embeds=rows)
        originals[item["seq_id"]] = rows
    w.finish()
    store = HiddenStateStore(tmp_path / "s", verify="sha256")
    assert store.manifest["image_dtype"] == FP8 and store.has_fused_image_rows
    from safetensors import safe_open
    with safe_open(str(tmp_path / "s" / store.manifest["shards"][0]["file"]), "pt") as f:
        assert f.get_slice("image_embeds").get_dtype() == "F8_E4M3" and "image_scale" in f.keys()
    for i in range(len(store)):
        got, want = store[i]["image_embeds"], originals[store[i]["id"]]
        assert got.dtype == torch.float32 and got.shape == want.shape
        if len(want):
            err = (got - want).abs()
            amax = want.abs().amax(-1, keepdim=True)
            assert bool((err <= 2 ** -4 * want.abs() + 2 ** -10 * amax / 448).all())  # e4m3: 3 mantissa bits
            assert float(err.max()) > 0  # really quantised (a bf16/fp32 copy would be exact here)


def test_a_store_in_dtype_keeps_image_rows_exactly(tmp_path):
    w = writer(tmp_path / "s", dtype="float32")
    item, rows = seq(0)
    w.add(**item, image_embeds=rows)
    w.finish()
    store = HiddenStateStore(tmp_path / "s")
    assert store.manifest["image_dtype"] == "float32" and torch.equal(store[0]["image_embeds"], rows)


def test_a_store_without_fused_rows_refuses_them_and_has_none(tmp_path):
    w = writer(tmp_path / "s", dtype="float32", image_rows="none")
    item, rows = seq(0)
    with pytest.raises(StoreError, match="image_rows='none'"):
        w.add(**item, image_embeds=rows)
    w.add(**item)
    w.finish()
    store = HiddenStateStore(tmp_path / "s")
    assert store.image_token_id == PAD and store.image_rows == "none" and not store.has_fused_image_rows
    assert "image_embeds" not in store[0] and int((store[0]["input_ids"] == PAD).sum()) == 3
    assert "image_dtype" not in json.loads((tmp_path / "s" / "manifest.json").read_text())
    with pytest.raises(StoreMismatchError, match="image_rows: 'none' != 'fused'"):  # no mixing on resume
        writer(tmp_path / "s", dtype="float32")
    with pytest.raises(ValueError, match="image_rows 'some'"):
        writer(tmp_path / "t", dtype="float32", image_rows="some")


def test_an_image_store_from_before_the_keys_reads_as_fused_in_dtype(tmp_path):
    w = writer(tmp_path / "s", dtype="float32")
    item, rows = seq(0)
    w.add(**item, image_embeds=rows)
    w.finish()
    path = tmp_path / "s" / "manifest.json"
    m = json.loads(path.read_text())
    del m["image_rows"], m["image_dtype"]
    path.write_text(json.dumps(m))
    store = HiddenStateStore(tmp_path / "s")
    assert store.has_fused_image_rows and torch.equal(store[0]["image_embeds"], rows)


def test_an_fp8_image_capture_keeps_the_fused_rows_within_e4m3(tmp_path, seeing_k25_target, image_prepared,  # noqa: F811
                                                               image_hf_store):
    from data.capture import run_capture
    from data.capture_setup import Dist

    out = run_capture(image_capture_config(tmp_path, seeing_k25_target, image_prepared, f"out_dir={tmp_path / 'fp8'}",
                                           "max_tokens_per_batch=1", f"aux_dtype={FP8}"), Dist())
    ref, got = HiddenStateStore(image_hf_store / "train"), HiddenStateStore(out / "train")
    assert got.manifest["image_dtype"] == FP8 and got.ids == ref.ids
    rows = 0
    for i in range(len(ref)):
        want, have = ref[i]["image_embeds"], got[i]["image_embeds"]
        assert have.dtype == want.dtype == torch.float32 and have.shape == want.shape
        amax = want.abs().amax(-1, keepdim=True) if len(want) else want
        assert bool(((have - want).abs() <= 2 ** -4 * want.abs() + 2 ** -10 * amax / 448).all())
        rows += len(want)
    assert rows > 0
