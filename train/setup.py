"""What a train run reads of its config and of where it runs, read once (`train_setup`) and passed on
as one typed object: its autos resolved (eagle3/config/resolve.py), the Accelerator and what the run
reads of it (main process, FSDP or not, device, rank, world size), and the config as a plain dict,
as the manifest records it (reuse check, resume key, metrics)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.config.conf import as_plain_dict
from eagle3.config.resolve import train_choices
from train.distributed import make_accelerator, prefer_expandable_segments, uses_fsdp


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


def train_setup(config) -> TrainSetup:
    """The setup of a run with this config, before anything touches CUDA but the Accelerator."""
    resolved = train_choices(config)  # every auto of this run, once
    prefer_expandable_segments()  # before anything touches CUDA
    acc = make_accelerator(config, resolved["precision"])
    fsdp = uses_fsdp(acc)
    if config.fsdp and not fsdp and acc.is_main_process:
        print(f"[train] fsdp=true but accelerate runs {acc.distributed_type} here (FSDP needs several "
              f"GPUs): training without sharding")
    return TrainSetup(config, as_plain_dict(config), resolved, acc, acc.is_main_process, fsdp, acc.device,
                      acc.process_index, acc.num_processes, Path(config.out_dir))
