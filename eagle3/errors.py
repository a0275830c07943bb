"""The one kind of error a user is shown: `StageError`, and how every entry script reports it.

A stage fails for two kinds of reasons: the user's input or config cannot be used (a missing store,
a drafter for another target, a bad override, a damaged file), or the code is wrong. The first kind
is a `StageError`: every stage's own error class derives from it (keeping its older base,
RuntimeError or ValueError, so code that catches those still does), and an entry script prints it as
one line `<stage> failed: <message>` and exits with status 1. Anything else is a bug and keeps its
traceback. `EAGLE3_DEBUG=1` shows the traceback of a StageError too. A config Hydra itself cannot
compose (an unknown key, a value of the wrong type, an override it cannot parse) is reported the same
way by `run_main`, which every entry script calls instead of its `@hydra.main` function directly.

Standard library only: the core modules (store, drafter loading, target loading) import it on the
GPU machine that has no hydra.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

DEBUG_ENV = "EAGLE3_DEBUG"


class StageError(Exception):
    """An input or config the stage cannot use; the message says what and, where it can, what to do."""


def one_line(message: str) -> str:
    """A (possibly multi-line) message as one line: lines stripped and joined by spaces."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


@contextmanager
def stage_errors(stage: str) -> Iterator[None]:
    """Run an entry script's body: a StageError ends the process with `<stage> failed: <message>`
    on stderr and exit status 1 (re-raised with its traceback when EAGLE3_DEBUG is set)."""
    try:
        yield
    except StageError as e:
        if debug_enabled():
            raise
        sys.exit(f"{stage} failed: {one_line(e) or type(e).__name__}")


def _from_config_library(e: BaseException) -> bool:
    return type(e).__module__.split(".")[0] in ("hydra", "omegaconf")


def run_main(stage: str, hydra_main: Callable[[], Any]) -> None:
    """Call an entry script's `@hydra.main` function. Hydra prints a config it cannot compose on
    several lines itself; with HYDRA_FULL_ERROR=1 it raises the error instead, which becomes one line
    `<stage> failed: ...` and exit status 1 here (re-raised with its traceback under EAGLE3_DEBUG)."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except Exception as e:
        if debug_enabled() or not _from_config_library(e):
            raise
        cause = e.__cause__
        detail = f" ({one_line(cause)})" if cause is not None and str(cause) not in str(e) else ""
        if not any(arg in str(e) + detail for arg in sys.argv[1:]):  # e.g. a parse error names no override
            detail += f" (overrides: {' '.join(sys.argv[1:])})"
        sys.exit(f"{stage} failed: {one_line(e)}{detail}")
