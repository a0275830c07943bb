"""Run a stage's real entry script with a test hook installed (eagle3/hooks.py), for fault tests that
kill a real process at a known point:

    python tests/hooked_stage.py kill_after_step=6 train/run.py <overrides>
    python tests/hooked_stage.py sleep_after_batch=0.2 data/run_capture.py <overrides>

kill_after_step=N     SIGKILL this process right after optimizer step N (after that step's checkpoint)
sleep_after_batch=S   sleep S seconds after each capture batch, so a kill lands in the middle of the work

The script runs as `__main__` with its own argv, exactly as `python <script> <overrides>` would run it
(Hydra finds ../conf from the script's path); only the hook is added. Tests build the command with
`hooked_command`.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _kill_after_step(value: str):
    n = int(value)

    def handler(step: int) -> None:
        if step == n:
            os.kill(os.getpid(), signal.SIGKILL)

    return "TRAIN_AFTER_STEP", handler


def _sleep_after_batch(value: str):
    seconds = float(value)
    return "CAPTURE_AFTER_BATCH", lambda sequences: time.sleep(seconds)


HOOKS = {"kill_after_step": _kill_after_step, "sleep_after_batch": _sleep_after_batch}


def hooked_command(hook: str, script: str, overrides: list[str]) -> list[str]:
    """argv of a subprocess running `script` (relative to the repo root) with `hook` ('name=value')."""
    return [sys.executable, str(Path(__file__).resolve()), hook, str(REPO / script), *overrides]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or "=" not in argv[0]:
        sys.exit(f"usage: hooked_stage.py <{'|'.join(HOOKS)}>=<value> <script> [overrides]")
    name, value = argv[0].split("=", 1)
    if name not in HOOKS:
        sys.exit(f"hooked_stage.py: unknown hook {name!r}; known: {sorted(HOOKS)}")
    sys.path.insert(1, str(REPO))
    from eagle3 import hooks

    point, handler = HOOKS[name](value)
    hooks.install(getattr(hooks, point), handler)
    script = argv[1]
    sys.argv = [script, *argv[2:]]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python <script>` has it (this file's dir otherwise)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
