"""What an exported EAGLE-3 drafter directory must contain, per serving format (pure: dicts and
tensors in, problem lists out; no file I/O).

Two formats:
- ``sglang``: SGLang's ``LlamaForCausalLMEagle3`` (also the SpecForge / AQ-MedAI layout). Weights
  ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``. SGLang's loader
  prefixes unknown names with ``model.`` and silently drops whatever still does not match a parameter,
  so a misspelt weight would leave a randomly initialised one in the served drafter: every name is checked.
- ``speculators``: vLLM's speculators ``Eagle3Speculator``. Same tensors, the decoder layer named
  ``layers.0.*`` instead of ``midlayer.*``.

Embeddings are the target's (SGLang calls ``set_embed``; vLLM shares the target's when the checkpoint has
none), so neither format ships ``embed_tokens``.

Aux layer ids: each engine turns a config's ids into Hugging Face hidden-state indices h by its own rule
(eagle3/engines/aux_layers.py, with the source lines). The SGLang config carries ids that mean the trained h in
every SGLang version where such a list exists (h [2, 30, 58] -> ids [1, 29, 57]), else the current rule's
ids plus a version requirement (`aux_layers.META_KEY`); the speculators config carries vLLM's ids (= h).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from eagle3.engines import aux_layers
from eagle3.drafter import drafter_keys
from eagle3.drafter import vocab_map
from eagle3.drafter.model import DEFAULT_ROPE_THETA, DrafterConfig, DrafterShape, rope_settings  # noqa: F401  (DrafterShape: re-exported)
from eagle3.config.choices import EXPORT_FORMAT_CHOICES, EXPORT_FORMATS

FORMATS, FORMAT_CHOICES = EXPORT_FORMATS, EXPORT_FORMAT_CHOICES  # export.format's choices (eagle3/config/choices.py)
LAYER_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}
SGLANG_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
# Names (after the layer prefix) of the one decoder layer, and the tensors outside it.
LAYER_WEIGHTS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)
TOP_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight")
VOCAB_BUFFERS = ("d2t", "t2d")
# The target's input embedding: never in the SGLang directory; in the speculators one only on request (export's
# speculators_embed), equal to the target's, for speculators' Python API (vLLM shares the target's either way).
EMBED = "embed_tokens.weight"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"  # every format's two files


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


# ---------------------------------------------------------------- names

def to_format_name(name: str, fmt: str) -> str:
    """An SGLang (canonical) weight name -> its name in `fmt`."""
    _check_format(fmt)
    canon = LAYER_PREFIX["sglang"]
    if fmt != "sglang" and name.startswith(canon):
        return LAYER_PREFIX[fmt] + name[len(canon):]
    return name


def from_format_name(name: str, fmt: str) -> str:
    """A weight name in `fmt` -> the SGLang (canonical) name (inverse of `to_format_name`)."""
    _check_format(fmt)
    prefix = LAYER_PREFIX[fmt]
    if fmt != "sglang" and name.startswith(prefix):
        return LAYER_PREFIX["sglang"] + name[len(prefix):]
    return name


def expected_tensors(shape: DrafterShape, fmt: str = "sglang", dtype: torch.dtype = torch.bfloat16,
                     embed: bool = False) -> dict[str, TensorSpec]:
    """Every tensor the `fmt` directory must hold, with shape and dtype; nothing else is allowed (`embed`: the
    speculators directory also holds the target's embedding)."""
    h, ht, i = shape.hidden_size, shape.target_hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = {
        "self_attn.q_proj.weight": (q, 2 * h),     # attends over [norm(embed), norm(hidden)]: 2H wide
        "self_attn.k_proj.weight": (kv, 2 * h),
        "self_attn.v_proj.weight": (kv, 2 * h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "hidden_norm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    spec = {to_format_name(LAYER_PREFIX["sglang"] + k, fmt): TensorSpec(v, dtype) for k, v in layer.items()}
    spec["fc.weight"] = TensorSpec((h, 3 * ht), dtype)          # 3 concatenated target aux states -> H
    spec["norm.weight"] = TensorSpec((h,), dtype)
    spec["lm_head.weight"] = TensorSpec((shape.draft_vocab_size, h), dtype)
    spec["d2t"] = TensorSpec((shape.draft_vocab_size,), torch.int64)   # offsets: target id = i + d2t[i]
    spec["t2d"] = TensorSpec((shape.vocab_size,), torch.bool)          # mask over the target vocab
    if embed:
        if fmt != "speculators":
            raise ValueError(f"the target's embedding is exported only into the speculators directory, not {fmt!r}")
        spec[EMBED] = TensorSpec((shape.vocab_size, h), dtype)          # the target's, [V, H]
    return spec


# ---------------------------------------------------------------- tensor checks

def tensor_problems(tensors: Mapping[str, Any], expected: Mapping[str, TensorSpec]) -> list[str]:
    """Missing / unexpected names, wrong shapes or dtypes. `tensors` values need `.shape` and `.dtype`
    (tensors, or safetensors slices mapped to torch dtypes by the caller)."""
    problems = []
    for name in sorted(set(expected) - set(tensors)):
        problems.append(f"missing tensor {name!r} (expected shape {list(expected[name].shape)}, "
                        f"{_dtype_name(expected[name].dtype)})")
    for name in sorted(set(tensors) - set(expected)):
        hint = _rename_hint(name, expected)
        problems.append(f"unexpected tensor {name!r} shape {list(tensors[name].shape)}: the server would "
                        f"silently ignore it{hint}")
    for name in sorted(set(tensors) & set(expected)):
        got, want = tensors[name], expected[name]
        if tuple(got.shape) != want.shape:
            problems.append(f"tensor {name!r} has shape {list(got.shape)}, expected {list(want.shape)}")
        if got.dtype != want.dtype:
            problems.append(f"tensor {name!r} has dtype {_dtype_name(got.dtype)}, expected {_dtype_name(want.dtype)}")
    return problems


def nonfinite_problems(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Floating tensors holding NaN/inf (a diverged run must not be shipped)."""
    out = []
    for name, t in tensors.items():
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                out.append(f"tensor {name!r} has {bad} non-finite values")
    return out


def vocab_mapping_problems(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int
                           ) -> list[str]:
    """`d2t` (int64 offsets, [draft_V]) and `t2d` (bool, [V]) must describe the same draft vocab (the
    project's one check, `vocab_map.mapping_problems`), stored with the dtypes servers expect, and sorted
    by target id (`vocab_map.order_problems`): loaders that use `t2d` (`logits[..., t2d]`) read the draft
    vocab in id order, so an unsorted d2t means shuffled logits."""
    problems = []
    if d2t.dtype != torch.int64:
        problems.append(f"d2t has dtype {_dtype_name(d2t.dtype)}, expected int64 offsets")
    if t2d.dtype != torch.bool:
        problems.append(f"t2d has dtype {_dtype_name(t2d.dtype)}, expected bool")
    core = vocab_map.mapping_problems(d2t, t2d, draft_vocab_size, vocab_size)
    return problems + core + ([] if core else vocab_map.order_problems(d2t))


def embed_problems(stored: torch.Tensor, target: torch.Tensor) -> list[str]:
    """A shipped embedding must be the target's (rounded to the stored dtype), or the drafter reads other
    token vectors than the ones it was trained with."""
    if tuple(stored.shape) != tuple(target.shape):
        return [f"tensor {EMBED!r} has shape {list(stored.shape)}, the target's embedding {list(target.shape)}"]
    if not torch.equal(stored, target.to(stored.dtype)):
        diff = (stored.double() - target.double()).abs().max().item()
        return [f"tensor {EMBED!r} is not the target's embedding (max |diff| {diff:.3g})"]
    return []



# ---------------------------------------------------------------- configs

# fields DrafterConfig.to_hf_dict writes that a served config carries only where its source had them
_OPTIONAL_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")


def served_sglang_config(served: DrafterConfig, source: Mapping[str, Any]) -> dict:
    """The SGLang `config.json` of the served drafter: `served` written by the one SGLang config writer
    (DrafterConfig.to_hf_dict: architecture, sizes, rope, ids every SGLang version reads as its h), over the
    source config's other keys that an engine reads with this drafter's meaning (drafter_keys; unknown and
    harmless ones are dropped). The optional token ids and initializer_range are written only where the source
    states them."""
    keep = set(drafter_keys.served_keys("top")) - {"rope_parameters", "dtype"}
    cfg = {k: v for k, v in source.items() if k in keep}
    cfg.update({k: v for k, v in served.to_hf_dict().items() if k not in _OPTIONAL_FIELDS or k in source})
    return cfg


def sglang_config(drafter_cfg: Mapping[str, Any], *, vocab_size: int, max_position_embeddings: int,
                  hf_indices: Sequence[int], dtype: str) -> dict:
    """The SGLang `config.json` for a drafter config dict (parsed once into a DrafterConfig) with the
    serving-critical fields set from the target and the capture (not from whatever the init drafter shipped
    with). `hf_indices`: the h the drafter was trained on."""
    drafter_keys.check_config(drafter_cfg, "sglang").raise_if_refused("checkpoint config")
    source = {**drafter_cfg, "vocab_size": vocab_size}  # an absent draft_vocab_size reads as the target's vocab
    served = DrafterConfig.from_hf_dict(source).replace(max_position_embeddings=int(max_position_embeddings),
                                                        aux_hf_indices=list(hf_indices), torch_dtype=dtype)
    return served_sglang_config(served, drafter_cfg)


def speculators_config(sglang_cfg: Mapping[str, Any], *, hf_indices: Sequence[int], verifier_path: str,
                       verifier_architectures: Sequence[str], speculative_tokens: int) -> dict:
    """The vLLM speculators `config.json` equivalent to an SGLang config (ids by vLLM's rule for `hf_indices`)."""
    layer_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                  "rope_scaling", "bos_token_id", "eos_token_id")
    layer = {k: sglang_cfg[k] for k in layer_keys if k in sglang_cfg}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                 attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                 torch_dtype=sglang_cfg.get("torch_dtype"))
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": int(sglang_cfg["draft_vocab_size"]),
        "target_hidden_size": int(sglang_cfg["target_hidden_size"]),
        # norm_before_residual / norm_before_fc / fc_norm / norm_output = false: vLLM defaults the first to true
        **drafter_keys.explicit_switches("speculators"),
        "eagle_aux_hidden_state_layer_ids": aux_layers.ids_for_rule(hf_indices, "vllm"),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_path), "architectures": list(verifier_architectures)},
        },
        "torch_dtype": sglang_cfg.get("torch_dtype"),
    }


def sglang_from_speculators(spec_cfg: Mapping[str, Any]) -> dict:
    """Inverse of `speculators_config` (for loading a speculators directory back into our drafter); a switch
    that changes the forward (norm_before_residual, fc_norm, ...) is refused by name (drafter_keys)."""
    drafter_keys.check_config(spec_cfg, "speculators").raise_if_refused("speculators config")
    layer = dict(spec_cfg["transformer_layer_config"])
    cfg = {k: v for k, v in layer.items() if k != "architectures"}
    cfg.update(architectures=[SGLANG_ARCH], draft_vocab_size=spec_cfg["draft_vocab_size"])
    if spec_cfg.get("target_hidden_size"):  # absent: the drafter's width, as config_sizes reads it
        cfg["target_hidden_size"] = spec_cfg["target_hidden_size"]
    listed = spec_cfg.get("eagle_aux_hidden_state_layer_ids")
    if listed:  # vLLM's ids -> h -> the SGLang ids meaning the same h
        ids = aux_layers.sglang_export_ids(aux_layers.hf_indices_from_ids(listed, "vllm"))[0]
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    if spec_cfg.get("torch_dtype"):
        cfg["torch_dtype"] = spec_cfg["torch_dtype"]
    return cfg


def sglang_config_problems(cfg: Mapping[str, Any], *, vocab_size: int, draft_vocab_size: int,
                           max_position_embeddings: int, hf_indices: Sequence[int], dtype: str,
                           rope: tuple[float, Any] | None = None) -> list[str]:
    """Every field SGLang reads that could silently ruin acceptance, against what it must be."""
    p: list[str] = []
    _expect(p, cfg, "architectures", [SGLANG_ARCH])
    _expect(p, cfg, "draft_vocab_size", int(draft_vocab_size), why="rows of lm_head / entries of d2t")
    p += _layer_field_problems(cfg, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                               dtype=dtype, rope=rope)
    eagle = cfg.get("eagle_config")
    if not isinstance(eagle, Mapping):
        p.append("config has no eagle_config: SGLang would capture its default layers [2, L//2, L-3] "
                 "instead of the ones the drafter was trained on")
    else:
        p += _sglang_ids_problems(cfg, eagle.get("eagle_aux_hidden_state_layer_ids"), hf_indices)
        if eagle.get("use_aux_hidden_state") is not True:
            p.append(f"eagle_config.use_aux_hidden_state={eagle.get('use_aux_hidden_state')!r}, expected true")
    return p + drafter_keys.engine_reading_problems(cfg, "sglang")  # every switch, as SGLang/vLLM/SpecForge read it


def speculators_config_problems(cfg: Mapping[str, Any], *, vocab_size: int, draft_vocab_size: int,
                                max_position_embeddings: int, hf_indices: Sequence[int], dtype: str,
                                rope: tuple[float, Any] | None = None) -> list[str]:
    """The speculators config's own fields, then its nested `transformer_layer_config`."""
    p: list[str] = []
    _expect(p, cfg, "architectures", [SPECULATORS_ARCH])
    _expect(p, cfg, "speculators_model_type", "eagle3")
    _expect(p, cfg, "draft_vocab_size", int(draft_vocab_size), why="rows of lm_head / entries of d2t")
    p += drafter_keys.engine_reading_problems(cfg, "speculators")  # e.g. vLLM's default norm_before_residual=true
    got = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not got or aux_layers.hf_indices_from_ids(got, "vllm") != [int(i) for i in hf_indices]:
        p.append(f"eagle_aux_hidden_state_layer_ids={got!r}: vLLM would capture other states than the trained "
                 f"h = {list(hf_indices)} (it reads ids as h; expected {aux_layers.ids_for_rule(hf_indices, 'vllm')})")
    spec = cfg.get("speculators_config")
    if not isinstance(spec, Mapping):
        p.append("config has no speculators_config")
    else:
        methods = spec.get("proposal_methods") or []
        first = methods[0] if methods and isinstance(methods[0], Mapping) else {}
        if not isinstance(first.get("speculative_tokens"), int):
            p.append("speculators_config.proposal_methods[0].speculative_tokens is missing")
        if spec.get("default_proposal_method") != first.get("proposal_type"):
            p.append(f"default_proposal_method={spec.get('default_proposal_method')!r} is not the listed "
                     f"proposal type {first.get('proposal_type')!r}")
        verifier = spec.get("verifier")
        if not isinstance(verifier, Mapping) or not verifier.get("name_or_path"):
            p.append("speculators_config.verifier.name_or_path is missing (vLLM needs the verifier named)")
        if spec.get("algorithm") != "eagle3":
            p.append(f"speculators_config.algorithm={spec.get('algorithm')!r}, expected 'eagle3'")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        p.append("config has no transformer_layer_config")
    else:
        p += [f"transformer_layer_config: {m}" for m in _layer_field_problems(
            layer, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, dtype=dtype, rope=rope)]
    return p


def _layer_field_problems(cfg: Mapping[str, Any], *, vocab_size: int, max_position_embeddings: int, dtype: str,
                          rope: tuple[float, Any] | None) -> list[str]:
    """Fields both formats' decoder-layer config must get right."""
    p: list[str] = []
    _expect(p, cfg, "vocab_size", int(vocab_size), why="the target's vocab")
    _expect(p, cfg, "num_hidden_layers", 1)
    _expect(p, cfg, "tie_word_embeddings", False, why="True makes the server use the embedding as lm_head")
    _expect(p, cfg, "torch_dtype", dtype)
    mpe = cfg.get("max_position_embeddings")
    if not isinstance(mpe, int) or mpe < int(max_position_embeddings):
        p.append(f"config max_position_embeddings={mpe!r}, expected >= the target's context length "
                 f"{max_position_embeddings}")
    theta, scaling = rope_settings(cfg, default_theta=None)  # an exported config states its rope: no engine default
    if theta is None:
        p.append(f"config has no rope_theta (nor rope_parameters.rope_theta): engines would assume "
                 f"{DEFAULT_ROPE_THETA:g}; the export writes the trained value")
    elif rope is not None and (theta, scaling) != (float(rope[0]), rope[1]):
        p.append(f"rope settings (theta={theta}, scaling={scaling}) differ from training's "
                 f"(theta={rope[0]}, scaling={rope[1]})")
    return p


def _sglang_ids_problems(cfg: Mapping[str, Any], ids, hf_indices: Sequence[int]) -> list[str]:
    """The listed ids must mean the trained h under current SGLang, and under legacy SGLang too unless the
    config states the version requirement (no portable form exists for that h)."""
    h = [int(i) for i in hf_indices]
    if not ids:
        return [f"eagle_config.eagle_aux_hidden_state_layer_ids={ids!r}: SGLang would capture its default layers "
                f"instead of the trained h = {h}"]
    r = aux_layers.readings(ids)
    if r["sglang"] != h:
        return [f"eagle_config.eagle_aux_hidden_state_layer_ids={list(ids)} mean h = {r['sglang']} in current SGLang "
                f"(h = {r['sglang_legacy']} before PR #25454), but the drafter was trained on h = {h}; expected "
                f"{aux_layers.sglang_export_ids(h)[0]}"]
    meta = cfg.get(aux_layers.META_KEY)
    if r["sglang_legacy"] != h and not (isinstance(meta, Mapping)
                                        and meta.get("sglang_versions") == aux_layers.SGLANG_RULE_CHANGE):
        return [f"eagle_config.eagle_aux_hidden_state_layer_ids={list(ids)} mean h = {h} only in "
                f"{aux_layers.SGLANG_RULE_CHANGE} (older SGLang reads h = {r['sglang_legacy']}) and the config does "
                f"not say so ({aux_layers.META_KEY})"]
    return []


# ---------------------------------------------------------------- helpers

def _expect(problems: list[str], cfg: Mapping[str, Any], key: str, want: Any, why: str = "") -> None:
    got = cfg.get(key, "<absent>")
    if got != want:
        problems.append(f"config {key}={got!r}, expected {want!r}" + (f" ({why})" if why else ""))


def _rename_hint(name: str, expected: Mapping[str, TensorSpec]) -> str:
    """Point at the expected name a stray one most likely meant: the same tensor under another
    layer prefix (`model.`, `layers.0.`, `midlayer.`), else the closest spelling."""
    def core(n: str) -> str:
        n = n[len("model."):] if n.startswith("model.") else n
        for prefix in ("midlayers.0.", "layers.0.", "midlayer."):
            if n.startswith(prefix):
                return "layer:" + n[len(prefix):]
        return n

    same = [cand for cand in expected if core(cand) == core(name)]
    close = same or difflib.get_close_matches(name, list(expected), n=1, cutoff=0.85)
    return f"; did you mean {close[0]!r}?" if close else ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: expected one of {FORMATS}")
