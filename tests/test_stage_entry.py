"""Every entry script reports a user's mistake the same way (eagle3/errors.py): one line
`<stage> failed: <what>` on stderr, exit status 1, no traceback; EAGLE3_DEBUG=1 shows the traceback.
The scripts run as real processes (all at once: each spends its few seconds importing torch)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eagle3 import REPO_ROOT
from eagle3.errors import StageError, one_line, stage_errors

# (script, overrides, the one line's expected start, a fragment naming the problem); `{root}` is an
# empty paths.root, so every stage finds its input missing unless the mistake is in the config itself.
CASES = {
    "mini_world": ("data/run_mini_world.py", ["seed=abc"], "mini world failed:", "could not be converted to Integer"),
    "prepare": ("data/run_prepare.py", [], "prepare failed:", "k25_mini.jsonl does not exist"),
    "capture": ("data/run_capture.py", [], "capture failed:", "prepare: no manifest.json"),
    "vocab": ("data/run_vocab.py", [], "vocab failed:", "prepare: no manifest.json"),
    "train_no_store": ("train/run.py", ["+init=scratch"], "train failed:", "capture: no manifest.json"),
    "train_no_init": ("train/run.py", [], "train failed:", "add +init=<aqmedai_k2|scratch>"),
    "train_bad_value": ("train/run.py", ["+init=scratch", "optim.lr=fast"], "train failed:", "optim.lr"),
    "train_unknown_key": ("train/run.py", ["+init=scratch", "bogus=1"], "train failed:", "Could not override 'bogus'"),
    "vocab_unparsable": ("data/run_vocab.py", ["draft_vocab_size=[1"], "vocab failed:", "draft_vocab_size=[1"),
    "eval": ("eval/run.py", [], "eval failed:", "no drafter at"),
    "export": ("export/run.py", [], "export failed:", "no config.json"),
    "check": ("export/run_check.py", [], "check failed:", "no config.json"),
    "demo": ("pipeline/run_demo.py", ["train_steps=0"], "demo failed:", "train_steps=0: must be >= 1"),
    "study": ("pipeline/run_study.py", ["seeds=[0]"], "study failed:", "at least two distinct seeds"),
    "study_no_records": ("pipeline/run_study.py", ["report_only=true"], "study failed:", "no run records under"),
}


def _run_all(root, env_extra: dict, names) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    procs = {}
    for name in names:
        script, overrides, _, _ = CASES[name]
        procs[name] = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / script), f"paths.root={root}", f"hydra.run.dir={root}/hydra/{name}",
             *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = (p.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run_all(tmp_path_factory.mktemp("entry_root"), {}, CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_users_mistake_is_one_line_and_exit_status_1(results, name):
    rc, stdout, stderr = results[name]
    _, _, head, problem = CASES[name]
    assert rc == 1, (stdout, stderr)
    assert "Traceback" not in stderr + stdout
    lines = [ln for ln in stderr.splitlines() if ln.startswith(head)]
    assert len(lines) == 1, stderr
    assert problem in lines[0]
    assert stderr.rstrip().splitlines()[-1] == lines[0]  # the last thing printed


def test_debug_switch_shows_the_traceback(tmp_path):
    rc, stdout, stderr = _run_all(tmp_path, {"EAGLE3_DEBUG": "1"}, ["train_no_store"])["train_no_store"]
    assert rc == 1
    assert "Traceback" in stderr and "TrainInputError" in stderr and "capture: no manifest.json" in stderr


def test_stage_errors_catches_only_stage_errors_and_keeps_their_old_bases(monkeypatch):
    from data.prepare import PrepareError
    from eagle3.config.conf import ConfigError
    from eagle3.formats.store import StoreError, StoreMismatchError

    monkeypatch.delenv("EAGLE3_DEBUG", raising=False)
    assert issubclass(ConfigError, ValueError) and issubclass(StoreError, RuntimeError)
    assert issubclass(StoreMismatchError, StageError) and issubclass(PrepareError, StageError)
    with pytest.raises(SystemExit) as e:
        with stage_errors("prepare"):
            raise PrepareError("no usable conversation:\n  - a\n  - b")
    assert e.value.code == "prepare failed: no usable conversation: - a - b"
    with pytest.raises(KeyError):  # a bug is not a user's mistake: its traceback stays
        with stage_errors("prepare"):
            raise KeyError("x")
    assert one_line("  a\n\n b  ") == "a b"


def test_a_bad_override_in_compose_is_a_config_error():
    from eagle3.config.conf import ConfigError, compose

    with pytest.raises(ConfigError, match=r"cannot compose conf/train.yaml .*bogus"):
        compose("train", ["bogus=1"])
