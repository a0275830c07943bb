"""Drafter config keys (eagle3/drafter/drafter_keys.py): a switch that changes the forward is refused by name, harmless
keys are accepted, unknown keys are reported and never written back, and this project's exports mean the
trained forward in every engine's reading of them.

Two kinds of drafters written "by SpecForge": with SpecForge 0.2.0's own code where it imports (it is not a
CI dependency: its wheel pins torch 2.11 and sglang), and everywhere as directories carrying exactly the keys
its `export_to_sglang` writes (SF_CONFIG, recorded from SpecForge 0.2.0 on transformers 5.24) with the
forward recomputed by `specforge_logits`, the math of its `LlamaForCausalLMEagle3` (project_hidden_states,
LlamaDecoderLayer.forward, compute_logits) written out independently here.
"""
import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from eagle3.drafter import drafter_keys as dk
from export import spec
from eagle3.drafter.drafter_io import DrafterLoadError, load_drafter_dir
from eagle3.drafter.model import DrafterConfig
from tests.fixtures.specforge_drafter import DV, SF_CONFIG, H, T, V, tiny_weights


# ------------------------------------------------------------------ the reference math (SpecForge 0.2.0)

def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def specforge_logits(w: dict, aux, embeds, *, norm_output=True, fc_norm=False):
    """Step-0 draft logits [T, DV] the way SpecForge 0.2.0 computes them, for aux [T, 3H], embeds [T, H]."""
    if fc_norm:  # project_hidden_states: one RMSNorm per aux chunk before fc
        aux = torch.cat([_rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(aux.chunk(3, -1))], -1)
    hidden = aux @ w["fc.weight"].T
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"]), _rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, 4, 4).transpose(0, 1)   # [heads, T, d]
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, 2, 4).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, 2, 4).transpose(0, 1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda t: torch.cat([-t[..., 2:], t[..., :2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)                       # GQA: 2 query heads per kv head
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, 16)
    h1 = hidden + att @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h1, w["midlayer.post_attention_layernorm.weight"])
    out = h1 + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    return (_rms(out, w["norm.weight"]) if norm_output else out) @ w["lm_head.weight"].T


def write_dir(path, config: dict, weights: dict):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 3 * H, generator=g), torch.randint(0, V, (T,), generator=g), torch.randn(V, H, generator=g)


@torch.no_grad()
def our_logits(model, aux, ids):
    pos = torch.arange(T)[None]
    return model.logits(model.step(ids[None], model.project_aux(aux[None]), pos))[0]


# ------------------------------------------------------------------ SpecForge's keys, CI-able

def test_specforge_default_layout_loads_exactly(tmp_path, caplog):
    w = tiny_weights()
    aux, ids, embed = inputs()
    with caplog.at_level(logging.WARNING):
        model = load_drafter_dir(write_dir(tmp_path / "d", SF_CONFIG, w), embed_tokens=embed, dtype=torch.float32)
    want = specforge_logits(w, aux, embed[ids])
    torch.testing.assert_close(our_logits(model, aux, ids), want, rtol=1e-5, atol=1e-5)
    assert "unknown_config_keys" not in model.load_report and "config keys" not in caplog.text  # all of them known


@pytest.mark.parametrize("switch, engines", [
    ({"norm_output": False}, ["SpecForge 0.2.0"]),
    ({"norm_output": True}, ["SGLang 0.5.14", "vLLM 0.34.0"]),
    ({"fc_norm": True}, ["SGLang 0.5.14", "vLLM 0.34.0", "SpecForge 0.2.0"]),
], ids=["norm_output_false", "norm_output_true", "fc_norm_true"])
def test_specforge_switches_are_refused_by_name(tmp_path, switch, engines):
    """Each switch makes some engine compute another forward (checked against the reference math), so the
    loader refuses it with one line naming the key, its value and the engines that honour it."""
    (name, value), = switch.items()
    w = tiny_weights(fc_norm=name == "fc_norm")
    aux, ids, embed = inputs()
    standard = specforge_logits(w, aux, embed[ids])
    variant = specforge_logits(w, aux, embed[ids], norm_output=switch.get("norm_output", True),
                               fc_norm=switch.get("fc_norm", False))
    if switch != {"norm_output": True}:  # true is SpecForge's standard forward (EAGLE-3.1's next-step hidden in SGLang)
        assert (variant - standard).abs().max() > 1e-2
    with pytest.raises(DrafterLoadError) as e:
        load_drafter_dir(write_dir(tmp_path / "d", {**SF_CONFIG, **switch}, w), embed_tokens=embed)
    line = str(e.value)
    assert f"{name}={json.dumps(value)}" in line and "\n" not in line
    assert all(n in line for n in engines) and "unexpected tensors" not in line


def test_unknown_keys_reported_and_never_written_back(tmp_path, caplog):
    cfg = {**SF_CONFIG, "some_vendor_key": 7, "eagle_config": {**SF_CONFIG["eagle_config"], "vendor_flag": 1}}
    with caplog.at_level(logging.WARNING):
        model = load_drafter_dir(write_dir(tmp_path / "d", cfg, tiny_weights()), embed_tokens=inputs()[2])
    assert model.load_report["unknown_config_keys"] == ["some_vendor_key", "eagle_config.vendor_flag"]
    assert "some_vendor_key" in caplog.text and "eagle_config.vendor_flag" in caplog.text
    out = model.config.to_hf_dict()
    assert "some_vendor_key" not in out and "vendor_flag" not in json.dumps(out)
    assert "transformers_version" not in out and "pretraining_tp" not in out  # harmless: accepted, not carried
    sg = spec.sglang_config(cfg, vocab_size=V, max_position_embeddings=64, hf_indices=[2, 3, 4], dtype="float32")
    assert "some_vendor_key" not in sg and not dk.check_config(sg).unknown


@pytest.mark.parametrize("change, needle", [
    ({"rope_theta": 5e5}, "rope_parameters.rope_theta"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "mrope_section": [1, 1]}}, "mrope_section"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"logit_scale": 2.0}, "vLLM 0.34.0"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config="),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": False}},
     "eagle_config.use_aux_hidden_state=false"),
    ({"layer_types": ["sliding_attention"]}, "layer_types="),
    ({"norm_before_residual": True}, "norm_before_residual=true"),
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"rope_parameters": None, "original_max_position_embeddings": 16,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}},
     "original_max_position_embeddings=16"),
])
def test_other_engine_switches_refused(change, needle):
    with pytest.raises(ValueError, match="changes the drafter|make them agree|not implemented") as e:
        DrafterConfig.from_hf_dict({**SF_CONFIG, **change})
    assert needle in str(e.value)


def test_standard_values_of_switches_are_accepted():
    ok = {"fc_norm": False, "norm_before_fc": False, "norm_before_residual": False, "logit_scale": 1.0,
          "layer_types": ["full_attention"], "num_aux_hidden_states": 3, "rope_is_neox_style": True}
    assert DrafterConfig.from_hf_dict({**SF_CONFIG, **ok}) == DrafterConfig.from_hf_dict(SF_CONFIG)


def test_every_switch_has_a_refused_value_that_names_it():
    """Every switch of the SGLang layout, set to a value some engine reads as another forward, is refused
    through the config reader (not only in the table)."""
    candidates = (True, False, None, 2, 0.5, "qwen3", ["LlamaForCausalLM"], ["sliding_attention"])
    checked = 0
    for k in dk.KEYS:
        if k.handling != dk.SWITCH or k.where not in ("top", "eagle_config") \
                or k.name == "original_max_position_embeddings":  # depends on rope_scaling: a case below
            continue
        bad = next(v for v in candidates if any(not r.ours(v, {}) for e, r in k.readings.items()
                                                 if e in dk.READERS["sglang"]))
        cfg = dict(SF_CONFIG, eagle_config=dict(SF_CONFIG["eagle_config"]))
        (cfg["eagle_config"] if k.where == "eagle_config" else cfg)[k.name] = bad
        with pytest.raises(ValueError) as e:
            DrafterConfig.from_hf_dict(cfg)
        assert f"{k.dotted}={json.dumps(bad)}" in str(e.value)
        checked += 1
    assert checked >= 20


# ------------------------------------------------------------------ speculators configs

def speculators_cfg(**top):
    sg = spec.sglang_config(SF_CONFIG, vocab_size=V, max_position_embeddings=64, hf_indices=[2, 3, 4], dtype="float32")
    sp = spec.speculators_config(sg, hf_indices=[2, 3, 4], verifier_path="/t", verifier_architectures=["X"],
                                 speculative_tokens=2)
    return {**sp, **top}


@pytest.mark.parametrize("switch", [{"norm_before_residual": True}, {"fc_norm": True}, {"norm_before_fc": True},
                                    {"norm_output": True}], ids=lambda s: next(iter(s)))
def test_speculators_switches_refused_by_name(switch):
    (name, value), = switch.items()
    with pytest.raises(ValueError) as e:
        spec.sglang_from_speculators(speculators_cfg(**switch))
    assert f"{name}=true" in str(e.value) and "vLLM 0.34.0" in str(e.value) and "speculators 0.9.0" in str(e.value)


def test_speculators_standard_config_reads_back():
    cfg = speculators_cfg(embed_requires_grad=False, speculators_version="0.9.0")
    back = DrafterConfig.from_hf_dict(spec.sglang_from_speculators(cfg))
    assert back == DrafterConfig.from_hf_dict(spec.sglang_config(
        SF_CONFIG, vocab_size=V, max_position_embeddings=64, hf_indices=[2, 3, 4], dtype="float32"))
    assert not dk.check_config(cfg, "speculators").unknown


# ------------------------------------------------------------------ exports, in each engine's reading

def test_exports_mean_the_trained_forward_in_every_engine():
    sg = spec.sglang_config(SF_CONFIG, vocab_size=V, max_position_embeddings=64, hf_indices=[2, 3, 4], dtype="float32")
    sp = speculators_cfg()
    assert dk.engine_reading_problems(sg, "sglang") == []
    assert dk.engine_reading_problems(sp, "speculators") == []
    # the speculators export writes every switch vLLM / speculators read, as false
    assert {k: sp[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == dict.fromkeys(
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False)
    assert "norm_output" not in sg  # either value means another forward to one of SGLang / SpecForge


@pytest.mark.parametrize("layout, edit, engine, needle", [
    ("speculators", lambda c: c.pop("norm_before_residual"), "vLLM 0.34.0", "absent, so its default true"),
    ("speculators", lambda c: c["transformer_layer_config"].pop("model_type"), "speculators 0.9.0", "model_type"),
    ("sglang", lambda c: c.update(norm_output=False), "SpecForge 0.2.0", "norm_output = false"),
    ("sglang", lambda c: c.update(norm_output=True), "SGLang 0.5.14", "norm_output = true"),
    ("sglang", lambda c: c.pop("num_hidden_layers"), "SGLang 0.5.14", "default 32"),
    ("sglang", lambda c: c["eagle_config"].update(use_aux_hidden_state=None), "vLLM 0.34.0", "use_aux_hidden_state"),
])
def test_engine_defaults_that_differ_are_caught(layout, edit, engine, needle):
    cfg = speculators_cfg() if layout == "speculators" else spec.sglang_config(
        SF_CONFIG, vocab_size=V, max_position_embeddings=64, hf_indices=[2, 3, 4], dtype="float32")
    edit(cfg)
    text = "\n".join(dk.engine_reading_problems(cfg, layout))
    assert engine in text and needle in text


def test_table_is_consistent():
    """What export writes means the trained forward to every engine reading that layout; every engine named
    has a source; table rows render."""
    for k in dk.KEYS:
        for layout, value in k.write.items():
            assert all(r.ours(value, {}) for e, r in k.readings.items() if e in dk.READERS[layout]), k.name
        assert set(k.readings) <= set(dk.ENGINES) <= set(dk.SOURCES)
    rows = dk.table_rows()
    norm_output = [r for r in rows if r["key"] == "norm_output" and r["layout"] == "sglang"][0]
    assert (norm_output["sglang"], norm_output["specforge"], norm_output["speculators"]) == ("false", "true", "not read")


# ------------------------------------------------------------------ with SpecForge's own code (not in CI)

@pytest.fixture
def specforge(monkeypatch):
    pytest.importorskip("specforge.export.to_sglang", reason="SpecForge 0.2.0 not installed (pip install --no-deps)")
    import specforge
    from specforge.modeling.draft.llama3_eagle import LlamaRMSNorm

    # its RMSNorm.forward is torch.compile'd: run the plain function (same math, no compiler on CPU)
    monkeypatch.setattr(LlamaRMSNorm, "forward", LlamaRMSNorm.forward.__wrapped__)
    return specforge


def _specforge_export(tmp_path, switch: dict):
    """A tiny drafter made and exported by SpecForge itself (model class, vocab mapping, export_to_sglang)."""
    from collections import Counter

    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.export.to_sglang import export_to_sglang
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    draft = {k: v for k, v in SF_CONFIG.items() if k not in ("transformers_version", "dtype", "rope_parameters")}
    (tmp_path / "draft.json").write_text(json.dumps({**draft, **switch}))
    torch.manual_seed(0)
    model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(tmp_path / "draft.json"))).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # norms away from 1, so a skipped norm shows
    d2t, t2d = process_token_dict_to_mappings(Counter({i: V - i for i in range(0, V, 2)}), DV, V)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    torch.save({"strategy": "eagle3", "draft_state_dict": model.state_dict()}, tmp_path / "training_state.pt")
    export_to_sglang(str(tmp_path / "training_state.pt"), str(tmp_path / "draft.json"), str(tmp_path / "out"))
    return model, tmp_path / "out"


def test_specforge_written_default_loads_exactly(tmp_path, specforge):
    sf, out = _specforge_export(tmp_path, {})
    aux, ids, embed = inputs()
    ours = load_drafter_dir(out, embed_tokens=embed, dtype=torch.float32)
    sf.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})  # its own weights, bf16-rounded by its export
    with torch.no_grad():
        want = sf.lm_head(sf(aux[None], embed[ids][None]))[0]  # forward = norm(midlayer(fc(aux)))
    torch.testing.assert_close(our_logits(ours, aux, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("switch, engine", [({"norm_output": False}, "SpecForge 0.2.0"),
                                            ({"norm_output": True}, "SGLang 0.5.14"),
                                            ({"fc_norm": True}, "SpecForge 0.2.0")],
                         ids=["norm_output_false", "norm_output_true", "fc_norm_true"])
def test_specforge_written_switches_refused(tmp_path, specforge, switch, engine):
    _, out = _specforge_export(tmp_path, switch)
    (name, value), = switch.items()
    with pytest.raises(DrafterLoadError, match=f"{name}={json.dumps(value)}.*{engine}"):
        load_drafter_dir(out, embed_tokens=inputs()[2])


def test_our_sglang_export_read_by_specforge(tmp_path, specforge):
    """SpecForge builds its model from this project's exported config (its key defaults apply) and, with the
    exported weights, computes the same logits as the project's loader."""
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    w = tiny_weights()
    sg = spec.sglang_config(SF_CONFIG, vocab_size=V, max_position_embeddings=64, hf_indices=[2, 3, 4], dtype="float32")
    d = write_dir(tmp_path / "export", sg, w)
    aux, ids, embed = inputs()
    ours = load_drafter_dir(d, embed_tokens=embed, dtype=torch.float32)
    sf = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(d / "config.json"))).float()
    assert sf.norm_output is True and sf.fc_norm is None
    missing, unexpected = sf.load_state_dict({**w, "embed_tokens.weight": embed}, strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        want = sf.compute_logits(sf.backbone(embed[ids][None], sf.project_hidden_states(aux[None]), None,
                                             _causal_mask(), torch.arange(T)[None]))[0]
    torch.testing.assert_close(our_logits(ours, aux, ids), want, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(want.abs().max()))


def _causal_mask():
    return torch.full((T, T), float("-inf")).triu(1)[None, None]
