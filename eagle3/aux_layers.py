"""Which target hidden states an EAGLE-3 drafter reads: the one home of the aux-layer convention.

The physical truth is h, the index into Hugging Face ``output_hidden_states`` (h = 0 the embeddings,
h = i + 1 the output of decoder layer i = the residual stream *entering* decoder layer i + 1). The
project's own configuration, stores and manifests name h. Layer *ids* exist only in drafter
``config.json`` files (``eagle_config.eagle_aux_hidden_state_layer_ids`` for SGLang, the top-level
``eagle_aux_hidden_state_layer_ids`` for vLLM speculators), and each serving engine turns them into h by
its own rule. Every read and write of such ids goes through `hf_indices_from_ids` / `ids_for_rule`.

Rules (checked against the engines' sources; see RULE_SOURCES):
- ``sglang`` (current, since PR #25454, 2026-05-16) for DeepSeek-family targets (Kimi-K2 / K2.5): the
  model captures ``hidden_states + residual`` before decoder-loop index ``c`` runs, so capture index
  c = h, and c = id + 1 if ``ids[0] == 1`` else c = id.
- ``sglang_legacy`` (before that PR): c = id + 1 always.
- ``vllm``: vLLM's DeepSeek-V2/V3 backbone appends ``hidden_states + residual`` before running layer
  ``idx`` when ``idx`` is in ``aux_hidden_state_layers``, the ids as listed: h = id.
With no ids, SGLang (and vLLM) capture h = [2, L // 2, L - 3] for L decoder layers: [2, 30, 58] for
Kimi's 61 layers (the outputs of decoder layers 1, 29, 57).

Pure functions on int lists; imports nothing but the standard library.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from eagle3.errors import StageError

RULES = ("sglang", "sglang_legacy", "vllm")
DEFAULT_RULE = "sglang"
NUM_AUX_LAYERS = 3  # EAGLE-3's fc reads exactly three concatenated target states
RULE_SOURCES = {
    "sglang": "sglang python/sglang/srt/models/deepseek_v2.py, DeepseekV2ForCausalLM.set_eagle3_layers_to_capture "
              "(after PR #25454, merged 2026-05-16): [v + 1 for v in ids] if ids[0] == 1 else list(ids); "
              "DeepseekV2Model.forward captures hidden_states + residual before layer i when i in layers_to_capture",
    "sglang_legacy": "sglang deepseek_v2.py before PR #25454: layers_to_capture = [v + 1 for v in ids]",
    "vllm": "vllm vllm/model_executor/models/deepseek_v2.py, DeepseekV2Model.forward: aux_hidden_states."
            "append(hidden_states + residual) before layer idx when idx in self.aux_hidden_state_layers "
            "(set from the draft config's eagle_aux_hidden_state_layer_ids as listed)",
}


class AuxLayerError(StageError, ValueError):
    """Aux layer ids / indices that no drafter can use, with the reason."""


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise AuxLayerError(f"aux layer id rule {rule!r}: expected one of {RULES}")
    return rule


def as_int_list(values, what: str) -> list[int]:
    """A list of plain ints from a config value; one clear line for anything else (a bare int,
    7.5, "2", a nested list, a bool)."""
    if values is None or isinstance(values, (str, bytes, int, float)) or not isinstance(values, Iterable):
        raise AuxLayerError(f"{what}={values!r}: expected a list of {NUM_AUX_LAYERS} integers, e.g. [2, 30, 58]")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise AuxLayerError(f"{what}={list(values)!r}: {v!r} is not an integer layer index")
        out.append(int(v))
    return out


def sglang_default_hf_indices(num_layers: int) -> list[int]:
    """What SGLang captures for a drafter config without ids: h = [2, L // 2, L - 3]."""
    L = int(num_layers)
    return [2, L // 2, L - 3]


def hf_indices_from_ids(ids: Sequence[int], rule: str = DEFAULT_RULE) -> list[int]:
    """h the engine captures for a drafter config listing `ids`, under `rule`."""
    check_rule(rule)
    ids = [int(i) for i in ids]
    if not ids:
        raise AuxLayerError("eagle_aux_hidden_state_layer_ids is an empty list")
    if rule == "sglang_legacy" or (rule == "sglang" and ids[0] == 1):
        return [i + 1 for i in ids]
    return list(ids)


def ids_for_rule(hf_indices: Sequence[int], rule: str) -> list[int]:
    """The ids an engine reading by `rule` turns into exactly `hf_indices` (inverse of
    `hf_indices_from_ids`). Raises where that engine cannot express h (current SGLang cannot
    capture h starting at 1: ids starting at 0 mean h = ids, ids starting at 1 mean ids + 1)."""
    check_rule(rule)
    h = [int(i) for i in hf_indices]
    if rule == "vllm":
        ids = list(h)
    elif rule == "sglang_legacy" or h[0] == 2:
        ids = [i - 1 for i in h]
    elif h[0] == 1:
        raise AuxLayerError(f"hidden-state indices {h} start at 1 (the output of decoder layer 0): current SGLang "
                            f"cannot express that (a first id 1 means h = id + 1, any other first id h = id)")
    else:
        ids = list(h)
    if any(i < 0 for i in ids):
        raise AuxLayerError(f"hidden-state indices {h} need negative layer ids under rule {rule!r}")
    if hf_indices_from_ids(ids, rule) != h:  # the contract, checked every time
        raise AuxLayerError(f"internal: ids {ids} do not read back as {h} under rule {rule!r}")
    return ids


def sglang_export_ids(hf_indices: Sequence[int]) -> tuple[list[int], bool]:
    """(ids, portable) to write into an SGLang drafter config for trained `hf_indices`. Where one list
    means h in every SGLang version (h[0] == 2 -> ids = h - 1, first id 1), portable is True;
    otherwise the current rule's ids are returned, portable False (needs SGLang with PR #25454)."""
    ids = ids_for_rule(hf_indices, "sglang")
    portable = hf_indices_from_ids(ids, "sglang_legacy") == [int(i) for i in hf_indices]
    return ids, portable


def readings(ids: Sequence[int]) -> dict[str, list[int]]:
    """h under every rule for a config listing `ids` (for reports where the rules disagree)."""
    return {rule: hf_indices_from_ids(ids, rule) for rule in RULES}


def validate_hf_indices(hf_indices, num_layers: int, what: str = "aux hidden-state indices") -> list[int]:
    """Exactly three distinct indices, each the output of a decoder layer: 1 <= h <= L - 1 (SGLang
    and vLLM capture the stream entering loop index h < L; h = 0 is the embeddings, not captured)."""
    h = as_int_list(hf_indices, what)
    L = int(num_layers)
    problems = []
    if len(h) != NUM_AUX_LAYERS:
        problems.append(f"{len(h)} given, an EAGLE-3 drafter reads exactly {NUM_AUX_LAYERS}")
    dup = sorted({i for i in h if h.count(i) > 1})
    if dup:
        problems.append(f"{dup} repeated (three distinct layers expected)")
    bad = [i for i in h if not 1 <= i <= L - 1]
    if bad:
        problems.append(f"{bad} outside 1..{L - 1} (h = i + 1 is the output of decoder layer i of {L})")
    if problems:
        raise AuxLayerError(f"{what} {h}: " + "; ".join(problems))
    return h
