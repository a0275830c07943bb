"""Test hook points: named places in a stage's loop where a test acts at a known moment (kill the
process right after optimizer step N, slow a capture so that a kill lands in the middle of it).

Why not environment switches: a loop that reads `os.environ` for a test behaves differently for
anyone who happens to set it, and the switch's meaning lives far from the test. Here production code
only calls `fire(point, **info)`; nothing is installed outside tests, so a fire is one dict lookup.
A test installs a handler in its own process (`installed`), or, for a real subprocess it kills,
through tests/hooked_stage.py, which installs one and then runs the stage's own entry script.

Standard library only (the core package runs where hydra is absent).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

# The hook points, and what each passes to its handlers.
TRAIN_AFTER_STEP = "train.after_step"        # step: optimizer steps done; after that step's log/validation/checkpoint
CAPTURE_AFTER_BATCH = "capture.after_batch"  # sequences: ids of the batch just handed to the store writer
POINTS = (TRAIN_AFTER_STEP, CAPTURE_AFTER_BATCH)

_handlers: dict[str, list[Callable[..., None]]] = {}


def _check_point(point: str) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown hook point {point!r}; the points are {list(POINTS)}")


def fire(point: str, **info) -> None:
    """Call the handlers installed at `point` (none outside tests)."""
    for handler in _handlers.get(point, ()):
        handler(**info)


def install(point: str, handler: Callable[..., None]) -> Callable[[], None]:
    """Install `handler` at `point` for the rest of the process; returns the function that removes it."""
    _check_point(point)
    _handlers.setdefault(point, []).append(handler)

    def remove() -> None:
        _handlers[point].remove(handler)
        if not _handlers[point]:
            del _handlers[point]

    return remove


@contextmanager
def installed(point: str, handler: Callable[..., None]) -> Iterator[None]:
    """`with installed(TRAIN_AFTER_STEP, f): run_train(...)` calls f(step=...) after each step."""
    remove = install(point, handler)
    try:
        yield
    finally:
        remove()
