"""Online training (issue 43): the producer (data/stream_capture.py, the real hf capture backend) fills a
capped spool (eagle3/formats/spool.py) while the train stage reads it (data.source=stream,
train/spool_source.py). The stream trains bit-identically to the offline store of the same sequences read in
the same windows; the disk stays under its cap plus one chunk; chunks go only after every rank's checkpointed
ack; restarts of either side and a silent producer behave as documented."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from data.capture import Dist, run_capture
from data.stream_capture import run_stream_capture
from eagle3 import REPO_ROOT
from eagle3.formats.spool import Spool, Watermarks, must_pause
from eagle3.formats.store import HiddenStateStore
from tests.fixtures.capture import capture_config, prepared, targets  # noqa: F401 (fixtures)
from tests.fixtures.train_world import config_for, world  # noqa: F401 (fixture)
from train.inputs import TrainInputError
from train.loop import run_train

WINDOW, REUSE, CHUNK = 8, 2, 3


def stream_capture_config(tmp_path, targets, prepared, **stream):  # noqa: F811
    over = [f"stream.{k}={v}" for k, v in {"enabled": "true", "chunk_sequences": CHUNK, "poll_s": 0.05,
                                             **stream}.items()]
    return capture_config(tmp_path, targets, prepared, out="stream", overrides=["max_tokens_per_batch=1", *over])


def train_config(world, tmp_path, capture_dir, name, **extra):  # noqa: F811
    return config_for(world, tmp_path / name, "scratch", capture_dir=str(capture_dir), max_steps=1000, epochs="null",
                      **{"data.window_sequences": WINDOW, "data.reuse": REUSE, "data.stream_timeout_s": 60,
                         "checkpoint_every": 1000, **extra})


def final_weights(out):
    from safetensors.torch import load_file
    return load_file(str(Path(out) / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def offline(tmp_path_factory, targets, prepared):  # noqa: F811
    tmp = tmp_path_factory.mktemp("offline")
    return run_capture(capture_config(tmp, targets, prepared, out="offline", overrides=["max_tokens_per_batch=1"]),
                       Dist())


def test_watermarks_pause_above_high_and_resume_only_below_low():
    m = Watermarks.from_gb(1e-6, 0.9, 0.5)  # 1000 bytes
    assert (m.cap, m.high, m.low) == (1000, 900, 500)
    assert not must_pause(900, m, paused=False) and must_pause(901, m, paused=False)
    assert must_pause(600, m, paused=True) and not must_pause(500, m, paused=True)


def test_stream_trains_bit_identically_to_the_offline_store_in_the_same_windows(tmp_path, world, targets,  # noqa: F811
                                                                                 prepared, offline):
    spool = run_stream_capture(stream_capture_config(tmp_path, targets, prepared, max_gb=1.0), Dist())
    entries = Spool(spool).chunks()
    assert len(entries) > 2 and Spool(spool).end()["tokens_captured"] == HiddenStateStore(offline / "train").num_tokens
    ref = run_train(train_config(world, tmp_path, offline, "ref", **{"data.order": "windows"}))
    got = run_train(train_config(world, tmp_path, spool.parent, "got", **{"data.source": "stream"}))
    a, b = final_weights(ref), final_weights(got)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m = json.loads((got / "manifest.json").read_text())
    assert m["steps"] == json.loads((ref / "manifest.json").read_text())["steps"] > 0
    assert m["stream"]["stream_complete"] and m["stream"]["reuse_per_sequence"] == REUSE
    assert not list(Path(spool).glob("chunk-*"))  # every chunk freed once the run finished
