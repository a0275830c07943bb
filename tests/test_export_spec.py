"""The pure export spec: expected names/shapes per format, the validators, the config builders."""
import pytest
import torch

from export import spec
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.vocab_map import d2t_from_ids, t2d_from_ids

TINY = dict(hidden_size=16, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=50, draft_vocab_size=12, target_hidden_size=24, aux_hf_indices=[2, 3, 5],
            rope_theta=10000.0, max_position_embeddings=128)
# The published Kimi-K2.5 EAGLE-3 drafter shape (docs/design.md "Sources").
K25 = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64, head_dim=128,
           vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168, aux_hf_indices=[2, 30, 58],
           rope_theta=1e6, max_position_embeddings=131072)


def tiny_drafter(seed=0, **over):
    torch.manual_seed(seed)
    cfg = DrafterConfig(**{**TINY, **over})
    model = Eagle3Drafter(cfg)
    ids = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    model.set_vocab_mapping(d2t_from_ids(ids), t2d_from_ids(ids, cfg.vocab_size))
    return model


def shape_of(cfg: DrafterConfig) -> spec.DrafterShape:
    return spec.DrafterShape.from_hf_dict(cfg.to_hf_dict())


@pytest.mark.parametrize("dims", [TINY, K25], ids=["tiny", "kimi_k25"])
def test_spec_equals_the_model_export_state_dict(dims):
    """The spec is written independently of the model; both must name and shape the same tensors."""
    cfg = DrafterConfig(**dims)
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    state = model.export_state_dict()
    expected = spec.expected_tensors(shape_of(cfg), "sglang", torch.float32)
    assert set(state) == set(expected)
    for name, t in state.items():
        assert tuple(t.shape) == expected[name].shape, name
        assert t.dtype == expected[name].dtype, name
    assert "embed_tokens.weight" not in expected


def test_real_k25_shapes_spot_checked_by_hand():
    expected = spec.expected_tensors(shape_of(DrafterConfig(**K25)), "sglang")
    assert expected["fc.weight"].shape == (7168, 3 * 7168)
    assert expected["midlayer.self_attn.q_proj.weight"].shape == (64 * 128, 2 * 7168)
    assert expected["lm_head.weight"].shape == (32000, 7168)
    assert expected["t2d"] == spec.TensorSpec((163840,), torch.bool)
    assert expected["d2t"] == spec.TensorSpec((32000,), torch.int64)
    assert expected["midlayer.mlp.down_proj.weight"].dtype == torch.bfloat16


def test_speculators_names_are_layers_0_and_map_back():
    shape = shape_of(DrafterConfig(**TINY))
    sg, sp = spec.expected_tensors(shape, "sglang"), spec.expected_tensors(shape, "speculators")
    assert not any(n.startswith("midlayer.") for n in sp)
    assert "layers.0.self_attn.q_proj.weight" in sp and "layers.0.hidden_norm.weight" in sp
    assert {spec.from_format_name(n, "speculators") for n in sp} == set(sg)
    assert {spec.to_format_name(n, "speculators") for n in sg} == set(sp)
    for n in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"):
        assert n in sp
    with pytest.raises(ValueError, match="unknown export format"):
        spec.to_format_name("fc.weight", "onnx")


def test_tensor_problems_name_every_fault_at_once():
    model = tiny_drafter()
    expected = spec.expected_tensors(shape_of(model.config), "sglang", torch.float32)
    good = model.export_state_dict()
    assert spec.tensor_problems(good, expected) == []
    bad = dict(good)
    bad["midlayer.self_attn.qproj.weight"] = bad.pop("midlayer.self_attn.q_proj.weight")  # renamed
    bad["fc.weight"] = torch.zeros(16, 16)                                                 # wrong shape
    del bad["d2t"]                                                                         # missing
    bad["norm.weight"] = bad["norm.weight"].half()                                         # wrong dtype
    bad["embed_tokens.weight"] = torch.zeros(50, 16)                                       # not exported
    problems = spec.tensor_problems(bad, expected)
    text = "\n".join(problems)
    assert "missing tensor 'midlayer.self_attn.q_proj.weight'" in text
    assert "unexpected tensor 'midlayer.self_attn.qproj.weight'" in text
    assert "missing tensor 'd2t'" in text
    assert "'fc.weight' has shape [16, 16], expected [16, 72]" in text
    assert "'norm.weight' has dtype float16, expected float32" in text
    assert "unexpected tensor 'embed_tokens.weight'" in text
    assert len(problems) == 6


def test_rename_hint_points_at_the_intended_name():
    expected = spec.expected_tensors(shape_of(DrafterConfig(**TINY)), "sglang")
    problems = spec.tensor_problems({"layers.0.mlp.up_proj.weight": torch.zeros(40, 16)}, expected)
    assert any("did you mean 'midlayer.mlp.up_proj.weight'" in p for p in problems)


def test_vocab_mapping_consistent_pair_passes_and_breakages_are_named():
    ids = torch.tensor([1, 4, 5, 9])
    d2t, t2d = d2t_from_ids(ids), t2d_from_ids(ids, 12)
    assert spec.vocab_mapping_problems(d2t, t2d, 4, 12) == []
    # t2d marks one token d2t does not map to (and misses one it does)
    t2d_bad = t2d.clone()
    t2d_bad[4], t2d_bad[6] = False, True
    assert any("t2d does not mark" in p for p in spec.vocab_mapping_problems(d2t, t2d_bad, 4, 12))
    # t2d marks an extra token
    t2d_extra = t2d.clone()
    t2d_extra[0] = True
    assert any("t2d marks 5 target ids, expected 4" in p for p in spec.vocab_mapping_problems(d2t, t2d_extra, 4, 12))
    # unsorted draft vocab: a valid set, shuffled order
    shuffled = torch.tensor([4, 1, 5, 9])
    d2t_unsorted = shuffled - torch.arange(4)
    assert any("strictly increasing" in p for p in spec.vocab_mapping_problems(d2t_unsorted, t2d, 4, 12))
    # out of range and wrong dtypes
    assert any("outside" in p for p in spec.vocab_mapping_problems(d2t + 5, t2d, 4, 12))
    probs = spec.vocab_mapping_problems(d2t.int(), t2d.to(torch.uint8), 4, 12)
    assert any("d2t has dtype int32" in p for p in probs) and any("t2d has dtype uint8" in p for p in probs)
    # sizes disagreeing with the config
    assert any("expected [5]" in p for p in spec.vocab_mapping_problems(d2t, t2d, 5, 12))


def test_nonfinite_weights_are_reported():
    probs = spec.nonfinite_problems({"fc.weight": torch.tensor([1.0, float("nan"), float("inf")]),
                                     "d2t": torch.zeros(3, dtype=torch.int64)})
    assert probs == ["tensor 'fc.weight' has 2 non-finite values"]


def test_sglang_config_takes_target_context_and_capture_ids():
    cfg = DrafterConfig(**{**K25, "aux_hf_indices": [2, 3, 4]}).to_hf_dict()  # stale ids, K2's 131072
    out = spec.sglang_config(cfg, vocab_size=163840, max_position_embeddings=262144, hf_indices=[2, 30, 58],
                             dtype="bfloat16")
    assert out["architectures"] == ["LlamaForCausalLMEagle3"]
    assert out["max_position_embeddings"] == 262144
    # h [2, 30, 58] as ids [1, 29, 57]: the form every SGLang version reads as h
    assert out["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}
    assert out["eagle3_aux_hidden_states"]["sglang_versions"] == "every version"
    assert out["vocab_size"] == 163840 and out["draft_vocab_size"] == 32000
    assert out["rope_theta"] == 1e6 and out["rope_scaling"] is None
    assert out["tie_word_embeddings"] is False and out["num_hidden_layers"] == 1
    assert out["torch_dtype"] == "bfloat16"
    assert spec.sglang_config_problems(out, vocab_size=163840, draft_vocab_size=32000, max_position_embeddings=262144,
                                       hf_indices=[2, 30, 58], dtype="bfloat16", rope=(1e6, None)) == []
    # the drafter as shipped (131072, ids from another capture) fails with both named
    probs = spec.sglang_config_problems(cfg, vocab_size=163840, draft_vocab_size=32000, max_position_embeddings=262144,
                                        hf_indices=[2, 30, 58], dtype="bfloat16")
    text = "\n".join(probs)
    assert "max_position_embeddings=131072" in text and "262144" in text
    assert "trained on h = [2, 30, 58]; expected [1, 29, 57]" in text


def test_sglang_config_problems_catch_each_silent_trap():
    good = spec.sglang_config(DrafterConfig(**TINY).to_hf_dict(), vocab_size=50, max_position_embeddings=256,
                              hf_indices=[2, 3, 5], dtype="bfloat16")
    kw = dict(vocab_size=50, draft_vocab_size=12, max_position_embeddings=256, hf_indices=[2, 3, 5],
              dtype="bfloat16", rope=(10000.0, None))
    assert spec.sglang_config_problems(good, **kw) == []
    cases = {
        "tie_word_embeddings": ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
        "no eagle_config": ({"eagle_config": None}, "no eagle_config"),
        # ids equal to h: right for current SGLang, one layer off for older SGLang, and the config does not say so
        "ids one off": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 5], "use_aux_hidden_state": True}},
                        "mean h = [2, 3, 5] only in SGLang with PR #25454"),
        "ids of other states": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 4, 6],
                                                  "use_aux_hidden_state": True}}, "trained on h = [2, 3, 5]"),
        "vocab": ({"vocab_size": 12}, "vocab_size=12"),
        "draft vocab": ({"draft_vocab_size": 50}, "draft_vocab_size=50"),
        "rope": ({"rope_theta": 5e5}, "rope settings"),
        "arch": ({"architectures": ["LlamaForCausalLM"]}, "architectures="),
        "dtype": ({"torch_dtype": "float32"}, "torch_dtype='float32'"),
    }
    for name, (change, needle) in cases.items():
        probs = spec.sglang_config_problems({**good, **change}, **kw)
        assert any(needle in p for p in probs), (name, probs)


def test_speculators_config_fields_and_inverse():
    sg = spec.sglang_config(DrafterConfig(**K25).to_hf_dict(), vocab_size=163840, max_position_embeddings=262144,
                            hf_indices=[2, 30, 58], dtype="bfloat16")
    sp = spec.speculators_config(sg, hf_indices=[2, 30, 58], verifier_path="/models/Kimi-K2.5",
                                 verifier_architectures=["KimiK25ForConditionalGeneration"], speculative_tokens=3)
    assert sp["architectures"] == ["Eagle3Speculator"] and sp["speculators_model_type"] == "eagle3"
    assert sp["norm_before_residual"] is False
    assert sp["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # vLLM reads ids as h
    assert sp["draft_vocab_size"] == 32000 and sp["target_hidden_size"] == 7168
    layer = sp["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == 163840
    assert layer["max_position_embeddings"] == 262144 and layer["num_hidden_layers"] == 1
    sc = sp["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 3,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert sc["verifier"] == {"name_or_path": "/models/Kimi-K2.5",
                              "architectures": ["KimiK25ForConditionalGeneration"]}
    kw = dict(vocab_size=163840, draft_vocab_size=32000, max_position_embeddings=262144, dtype="bfloat16",
              rope=(1e6, None))
    assert spec.speculators_config_problems(sp, hf_indices=[2, 30, 58], **kw) == []
    assert any("vLLM would capture other states" in p
               for p in spec.speculators_config_problems(sp, hf_indices=[3, 31, 59], **kw))
    broken = {**sp, "norm_before_residual": None, "speculators_config": {**sc, "verifier": {}}}
    text = "\n".join(spec.speculators_config_problems(broken, hf_indices=[2, 30, 58], **kw))
    assert "norm_before_residual" in text and "verifier.name_or_path" in text
    # back to an SGLang config our DrafterConfig parses to the same drafter
    back = DrafterConfig.from_hf_dict(spec.sglang_from_speculators(sp))
    assert back == DrafterConfig.from_hf_dict(sg)


def test_exported_config_must_state_its_rope():
    """model.rope_settings reads an absent theta as 10000; an exported config is still asked to state it."""
    good = spec.sglang_config(DrafterConfig(**TINY).to_hf_dict(), vocab_size=50, max_position_embeddings=256,
                              hf_indices=[2, 3, 4], dtype="bfloat16")
    kw = dict(vocab_size=50, draft_vocab_size=good["draft_vocab_size"], max_position_embeddings=256,
              hf_indices=[2, 3, 4], dtype="bfloat16", rope=(good["rope_theta"], None))
    assert spec.sglang_config_problems(good, **kw) == []
    bare = {k: v for k, v in good.items() if k != "rope_theta"}
    assert [p for p in spec.sglang_config_problems(bare, **kw) if "rope" in p] == [
        "config has no rope_theta (nor rope_parameters.rope_theta): engines would assume 10000; the export "
        "writes the trained value"]
    moved = {**bare, "rope_parameters": {"rope_theta": good["rope_theta"], "rope_type": "default"}}
    assert spec.sglang_config_problems(moved, **kw) == []
    assert any("differ from training" in p for p in spec.sglang_config_problems(good, **{**kw, "rope": (5e5, None)}))


# --- what the servers' loaders do with these names (their load_weights logic, restated from the sources) ----

SGLANG_PARAMS = {  # LlamaForCausalLMEagle3.named_parameters() (q/k/v and gate/up fused)
    "model.embed_tokens.weight", "model.fc.weight", "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight", "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight", "model.midlayer.input_layernorm.weight",
    "model.midlayer.hidden_norm.weight", "model.midlayer.post_attention_layernorm.weight",
    "model.norm.weight", "lm_head.weight"}
VLLM_PARAMS = {  # Eagle3LlamaForCausalLM.named_parameters()
    "model.embed_tokens.weight", "model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.hidden_norm.weight", "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}
STACKED = ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj"))


def sglang_target(name):
    """SGLang's load_weights: d2t -> hot_token_id, t2d skipped, fused names, `model.` prefix fallback;
    a name that still matches no parameter is dropped without a word (None here)."""
    if "d2t" in name or "t2d" in name:
        return "<consumed>"
    for fused, part in STACKED:
        if part in name:
            name = name.replace(part, fused)
            break
    for cand in (name, f"model.{name}"):
        if cand in SGLANG_PARAMS:
            return cand
    return None


def vllm_target(name):
    """vLLM's Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights (speculators names)."""
    if "t2d" in name:
        return "<consumed>"
    if "d2t" in name:
        return "draft_id_to_target_id"
    name = name if "lm_head" in name else "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for fused, part in STACKED:
        if part in name:
            name = name.replace(part, fused)
            break
    return name if name in VLLM_PARAMS else None


@pytest.mark.parametrize("fmt,target,params", [("sglang", sglang_target, SGLANG_PARAMS),
                                                ("speculators", vllm_target, VLLM_PARAMS)])
def test_every_exported_name_lands_in_a_server_parameter(fmt, target, params):
    names = spec.expected_tensors(shape_of(DrafterConfig(**TINY)), fmt)
    landed = {n: target(n) for n in names}
    assert [n for n, t in landed.items() if t is None] == []          # nothing silently dropped
    # every server parameter but the (target's, shared) embedding receives a tensor
    assert params - set(landed.values()) == {"model.embed_tokens.weight"}
    # and the mistakes the validator exists for really are silent on the server side: a misspelt weight,
    # and the other format's layer prefix
    other_prefix = {"sglang": "layers.0.mlp.up_proj.weight", "speculators": "midlayers.0.mlp.up_proj.weight"}[fmt]
    assert target("midlayer.self_attn.qproj.weight") is None
    assert target(other_prefix) is None


def test_exported_configs_parse_as_transformers_configs():
    """SGLang reads the draft config with AutoConfig (model_type llama); speculators builds a LlamaConfig
    from transformer_layer_config."""
    from transformers import LlamaConfig

    sg = spec.sglang_config(DrafterConfig(**TINY).to_hf_dict(), vocab_size=50, max_position_embeddings=4096,
                            hf_indices=[2, 3, 5], dtype="bfloat16")
    cfg = LlamaConfig(**{k: v for k, v in sg.items() if k != "model_type"})
    assert cfg.draft_vocab_size == 12 and cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert cfg.tie_word_embeddings is False and cfg.max_position_embeddings == 4096 and cfg.head_dim == 8
    assert cfg.num_hidden_layers == 1 and cfg.target_hidden_size == 24
    sp = spec.speculators_config(sg, hf_indices=[2, 3, 5], verifier_path="/t", verifier_architectures=["X"],
                                 speculative_tokens=2)
    layer = LlamaConfig(**{k: v for k, v in sp["transformer_layer_config"].items() if k != "model_type"})
    assert layer.vocab_size == 50 and layer.hidden_size == 16 and layer.num_key_value_heads == 2
