"""The serve commands and the choice of knobs behind them."""
import json
import shlex
from types import SimpleNamespace

import pytest

from eagle3.config.schema.export import ServeConf
from eagle3.engines.serve_launch import ServeChoice, shell, sglang_command, tensor_parallel, vllm_command
from export.serving import choice_from_report, read_serve_choice, serve_markdown

K25 = SimpleNamespace(name="kimi_k25", path="/models/Kimi-K2.5", layout="kimi_k25", trust_remote_code=True)
MINI = SimpleNamespace(name="k25_mini", path="/runs/mini_world/k25-mini", layout="kimi_k25", trust_remote_code=False)


def test_sglang_command_for_kimi_k25_has_remote_code_and_tp():
    choice = ServeChoice(3, 1, 4, source="x")
    cmd = sglang_command(K25, "/out/export-aqmedai_k2", choice, tensor_parallel(K25, None), ["--mem-fraction-static", "0.8"])
    s = " ".join(cmd)
    assert s.startswith("python -m sglang.launch_server --model-path /models/Kimi-K2.5")
    assert "--speculative-algorithm EAGLE3" in s
    assert "--speculative-draft-model-path /out/export-aqmedai_k2" in s
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in s
    assert "--trust-remote-code" in cmd and cmd[cmd.index("--tp") + 1] == "8"
    assert cmd[-2:] == ["--mem-fraction-static", "0.8"]


def test_mini_target_needs_no_tp_and_tp_override_wins():
    assert tensor_parallel(MINI, None) is None
    assert tensor_parallel(K25, 4) == 4
    cmd = sglang_command(MINI, "/d", ServeChoice(2, 1, 3, "config"), None, [])
    assert "--tp" not in cmd and "--trust-remote-code" not in cmd


def test_vllm_command_names_the_speculators_dir_and_chain_length():
    cmd = vllm_command(K25, "/out/e/speculators", ServeChoice(3, 1, 4, "x"), 8)
    assert cmd[:3] == ["vllm", "serve", "/models/Kimi-K2.5"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/out/e/speculators", "num_speculative_tokens": 3}
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"


def test_shell_rendering_is_copy_pasteable():
    cmd = vllm_command(K25, "/out/my dir", ServeChoice(2, 1, 3, "x"), None)
    text = shell(cmd)
    assert shlex.split(text.replace("\\\n", " ")) == cmd


def test_choice_from_the_eval_stage_best_setting():
    """The shape eval/report.py writes (`best_setting`)."""
    report = {"best": {"label": "3/1/4", "num_steps": 3, "topk": 1, "num_draft_tokens": 4, "accept_length": 2.9,
                       "speedup": 1.31, "predicted_tok_s": 107.4, "baseline_tok_s": 82.0,
                       "break_even_accept_length": 2.2, "wins": True, "verdict": "predicted to beat no speculation"}}
    c = choice_from_report(report, "eval/report.json")
    assert (c.num_steps, c.topk, c.num_draft_tokens) == (3, 1, 4)
    assert (c.accept_length, c.speedup, c.predicted_tok_s, c.baseline_tok_s, c.break_even_accept_length) == (
        2.9, 1.31, 107.4, 82.0, 2.2)
    md = serve_markdown(name="x", target=K25, choice=c, sglang_cmd=["python"], vllm_cmd=None, facts={})
    assert "107.4 vs baseline 82.0" in md and "break-even accept length on that server: 2.20" in md
    assert "eval verdict: predicted to beat no speculation" in md


def test_choice_from_explicit_best():
    c = choice_from_report({"best": {"knobs": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4},
                                     "accept_length": 2.5, "speedup": 0.9}, "baseline_tok_s": 82}, "r.json")
    assert (c.num_steps, c.topk, c.num_draft_tokens, c.accept_length, c.speedup, c.baseline_tok_s) == (3, 1, 4, 2.5, 0.9, 82.0)


def test_choice_picks_the_fastest_predicted_setting_from_accept_entries():
    report = {"accept": {
        "2/1/3": {"knobs": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}, "drafter": {"accept_length": 2.1},
                  "prediction": {"speedup": 1.10}},
        "3/1/4": {"knobs": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}, "drafter": {"accept_length": 2.4},
                  "prediction": {"speedup": 1.05}}}}
    c = choice_from_report(report, "r")
    assert (c.num_steps, c.accept_length, c.speedup) == (2, 2.1, 1.10) and "speed-up" in c.note
    for e in report["accept"].values():
        del e["prediction"]
    c = choice_from_report(report, "r")
    assert (c.num_steps, c.accept_length, c.speedup) == (3, 2.4, None) and "accept length" in c.note
    assert choice_from_report({"accept": {}}, "r") is None


def test_read_serve_choice_falls_back_to_config_and_says_why(tmp_path):
    defaults = ServeConf()
    c = read_serve_choice(tmp_path / "absent", defaults)
    assert (c.num_steps, c.topk, c.num_draft_tokens, c.source) == (2, 1, 3, "config") and "no eval report" in c.note
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable eval report"):
        read_serve_choice(tmp_path, defaults)
    (tmp_path / "report.json").write_text(json.dumps({"best": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}}))
    assert read_serve_choice(tmp_path, defaults).num_steps == 3
    assert read_serve_choice(tmp_path, defaults, use_report=False).num_steps == 2


def test_serve_markdown_warns_when_predicted_slower():
    md = serve_markdown(name="aqmedai_k2", target=K25, choice=ServeChoice(2, 1, 3, "r", accept_length=1.5, speedup=0.73),
                        sglang_cmd=["python", "-m", "sglang.launch_server"], vllm_cmd=None, facts={"dtype": "bfloat16"})
    assert "1.50" in md and "0.73" in md and "predicted slower than no speculation" in md
    assert "vLLM" not in md and "- dtype: bfloat16" in md


def test_serve_conf_rejects_impossible_chain():
    from eagle3.config.conf import ConfigError
    with pytest.raises(ConfigError, match=r"export.serve: .*num_draft_tokens must be in \[2, 3\]"):
        ServeConf(num_steps=2, topk=1, num_draft_tokens=5).validate()
