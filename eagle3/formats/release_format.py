"""The Kimi-K2.5 release's own checkpoint format: INT4 routed experts in compressed-tensors
`pack-quantized` form, bf16 for everything else. The one home of that format's facts (checked
against the release; ARCHITECTURE.md "The Kimi-K2.5 release format" says where and what).

- config.json carries `quantization_config` (RELEASE_QUANTIZATION_CONFIG) at the top level and
  inside `text_config`: one group, targets `Linear`, weights int4, symmetric, strategy `group`,
  group size 32, observer minmax; format `pack-quantized`; status `compressed`; ignored (kept bf16):
  `lm_head`, `re:.*self_attn.*`, `re:.*shared_experts.*`, `re:.*mlp\\.(gate|up|gate_up|down)_proj.*`
  (the dense MLP of layer 0). What stays quantized are the routed experts of the MoE layers
  (`first_k_dense_replace` = 1 .. 60).
- A routed expert projection `language_model.model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`
  is stored as `weight_packed` int32 [out, in / 8] (eight 4-bit values per int32),
  `weight_scale` bf16 [out, in / 32] (one scale per group of 32 inputs), `weight_shape` int32 [2]
  (= [out, in]); no `weight`. `mlp.gate.e_score_correction_bias` stays float32.

transformers (5.24) reads this through the `compressed-tensors` package and DEQUANTISES the routed
experts to the model dtype while loading (its fused `experts.gate_up_proj` / `down_proj` parameters
have no INT4 form): a K2.5 replica loaded that way holds bf16 experts, ~34 GB per MoE layer.

Loading checks (`check_checkpoint`) need only the tensor names. Writing and reading single expert
weights (`quantize_expert_weight`, `dequantize_expert_weight`, `to_release_tensors`) use
compressed-tensors' own quantisation and packing, imported inside the functions: the core loading
path stays torch + safetensors + transformers.
"""
from __future__ import annotations

import copy
import importlib.util
import re
from typing import Iterable

import torch

PACKAGE = "compressed-tensors"  # the PyPI name; the module is compressed_tensors
INT4_BITS = 4
GROUP_SIZE = 32
PACKED_PARAMS = ("weight_packed", "weight_scale", "weight_shape")
FP32_PARAMS = ("e_score_correction_bias",)  # the release keeps the router's bias in float32

_WEIGHTS = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE,
            "num_bits": INT4_BITS, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
            "symmetric": True, "type": "int"}
RELEASE_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": _WEIGHTS}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# A routed expert's projection, by any of its stored parameter names.
ROUTED_EXPERT = re.compile(r"^(?P<module>(?:.+\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                           r"(?:gate|up|down)_proj)\.(?P<param>weight|weight_packed|weight_scale|weight_shape)$")


class ReleaseFormatError(ValueError):
    """A checkpoint whose tensors do not match what its config.json says about quantisation."""


def quantization_config_of(full_config: dict) -> dict | None:
    """The checkpoint's `quantization_config` (top level, else the wrapper's `text_config`'s)."""
    q = full_config.get("quantization_config")
    if q is None:
        q = (full_config.get("text_config") or {}).get("quantization_config")
    return q


def is_packed_int4(qconfig: dict | None) -> bool:
    return bool(qconfig) and qconfig.get("quant_method") == "compressed-tensors" \
        and qconfig.get("format") == "pack-quantized"


def is_int4_expert_weight(name: str, first_k_dense_replace: int) -> bool:
    """True for a bf16 `...experts.{e}.{gate,up,down}_proj.weight` that the release stores INT4."""
    m = ROUTED_EXPERT.match(name)
    return bool(m) and m["param"] == "weight" and int(m["layer"]) >= first_k_dense_replace


def check_checkpoint(full_config: dict, text_config: dict, tensor_names: Iterable[str], where: str) -> None:
    """Refuse, before any weight is read, a checkpoint that transformers would load wrongly without
    an error: INT4 tensors with no quantization_config (their `weight` would be left random), a
    pack-quantized config with a routed expert stored otherwise, or the package missing."""
    qconfig = quantization_config_of(full_config)
    first_k = int(text_config.get("first_k_dense_replace", 0))
    plain, packed = {}, {}
    for name in tensor_names:
        m = ROUTED_EXPERT.match(name)
        if m and int(m["layer"]) >= first_k:
            (plain if m["param"] == "weight" else packed).setdefault(m["module"], set()).add(m["param"])
    if not is_packed_int4(qconfig):
        if packed:
            raise ReleaseFormatError(f"{where}: {len(packed)} routed experts are stored INT4 ({PACKED_PARAMS}, e.g. "
                                     f"{sorted(packed)[0]}) but config.json has no compressed-tensors pack-quantized "
                                     f"quantization_config (got {qconfig and qconfig.get('format')!r})")
        return
    if importlib.util.find_spec("compressed_tensors") is None:
        raise ReleaseFormatError(f"{where} is INT4 (compressed-tensors pack-quantized): install the `{PACKAGE}` "
                                 f"package (a dependency of this project: pip install -e .)")
    if plain:
        raise ReleaseFormatError(f"{where}: config.json says the routed experts are INT4 (pack-quantized) but "
                                 f"{len(plain)} are stored as plain `weight` (e.g. {sorted(plain)[0]})")
    partial = sorted(m for m, params in packed.items() if set(PACKED_PARAMS) - params)
    if partial:
        lacks = sorted(set(PACKED_PARAMS) - packed[partial[0]])
        raise ReleaseFormatError(f"{where}: {len(partial)} INT4 routed experts lack part of {PACKED_PARAMS} "
                                 f"(e.g. {partial[0]} has no {lacks})")


def release_scheme():
    """The release's quantisation scheme as a compressed-tensors QuantizationScheme."""
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(RELEASE_QUANTIZATION_CONFIG).config_groups["group_0"]


def quantize_expert_weight(weight: torch.Tensor, scheme=None) -> dict[str, torch.Tensor]:
    """One expert projection weight [out, in] (bf16, in % 32 == 0) -> the release's stored tensors
    {weight_packed int32 [out, in/8], weight_scale bf16 [out, in/32], weight_shape int32 [2]}:
    per-group min/max scales (compressed-tensors' calculate_qparams, as the minmax observer does),
    quantised and packed by compressed-tensors' PackedQuantizationCompressor. Runs on weight's device."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = scheme or release_scheme()
    if weight.ndim != 2 or weight.shape[1] % GROUP_SIZE:
        raise ReleaseFormatError(f"expert weight of shape {tuple(weight.shape)}: expected [out, in] with in % "
                                 f"{GROUP_SIZE} == 0")
    weight = weight.to(torch.bfloat16)
    groups = weight.unflatten(-1, (-1, GROUP_SIZE))  # [out, in/32, 32]
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    out = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.to(torch.bfloat16)}, scheme)
    return {"weight_packed": out["weight_packed"], "weight_scale": out["weight_scale"],
            "weight_shape": out["weight_shape"].to(torch.int32)}


def dequantize_expert_weight(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                             scheme=None) -> torch.Tensor:
    """The release's stored tensors of one expert projection -> its weight [out, in] (scale's dtype),
    through compressed-tensors' own decompression."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    return PackedQuantizationCompressor.decompress(state, scheme or release_scheme())["weight"]


def to_release_tensors(tensors: dict[str, torch.Tensor], first_k_dense_replace: int) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (release names, unfused experts) in the release's dtypes: routed experts
    of layers >= first_k_dense_replace INT4-packed, the router bias float32, every other float bf16."""
    scheme = release_scheme()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_int4_expert_weight(name, first_k_dense_replace):
            module = name[: -len("weight")]
            out.update({module + k: v for k, v in quantize_expert_weight(t, scheme).items()})
        elif t.is_floating_point():
            out[name] = t.to(torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMS else torch.bfloat16)
        else:
            out[name] = t
    return out


def with_release_quantization(full_config: dict) -> dict:
    """config.json as the release writes it: quantization_config at the top level and, for the
    Kimi wrapper, inside text_config too; dtype bfloat16."""
    cfg = copy.deepcopy(full_config)
    cfg["quantization_config"] = copy.deepcopy(RELEASE_QUANTIZATION_CONFIG)
    if "text_config" in cfg:
        cfg["text_config"]["quantization_config"] = copy.deepcopy(RELEASE_QUANTIZATION_CONFIG)
        cfg["text_config"]["dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    return cfg
