"""`make check` (export/run_check.py): a matching drafter/target pair passes; a deliberately broken
drafter gets each mismatch named, and the command exits non-zero."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from eagle3 import REPO_ROOT
from eagle3.config.conf import compose, to_schema
from eagle3.drafter.drafter_io import save_drafter_dir
from eagle3.formats.manifest import write_manifest
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.config.schema.check import CheckConfig
from export.run_check import run_check

TEXT = {"model_type": "deepseek_v3", "hidden_size": 16, "num_hidden_layers": 6, "vocab_size": 80,
        "max_position_embeddings": 512, "num_attention_heads": 2, "intermediate_size": 32}


def fake_target(path, layout="kimi_k25"):
    """A target directory as the check reads it: config.json (Kimi_K25 wrapper) + safetensors."""
    path.mkdir(parents=True)
    cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": TEXT} \
        if layout == "kimi_k25" else TEXT
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"language_model.model.embed_tokens.weight": torch.zeros(80, 16)}, str(path / "model.safetensors"))
    return path


def drafter_dir(path, **kw):
    base = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                vocab_size=80, draft_vocab_size=20, target_hidden_size=16, aux_hf_indices=[2, 3, 5],
                max_position_embeddings=512, torch_dtype="float32")
    base.update(kw)
    return save_drafter_dir(Eagle3Drafter(DrafterConfig(**base)), path)


def config(tmp_path, drafter, extra=()):
    cfg = compose("check", [f"paths.root={tmp_path}", f"target.path={tmp_path / 'target'}",
                            f"drafter_dir={drafter}", *extra])
    return to_schema(cfg, CheckConfig)


def test_matching_pair_passes(tmp_path):
    fake_target(tmp_path / "target")
    d = drafter_dir(tmp_path / "good")
    cap = tmp_path / "stages" / "k25_mini" / "capture"
    write_manifest(cap, "capture", {}, hf_indices=[2, 3, 5])
    result = run_check(config(tmp_path, d))
    assert result.ok() and result.mismatches == []
    assert any("capture " in i and "hidden states h = [2, 3, 5]" in i for i in result.info)
    # the drafter was saved with ids [1, 2, 4]: every SGLang version reads h = [2, 3, 5]
    assert any("config lists ids [1, 2, 4]; capture takes h = [2, 3, 5]" in i for i in result.info)
    assert result.lines()[-1].startswith("OK")


def test_broken_drafter_names_each_mismatch(tmp_path):
    fake_target(tmp_path / "target")
    d = drafter_dir(tmp_path / "bad", vocab_size=90, aux_hf_indices=[2, 3, 7], max_position_embeddings=128)
    # also corrupt the weights: drop one, add one SGLang would silently ignore
    from safetensors.torch import load_file
    sd = load_file(str(d / "model.safetensors"))
    del sd["midlayer.hidden_norm.weight"]
    sd["midlayer.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    save_file(sd, str(d / "model.safetensors"))
    cap = tmp_path / "stages" / "k25_mini" / "capture"
    write_manifest(cap, "capture", {}, hf_indices=[2, 3, 5])
    result = run_check(config(tmp_path, d))
    keys = [m.key for m in result.mismatches]
    assert not result.ok()
    assert {"weights", "vocab_size", "aux_hf_indices", "max_position_embeddings"} <= set(keys)
    text = "\n".join(result.lines())
    for needle in ("midlayer.hidden_norm.weight", "rotary_emb.inv_freq", "drafter 90 != target 80",
                   "[7] outside 1..5", "the store holds h = [2, 3, 5]", "128 < target context 512"):
        assert needle in text, needle
    assert result.lines()[-1].startswith("FAIL")


@pytest.mark.parametrize("rule, h", [("sglang", [2, 3, 4]), ("sglang_legacy", [3, 4, 5]), ("vllm", [2, 3, 4])])
def test_ids_the_sglang_versions_read_differently_show_every_reading(tmp_path, rule, h, caplog):
    """A config listing ids whose first is not 1 (like lightseekorg's K2.5 drafter's [2, 30, 58]): the check
    prints the h a capture takes under the chosen rule, every engine's reading, and a warning (once: not
    also as the config reader's log warning)."""
    fake_target(tmp_path / "target")
    d = drafter_dir(tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]
    del cfg["eagle3_aux_hidden_states"]
    (d / "config.json").write_text(json.dumps(cfg))
    result = run_check(config(tmp_path, d, [f"aux_id_rule={rule}"]))
    text = "\n".join(result.lines())
    assert f"config lists ids [2, 3, 4]; capture takes h = {h} (rule '{rule}')" in text
    assert "sglang h = [2, 3, 4], sglang_legacy h = [3, 4, 5], vllm h = [2, 3, 4]" in text
    warn = [m for m in result.mismatches if m.key == "eagle_aux_hidden_state_layer_ids"]
    assert len(warn) == 1 and not warn[0].fatal and "read differently" in warn[0].problem
    assert not [r for r in caplog.records if "read differently" in r.getMessage()]
    assert result.ok()


def test_warnings_only_pass_unless_strict(tmp_path):
    fake_target(tmp_path / "target", layout="causal_lm")
    d = drafter_dir(tmp_path / "old", max_position_embeddings=128)
    result = run_check(config(tmp_path, d, ["target=k2_mini", f"target.path={tmp_path / 'target'}"]))
    assert [m.key for m in result.mismatches] == ["max_position_embeddings"]
    assert result.ok() and not result.ok(fail_on_warnings=True)


@pytest.mark.slow
def test_cli_exit_codes(tmp_path):
    fake_target(tmp_path / "target")
    good, bad = drafter_dir(tmp_path / "good"), drafter_dir(tmp_path / "bad", hidden_size=32, intermediate_size=24)
    cmd = [sys.executable, str(REPO_ROOT / "export" / "run_check.py"), f"paths.root={tmp_path}",
           f"target.path={tmp_path / 'target'}"]
    ok = subprocess.run(cmd + [f"drafter_dir={good}"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "OK: compatible" in ok.stdout
    fail = subprocess.run(cmd + [f"drafter_dir={bad}"], capture_output=True, text=True)
    assert fail.returncode == 1 and "ERROR hidden_size" in fail.stdout
