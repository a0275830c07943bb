"""The hidden-state store's format: the constants, errors and manifest rules that the writer
(eagle3/formats/store_writer.py) and the reader (eagle3/formats/store.py) share. The layout is described in
eagle3/formats/store.py. Imports only torch (core code)."""
from __future__ import annotations

from pathlib import Path

from eagle3.config.choices import AUX_FP8  # noqa: F401  (capture.aux_dtype's one quantised format; re-exported)
from eagle3.config.dtypes import TORCH_FLOAT_DTYPES
from eagle3.errors import StageError
from eagle3.formats.manifest import read_json

STORE_FORMAT = "eagle3-hidden-state-store"
STORE_VERSION = 1  # raise when a reader of today would misread a new store; readers refuse newer versions
MANIFEST = "manifest.json"
DTYPES = TORCH_FLOAT_DTYPES  # the store's state dtypes: every float dtype name
# Header keys that must agree between a resumed writer and the store on disk (and between parts).
HEADER_KEYS = ("hidden_size", "target_hidden_size", "hf_indices", "dtype", "aux_dtype",
               "shard_tokens", "meta", "image_token_id", "image_rows", "image_dtype")
# An image store's `image_rows`: FUSED keeps the target's fused input embedding of every image row (the HF
# backend), NO_ROWS keeps none (the vLLM backend: its connector has no h = 0, eagle3/engines/vllm_images.py)
FUSED, NO_ROWS = "fused", "none"
IMAGE_ROWS = (FUSED, NO_ROWS)


class StoreError(StageError, RuntimeError):
    """A store that cannot be used: missing, incomplete, corrupt, or mismatched."""


class StoreMismatchError(StoreError):
    """An existing store was written with different settings (target, layers, dtype, ...)."""


class NonFiniteHiddenStateError(StageError, ValueError):
    """A sequence whose hidden states contain NaN/inf (after the cast to the store dtype)."""

    def __init__(self, seq_id: str, what: str):
        super().__init__(f"sequence {seq_id!r}: non-finite values in {what!r} (NaN/inf after casting)")
        self.seq_id = seq_id


def read_store_manifest(store_dir: Path) -> dict:
    path = store_dir / MANIFEST
    manifest = read_json(path, StoreError, unreadable="unreadable store manifest ({e})",
                         missing=f"{store_dir}: not a hidden-state store (no {MANIFEST}); run the capture stage first")
    if manifest.get("format") != STORE_FORMAT:
        raise StoreError(f"{path}: format {manifest.get('format')!r}, expected {STORE_FORMAT!r}")
    version = manifest.get("version", 1)
    if not isinstance(version, int) or version > STORE_VERSION:
        raise StoreError(f"{path}: store format version {version!r}, this code reads up to {STORE_VERSION}; "
                         f"update eagle3 (a newer writer made it) or recapture")
    return manifest


def header_value(m: dict, key: str):
    if key == "aux_dtype":  # stores written before aux_dtype existed hold aux in `dtype`
        return m.get("aux_dtype") or m.get("dtype")
    if key == "image_rows":  # None: a text store; image stores written before the key kept fused rows
        return None if m.get("image_token_id") is None else m.get("image_rows") or FUSED
    if key == "image_dtype":  # the fused rows' dtype (dtype or AUX_FP8); None where there are none
        if header_value(m, "image_rows") != FUSED:
            return None
        return m.get("image_dtype") or m.get("dtype")
    return m.get(key)


def header_diff(a: dict, b: dict) -> list[str]:
    return [f"{k}: {header_value(a, k)!r} != {header_value(b, k)!r}" for k in HEADER_KEYS
            if header_value(a, k) != header_value(b, k)]
