"""A train stage's checkpoint directory, as every stage reads it: `checkpoints/step-NNNNNN/` holds a
drafter directory (the shared layout, loadable by the export stage, export/), `training_state.pt` (optimizer,
scheduler, RNG, data position, counters) and `checkpoint.json` (size and sha256 of each file).

The format's one home: train/checkpointing.py writes checkpoints atomically and resumes from them; the
export refuses a checkpoint whose files disagree with their index; the study lists a run's
checkpoints; the demo recognises a CheckpointError. None of them imports another stage's module.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import StageError
from eagle3.formats.manifest import atomic_write_json, sha256_file

STEP_DIR = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "training_state.pt"
INDEX_FILE = "checkpoint.json"


class CheckpointError(StageError, RuntimeError):
    """A checkpoint that cannot be used (corrupt, unreadable, or from an incompatible run)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def write_file_index(directory: Path, step: int) -> None:
    """`checkpoint.json`: size and sha256 of every file in `directory`, so a reader (resume, the
    export) can refuse a truncated or bit-flipped file by name."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(Path(directory).iterdir()) if p.is_file() and p.name != INDEX_FILE}
    atomic_write_json(Path(directory) / INDEX_FILE, {"step": step, "files": files})


def index_problems(path: Path) -> list[str]:
    """Every way the files of checkpoint `path` disagree with its `checkpoint.json` (the index
    unreadable or missing, a listed file missing, a size or sha256 differing), each naming the file;
    [] when all match."""
    path = Path(path)
    index_path = path / INDEX_FILE
    try:
        files = json.loads(index_path.read_text())["files"]
        entries = [(name, int(meta["bytes"]), str(meta["sha256"])) for name, meta in files.items()]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        return [f"{index_path}: unreadable checkpoint index ({e})"]
    out = []
    for name, size, sha in entries:
        f = path / name
        if not f.is_file():
            out.append(f"{f}: listed in {INDEX_FILE} but missing")
        elif f.stat().st_size != size or sha256_file(f) != sha:
            out.append(f"{f}: does not match its sha256 checksum in {INDEX_FILE} (truncated or corrupt)")
    return out


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError naming the first file that disagrees with checkpoint.json."""
    problems = index_problems(path)
    if problems:
        raise CheckpointError(f"{problems[0]}; delete {path} to resume from the previous checkpoint "
                              f"(or start over in a new out_dir)")


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (step, directory), oldest first."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(ckpt_root: Path) -> Optional[tuple[int, Path]]:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def load_training_state(path: Path) -> dict[str, Any]:
    """The verified `training_state.pt` of checkpoint `path` (on CPU)."""
    verify_checkpoint(path)
    try:
        return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # verified bytes that still do not unpickle: written by another version
        raise CheckpointError(f"{Path(path) / STATE_FILE}: cannot be loaded ({e})") from e


def read_checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The drafter weights of a checkpoint (fp32 master weights, SGLang names, no embeddings)."""
    from safetensors.torch import load_file

    f = Path(path) / "model.safetensors"
    try:
        return load_file(str(f))
    except Exception as e:
        raise CheckpointError(f"{f}: cannot be read ({e}); delete {path} to resume from the previous checkpoint") from e
