"""`target=kimi_k25` on the Kimi-K2.5 release's own INT4 format (eagle3/formats/release_format.py): a tiny
checkpoint written with compressed-tensors' own quantiser and packer, captured through the real
capture stage, equals the same weights dequantised into a plain DeepSeek-V3 checkpoint (aux, post-norm
last state, argmax); and the checkpoints transformers would load wrongly without a word are refused."""
import importlib.util
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.capture import run_capture
from data.capture_setup import Dist
from data.mini_world.checkpoints import WEIGHTS
from data.mini_world.release_checkpoint import save_kimi_k25_release
from eagle3.formats import release_format
from eagle3.target_model import target_io
from eagle3.config.conf import compose, to_schema
from eagle3.config.schema.capture import CaptureConfig
from eagle3.formats.store import HiddenStateStore
from numeric_checks import assert_argmax_up_to_ties


def read_tensors(ckpt) -> dict:
    with safe_open(str(ckpt / WEIGHTS), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def release(tmp_path_factory, tiny_text_model, tiny_tokenizer):
    return save_kimi_k25_release(tiny_text_model, tiny_tokenizer, tmp_path_factory.mktemp("rel") / "k25-int4")


@pytest.fixture(scope="module")
def dequantized(tmp_path_factory, release):
    """The release checkpoint's text weights as a plain DeepseekV3ForCausalLM checkpoint: every INT4
    expert decompressed by compressed-tensors, names without the `language_model.` prefix."""
    out = tmp_path_factory.mktemp("deq") / "k25-dequantized"
    out.mkdir()
    tensors, plain = read_tensors(release), {}
    for name, t in tensors.items():
        if not name.startswith("language_model."):
            continue  # the vision tower
        m = release_format.ROUTED_EXPERT.match(name)
        if m and m["param"] == "weight_packed":
            mod = m["module"]
            t = release_format.dequantize_expert_weight(t, tensors[f"{mod}.weight_scale"], tensors[f"{mod}.weight_shape"])
            name = f"{mod}.weight"
        elif m and m["param"] != "weight":
            continue
        plain[name.removeprefix("language_model.")] = t
    save_file(plain, str(out / WEIGHTS), metadata={"format": "pt"})
    text = json.loads((release / "config.json").read_text())["text_config"]
    text.pop("quantization_config")
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(text))
    return out


def test_written_checkpoint_has_the_release_layout(release, tiny_text_model):
    cfg = json.loads((release / "config.json").read_text())
    assert cfg["quantization_config"] == release_format.RELEASE_QUANTIZATION_CONFIG
    assert cfg["text_config"]["quantization_config"] == release_format.RELEASE_QUANTIZATION_CONFIG
    t, tc = read_tensors(release), tiny_text_model.config
    H, I, E = tc.hidden_size, tc.moe_intermediate_size, tc.n_routed_experts
    for i in range(1, tc.num_hidden_layers):  # MoE layers: routed experts INT4, nothing else
        for e in range(E):
            for proj, (out_f, in_f) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
                p = f"language_model.model.layers.{i}.mlp.experts.{e}.{proj}_proj."
                assert p + "weight" not in t
                assert t[p + "weight_packed"].dtype == torch.int32 and t[p + "weight_packed"].shape == (out_f, in_f // 8)
                assert t[p + "weight_scale"].dtype == torch.bfloat16 and t[p + "weight_scale"].shape == (out_f, in_f // 32)
                assert t[p + "weight_shape"].dtype == torch.int32 and t[p + "weight_shape"].tolist() == [out_f, in_f]
        assert t[f"language_model.model.layers.{i}.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert t[f"language_model.model.layers.{i}.mlp.shared_experts.down_proj.weight"].dtype == torch.bfloat16
    assert t["language_model.model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # dense layer 0
    assert t["language_model.model.layers.3.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    assert t["language_model.lm_head.weight"].dtype == torch.bfloat16
    # 4-bit symmetric groups of 32: every weight within half a step of its group's scale (plus the bf16
    # rounding of scale and result: 0.55)
    w = tiny_text_model.model.layers[2].mlp.experts.down_proj[1].detach().to(torch.bfloat16).float()  # [H, I]
    p = "language_model.model.layers.2.mlp.experts.1.down_proj."
    back = release_format.dequantize_expert_weight(t[p + "weight_packed"], t[p + "weight_scale"], t[p + "weight_shape"])
    step = t[p + "weight_scale"].float().repeat_interleave(32, dim=1)
    assert ((back.float() - w).abs() <= 0.55 * step).all()
    assert (back.float() - w).abs().max() > 1e-4  # and it is really quantised


def test_loaded_experts_are_the_dequantised_int4_weights(release, dequantized, tiny_text_model):
    model, _ = target_io.load_target(release, "kimi_k25", "float32")
    ref, _ = target_io.load_target(dequantized, "causal_lm", "float32")
    got = target_io.decoder_layers(model)[3].mlp.experts
    want = target_io.decoder_layers(ref)[3].mlp.experts
    orig = tiny_text_model.model.layers[3].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
        assert (getattr(got, name) - getattr(orig, name)).abs().max() > 1e-4  # not the unquantised weights


def capture_cfg(tmp_path, target, layout, prepared, out):
    cfg = compose("capture", [f"paths.root={tmp_path}", f"target.path={target}", f"target.tokenizer={target}",
                              f"target.layout={layout}", "target.dtype=float32", "target.device_map=null",
                              f"in_dir={prepared}", f"out_dir={tmp_path / out}", "dtype=float32", "splits=[train]",
                              "progress=false", "max_tokens_per_batch=128", "shard_tokens=256"])
    return to_schema(cfg, CaptureConfig)


def test_capture_from_release_equals_dequantised_plain_model(tmp_path, release, dequantized, tiny_tokenizer,
                                                             tiny_corpus_jsonl):
    from data.prepare import run_prepare
    from eagle3.config.schema.prepare import PrepareConfig

    for f in tiny_tokenizer.iterdir():  # the plain checkpoint gets the same tokenizer files
        shutil.copy2(f, dequantized / f.name)
    prep = run_prepare(to_schema(compose("prepare", [
        f"paths.root={tmp_path}", f"target.path={release}", f"target.tokenizer={release}", f"input={tiny_corpus_jsonl}",
        "max_length=40", "max_records=12", "validation_fraction=0.0"]), PrepareConfig))
    got = HiddenStateStore(run_capture(capture_cfg(tmp_path, release, "kimi_k25", prep, "int4"), Dist()) / "train")
    want = HiddenStateStore(run_capture(capture_cfg(tmp_path, dequantized, "causal_lm", prep, "deq"), Dist()) / "train")
    assert len(got) == len(want) >= 4 and got.hf_indices == want.hf_indices
    head = target_io.lm_head(target_io.load_target(dequantized, "causal_lm", "float32")[0])
    for i in range(len(got)):
        a, b = got[i], want[i]
        assert a["id"] == b["id"]
        torch.testing.assert_close(a["aux"], b["aux"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a["last"], b["last"], rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # both captures chose the top token of the same logits (up to float-noise ties)
            logits = head(b["last"])
        assert_argmax_up_to_ties(a["target_argmax"], logits, tol=1e-4)
        assert_argmax_up_to_ties(b["target_argmax"], logits, tol=1e-4)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(ckpt, fn):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(fn(cfg)))
    return ckpt


def _drop_tensor(ckpt, name):
    t = read_tensors(ckpt)
    del t[name]
    save_file(t, str(ckpt / WEIGHTS), metadata={"format": "pt"})


def test_mismatched_checkpoints_are_refused_before_loading(tmp_path, release, tiny_k25_target, monkeypatch):
    def no_quant(cfg):
        cfg.pop("quantization_config"), cfg["text_config"].pop("quantization_config")
        return cfg

    with pytest.raises(target_io.TargetError, match="stored INT4 .* no compressed-tensors pack-quantized"):
        target_io.load_target(_edit_config(_copy(release, tmp_path / "a"), no_quant), "kimi_k25")
    plain = _edit_config(_copy(tiny_k25_target, tmp_path / "b"), release_format.with_release_quantization)
    with pytest.raises(target_io.TargetError, match="stored as plain `weight`"):
        target_io.load_target(plain, "kimi_k25")
    partial = _copy(release, tmp_path / "c")
    _drop_tensor(partial, "language_model.model.layers.4.mlp.experts.2.up_proj.weight_scale")
    with pytest.raises(target_io.TargetError, match=r"layers\.4\.mlp\.experts\.2\.up_proj has no \['weight_scale'\]"):
        target_io.load_target(partial, "kimi_k25")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "compressed_tensors" else real_find_spec(name, *a))
    with pytest.raises(target_io.TargetError, match="install the `compressed-tensors` package"):
        target_io.load_target(release, "kimi_k25")


def test_missing_text_weight_is_an_error_not_a_random_init(tmp_path, tiny_k25_target):
    damaged = _copy(tiny_k25_target, tmp_path / "damaged")
    _drop_tensor(damaged, "language_model.model.layers.3.self_attn.o_proj.weight")
    with pytest.raises(target_io.TargetError, match=r"1 text-model weights not in the checkpoint .*layers\.3\.self_attn"):
        target_io.load_target(damaged, "kimi_k25")
