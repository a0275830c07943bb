"""Fixtures of the fault suite (tests/faults): one small finished pipeline (capture + vocab of the
train toy world, a short scratch training run, its export) that the fault tests copy and break.

Everything goes through the stages' real entry functions (`run_train`, `run_export`, the store and
drafter loaders); nothing here patches stage code except to inject an I/O error or a kill."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fault_helpers import export_config, train_config


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, tiny_k25_target):
    """{capture, vocab, target, old_drafter, train_out, final, export}: a finished tiny pipeline.
    Read-only by convention: tests that break something copy it first (`copy_tree`)."""
    from export.stage import run_export
    from tests.fixtures.train_world import write_world
    from train.stage import run_train

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("fault_pipeline")
        world = write_world(root / "world", tiny_k25_target, n_train=12, n_val=4)
        train_out = run_train(train_config(world, root / "train-scratch"))
        final = Path(train_out) / "final"
        export = run_export(export_config(world, final, root / "export-scratch"))
    finally:
        torch.set_num_threads(n)
    return {**world, "root": root, "train_out": Path(train_out), "final": final, "export": Path(export)}
