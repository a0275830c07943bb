"""Test hook points (eagle3/hooks.py) and the wrapper that installs one in a real stage process
(tests/hooked_stage.py). The stage loops that fire them are tested through their fault tests:
tests/test_train_resume.py, tests/faults/test_process_death.py, tests/test_capture.py."""
import re
import subprocess

import pytest

from eagle3 import REPO_ROOT, hooks
from hooked_stage import hooked_command


def test_a_point_calls_its_handlers_only_while_installed():
    seen = []
    hooks.fire(hooks.TRAIN_AFTER_STEP, step=1)  # nothing installed: nothing happens
    with hooks.installed(hooks.TRAIN_AFTER_STEP, lambda step: seen.append(("a", step))):
        remove = hooks.install(hooks.TRAIN_AFTER_STEP, lambda step: seen.append(("b", step)))
        hooks.fire(hooks.TRAIN_AFTER_STEP, step=2)
        hooks.fire(hooks.CAPTURE_AFTER_BATCH, sequences=["x"])  # another point: not these handlers
        remove()
        hooks.fire(hooks.TRAIN_AFTER_STEP, step=3)
    hooks.fire(hooks.TRAIN_AFTER_STEP, step=4)
    assert seen == [("a", 2), ("b", 2), ("a", 3)]


def test_an_unknown_point_is_refused_by_name():
    with pytest.raises(ValueError, match="train.after_stpe"):
        hooks.install("train.after_stpe", lambda step: None)


def test_the_wrapper_refuses_an_unknown_hook():
    cmd = hooked_command("kill_after_stpe=3", "train/run.py", [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "unknown hook 'kill_after_stpe'" in res.stderr


def test_production_code_reads_no_test_switches_from_the_environment():
    """Fault injection goes through hook points; the only EAGLE3_* variables stage code reads are the
    user's debug switch and the compile-shape switch of the fast kernels."""
    allowed = {"EAGLE3_DEBUG", "EAGLE3_COMPILE_DYNAMIC"}
    found = {}
    for folder in ("eagle3", "data", "train", "eval"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            for name in re.findall(r"[\"'](EAGLE3_[A-Z0-9_]+)[\"']", path.read_text()):
                found.setdefault(name, []).append(str(path.relative_to(REPO_ROOT)))
    assert {k: v for k, v in found.items() if k not in allowed} == {}
    assert "EAGLE3_DEBUG" in found  # the scan does see literals
