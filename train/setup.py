"""What a train run reads of its config and of where it runs, read once (`train_setup`) and passed on
as one typed object: its autos resolved (eagle3/config/resolve.py), the Accelerator and what the run
reads of it (main process, FSDP or not, device, rank, world size), the config as a plain dict,
as the manifest records it (reuse check, resume key, metrics), and what its data stream reads (`StreamConf`:
the spool, its waits, the batch plan's sizes; train/spool_source.py and train/local_producer.py take it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.config.conf import as_plain_dict
from eagle3.config.resolve import train_choices
from train.distributed import make_accelerator, prefer_expandable_segments, uses_fsdp


@dataclass(frozen=True)
class StreamConf:
    """What the batch stream and a streamed run's spool read of the config (`data.*`, seed), resolved once."""
    source: str              # data.source: "store" or "stream" (a producer fills the spool)
    spool: Path              # data.spool_dir, absolute or inside capture_dir (read only for data.source=stream)
    verify: str              # data.verify: how each store / chunk opened is checked
    timeout_s: float         # data.stream_timeout_s: a silent producer for this long stops the run
    status_s: float          # data.stream_status_s: a waiting line every this many seconds
    order: str               # data.order resolved: "epochs" or "windows"
    window_sequences: int
    reuse: int
    max_tokens_per_batch: int
    max_length: int
    bucket_window: int
    seed: int


def stream_conf(config) -> StreamConf:
    """The run's StreamConf (data.order resolved once, in the config schema)."""
    d = config.data
    spool = Path(d.spool_dir) if Path(d.spool_dir).is_absolute() else Path(config.capture_dir) / d.spool_dir
    return StreamConf(d.source, spool, d.verify, d.stream_timeout_s, d.stream_status_s, d.resolved_order(),
                      d.window_sequences, d.reuse, d.max_tokens_per_batch, d.max_length, d.bucket_window, config.seed)


@dataclass(frozen=True)
class TrainSetup:
    config: Any              # the train config (eagle3/config/schema/train.py)
    plain: dict              # the config as a plain dict (eagle3/config/conf.py as_plain_dict)
    resolved: dict           # every auto of the config, resolved: what the manifest records as `resolved`
    accelerator: Any         # accelerate's Accelerator (train/distributed.py make_accelerator)
    main: bool               # rank 0: the process that prints and writes
    fsdp: bool               # whether accelerate actually shards (FSDP needs several GPUs)
    device: torch.device
    rank: int
    world: int
    out: Path
    stream: StreamConf       # what the data stream reads of the config (stream_conf)


def train_setup(config) -> TrainSetup:
    """The setup of a run with this config, before anything touches CUDA but the Accelerator."""
    stream = stream_conf(config)
    resolved = train_choices(config)  # every auto of this run, once
    prefer_expandable_segments()  # before anything touches CUDA
    acc = make_accelerator(config, resolved["precision"])
    fsdp = uses_fsdp(acc)
    if config.fsdp and not fsdp and acc.is_main_process:
        print(f"[train] fsdp=true but accelerate runs {acc.distributed_type} here (FSDP needs several "
              f"GPUs): training without sharding")
    return TrainSetup(config, as_plain_dict(config), resolved, acc, acc.is_main_process, fsdp, acc.device,
                      acc.process_index, acc.num_processes, Path(config.out_dir), stream)
