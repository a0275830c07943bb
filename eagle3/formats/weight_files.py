"""A safetensors checkpoint directory's weight files, one rule for every reader (a drafter's load and its
fingerprint, a target's tensors): the shards that `model.safetensors.index.json` names when there is an
index, else `model.safetensors` alone. Standard library only (the names in a single file are its
reader's to list: safetensors)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def indexed_files(directory: Path) -> Optional[dict[str, Path]]:
    """Tensor name (as stored) -> shard, from the directory's index; None where it has no index."""
    index = Path(directory) / INDEX
    if not index.is_file():
        return None
    return {name: Path(directory) / f for name, f in json.loads(index.read_text())["weight_map"].items()}


def weight_files(directory: Path) -> list[Path]:
    """The directory's weight files in name order: the index's shards, else [model.safetensors], else []."""
    shards = indexed_files(directory)
    if shards is not None:
        return sorted(set(shards.values()))
    single = Path(directory) / WEIGHTS
    return [single] if single.is_file() else []
