"""Published EAGLE-3 drafter configs (tests/fixtures/published_drafters/, SOURCES.md) through `make check` against
the Kimi-K2.5 target, under every aux-id rule: every verdict and every line is asserted. Each line names its cause,
what the engines do, and one fix (never the directory fix for a config-content problem)."""
import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from eagle3.engines import aux_layers
from eagle3.drafter.drafter_io import load_drafter_dir
from eagle3.drafter.model import DrafterConfig
from tests.fixtures.drafter_corpus import CORPUS_DIR, check_config, corpus_config, corpus_names, drafter_dir
from tests.fixtures.specforge_drafter import SF_CONFIG, tiny_weights
from export.run_check import run_check

DIRECTORY_FIX = "point at a drafter directory"
MLA = ("architectures", "ERROR", ["is an MLA EAGLE-3 drafter", "SGLang 0.5.14 models/kimi_k25_eagle3.py",
                                  "vLLM 0.34.0 models/deepseek_eagle3.py", "trains only LlamaForCausalLMEagle3"],
       ["use a Llama EAGLE-3 drafter", "init=scratch"])
YARN = ("rope_scaling", "ERROR", ['rope_scaling type "yarn"', "not implemented here", "SGLang 0.5.14, vLLM 0.34.0 and "
                                  "SpecForge 0.2.0 apply YaRN", "beta_fast / beta_slow", "mscale"],
        ["use a Llama EAGLE-3 drafter", "init=scratch"])
KIMI_K2 = ("model_type", "WARNING", ['model_type="kimi_k2" with LlamaForCausalLMEagle3', "SpecForge 0.2.0 builds the "
                                     "layer from architectures", "head_dim = qk_rope_head_dim = 64",
                                     "trained heads are 128 wide", "MLA KV cache", "do not know kimi_k2"],
           ['export writes model_type "llama"', "set model_type: llama"])
NO_IDS = ("eagle_config", "WARNING", ["no eagle_aux_hidden_state_layer_ids", "h = [2, 30, 58]"],
          ["write eagle_config.eagle_aux_hidden_state_layer_ids"])
VOCAB = ("vocab_size", "ERROR", ["drafter 129280 != target 163840"], ["another tokenizer"])
SGLANG_STYLE = ("eagle_aux_hidden_state_layer_ids", "ERROR",
                ["ids [1, 29, 57] look SGLang-style", "h = id + 1 = [2, 30, 58]", "aux_id_rule=vllm they are h = "
                 "[1, 29, 57]", "vLLM would feed"], ["read its ids with aux_id_rule=sglang"])


def context(n):
    return ("max_position_embeddings", "WARNING", [f"drafter {n} < target context 262144", "SGLang 0.5.14 and vLLM "
                                                   "0.34.0 size the draft's rope cos/sin cache from it",
                                                   f"breaks past {n} tokens"],
            ["they write 262144", "set max_position_embeddings: 262144"])


def readings_2_30_58(rule):
    h = {"sglang": "[2, 30, 58]", "sglang_legacy": "[3, 31, 59]", "vllm": "[2, 30, 58]"}[rule]
    return ("eagle_aux_hidden_state_layer_ids", "WARNING",
            ["[2, 30, 58] are read differently", "SGLang before it h = [3, 31, 59]", f"using rule '{rule}': h = {h}"],
            ["export rewrites the ids"])


def token(key, n, mine):
    return (key, "WARNING", [f"drafter {mine} != target {n}"], [f"set {key} to {n}"])


def expected(name, rule):
    """(verdict, [(key, level, problem needles, fix needles)] in the order make check prints them)."""
    if name in ("torchspec_kimi_k25_eagle3_mla_88ca60b", "lightseek_torchspec_kimi_k25_eagle3_moe_3bd756e"):
        return "FAIL: 1 error(s), 0 warning(s)", [MLA]
    if name == "torchspec_kimi_k25_eagle3_06a9760":
        return "FAIL: 1 error(s), 0 warning(s)", [YARN]
    if name in ("torchspec_kimi_k25_eagle3_4643a09", "torchspec_kimi_k25_eagle3_918aa03"):
        return "OK: compatible (1 warning(s))", [NO_IDS]
    if name == "specforge_kimi_k25_eagle3_3f9b5fc":
        return "OK: compatible (2 warning(s))", [context(131072), readings_2_30_58(rule)]
    if name == "specforge_kimi_k2_eagle3_03ebe2c":
        return "OK: compatible (3 warning(s))", [KIMI_K2, context(131072), readings_2_30_58(rule)]
    if name == "specforge_deepseek_v3_671b_eagle3_c02a09a":  # another target (DeepSeek-V3's vocab)
        tail = [context(163840), token("bos_token_id", 163584, 128000), token("eos_token_id", 163585, 128001)]
        if rule == "vllm":
            return "FAIL: 2 error(s), 3 warning(s)", [VOCAB, SGLANG_STYLE, *tail]
        return "FAIL: 1 error(s), 3 warning(s)", [VOCAB, *tail]
    raise AssertionError(f"corpus entry {name} has no expectation")


def test_the_corpus_is_what_sources_names():
    names = corpus_names()
    assert len(names) == 8
    sources = (CORPUS_DIR / "SOURCES.md").read_text()
    assert all(f"`{n}.json`" in sources for n in names)


@pytest.mark.parametrize("rule", aux_layers.RULES)
@pytest.mark.parametrize("name", corpus_names())
def test_published_drafter_through_make_check(tmp_path, name, rule):
    result = run_check(check_config(tmp_path, drafter_dir(tmp_path / "drafters", name), rule))
    verdict, lines = expected(name, rule)
    assert result.lines()[-1] == verdict
    got = [(m.key, "ERROR" if m.fatal else "WARNING") for m in result.mismatches]
    assert got == [(key, level) for key, level, _, _ in lines]
    for m, (key, _, problem, fix) in zip(result.mismatches, lines):
        for needle in problem:
            assert needle in m.problem, (key, needle, m.problem)
        for needle in fix:
            assert needle in m.fix, (key, needle, m.fix)
        assert DIRECTORY_FIX not in str(m) and "\n" not in str(m)


def test_every_readable_corpus_config_has_no_unknown_keys():
    """max_window_layers / use_sliding_window (Qwen2 template leftovers in the SpecForge and TorchSpec templates) are
    harmless, not 'keys no known engine reads'."""
    readable = 0
    for name in corpus_names():
        cfg = corpus_config(name)
        try:
            parsed = DrafterConfig.from_hf_dict(cfg)
        except ValueError:
            continue
        readable += 1
        assert parsed.unknown_keys == [], name
    assert readable == 5


def test_the_directory_fix_only_for_a_directory_problem(tmp_path):
    empty = tmp_path / "not_a_drafter"
    empty.mkdir()
    result = run_check(check_config(tmp_path, empty, "sglang"))
    assert [m.key for m in result.mismatches] == ["config"] and DIRECTORY_FIX in result.mismatches[0].fix


def test_kimi_k2_init_loads_warns_and_exports_llama(tmp_path, caplog):
    """SpecForge's Kimi-K2 template pair (model_type kimi_k2, LlamaForCausalLMEagle3): the init loads as the Llama
    layer SpecForge trained, the console says what serving it as is would do, and the written config says llama."""
    d = tmp_path / "k2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**SF_CONFIG, "model_type": "kimi_k2"}))
    save_file(tiny_weights(), str(d / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        model = load_drafter_dir(d)
    assert 'model_type="kimi_k2"' in caplog.text and "set model_type: llama" in caplog.text
    plain = DrafterConfig.from_hf_dict(SF_CONFIG)
    assert model.config == plain and model.config.to_hf_dict()["model_type"] == "llama"
    assert torch.equal(model.fc.weight, tiny_weights()["fc.weight"])


@pytest.mark.parametrize("value, needle", [("deepseek_v3", "head_dim = qk_rope_head_dim = 64"),
                                           ("llama4_text", "intermediate_size_mlp"),
                                           ("mistral", 'config class registered for "mistral"')])
def test_other_model_types_say_what_their_value_does(value, needle):
    cfg = {**SF_CONFIG, "model_type": value}
    if value == "deepseek_v3":  # the same DeepSeek-V3 config class as kimi_k2: read, with the warning
        assert "do not know kimi_k2" not in str(DrafterConfig.from_hf_dict(cfg).key_warnings[0])
        assert needle in str(DrafterConfig.from_hf_dict(cfg).key_warnings[0])
        return
    with pytest.raises(ValueError) as e:
        DrafterConfig.from_hf_dict(cfg)
    assert needle in str(e.value) and "set model_type: llama" in str(e.value) and "qwen3" not in str(e.value)
