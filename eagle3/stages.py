"""Where each stage's code is, for the orchestrators that run several stages (the demo and the study,
in eval/): stage name -> the function its entry script calls, `run_<stage>(typed config) -> Path`,
imported by name only when asked for.

A stage folder (data/, train/, eval/) never imports another's modules (tests/test_layout.py): an
orchestrator runs another folder's stage through this table, with the same typed config and the same
function as the stage's entry script. Besides the run functions the table names the one other piece
of a stage an orchestrator uses: the train stage's init drafter (the study's point at 0 tokens).
Standard library only; tests/test_layout.py checks every entry resolves.
"""
from __future__ import annotations

from importlib import import_module
from typing import Callable

ENTRY_POINTS: dict[str, str] = {  # name -> "module:function"
    "mini_world": "data.mini_world.build:run_mini_world",
    "prepare": "data.prepare:run_prepare",
    "capture": "data.capture:run_capture",
    "vocab": "data.vocab:run_vocab",
    "train": "train.loop:run_train",
    "train.init_drafter": "train.model_setup:init_drafter",
    "eval": "eval.stage:run_eval",
    "export": "eval.export:run_export",
}


def entry_point(name: str) -> Callable:
    """The function registered as `name` (a stage's run function, or `train.init_drafter`)."""
    if name not in ENTRY_POINTS:
        raise ValueError(f"unknown stage entry {name!r}; known: {', '.join(ENTRY_POINTS)}")
    module, function = ENTRY_POINTS[name].split(":")
    return getattr(import_module(module), function)
