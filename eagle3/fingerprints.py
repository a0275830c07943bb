"""Every fingerprint a manifest records, one rule each: what a later run compares to decide that its
inputs did not change (eagle3/stage_dir.py) and what tells two worlds apart (eagle3/world.py).

A rule's VALUE is stored in manifests already written: changing one makes every finished stage directory
that recorded it stale. Two concerns keep two rules for that reason, each named for what it covers:
  * the target: `target_weights` (the world's target part, in every manifest's `world`) and
    `target_checkpoint` (config.json + index + weights: what capture records and every store's meta,
    which a resumed store writer compares);
  * a drafter: `drafter_weights` (an init drafter's weights: train's `init_fingerprint`, vocab's
    `fingerprints.init_drafter`) and `drafter_dir` (config.json + weights: what eval records).

Standard library only (a tokenizer is passed in, never loaded here).
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Optional

from eagle3.formats.manifest import fingerprint as _manifest_sha256, sha256_file
from eagle3.formats.weight_files import weight_files

FULL_HASH_LIMIT = 2 << 30                # target_weights: weights up to 2 GiB hashed whole; larger ones sampled
SAMPLE_BYTES = 1 << 20
CHECKPOINT_FULL_LIMIT = 1 << 30          # target_checkpoint: contents hashed up to 1 GiB, else headers only


def stage_dir(path: Path) -> str:
    """A finished stage directory: the sha256 of its manifest (ManifestError when it has none)."""
    return _manifest_sha256(path)


def input_file(path: Path) -> str:
    """sha256 over a file, or over every file (relative name + content) of a directory."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(path)).encode() + b"\x00" + sha256_file(p).encode())
    return h.hexdigest()


def tokenizer(tok) -> str:
    """sha256 of what decides the token ids: the vocab, the special tokens and the chat template
    (independent of where the files live; the real target dir holds 600 GB)."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps([str(t) for t in tok.all_special_tokens]).encode())
    h.update(str(tok.chat_template).encode())
    return h.hexdigest()


def target_weights(model_dir: Path) -> str:
    """sha256 (16 hex) of a checkpoint's weights: every `*.safetensors` file's name and size and its
    bytes (whole up to FULL_HASH_LIMIT in all; else each file's header plus 1 MiB at the start, middle
    and end of its data, enough to tell a retrained model: training changes every tensor)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to fingerprint")
    whole = sum(f.stat().st_size for f in files) <= FULL_HASH_LIMIT
    h = hashlib.sha256(b"whole" if whole else b"sampled")
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if whole:
                while block := fh.read(1 << 20):
                    h.update(block)
                continue
            (header_len,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(header_len))
            start = 8 + header_len
            for at in (start, start + (size - start) // 2, max(start, size - SAMPLE_BYTES)):
                fh.seek(at)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def target_part(model_dir: Path) -> str:
    """The world's target part: the weights' fingerprint, or `unread:<dir>` where the directory holds no
    safetensors weights (a stage that only needs the tokenizer, run before the weights are there)."""
    try:
        return target_weights(model_dir)
    except FileNotFoundError:
        return f"unread:{Path(model_dir).name}"


def target_checkpoint(path: Path, full_hash_limit: int = CHECKPOINT_FULL_LIMIT) -> str:
    """sha256 over config.json, the index, and every weight file's safetensors header (names, shapes,
    dtypes); weight *contents* too when all weights are under `full_hash_limit` bytes (the mini targets;
    hashing 600 GB of Kimi-K2.5 is not worth it, its header set is unique)."""
    path = Path(path)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (path / name).is_file():
            h.update(name.encode() + b"\0" + (path / name).read_bytes())
    files = sorted(path.glob("*.safetensors"))
    full = sum(f.stat().st_size for f in files) <= full_hash_limit
    for f in files:
        with open(f, "rb") as fh:
            if full:
                while block := fh.read(1 << 22):
                    h.update(block)
            else:
                n = int.from_bytes(fh.read(8), "little")
                h.update(f.name.encode() + fh.read(n))
    return h.hexdigest()


def drafter_weights(drafter_dir: Optional[Path]) -> Optional[str]:
    """An init drafter's weights: each weight file's sha256, joined by ';' (None: no directory or no weights)."""
    if drafter_dir is None or not Path(drafter_dir).is_dir():
        return None
    files = weight_files(drafter_dir)  # the files a load reads (eagle3/formats/weight_files.py)
    return ";".join(sha256_file(f) for f in files) if files else None


def drafter_dir(path: Path) -> str:
    """A drafter directory as served: sha256 over its config.json and weight files (names + contents)."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).iterdir() if p.name == "config.json" or p.name.endswith(".safetensors")
                   or p.name.endswith(".safetensors.index.json"))
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()
