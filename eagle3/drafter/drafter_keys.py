"""Every config key an engine reads for an EAGLE-3 Llama drafter, and what this project does with it.

A drafter `config.json` is read by several programs that share key names but not always meanings or
defaults. This table is the one home of those facts (checked against the sources named in `ENGINES`).
Each key is one of:
- ``field``: parsed into `DrafterConfig` (the model is built from it; its value is the trained one);
- ``switch``: selects a variant of the forward. Each engine that reads it has a default (used when the key
  is absent) and the values that mean *this project's* forward (standard EAGLE-3: fc over the raw aux
  states, un-normalised hidden as residual, final norm before lm_head, pre-norm output fed to the next
  step). A config is loaded only if every present switch means this forward in every engine that reads
  that layout; otherwise it is refused with one line naming the key, its value and the engines that
  honour it. Export writes the switches whose absence some engine would read differently;
- ``harmless``: read by some engine but no effect on the forward (ids, training-only settings); accepted,
  not carried into exports.
Any other key is unknown: reported (console and load report) and never written back.

The same name can mean different things: ``norm_output`` is EAGLE-3.1's "feed the normed output to the
next step" in SGLang / vLLM / speculators (default false) but "apply the final norm before lm_head" in
SpecForge 0.2.0 (default true). Both explicit values therefore change the forward in some engine that
reads the SGLang layout: only its absence means standard EAGLE-3 everywhere, so export never writes it
there (the speculators layout is read only by vLLM and speculators, where ``false`` is unambiguous).

Pure; imports only the standard library (and eagle3's stdlib-only modules).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from eagle3.drafter.drafter_values import (ANOTHER_INIT, ROPE_TYPES, Finding, architecture_finding, model_type_finding,
                                           rope_type_finding, show)
from eagle3.drafter.image_embeddings import CONFIG_KEY as IMAGE_CONFIG_KEY

ENGINES = {
    "sglang": "SGLang 0.5.14",
    "vllm": "vLLM 0.34.0",
    "speculators": "speculators 0.9.0",
    "specforge": "SpecForge 0.2.0",
}
SOURCES = {
    "sglang": "sglang 0.5.14 wheel: sglang/srt/models/llama_eagle3.py (LlamaModel.__init__/forward, "
              "LlamaForCausalLMEagle3.__init__/load_weights), sglang/srt/models/llama.py (LlamaAttention, "
              "LlamaDecoderLayer), sglang/srt/model_executor/model_runner.py and speculative/eagle_worker_v2.py "
              "(eagle_config.use_aux_hidden_state / eagle_aux_hidden_state_layer_ids)",
    "vllm": "vllm 0.34.0 wheel: vllm/model_executor/models/llama_eagle3.py (LlamaDecoderLayer, LlamaModel, "
            "Eagle3LlamaForCausalLM), vllm/model_executor/models/llama.py (LlamaAttention, LlamaDecoderLayer), "
            "vllm/transformers_utils/configs/speculators/algos.py (update_eagle3: speculators-format defaults)",
    "speculators": "speculators 0.9.0 wheel: speculators/models/eagle3/config.py (Eagle3SpeculatorConfig), "
                   "core.py (Eagle3DraftModel.__init__/forward), model_definitions.py (first-layer norms)",
    "specforge": "specforge 0.2.0 wheel: specforge/modeling/draft/llama3_eagle.py (LlamaForCausalLMEagle3, "
                 "LlamaAttention._init_rope, LlamaMLP, compute_logits), algorithms/eagle3/model.py (TTT loop: "
                 "the pre-norm backbone output is the next step's hidden)",
}
# Which engines read which layout's top level ("top" keys of the speculators layout live in its
# transformer_layer_config, read by vLLM and speculators).
READERS = {"sglang": ("sglang", "vllm", "specforge"), "speculators": ("vllm", "speculators")}
ABSENT = "<absent>"  # a default meaning "the key is not set" (e.g. None-valued optional settings)

FIELD, SWITCH, HARMLESS = "field", "switch", "harmless"


@dataclass(frozen=True)
class Reading:
    """How one engine reads a switch: its default, whether a value means this project's forward, and what
    a value that does not means there."""
    default: Any
    ours: Callable[[Any, Mapping[str, Any]], bool]
    meaning: str


@dataclass(frozen=True)
class Key:
    name: str
    where: str              # "top" (SGLang config / speculators transformer_layer_config), "eagle_config", "speculators"
    handling: str           # FIELD, SWITCH, HARMLESS
    effect: str
    readings: dict = field(default_factory=dict)   # engine -> Reading (switches only)
    write: dict = field(default_factory=dict)      # layout -> value export writes explicitly
    hints: dict = field(default_factory=dict)      # JSON spelling of a refused value -> what to do

    @property
    def dotted(self) -> str:
        return f"eagle_config.{self.name}" if self.where == "eagle_config" else self.name


def _is(*values) -> Callable[[Any, Mapping[str, Any]], bool]:
    """A value check: equal to one of `values` (bools compared as bools, never as 0/1)."""
    def ok(v, _cfg) -> bool:
        return any(type(v) is type(w) and v == w if isinstance(w, bool) or isinstance(v, bool) else v == w
                   for w in values)
    return ok


def _arch(name: str):
    return lambda v, _cfg: isinstance(v, list) and name in v


def _full_attention_only(v, _cfg) -> bool:
    return v is None or (isinstance(v, list) and all(t == "full_attention" for t in v))


def _same_original_context(v, cfg) -> bool:
    """SGLang copies a top-level original_max_position_embeddings into rope_scaling: harmless only when
    there is no rope scaling or it already holds the same value."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    return v is None or not rope or rope.get("original_max_position_embeddings", v) == v


def _switch(name, effect, readings, where="top", write=None, hints=None) -> Key:
    return Key(name, where, SWITCH, effect, readings, write or {}, hints or {})


_LLAMA_DEFAULT_LAYERS = 32  # transformers LlamaConfig's num_hidden_layers default, used by the engines when absent
NORM_OUTPUT_31 = "true feeds the final norm's output (not the pre-norm sum) to the next draft step (EAGLE-3.1)"

KEYS: tuple[Key, ...] = (
    # ------------------------------------------------------------- fields (DrafterConfig)
    *(Key(n, "top", FIELD, e) for n, e in (
        ("hidden_size", "drafter width H"), ("intermediate_size", "MLP width"),
        ("num_attention_heads", "query heads"), ("num_key_value_heads", "KV heads (absent: = heads)"),
        ("head_dim", "per-head width (absent: H / heads)"), ("vocab_size", "the target's vocab"),
        ("draft_vocab_size", "rows of lm_head (absent: vocab_size in every engine)"),
        ("target_hidden_size", "fc input = 3 x this (absent: hidden_size)"),
        ("rms_norm_eps", "every RMSNorm's epsilon"), ("rope_theta", "rope base"),
        ("rope_scaling", "rope variant (default / linear / llama3 implemented; others refused)"),
        ("rope_parameters", "transformers-5 form of rope_theta + rope_scaling (SGLang, vLLM, SpecForge prefer it)"),
        ("max_position_embeddings", "context length: SGLang / vLLM size the rope cache from it (the rope below it does "
                                    "not depend on it)"),
        ("hidden_act", "MLP activation (silu only)"), ("bos_token_id", "id"), ("eos_token_id", "id"),
        ("pad_token_id", "id (SpecForge: embedding padding_idx; the target's embedding is used)"),
        ("torch_dtype", "weight dtype"), ("dtype", "weight dtype (transformers-5 name)"),
        ("initializer_range", "init std of a fresh drafter"),
        ("eagle_config", "SGLang/vLLM drafter settings (nested keys below)"),
        ("eagle3_aux_hidden_states", "this project's record of the aux hidden-state indices (aux_layers)"),
        (IMAGE_CONFIG_KEY, "this project's record of what the drafter was trained to read at image rows "
                           "(image_embeddings: fused | placeholder); no engine reads it"),
    )),
    Key("eagle_aux_hidden_state_layer_ids", "eagle_config", FIELD,
        "which target states fc reads (engine rules: eagle3/engines/aux_layers.py); its length sets fc's width"),
    # ------------------------------------------------------------- switches, SGLang layout (and layer configs)
    _switch("architectures", "model class", {
        "sglang": Reading(ABSENT, _arch("LlamaForCausalLMEagle3"), "another class is another model"),
        "vllm": Reading(ABSENT, _arch("LlamaForCausalLMEagle3"), "another class is another model")}),
    _switch("model_type", "the config class the engines build (SGLang layout: value-specific, _model_type_finding)", {
        "sglang": Reading("llama", _is("llama", None), "builds the config class registered for this model_type"),
        "vllm": Reading("llama", _is("llama", None), "builds the config class registered for this model_type"),
        "speculators": Reading("qwen3", _is("llama", None), "qwen3 builds a Qwen3 layer (q/k norms)")}),
    _switch("num_hidden_layers", "decoder layers", {
        "sglang": Reading(_LLAMA_DEFAULT_LAYERS, _is(1), "more layers after the first (hidden only, no embeds)"),
        "vllm": Reading(_LLAMA_DEFAULT_LAYERS, _is(1), "more layers after the first (hidden only, no embeds)"),
        "speculators": Reading(_LLAMA_DEFAULT_LAYERS, _is(1), "more decoder layers")}),
    _switch("tie_word_embeddings", "lm_head source", {
        "sglang": Reading(False, _is(False, None), "true uses the target's embedding as lm_head")}),
    _switch("attention_bias", "attention biases", {
        "sglang": Reading(False, _is(False, None), "true adds an o_proj bias"),
        "vllm": Reading(False, _is(False, None), "true adds q/k/v/o biases"),
        "speculators": Reading(False, _is(False, None), "true adds q/k/v/o biases")}),
    _switch("mlp_bias", "MLP biases", {
        "vllm": Reading(False, _is(False, None), "true adds gate/up/down biases"),
        "speculators": Reading(False, _is(False, None), "true adds gate/up/down biases")}),
    _switch("bias", "fc / attention bias", {
        "sglang": Reading(False, _is(False, None), "true adds an fc bias and an o_proj bias"),
        "vllm": Reading(False, _is(False, None), "true adds q/k/v/o biases")}),
    _switch("qkv_bias", "q/k/v bias of the base layer", {
        "vllm": Reading(ABSENT, _is(False, None, ABSENT), "true adds q/k/v biases to the base Llama layer")}),
    _switch("logit_scale", "logit multiplier", {
        "vllm": Reading(1.0, _is(1, 1.0), "multiplies the draft logits")}),
    _switch("partial_rotary_factor", "rotated fraction of each head", {
        "sglang": Reading(1, _is(1, 1.0), "rotates only this fraction of head_dim")}),
    _switch("rope_is_neox_style", "rope pairing", {
        "sglang": Reading(True, _is(True), "false rotates interleaved (GPT-J) pairs")}),
    _switch("is_causal", "attention mask", {
        "vllm": Reading(True, _is(True), "false attends bidirectionally")}),
    _switch("layer_types", "per-layer attention kind", {
        "vllm": Reading(None, _full_attention_only, "sliding_attention limits the layer to sliding_window keys"),
        "speculators": Reading(None, _full_attention_only, "sliding_attention limits the layer to sliding_window keys")}),
    _switch("original_max_position_embeddings", "rope scaling's original context", {
        "sglang": Reading(None, _same_original_context, "overrides rope_scaling.original_max_position_embeddings")}),
    _switch("quantization_config", "quantized drafter weights", {
        "sglang": Reading(None, _is(None), "weights are dequantized by its method"),
        "vllm": Reading(None, _is(None), "weights are dequantized by its method")}),
    _switch("num_aux_hidden_states", "number of aux states fc reads", {
        "sglang": Reading(3, _is(3), "fc reads this many target states"),
        "vllm": Reading(3, _is(3), "fc reads this many target states")}),
    _switch("fc_norm", "per-aux RMSNorm before fc", {
        "sglang": Reading(False, _is(False, None), "true normalises each aux state before fc (fc_norm.* weights)"),
        "vllm": Reading(False, _is(False, None), "true normalises each aux state before fc (fc_norm.* weights)"),
        "specforge": Reading(False, _is(False, None), "true normalises each aux state before fc (fc_norm.* weights)")}),
    _switch("use_aux_norm", "SGLang's legacy name of fc_norm", {
        "sglang": Reading(False, _is(False, None), "true normalises each aux state before fc")}),
    _switch("norm_before_fc", "one RMSNorm over the concatenated aux states", {
        "vllm": Reading(False, _is(False, None), "true normalises the 3H concatenation before fc (input_norm weight)")}),
    _switch("norm_before_residual", "residual of the first layer", {
        "vllm": Reading(False, _is(False, None), "true makes the residual the normalised hidden")}),
    _switch("norm_output", "final norm and the next step's hidden", {
        "sglang": Reading(False, _is(False, None), NORM_OUTPUT_31),
        "vllm": Reading(False, _is(False, None), NORM_OUTPUT_31),
        "specforge": Reading(True, _is(True), "false (or null) feeds lm_head the un-normalised output (no final norm)")},
        hints={"true": "SpecForge 0.2.0 means its standard forward by true: if SpecForge <= 0.2.0 trained this "
                       "drafter, delete the key (SGLang / vLLM would serve true as EAGLE-3.1)",
               "false": "if SpecForge 0.2.0 trained it, lm_head never saw a normalised input and no serving "
                        "engine can reproduce that; if another trainer wrote false (its default), delete the key"}),
    # ------------------------------------------------------------- eagle_config (SGLang layout)
    _switch("use_aux_hidden_state", "fc over aux states vs the target's last state", {
        "sglang": Reading(True, _is(True), "false feeds the target's last hidden state, no fc"),
        "vllm": Reading(True, _is(True), "false feeds the target's last hidden state, no fc")},
        where="eagle_config"),
    _switch("norm_before_fc", "one RMSNorm over the concatenated aux states", {
        "vllm": Reading(False, _is(False, None), "true normalises the 3H concatenation before fc")},
        where="eagle_config"),
    # ------------------------------------------------------------- speculators layout, top level
    Key("transformer_layer_config", "speculators", FIELD, "the decoder layer's LlamaConfig (checked as a config)"),
    Key("draft_vocab_size", "speculators", FIELD, "rows of lm_head"),
    Key("target_hidden_size", "speculators", FIELD, "fc input = 3 x this"),
    Key("eagle_aux_hidden_state_layer_ids", "speculators", FIELD, "vLLM: ids read as hidden-state indices"),
    Key("speculators_config", "speculators", FIELD, "proposal methods and verifier (validated by export)"),
    Key("torch_dtype", "speculators", FIELD, "weight dtype"),
    # speculators 0.9.0 keeps extra keys (speculators/config.py SpeculatorModelConfig: ConfigDict(extra="allow"),
    # to_dict = PretrainedConfig's dict + model_dump); vLLM 0.34.0 picks named keys only
    # (transformers_utils/configs/speculators/algos.py update_eagle3), so the record is read by neither
    Key(IMAGE_CONFIG_KEY, "speculators", FIELD, "this project's record of what the drafter was trained to read at "
        "image rows (image_embeddings: fused | placeholder); no engine reads it"),
    Key("dtype", "speculators", FIELD, "weight dtype"),
    _switch("architectures", "model class", {
        "vllm": Reading(ABSENT, _arch("Eagle3Speculator"), "another speculator class"),
        "speculators": Reading(ABSENT, _arch("Eagle3Speculator"), "another speculator class")}, where="speculators"),
    _switch("speculators_model_type", "algorithm", {
        "vllm": Reading(ABSENT, _is("eagle3"), "another algorithm"),
        "speculators": Reading(ABSENT, _is("eagle3"), "another algorithm")}, where="speculators"),
    _switch("norm_before_residual", "residual of the first layer", {
        "vllm": Reading(True, _is(False), "true (its default when absent) makes the residual the normalised hidden"),
        "speculators": Reading(False, _is(False), "true makes the residual the normalised hidden")},
        where="speculators", write={"speculators": False}),
    _switch("norm_before_fc", "one RMSNorm over the concatenated aux states", {
        "vllm": Reading(False, _is(False), "true normalises the 3H concatenation before fc (input_norm weight)"),
        "speculators": Reading(False, _is(False), "true normalises the 3H concatenation before fc")},
        where="speculators", write={"speculators": False}),
    _switch("fc_norm", "per-aux RMSNorm before fc", {
        "vllm": Reading(False, _is(False), "true normalises each aux state before fc (fc_norm.* weights)"),
        "speculators": Reading(False, _is(False), "true normalises each aux state before fc")},
        where="speculators", write={"speculators": False}),
    _switch("norm_output", "the next step's hidden", {
        "vllm": Reading(False, _is(False), NORM_OUTPUT_31),
        "speculators": Reading(False, _is(False), NORM_OUTPUT_31)}, where="speculators", write={"speculators": False}),
    Key("embed_requires_grad", "speculators", HARMLESS, "speculators: trains the embedding (training only)"),
    Key("speculators_version", "speculators", HARMLESS, "writer's version"),
    *(Key(n, w, HARMLESS, e) for w in ("top", "speculators") for n, e in (
        ("transformers_version", "writer's version"), ("_name_or_path", "where it was loaded from"),
        ("auto_map", "remote-code pointer (not used by these loaders)"),
    )),
    # ------------------------------------------------------------- harmless, SGLang layout / layer configs
    *(Key(n, "top", HARMLESS, e) for n, e in (
        ("pretraining_tp", "SpecForge: splits the MLP matmuls into slices (same sums)"),
        ("attention_dropout", "training-time dropout; no engine applies it at inference"),
        ("sliding_window", "used only by layers that layer_types marks sliding (checked there)"),
        ("intermediate_size_mlp", "SGLang: read only for model_type llama4_text (refused)"),
        ("max_window_layers", "Qwen2 template leftover (SpecForge / TorchSpec templates): no engine's Llama drafter "
                              "layer reads it"),
        ("use_sliding_window", "Qwen2 template leftover (SpecForge / TorchSpec templates): no engine's Llama drafter "
                               "layer reads it (sliding attention is layer_types', checked there)"),
        ("target_layer_count", "vLLM sets it at load time"),
        ("use_cache", "generation setting"), ("output_attentions", "HF output flag"),
        ("output_hidden_states", "HF output flag"), ("return_dict", "HF output flag"), ("torchscript", "HF flag"),
        ("tokenizer_class", "tokenizer name"), ("id2label", "classifier labels"), ("label2id", "classifier labels"),
        ("problem_type", "classifier setting"), ("chunk_size_feed_forward", "HF memory setting"),
        ("is_encoder_decoder", "HF flag (false for Llama)"), ("is_decoder", "HF flag"),
        ("add_cross_attention", "HF flag"), ("tie_encoder_decoder", "HF flag"), ("prefix", "HF generation prefix"),
        ("decoder_start_token_id", "id"), ("sep_token_id", "id"), ("task_specific_params", "HF generation settings"),
        ("finetuning_task", "HF metadata"), ("pruned_heads", "HF metadata (empty for drafters)"),
        ("cross_attention_hidden_size", "HF flag"), ("_attn_implementation", "attention kernel choice"),
        ("_attn_implementation_autoset", "attention kernel choice"),
    )),
)

_BY_WHERE: dict[str, dict[str, Key]] = {}
for _k in KEYS:
    _BY_WHERE.setdefault(_k.where, {})[_k.name] = _k
# rope dict entries this project implements (linear / llama3); any other entry changes the rope
_ROPE_ENTRIES = {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings", "rope_theta"}
# In a speculators transformer_layer_config these are replaced by vLLM's update_eagle3 (from the top level, or
# its defaults) and not read by speculators: no effect there.
_LAYER_OVERRIDDEN = {"architectures", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"}
LAYER_PREFIX = "transformer_layer_config."


def key(name: str, where: str = "top") -> Key:
    return _BY_WHERE[where][name]


@dataclass
class KeyCheck:
    """What a config's keys mean here: refusals and warnings (Findings: key, cause, fix), unknown and harmless keys
    (dotted names)."""
    refused: list[Finding] = field(default_factory=list)
    warned: list[Finding] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    harmless: list[str] = field(default_factory=list)

    def raise_if_refused(self, what: str = "drafter config") -> None:
        if self.refused:
            raise ConfigRefused(what, self.refused)

    def report(self) -> dict:
        """For a load report: only what is there."""
        return {k: v for k, v in (("unknown_config_keys", self.unknown), ("ignored_config_keys", self.harmless)) if v}


class ConfigRefused(ValueError):
    """A config this project cannot read; `findings` holds each refusal (key, cause and engines, fix)."""

    def __init__(self, what: str, findings: list[Finding]):
        self.findings = list(findings)
        lines = [str(f) for f in self.findings]
        super().__init__(f"{what}: {lines[0]}" if len(lines) == 1 else f"{what}:\n  - " + "\n  - ".join(lines))


def check_config(cfg: Mapping[str, Any], layout: str = "sglang") -> KeyCheck:
    """Sort the keys of a drafter config (`layout` "sglang": a LlamaForCausalLMEagle3 config.json; "speculators":
    an Eagle3Speculator one, whose transformer_layer_config is checked as a layer config)."""
    out = KeyCheck()
    if layout == "speculators":
        _check_level(cfg, "speculators", READERS["speculators"], "", out)
        layer = cfg.get("transformer_layer_config")
        if isinstance(layer, Mapping):
            _check_level(layer, "top", READERS["speculators"], LAYER_PREFIX, out)
        return out
    if layout != "sglang":
        raise ValueError(f"config layout {layout!r}: expected 'sglang' or 'speculators'")
    architecture = architecture_finding(cfg.get("architectures"))
    if architecture is not None:  # another model class: its other keys (MLA sizes, rope, model_type) are moot here
        out.refused.append(architecture)
        return out
    _check_level(cfg, "top", READERS["sglang"], "", out)
    eagle = cfg.get("eagle_config")
    if isinstance(eagle, Mapping):
        _check_level(eagle, "eagle_config", READERS["sglang"], "eagle_config.", out)
    elif eagle is not None:
        out.refused.append(Finding("eagle_config", f"eagle_config={_show(eagle)}: expected a mapping (SGLang and vLLM "
                                   f"read keys from it)", "make eagle_config a mapping, as SGLang's layout has it"))
    return out


# switches whose value-specific findings live in drafter_values (SGLang layout, top level)
_VALUE_SPECIFIC = {"architectures", "model_type"}


def _check_level(cfg: Mapping[str, Any], where: str, readers, prefix: str, out: KeyCheck) -> None:
    table = _BY_WHERE[where]
    for name, value in cfg.items():
        entry = table.get(name)
        if entry is None:
            out.unknown.append(prefix + name)
        elif entry.handling == HARMLESS or (prefix == LAYER_PREFIX and name in _LAYER_OVERRIDDEN):
            out.harmless.append(prefix + name)
        elif where == "top" and prefix == "" and name in _VALUE_SPECIFIC:
            if name == "model_type":
                finding, fatal = model_type_finding(value, cfg, prefix)
                if finding is not None:
                    (out.refused if fatal else out.warned).append(finding)
        elif entry.handling == SWITCH:
            finding = _refusal(entry, value, cfg, readers, prefix)
            if finding:
                out.refused.append(finding)
    if where == "top":
        out.refused += _rope_refusals(cfg, prefix)


def _refusal(entry: Key, value: Any, cfg: Mapping[str, Any], readers, prefix: str) -> Optional[Finding]:
    """A refusal when `value` means another forward in some engine reading this layout, else None."""
    wrong = [(e, r) for e, r in entry.readings.items() if e in readers and not r.ours(value, cfg)]
    if not wrong:
        return None
    groups: dict[tuple[str, str], list[str]] = {}  # engines that read it alike, named once
    for e, r in wrong:
        groups.setdefault((r.meaning, _show(r.default)), []).append(ENGINES[e])
    honour = "; ".join(f"{', '.join(names)} (default {default}): {meaning}" for (meaning, default), names in groups.items())
    hint = entry.hints.get(_show(value))
    return Finding(prefix + entry.name, f"{prefix}{entry.name}={_show(value)} changes the drafter's forward "
                   f"({entry.effect}) and is not implemented here; honoured by {honour}",
                   hint or f"delete the key if the drafter was trained without it (its absence means this forward in "
                           f"every engine); otherwise {ANOTHER_INIT}")


def _rope_refusals(cfg: Mapping[str, Any], prefix: str) -> list[Finding]:
    """Rope variants this project does not implement, and rope settings whose two spellings disagree (SGLang,
    vLLM and SpecForge read rope_parameters first; a config holding both must say the same in both)."""
    out = []
    for name in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(name)
        if isinstance(rope, Mapping):
            extra = sorted(k for k in set(rope) - _ROPE_ENTRIES
                           if not (k == "partial_rotary_factor" and rope[k] in (1, 1.0)))
            kind = str(rope.get("rope_type") or rope.get("type") or "default")
            if extra or kind not in ROPE_TYPES:
                out.append(rope_type_finding(name, rope, extra, prefix))
    params = cfg.get("rope_parameters")
    agree = "make them agree (the value the drafter was trained with in both)"
    if isinstance(params, Mapping):
        theta = cfg.get("rope_theta")
        if theta is not None and params.get("rope_theta") is not None and float(theta) != float(params["rope_theta"]):
            out.append(Finding(f"{prefix}rope_theta", f"{prefix}rope_theta={_show(theta)} but rope_parameters.rope_theta="
                               f"{_show(params['rope_theta'])}: SGLang 0.5.14, vLLM 0.34.0 and SpecForge 0.2.0 use "
                               f"rope_parameters", agree))
        scaling = cfg.get("rope_scaling")
        kind = params.get("rope_type", "default")
        if isinstance(scaling, Mapping) and kind != "default" and \
                {k: v for k, v in params.items() if k != "rope_theta"} != dict(scaling):
            out.append(Finding(f"{prefix}rope_scaling", f"{prefix}rope_scaling={_show(scaling)} differs from "
                               f"rope_parameters={_show(params)}: SGLang 0.5.14, vLLM 0.34.0 and SpecForge 0.2.0 use "
                               f"rope_parameters", agree))
    return out


def engine_reading_problems(cfg: Mapping[str, Any], layout: str) -> list[str]:
    """For a config this project writes: every switch, as each engine reading `layout` sees it (the value, or
    the engine's default when absent), must mean this project's forward."""
    out = []
    if layout == "speculators":
        levels = [(cfg, "speculators", ""), (cfg.get("transformer_layer_config") or {}, "top", LAYER_PREFIX)]
    else:
        levels = [(cfg, "top", ""), (cfg.get("eagle_config") or {}, "eagle_config", "eagle_config.")]
    for level, where, prefix in levels:
        for entry in _BY_WHERE[where].values():
            if entry.handling != SWITCH or (prefix == LAYER_PREFIX and entry.name in _LAYER_OVERRIDDEN):
                continue
            for engine, r in entry.readings.items():
                if engine not in READERS[layout]:
                    continue
                present = entry.name in level
                value = level[entry.name] if present else r.default
                if not r.ours(value, level):
                    how = _show(value) if present else f"absent, so its default {_show(r.default)}"
                    out.append(f"{ENGINES[engine]} reads {prefix}{entry.name} = {how}: {r.meaning}; the export "
                               f"must mean the trained forward")
    return out


def explicit_switches(layout: str) -> dict[str, Any]:
    """Top-level switches export writes for `layout` (those some engine would otherwise read differently)."""
    where = "speculators" if layout == "speculators" else "top"
    return {k.name: k.write[layout] for k in _BY_WHERE[where].values() if layout in k.write}


def served_keys(where: str = "top") -> tuple[str, ...]:
    """Names a written config may carry at this level: fields and switches (never unknown or harmless keys)."""
    return tuple(k.name for k in _BY_WHERE[where].values() if k.handling in (FIELD, SWITCH))


def table_rows() -> list[dict[str, str]]:
    """The table as rows (key, where, per-engine default, handling, effect), e.g. for documentation."""
    rows = []
    for k in KEYS:
        defaults = {e: (_show(r.default) if isinstance(r, Reading) else "") for e, r in k.readings.items()}
        rows.append({"key": k.dotted, "layout": "speculators" if k.where == "speculators" else "sglang",
                     "handling": k.handling, "effect": k.effect,
                     **{e: defaults.get(e, "not read" if k.handling == SWITCH else "") for e in ENGINES}})
    return rows


def _show(value: Any) -> str:
    """JSON spelling (true / null), as the config file has it."""
    return "absent" if value is ABSENT else show(value)
