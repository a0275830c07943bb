"""The demo's short online run (issue 43): the from-K2 drafter trained on K2.5 through a capped spool that the
train stage's own producer fills (`data.producer=local`, what `make train-online` runs), beside the offline
store the other runs trained from. It shows the disk bound at work on the mini world: the spool's cap against
the offline store's bytes, its measured high-water mark, both sides' waits and what was trained."""
from __future__ import annotations

import json
from pathlib import Path

from eagle3.config.conf import compose, to_schema
from eagle3.config.schema.train import TrainConfig
from eagle3.formats.spool import dir_bytes
from eagle3.formats.store import HiddenStateStore

CAP_FRACTION = 0.75      # the spool's cap as a share of the offline train store
WINDOW_SHARE = 4         # a window is a quarter of the train split ...
CHUNKS_PER_WINDOW = 3    # ... written in three chunks: window + one chunk stays below the low watermark (0.7)
REUSE = 2


def online_overrides(train_cfg: TrainConfig, sequences: int, cap_bytes: int, producer_extra: list[str]) -> list[str]:
    """Train overrides of the online run: its own capture and train directories (the offline ones stay as they
    are), windows sized to the split, and the producer's cap."""
    window = max(2, sequences // WINDOW_SHARE)
    chunk = max(1, window // CHUNKS_PER_WINDOW)
    producer = [f"stream.max_gb={cap_bytes / 1e9:.9f}", f"stream.chunk_sequences={chunk}", "progress=false",
                *producer_extra]
    # no step cap: the run trains the whole stream, each window REUSE times (about REUSE epochs of steps)
    return ["max_steps=100000000", "data.source=stream", "data.producer=local", f"data.window_sequences={window}", f"data.reuse={REUSE}",
            f"capture_dir={Path(train_cfg.capture_dir).with_name('capture-online')}",
            f"out_dir={Path(train_cfg.out_dir).with_name('train-online')}",
            f"data.producer_args={json.dumps(producer)}"]


def run_online(log, k25: list[str], train_over: list[str], capture_over: list[str]) -> dict:
    """Train +init=aqmedai_k2 online; returns the figures the demo reports."""
    base = k25 + ["+init=aqmedai_k2"] + train_over
    offline = to_schema(compose("train", base), TrainConfig)
    store = Path(offline.capture_dir) / offline.data.train_split
    sequences, size = len(HiddenStateStore(store, verify="none")), dir_bytes(store)
    cap = int(CAP_FRACTION * size)
    out = log.run("k25: train online +init=aqmedai_k2 (data.producer=local, a capped spool)", "train",
                  base + online_overrides(offline, sequences, cap, capture_over))
    m = json.loads((out / "manifest.json").read_text())
    s = m["stream"]
    return {"offline_store_bytes": size, "cap_bytes": s["cap_bytes"], "peak_bytes": s["peak_bytes"],
            "tokens_captured": s["tokens_captured"], "tokens_trained": s["tokens_trained"],
            "reuse_per_sequence": s["reuse_per_sequence"], "producer_wait_s": s["producer_wait_s"],
            "trainer_wait_s": s["trainer_wait_s"], "pauses": s["pauses"], "steps": m["steps"],
            "val_end": m.get("val_end"), "train_dir": str(out)}


def online_section(fig: dict | None) -> str:
    if not fig:
        return ""
    val = fig.get("val_end") or {}
    acc = (val.get("acc") or [None])[0]
    tau = next(iter((val.get("accept_length") or {}).items()), None)
    return ("## Online: the from-K2 run through a capped spool (`make train-online`)\n\n"
            f"The producer captured {fig['tokens_captured']:,} tokens while the drafter trained "
            f"{fig['tokens_trained']:,} ({fig['reuse_per_sequence']}x reuse, {fig['steps']} steps). The spool's cap was "
            f"{fig['cap_bytes'] / 1e6:.2f} MB ({fig['cap_bytes'] / fig['offline_store_bytes']:.2f} x the offline store's "
            f"{fig['offline_store_bytes'] / 1e6:.2f} MB); the disk's high-water mark was {fig['peak_bytes'] / 1e6:.2f} MB "
            f"({fig['peak_bytes'] / fig['cap_bytes']:.2f} x the cap). The producer paused {fig['pauses']} "
            f"time{'' if fig['pauses'] == 1 else 's'} "
            f"({fig['producer_wait_s']:.1f} s); the trainer waited {fig['trainer_wait_s']:.1f} s"
            + (f"; at the end, validation acc_step0 {acc:.3f}" if acc is not None else "")
            + (f", simulated tau {tau[1]:.3f} ({tau[0]})" if tau else "") + ".\n\n")
