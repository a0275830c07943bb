"""Writing training checkpoints and resuming from them. The directory format (`out_dir/checkpoints/
step-NNNNNN/`: a drafter directory, `training_state.pt`, `checkpoint.json`) and its verified reading
live in eagle3/formats/checkpoints.py, which the export and the study read too.

Atomicity: a checkpoint is written into `checkpoints/.tmp-step-NNNNNN-<pid>/`, fsynced, then
renamed to its final name, so a `step-*` directory is always complete; leftovers of a killed
write are `.tmp-*` directories, deleted on the next start. A checkpoint whose files do not match
`checkpoint.json` (truncated / bit-flipped) is refused with its path named. Only rank 0 writes.

Resume: a checkpoint records the run key of the run that wrote it (config less the keys that may
change between a run and its continuation, input fingerprints, world size); `resume_point`
returns the newest checkpoint's state only when this run's key equals it, and names the differences
otherwise.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from eagle3.formats.checkpoints import (STATE_FILE, CheckpointError, latest_checkpoint, list_checkpoints, load_training_state,
                                        read_checkpoint_weights, step_dir_name, write_file_index)

# Config keys that may change between a run and its resumption (length, logging, I/O knobs).
RESUMABLE_CHANGES = ("max_steps", "epochs", "log_every", "val_every", "val_max_batches", "checkpoint_every",
                     "keep_checkpoints", "progress", "wandb", "on_nonfinite", "max_nonfinite_skips")


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_root: Path, step: int, write_drafter: Callable[[Path], None], state: dict,
                    keep_last: int) -> Path:
    """Write checkpoint `step` atomically; `write_drafter(dir)` writes the drafter directory files.
    Keeps the newest `keep_last` checkpoints (0 = keep all). Returns the final directory."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_drafter(tmp)
        torch.save(state, tmp / STATE_FILE)
        write_file_index(tmp, step)
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # a re-run of the same step after a crash between rename and prune
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(ckpt_root)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing checkpoint {final} failed ({e}); is the disk full? Nothing partial was "
                              f"left; earlier checkpoints are intact and the same command resumes from them") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(ckpt_root, keep_last)
    return final


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for _, p in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)


def remove_partial_checkpoints(ckpt_root: Path) -> list[str]:
    """Delete `.tmp-*` leftovers of a killed write; returns their names."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    gone = []
    for p in ckpt_root.iterdir():
        if p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def run_key(plain_config: dict, fingerprints: dict, world_size: int) -> dict:
    """What must be equal for a checkpoint to be resumed by this config (as a plain dict, as_plain_dict)."""
    cfg = {k: v for k, v in plain_config.items() if k not in RESUMABLE_CHANGES}
    cfg["data"] = {k: v for k, v in cfg["data"].items() if k not in ("num_workers", "verify")}
    return {"config": cfg, "inputs": fingerprints, "world_size": world_size}


def resume_point(ckpt_root: Path, plain_config: dict, fingerprints: dict, world_size: int,
                 main: bool) -> tuple[dict, Optional[dict]]:
    """(this run's key, the newest checkpoint's training state plus its weights (`"model"`), or None to start
    fresh). Rank 0 first deletes leftovers of killed writes. Refuses a checkpoint of another run key."""
    key = run_key(plain_config, fingerprints, world_size)
    if main:
        gone = remove_partial_checkpoints(ckpt_root)
        if gone:
            print(f"[train] removed unfinished checkpoint writes: {gone}")
    latest = latest_checkpoint(ckpt_root)
    if latest is None:
        return key, None
    state = load_training_state(latest[1])
    if state["run_key"] != key:
        diff = _key_diff(state["run_key"], key)
        raise CheckpointError(f"{latest[1]} was written by a run with other settings ({diff}); use another "
                              f"out_dir, or delete {ckpt_root} to start over")
    state["model"] = read_checkpoint_weights(latest[1])
    if main:
        print(f"[train] resuming from {latest[1]}")
    return key, state


def _key_diff(a, b, prefix="") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        parts = [_key_diff(a.get(k), b.get(k), f"{prefix}{k}.") for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        return "; ".join(p for p in parts if p)
    return f"{prefix.rstrip('.')}: {a!r} -> {b!r}"
