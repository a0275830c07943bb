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
Kimi's 61 layers (the outputs of decoder layers 1, 29, 57). Both engines append the states while looping over
the layers, so they reach the drafter in ascending order whatever order a config lists: h must be ascending.

Pure functions on int lists; imports nothing but the standard library.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from eagle3.errors import StageError

RULES = ("sglang", "sglang_legacy", "vllm")
DEFAULT_RULE = "sglang"
NUM_AUX_LAYERS = 3  # EAGLE-3's fc reads exactly three concatenated target states
RULE_SOURCES = {
    "sglang": "sglang python/sglang/srt/models/deepseek_v2.py, DeepseekV2ForCausalLM.set_eagle3_layers_to_capture "
              "(after PR #25454, merged 2026-05-16): [v + 1 for v in ids] if ids[0] == 1 else list(ids); "
              "DeepseekV2Model.forward captures hidden_states + residual before layer i when i in layers_to_capture",
    "sglang_legacy": "sglang deepseek_v2.py before PR #25454: layers_to_capture = [v + 1 for v in ids]",
    "vllm": "vllm 0.34.0 vllm/model_executor/models/deepseek_v2.py 1561-1568, DeepseekV2Model.forward: "
            "aux_hidden_states.append(hidden_states + residual) before layer idx when idx in "
            "self.aux_hidden_state_layers (the draft config's eagle_aux_hidden_state_layer_ids as listed, "
            "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py); id L (1586-1589) = the last layer's un-normed output",
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


def listed_aux_ids(config: dict) -> Optional[list[int]]:
    """`eagle_config.eagle_aux_hidden_state_layer_ids` as an SGLang drafter config lists them (None: absent): the
    one reading of that key (the drafter config's parse, a capture's choice and `make check` use it)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else as_int_list(ids, "eagle_aux_hidden_state_layer_ids")


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


# Written into SGLang drafter configs beside eagle_config: the trained h and the SGLang versions that read
# the listed ids as h (never read back as the truth: the ids are, by the reader's rule).
META_KEY = "eagle3_aux_hidden_states"
SGLANG_RULE_CHANGE = "SGLang with PR #25454 (merged 2026-05-16) or later"


def sglang_config_entries(hf_indices: Sequence[int]) -> dict:
    """The SGLang drafter config's entries for trained `hf_indices`: `eagle_config` with the ids
    (`sglang_export_ids`) and `META_KEY` saying what they mean and for which SGLang versions."""
    ids, portable = sglang_export_ids(hf_indices)
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            META_KEY: {"hf_indices": [int(h) for h in hf_indices], "eagle_aux_hidden_state_layer_ids": ids,
                       "sglang_rule": "h = id + 1 if ids[0] == 1 else id",
                       "sglang_versions": "every version" if portable else SGLANG_RULE_CHANGE}}


def readings(ids: Sequence[int]) -> dict[str, list[int]]:
    """h under every rule for a config listing `ids` (for reports where the rules disagree)."""
    return {rule: hf_indices_from_ids(ids, rule) for rule in RULES}


def validate_hf_indices(hf_indices, num_layers: Optional[int], what: str = "aux hidden-state indices") -> list[int]:
    """Exactly three distinct indices, each the output of a decoder layer: 1 <= h <= L - 1 (SGLang
    and vLLM capture the stream entering loop index h < L; h = 0 is the embeddings, not captured), and
    not h[0] == 1, which current SGLang cannot be told (a first id 1 means h = 2; `ids_for_rule`); in
    ascending order, because both engines hand the drafter the states in layer order whatever order the
    config lists (SGLang deepseek_v2 and vLLM deepseek_v2 append while looping over the layers), so an
    unsorted list would feed fc its input blocks permuted.
    num_layers None: everything but the range (a config checked before the target is known)."""
    h = as_int_list(hf_indices, what)
    problems = []
    if len(h) != NUM_AUX_LAYERS:
        problems.append(f"{len(h)} given, an EAGLE-3 drafter reads exactly {NUM_AUX_LAYERS}")
    dup = sorted({i for i in h if h.count(i) > 1})
    if dup:
        problems.append(f"{dup} repeated (three distinct layers expected)")
    bad = [i for i in h if i < 1 or (num_layers is not None and i > int(num_layers) - 1)]
    L = "L" if num_layers is None else int(num_layers)
    if bad:
        top = "L-1" if num_layers is None else L - 1
        problems.append(f"{bad} outside 1..{top} (h = i + 1 is the output of decoder layer i of {L})")
    if not dup and h != sorted(h):
        problems.append(f"not ascending (SGLang and vLLM hand the drafter the states in layer order, "
                        f"{sorted(h)}, whatever order the config lists)")
    if h and h[0] == 1:
        problems.append("h[0] = 1 (the output of decoder layer 0) cannot be served by current SGLang, which reads a "
                        "first id 1 as h = 2: start at h >= 2")
    if problems:
        raise AuxLayerError(f"{what} {h}: " + "; ".join(problems))
    return h


def sglang_style_ids_note(ids: Optional[Sequence[int]], rule: Optional[str]) -> Optional[tuple[str, str]]:
    """(problem, fix) when ids starting at 1 are read by the vllm rule: they look SGLang-style (current and legacy
    SGLang read a first id 1 as h = id + 1), while vLLM feeds h = id, whose h = 1 current SGLang cannot capture.
    None otherwise."""
    if rule != "vllm" or not ids or int(ids[0]) != 1:
        return None
    ids = [int(i) for i in ids]
    sglang = hf_indices_from_ids(ids, "sglang")
    return (f"ids {ids} look SGLang-style: SGLang reads a first id 1 as h = id + 1 = {sglang}; read by aux_id_rule=vllm "
            f"they are h = {ids}, the states vLLM would feed (h = 1 is decoder layer 0's output), which current SGLang "
            f"cannot be told to capture",
            "if the drafter was trained on SGLang's reading (SpecForge, an SGLang capture), read its ids with "
            "aux_id_rule=sglang (init.aux_id_rule=sglang to train from it)")


def disagreement_note(ids: Optional[Sequence[int]], rule: str, where: str) -> str | None:
    """One line when SGLang's two rules read `ids` differently (first id not 1), naming every reading and
    the one used; None when current and legacy SGLang agree, or when no ids are listed."""
    if not ids:
        return None
    r = readings(ids)
    if r["sglang"] == r["sglang_legacy"]:
        return None
    return (f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} are read differently by the engines: current "
            f"SGLang (PR #25454+) h = {r['sglang']}, SGLang before it h = {r['sglang_legacy']}, vLLM h = {r['vllm']}; "
            f"using rule {rule!r}: h = {r[rule]} (init.aux_id_rule selects the rule)")


@dataclass(frozen=True)
class AuxChoice:
    """The hidden states a capture takes, and why."""
    hf_indices: list[int]
    source: str                       # "init_drafter:<dir>" | "config" | "sglang_default"
    rule: Optional[str] = None        # the engine rule that read `listed_ids` (None: no ids were read)
    listed_ids: Optional[list[int]] = None

    def provenance(self) -> dict:
        """What manifests record beside h: the rule, the source, and the ids as listed with every reading."""
        out = {"hf_indices": list(self.hf_indices), "source": self.source, "rule": self.rule,
               "listed_ids": self.listed_ids}
        if self.listed_ids is not None:
            out["readings"] = readings(self.listed_ids)
        return out


def choose_hf_indices(listed_ids: Optional[Sequence[int]], init_where: Optional[str], configured,
                      num_layers: int, rule: str = DEFAULT_RULE) -> AuxChoice:
    """h to capture: the init drafter's listed ids read by `rule` if it lists some, else `configured`
    (h, as the project's config names it), else SGLang's default. A configured h that differs from the
    init drafter's reading is an error (its fc was trained on those states). Validated against the
    target's `num_layers` (call before loading the target)."""
    check_rule(rule)
    if listed_ids is not None:
        h = hf_indices_from_ids(listed_ids, rule)
        choice = AuxChoice(h, f"init_drafter:{init_where}", rule, [int(i) for i in listed_ids])
        if configured is not None and as_int_list(configured, "aux_hf_indices") != h:
            raise AuxLayerError(f"aux_hf_indices={list(configured)} conflicts with the init drafter {init_where}: it "
                                f"lists ids {list(listed_ids)}, read by rule {rule!r} as h = {h} (its fc was trained "
                                f"on those states). Drop aux_hf_indices, change init.aux_id_rule, or use another init.")
    elif configured is not None:
        choice = AuxChoice(as_int_list(configured, "aux_hf_indices"), "config")
    else:
        choice = AuxChoice(sglang_default_hf_indices(num_layers), "sglang_default")
    validate_hf_indices(choice.hf_indices, num_layers, f"aux hidden-state indices (from {choice.source})")
    return choice


def reading_mismatch(drafter_h: Optional[Sequence[int]], store_h: Sequence[int]) -> Optional[str]:
    """The one agreement check between the states a drafter reads and those a store holds (None: they agree,
    or the drafter names none). Every stage that pairs a drafter with a store asks this."""
    if drafter_h is None or [int(i) for i in drafter_h] == [int(i) for i in store_h]:
        return None
    return f"drafter reads hidden states h = {list(drafter_h)}, the store holds h = {list(store_h)}"
