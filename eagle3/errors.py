"""The one kind of error a user is shown: `StageError`, and how every entry script reports it.

A stage fails for two kinds of reasons: the user's input or config cannot be used (a missing store,
a drafter for another target, a bad override, a damaged file), or the code is wrong. The first kind
is a `StageError`: every stage's own error class derives from it (keeping its older base,
RuntimeError or ValueError, so code that catches those still does), and an entry script prints it as
one line `<stage> failed: <message>` and exits with status 1. Anything else is a bug and keeps its
traceback. `EAGLE3_DEBUG=1` shows the traceback of a StageError too.

Standard library only: the core modules (store, drafter loading, target loading) import it on the
GPU machine that has no hydra.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

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
