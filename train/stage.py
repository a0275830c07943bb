"""The train stage: `run_train(config) -> out_dir` (what `train/run.py` and tests call).

One CPU process, one GPU, or `accelerate launch` (DDP; `fsdp=true` for FSDP). Per optimizer step
each rank takes `grad_accum` token-budget micro-batches of its shard (train/batches.py); AdamW (fused on
CUDA), warmup + cosine, grad clipping; bf16 autocast on GPU. The run itself is a `Trainer`
(train/trainer.py: setup, data, step, validate, checkpoint, finish).

Restartable: checkpoints every `checkpoint_every` steps (train/checkpointing.py, atomic) hold the
weights, optimizer, scheduler, RNG and data position; rerunning the same command resumes from the
newest one; a finished run whose manifest matches config and inputs is reused as is.
"""
from __future__ import annotations

import logging
from pathlib import Path

from eagle3.stage_dir import StageDir
from train.input_errors import TrainInputError
from train.inputs import open_inputs
from train.local_producer import local_producer
from train.setup import train_setup
from train.trainer import FINAL, Trainer, init_fingerprint

log = logging.getLogger(__name__)


def run_train(config) -> Path:
    setup = train_setup(config)  # the autos, the accelerator, the plain config: once (train/setup.py)
    with local_producer(config, setup.stream, setup.main):  # data.producer=local: the producer, for the run's span
        inputs = open_inputs(config, setup.stream)
        for w in inputs.warnings:
            log.warning(w)
        stage = StageDir(setup.out, "train", TrainInputError)  # an interrupted publish of out put back first
        # train's own rule: the same init drafter (its weights' fingerprint), beside the input stages'
        if stage.reused({"config": setup.plain, "init_fingerprint": init_fingerprint(config)},
                        needs=[f"{FINAL}/config.json"], inputs=inputs.fingerprints):
            if setup.main:
                print(f"[train] {setup.out} already holds a finished run with this config and inputs: reused")
            return setup.out
        return Trainer(setup, inputs, stage).run()
