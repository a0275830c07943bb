"""fp8 aux states in the hidden-state store: the pure per-row quantiser (eagle3/formats/fp8.py) and the
store option aux_dtype="float8_e4m3fn" (round trip within e4m3's precision, `last` exact, zero rows,
NaN/inf refused, resume with another format refused, about half the aux bytes on disk)."""
import json

import pytest
import torch

from eagle3.formats.fp8 import FP8_DTYPE, FP8_MAX, dequantise_rows, quantise_rows
from eagle3.formats.store import (HiddenStateStore, HiddenStateWriter, NonFiniteHiddenStateError, StoreError,
                                  StoreMismatchError, merge_stores)

H = 64
HF = [2, 30, 58]  # Kimi's aux hidden states h
LENGTHS = [5, 3, 7, 2, 6]
FP8 = "float8_e4m3fn"


def make_seq(i, T):
    g = torch.Generator().manual_seed(i)
    # rows of very different magnitudes (per-row scales matter), one outlier column like real residuals
    aux = torch.randn(T, 3, H, generator=g) * torch.logspace(-3, 3, 3 * T).view(T, 3, 1)
    aux[:, :, 0] *= 30
    return dict(seq_id=f"s{i}", input_ids=torch.randint(0, 100, (T,), generator=g),
                loss_mask=torch.randint(0, 2, (T,), generator=g).bool(),
                aux=aux.reshape(T, 3 * H), last=torch.randn(T, H, generator=g),
                target_argmax=torch.randint(0, 100, (T,), generator=g))


def writer(d, **kw):
    args = dict(hidden_size=H, target_hidden_size=H, hf_indices=HF, shard_tokens=10,
                meta={"target": "abc"})
    args.update(kw)
    return HiddenStateWriter(d, **args)


def write_all(d, **kw):
    w = writer(d, **kw)
    for i, T in enumerate(LENGTHS):
        w.add(**make_seq(i, T))
    return w.finish()


def assert_within_e4m3(x, y, scale):
    """|x - y| <= 2^-4 |x| (e4m3 normals: 3 mantissa bits, round to nearest) + 2^-10 scale (subnormals),
    plus bf16's rounding of the result (2^-8 relative); and per row max|err| / amax <= 2^-4."""
    x, y = x.float(), y.float()
    err = (x - y).abs()
    bound = 2 ** -4 * x.abs() + 2 ** -10 * scale.unsqueeze(-1) + 2 ** -8 * y.abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    amax = x.abs().amax(-1)
    row_rel = err.amax(-1) / torch.where(amax > 0, amax, torch.ones_like(amax))
    assert float(row_rel.max()) <= 2 ** -4


# -- the pure quantiser ---------------------------------------------------------------------------

def test_quantise_rows_hand_checked():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-448.0, 1.0, 3.0, 0.0]])
    codes, scale = quantise_rows(x)
    assert codes.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (3,)
    assert torch.equal(scale, torch.tensor([4.0, FP8_MAX, FP8_MAX]) * (1 / FP8_MAX))  # amax / 448; zero row: 1
    assert codes[0].float().tolist() == [112.0, -224.0, 56.0, 448.0]  # powers of two: exact
    assert codes[1].float().tolist() == [0.0] * 4
    assert dequantise_rows(codes, scale, torch.float32).tolist() == x.tolist()


def test_quantise_rows_error_bound_and_no_overflow():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 256, generator=g) * torch.logspace(-8, 8, 600).view(200, 3, 1)
    codes, scale = quantise_rows(x)
    assert bool(torch.isfinite(codes.float()).all())  # amax/scale never rounds past 448 into NaN
    assert codes.float().abs().amax(-1).eq(FP8_MAX).all()  # every row uses the full range
    assert_within_e4m3(x, dequantise_rows(codes, scale, torch.float32), scale)
    # and the bound is tight enough to fail: a 3-mantissa-bit code of 1.0625 is 1.0 or 1.125
    with pytest.raises(AssertionError):
        assert_within_e4m3(x, dequantise_rows(codes, scale * 1.07, torch.float32), scale)


def test_dequantise_rows_needs_one_scale_per_row():
    codes, scale = quantise_rows(torch.randn(4, 8))
    with pytest.raises(ValueError, match="one scale per row"):
        dequantise_rows(codes, scale[:3])


# -- the store option -----------------------------------------------------------------------------

def test_fp8_store_round_trip(tmp_path):
    m = write_all(tmp_path, aux_dtype=FP8)
    assert m["aux_dtype"] == FP8 and m["dtype"] == "bfloat16"
    store = HiddenStateStore(tmp_path, verify="sha256")
    assert store.aux_dtype == FP8 and store.lengths == LENGTHS
    for i in [4, 0, 2]:
        ref, got = make_seq(i, LENGTHS[i]), store[i]
        assert got["aux"].dtype == torch.bfloat16 and got["aux"].shape == (LENGTHS[i], 3 * H)
        x = ref["aux"].to(torch.bfloat16).view(-1, 3, H)  # quantised from the store dtype
        _, scale = quantise_rows(x)
        assert_within_e4m3(x, got["aux"].view(-1, 3, H), scale)
        assert not torch.equal(got["aux"], ref["aux"].to(torch.bfloat16))  # it really is quantised
        assert torch.equal(got["last"], ref["last"].to(torch.bfloat16))  # the teacher's input stays exact
        assert torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["loss_mask"], ref["loss_mask"])


def test_plain_store_is_unchanged(tmp_path):
    m = write_all(tmp_path)
    assert m["aux_dtype"] == "bfloat16"
    store = HiddenStateStore(tmp_path)
    for i, T in enumerate(LENGTHS):
        assert torch.equal(store[i]["aux"], make_seq(i, T)["aux"].to(torch.bfloat16))  # bit-exact
    from safetensors import safe_open
    with safe_open(str(tmp_path / m["shards"][0]["file"]), "pt") as f:
        assert set(f.keys()) == {"aux", "last", "input_ids", "loss_mask", "target_argmax", "offsets"}
        assert f.get_slice("aux").get_dtype() == "BF16"


def test_fp8_shards_are_standard_safetensors(tmp_path):
    from safetensors.torch import load_file
    m = write_all(tmp_path, aux_dtype=FP8)
    t = load_file(str(tmp_path / m["shards"][0]["file"]))
    assert t["aux"].dtype == FP8_DTYPE and t["aux_scale"].dtype == torch.float32
    assert t["aux_scale"].shape == (t["aux"].shape[0], len(HF))
    assert t["last"].dtype == torch.bfloat16


def test_zero_rows_round_trip_to_zero(tmp_path):
    w = writer(tmp_path, aux_dtype=FP8)
    s = make_seq(0, 4)
    s["aux"][1] = 0.0  # a whole token
    s["aux"][2, H:2 * H] = 0.0  # one layer of a token
    w.add(**s)
    w.finish()
    got = HiddenStateStore(tmp_path)[0]["aux"]
    assert bool(torch.isfinite(got).all())
    assert got[1].eq(0).all() and got[2, H:2 * H].eq(0).all()
    assert got[2, :H].ne(0).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_fp8_store_refuses_non_finite(tmp_path, bad):
    w = writer(tmp_path, aux_dtype=FP8)
    s = make_seq(0, 4)
    s["aux"][2, 5] = bad
    with pytest.raises(NonFiniteHiddenStateError, match="'s0'.*'aux'"):
        w.add(**s)
    w.add(**make_seq(1, 3))  # nothing of s0 was buffered
    w.finish()
    assert HiddenStateStore(tmp_path).ids == ["s1"]


def test_resume_with_other_aux_format_is_refused(tmp_path):
    w = writer(tmp_path / "a", aux_dtype=FP8)
    w.add(**make_seq(0, 4))
    w.finish()
    with pytest.raises(StoreMismatchError, match="aux_dtype: 'float8_e4m3fn' != 'bfloat16'"):
        writer(tmp_path / "a")
    write_all(tmp_path / "b")
    with pytest.raises(StoreMismatchError, match="aux_dtype"):
        writer(tmp_path / "b", aux_dtype=FP8)
    assert writer(tmp_path / "a", aux_dtype=FP8).done_ids == {"s0"}  # same format resumes


def test_old_store_without_aux_dtype_reads_and_resumes(tmp_path):
    """A manifest written before aux_dtype existed: aux is in `dtype`; a default writer resumes it."""
    w = writer(tmp_path)
    w.add(**make_seq(0, 4))
    w.finish()
    path = tmp_path / "manifest.json"
    m = json.loads(path.read_text())
    del m["aux_dtype"]
    path.write_text(json.dumps(m))
    store = HiddenStateStore(tmp_path)
    assert store.aux_dtype == "bfloat16" and torch.equal(store[0]["aux"], make_seq(0, 4)["aux"].to(torch.bfloat16))
    assert writer(tmp_path).done_ids == {"s0"}
    with pytest.raises(StoreMismatchError, match="aux_dtype"):
        writer(tmp_path, aux_dtype=FP8)


def test_unknown_aux_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="aux_dtype 'float16'"):
        writer(tmp_path / "w", aux_dtype="float16")
    write_all(tmp_path / "s", aux_dtype=FP8)
    path = tmp_path / "s" / "manifest.json"
    path.write_text(path.read_text().replace(FP8, "float4_e2m1"))
    with pytest.raises(StoreError, match="float4_e2m1"):
        HiddenStateStore(tmp_path / "s")


def test_merge_refuses_parts_of_different_formats(tmp_path):
    for name, kw in (("part-0", {"aux_dtype": FP8}), ("part-1", {})):
        w = writer(tmp_path / name, **kw)
        w.add(**make_seq(int(name[-1]), 3), order=int(name[-1]))
        w.finish()
    with pytest.raises(StoreMismatchError, match="aux_dtype"):
        merge_stores(tmp_path, [tmp_path / "part-0", tmp_path / "part-1"])


def test_fp8_halves_the_aux_bytes_on_disk(tmp_path):
    """Shard bytes per token: bf16 aux 3H x 2, fp8 aux 3H x 1 + 3 fp32 scales."""
    big = dict(hidden_size=512, target_hidden_size=512, shard_tokens=4096)
    sizes = {}
    for fmt in ("bfloat16", FP8):
        w = writer(tmp_path / fmt, aux_dtype=fmt, **big)
        g = torch.Generator().manual_seed(0)
        for i in range(4):
            w.add(f"s{i}", torch.zeros(256, dtype=torch.long), torch.ones(256, dtype=torch.bool),
                  torch.randn(256, 3 * 512, generator=g), torch.randn(256, 512, generator=g),
                  torch.zeros(256, dtype=torch.long))
        m = w.finish()
        sizes[fmt] = sum(s["bytes"] for s in m["shards"]) / m["num_tokens"]
    last_and_ids = 512 * 2 + 9
    aux_bf16, aux_fp8 = sizes["bfloat16"] - last_and_ids, sizes[FP8] - last_and_ids
    assert aux_bf16 == pytest.approx(3 * 512 * 2, abs=1)  # + the shard's header and offsets, amortised
    assert aux_fp8 == pytest.approx(3 * 512 + 3 * 4, abs=1)
    assert aux_fp8 / aux_bf16 < 0.51


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("background", [False, True])
def test_cuda_states_are_quantised_on_the_device(tmp_path, background):
    w = writer(tmp_path, aux_dtype=FP8, background=background)
    for i, T in enumerate(LENGTHS):
        s = make_seq(i, T)
        s["aux"], s["last"] = s["aux"].cuda(), s["last"].cuda()
        w.add(**s)
    w.finish()
    cpu = tmp_path / "cpu"
    write_all(cpu, aux_dtype=FP8)
    a, b = HiddenStateStore(tmp_path), HiddenStateStore(cpu)
    for i in range(len(LENGTHS)):
        assert torch.equal(a[i]["aux"], b[i]["aux"]) and torch.equal(a[i]["last"], b[i]["last"])


# -- the capture stage with aux_dtype=float8_e4m3fn ----------------------------------------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_k25_target, tiny_sharegpt_records):
    from data.prepare import run_prepare
    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.prepare import PrepareConfig

    root = tmp_path_factory.mktemp("fp8_prep")
    corpus = root / "short.jsonl"
    with open(corpus, "w") as f:
        for i, r in enumerate(tiny_sharegpt_records[:12]):
            turns = [{"from": t["from"], "value": " ".join(str(t["value"]).split()[:12])}
                     for t in r["conversations"][:2]]
            f.write(json.dumps({"id": f"c{i:02d}", "conversations": turns}) + "\n")
    cfg = compose("prepare", [f"paths.root={root}", f"target.path={tiny_k25_target}",
                              f"target.tokenizer={tiny_k25_target}", f"input={corpus}",
                              "max_length=64", "validation_fraction=0.5"])
    return run_prepare(to_schema(cfg, PrepareConfig))


def capture(tmp_path, target, prepared, out, *overrides):
    from data.capture import run_capture
    from data.capture_setup import Dist
    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.capture import CaptureConfig

    cfg = compose("capture", [f"paths.root={tmp_path}", f"target.path={target}", f"target.tokenizer={target}",
                              f"in_dir={prepared}", f"out_dir={tmp_path / out}", "progress=false",
                              "splits=[validation]", "limit=3", *overrides])
    return run_capture(to_schema(cfg, CaptureConfig), Dist())


def test_capture_stage_writes_fp8_aux(tmp_path, tiny_k25_target, prepared):
    plain = capture(tmp_path, tiny_k25_target, prepared, "bf16")
    fp8 = capture(tmp_path, tiny_k25_target, prepared, "fp8", f"aux_dtype={FP8}")
    m = json.loads((fp8 / "manifest.json").read_text())
    assert m["store_aux_dtype"] == FP8 and m["store_dtype"] == "bfloat16"
    assert m["bytes_per_token"] == 3 * (64 + 4) + 64 * 2 + 9  # fp8 aux + 3 fp32 scales, bf16 last, ids
    a, b = HiddenStateStore(plain / "validation"), HiddenStateStore(fp8 / "validation")
    assert b.aux_dtype == FP8 and a.aux_dtype == "bfloat16" and a.ids == b.ids and len(a) == 3
    for i in range(len(a)):
        x = a[i]["aux"].view(-1, 3, 64)
        assert_within_e4m3(x, b[i]["aux"].view(-1, 3, 64), quantise_rows(x)[1])
        assert torch.equal(a[i]["last"], b[i]["last"]) and torch.equal(a[i]["target_argmax"], b[i]["target_argmax"])
    from data.capture_plan import CaptureError
    with pytest.raises(CaptureError, match="aux_dtype"):  # the same out_dir in the other format is refused
        capture(tmp_path, tiny_k25_target, prepared, "fp8")


def test_capture_config_rejects_other_aux_dtypes():
    from eagle3.config.conf import ConfigError, compose, to_schema
    from eagle3.config.schema.capture import CaptureConfig

    assert to_schema(compose("capture", []), CaptureConfig).aux_dtype is None
    with pytest.raises(ConfigError, match="aux_dtype='float16'"):
        to_schema(compose("capture", ["aux_dtype=float16"]), CaptureConfig)
