"""What the engines do with particular values of a drafter config's `architectures`, `model_type` and rope type,
and the one action that fixes each: the value-specific half of drafter_keys (which holds the per-key table).

A finding is (key, problem, fix): the problem names the cause and what each engine would do with the value; the fix
is one action. drafter_keys turns them into refusals (the config cannot be read here) or warnings (read here, but
the directory served as is would break somewhere).

`model_type: kimi_k2` with `architectures: ["LlamaForCausalLMEagle3"]` (SpecForge's Kimi-K2 template writes this
pair) is accepted with a warning. SpecForge builds the drafter from `architectures` (a LlamaConfig: the weights are
a Llama layer, and the strict weight check here verifies every shape against that reading); the engines build the
config class named by `model_type`, DeepSeek-V3's, whose head_dim is forced to qk_rope_head_dim = 64, so the
directory served as is does not load; export writes `model_type: llama`. Sources: `KIMI_K2_SOURCES`.

Pure; imports only the standard library.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

LLAMA_CLASS = "LlamaForCausalLMEagle3"
ROPE_TYPES = ("default", "linear", "llama3")  # the rope variants this project implements (model.rope_inv_freq)

# MLA EAGLE-3 drafter classes: the class each engine serves them with
MLA_CLASSES = {
    "Eagle3DeepseekV2ForCausalLM": "SGLang 0.5.14 models/kimi_k25_eagle3.py, vLLM 0.34.0 models/deepseek_eagle3.py",
    "Eagle3DeepseekV3ForCausalLM": "vLLM 0.34.0 models/deepseek_eagle3.py (registry.py:744)",
}
# model_type values for which SGLang and vLLM build transformers' DeepseekV3Config (head_dim = qk_rope_head_dim)
DEEPSEEK_V3_CONFIG_TYPES = ("kimi_k2", "deepseek_v3")
KIMI_K2_SOURCES = (
    "SGLang 0.5.14 wheel: sglang/srt/utils/hf_transformers/common.py:133-137 (kimi_k2 registered as a subclass of "
    "transformers' DeepseekV3Config), configs/model_config.py:703 and models/llama.py:161-166 (the Llama attention's "
    "head_dim is the config's)",
    "transformers 5.8.1 (SGLang 0.5.14's pin) models/deepseek_v3/configuration_deepseek_v3.py:111, 5.24.0 :123: "
    "head_dim = qk_rope_head_dim (default 64) whatever the config file says",
    "vLLM 0.34.0 wheel: vllm/transformers_utils/config.py:142 (kimi_k2 -> DeepseekV3Config), "
    "transformers_utils/model_arch_config_convertor.py:294-312 (kimi_k2 is MLA: config/model.py:2104-2117 use_mla), "
    "model_executor/models/llama.py:158-159 (head_dim from the config)",
    "SGLang 0.5.6 wheel (transformers 4.57.1): sglang/srt/utils/hf_transformers_utils.py:219-225 re-raises "
    "AutoConfig's error; transformers 5.24.0 models/auto/configuration_auto.py:437-441: model type kimi_k2 is not "
    "recognised (ValueError)",
    "SpecForge 0.2.0 wheel: specforge/modeling/auto.py:94-116 (the config class comes from architectures), "
    "modeling/draft/llama3_eagle.py:1656 (LlamaForCausalLMEagle3.config_class = LlamaConfig; saved as model_type llama)",
)
YARN_NEEDS = ("YaRN's per-frequency blend of interpolated and original inverse frequencies (factor, "
              "original_max_position_embeddings, beta_fast / beta_slow ramp) in eagle3/drafter/model.py's rope_inv_freq, its "
              "attention scale (mscale, mscale_all_dim) on cos/sin, and a numeric check against SGLang's / vLLM's YaRN "
              "rotary embedding")
ANOTHER_INIT = "use a Llama EAGLE-3 drafter (LlamaForCausalLMEagle3, standard rope) as init, or init=scratch"


@dataclass(frozen=True)
class Finding:
    """One thing a drafter config says that matters: its key, the cause and what each engine does, the fix."""
    key: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.problem}. Fix: {self.fix}"


def show(value: Any) -> str:
    """JSON spelling (true / null), as the config file has it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def architecture_finding(value: Any, prefix: str = "") -> Optional[Finding]:
    """None when `architectures` names LlamaForCausalLMEagle3 or is absent (the SGLang layout's class: what the
    layout is read as; export writes it), else the refusal naming what the class is."""
    key = f"{prefix}architectures"
    if value is None or (isinstance(value, list) and LLAMA_CLASS in value):
        return None
    mla = [c for c in (value if isinstance(value, list) else [value]) if c in MLA_CLASSES]
    if mla:
        return Finding(key, f"{key}={show(value)} is an MLA EAGLE-3 drafter (DeepSeek-V2/V3 attention: low-rank q/kv "
                            f"projections and a split rope part), served by {MLA_CLASSES[mla[0]]}; this project trains "
                            f"only {LLAMA_CLASS} (Llama attention: q/k/v/o), which MLA weights do not map onto",
                       ANOTHER_INIT)
    return Finding(key, f"{key}={show(value)} is another model class (SGLang and vLLM build the draft from it); this "
                        f"project trains only {LLAMA_CLASS}", ANOTHER_INIT)


def model_type_finding(value: Any, cfg: Mapping[str, Any], prefix: str = "") -> tuple[Optional[Finding], bool]:
    """(finding, fatal) for `model_type` in a LlamaForCausalLMEagle3 config: (None, False) for llama / absent."""
    key = f"{prefix}model_type"
    if value in (None, "llama"):
        return None, False
    v = show(value)
    if value in DEEPSEEK_V3_CONFIG_TYPES:
        older = ("; SGLang before 0.5.14 and transformers' AutoConfig do not know kimi_k2 at all (the server does "
                 "not start)") if value == "kimi_k2" else ""
        sizes = (cfg.get("hidden_size"), cfg.get("num_attention_heads"))
        head = cfg.get("head_dim") or (sizes[0] // sizes[1] if all(isinstance(x, int) and x for x in sizes) else "?")
        return Finding(key, f"{key}={v} with {LLAMA_CLASS} (SpecForge's Kimi-K2 template writes this pair): SpecForge "
                            f"0.2.0 builds the layer from architectures (a LlamaConfig), so the weights are a Llama "
                            f"layer and are read as one here; served as is, SGLang 0.5.14 and vLLM 0.34.0 build "
                            f"DeepSeek-V3's config class for it, which forces head_dim = qk_rope_head_dim = 64 (the "
                            f"trained heads are {head} wide: the weights do not load; vLLM also sizes an MLA KV "
                            f"cache){older}",
                       f'nothing for init, train or export (export writes model_type "llama"); to serve this '
                       f'directory as is, set {key}: llama'), False
    if value == "llama4_text":
        problem = (f"{key}={v}: SGLang 0.5.14 sizes the MLP from intermediate_size_mlp (models/llama_eagle3.py:69) "
                   f"and vLLM 0.34.0 builds transformers' Llama4TextConfig (its defaults, not LlamaConfig's)")
    else:
        problem = (f"{key}={v}: SGLang 0.5.14 and vLLM 0.34.0 build the config class registered for {v} (its "
                   f"defaults and derived sizes, not LlamaConfig's) or stop at an unknown type; SpecForge 0.2.0 "
                   f"builds a LlamaConfig from architectures")
    return Finding(key, problem, f"if a trainer built a Llama layer from this config (SpecForge does), set {key}: "
                                 f"llama; else {ANOTHER_INIT}"), True


def rope_type_finding(name: str, rope: Mapping[str, Any], extra: list[str], prefix: str = "") -> Finding:
    """The refusal of a rope variant this project does not implement (`extra`: its entries beyond ours)."""
    key = f"{prefix}{name}"
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    keys = f" (with {extra})" if extra else ""
    if kind == "yarn":
        return Finding(key, f"{key} type \"yarn\"{keys} is not implemented here (implemented: {', '.join(ROPE_TYPES)}); "
                            f"SGLang 0.5.14, vLLM 0.34.0 and SpecForge 0.2.0 apply YaRN, so this drafter's attention "
                            f"was trained on YaRN-rotated queries and keys. Reading it would need {YARN_NEEDS}",
                       ANOTHER_INIT)
    what = f"type {show(kind)}" if kind not in ROPE_TYPES else f"entries {extra}"
    return Finding(key, f"{key} {what} is not implemented here (implemented: {', '.join(ROPE_TYPES)}, without extra "
                        f"entries); SGLang 0.5.14, vLLM 0.34.0 and SpecForge 0.2.0 apply it", ANOTHER_INIT)
