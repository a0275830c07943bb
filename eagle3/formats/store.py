"""The hidden-state store: what capture writes and what train / eval read.

Layout of a store directory:
    manifest.json             header (widths, layer ids, dtype, aux_dtype, meta) + the list of FINISHED shards
    shard-NNNNN.safetensors   sequences packed back to back: aux [N,3H], last [N,H] (bf16 by default),
                              input_ids int32 [N], loss_mask uint8 [N], target_argmax int32 [N],
                              offsets int64 [S+1] (sequence s is rows offsets[s]:offsets[s+1])
                              with image_token_id in the header (an image capture): image_embeds [M, H] (dtype),
                              the target's fused input embedding (projector output) at the image rows only, in
                              order, and image_offsets int64 [S+1] (sequence s's are image_offsets[s]:[s+1]);
                              with aux_dtype fp8 those rows are fp8 codes + image_scale fp32 [M] (one per row),
                              read back in `dtype`. image_rows="none" in the header (a vLLM capture, whose
                              connector cannot give them): no fused rows at all, store[i] has no image_embeds

aux_dtype="float8_e4m3fn" (opt-in; default: aux in `dtype`) halves the aux bytes: `aux` holds fp8 e4m3fn
codes and `aux_scale` fp32 [N, layers] one scale per (token, captured layer) row (eagle3/formats/fp8.py); the
reader dequantises, so store[i]["aux"] is in `dtype` either way. `last` always stays in `dtype` (the
teacher's logits are computed from it). A manifest without aux_dtype (older stores) means aux_dtype=dtype.

Crash safety: a shard is written (straight from its host buffer) to a hidden temp name, fsynced and
renamed; only then is the manifest (atomic) rewritten to list it. So a killed capture leaves at most one
stray file that is not in the manifest; the writer deletes it on restart and redoes that shard.
A reader only ever opens shards the manifest lists and checks their size (and sha256 on request).

A store written by several processes is a merged manifest whose shard paths point into
`part-<rank>/` directories; every sequence carries a global `order` key and the reader sorts by it,
so a merged store reads exactly like a one-process store over the same sequences.

Modules: eagle3/formats/store_format.py (constants, errors, manifest rules), eagle3/formats/store_writer.py
(HiddenStateWriter, merge_stores), this one (HiddenStateStore, the reader; it re-exports the rest so
`from eagle3.formats.store import ...` serves every name). Imports only torch + safetensors (core code runs
on the GPU machine).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from eagle3.config.choices import STORE_VERIFY
from eagle3.formats.fp8 import dequantise_rows
from eagle3.formats.store_format import (AUX_FP8, DTYPES, FUSED, HEADER_KEYS, MANIFEST, STORE_FORMAT, STORE_VERSION,
                                         NonFiniteHiddenStateError, StoreError, StoreMismatchError, header_value,
                                         read_store_manifest)
from eagle3.formats.store_writer import HiddenStateWriter, merge_stores
from safetensors import safe_open

__all__ = ["HiddenStateStore", "HiddenStateWriter", "merge_stores", "StoreError", "StoreMismatchError",
           "NonFiniteHiddenStateError", "AUX_FP8", "DTYPES", "HEADER_KEYS", "MANIFEST", "STORE_FORMAT",
           "STORE_VERSION", "read_store_manifest"]


class HiddenStateStore:
    """Random access to a store's sequences: `store[i]` is a dict of CPU tensors
    {"id", "input_ids" Long[T], "loss_mask" Bool[T], "aux" [T,3H], "last" [T,H], "target_argmax" Long[T]}
    (+ "image_embeds" [n, H] in an image store: the fused input embeddings of its n image rows).
    Shards are memory-mapped via safetensors `safe_open`; the most recently used one stays open.

    verify="size" checks every listed shard's size at open; "sha256" also hashes each shard the first
    time it is read; "none" skips both. An incomplete store (capture still running or killed) is an
    error unless allow_incomplete=True."""

    def __init__(self, store_dir: str | Path, verify: str = "size", allow_incomplete: bool = False):
        if verify not in STORE_VERIFY:
            raise ValueError(f"verify={verify!r}: expected one of {STORE_VERIFY}")
        self.dir = Path(store_dir)
        self.manifest = read_store_manifest(self.dir)
        if not self.manifest.get("complete") and not allow_incomplete:
            raise StoreError(f"{self.dir}: store is incomplete ({len(self.manifest['shards'])} shards so far); "
                             f"rerun the capture stage to finish it")
        if self.aux_dtype not in (self.manifest["dtype"], AUX_FP8):
            raise StoreError(f"{self.dir}: aux_dtype {self.aux_dtype!r} is not a format this reader knows "
                             f"({self.manifest['dtype']!r} or {AUX_FP8!r}); update the code or recapture")
        if header_value(self.manifest, "image_dtype") not in (None, self.manifest["dtype"], AUX_FP8):
            raise StoreError(f"{self.dir}: image_dtype {self.manifest.get('image_dtype')!r} is not a format this "
                             f"reader knows; update the code or recapture")
        self.verify = verify
        self._shards = self.manifest["shards"]
        if verify != "none":
            for s in self._shards:
                path = self.dir / s["file"]
                if not path.is_file():
                    raise StoreError(f"{path}: shard listed in the manifest is missing")
                size = path.stat().st_size
                if size != s["bytes"]:
                    raise StoreError(f"{path}: shard is {size} bytes, manifest says {s['bytes']} (truncated or corrupt)")
        # Global order: (order key, shard, position in shard), sorted by the order key.
        index = [(o, si, j) for si, s in enumerate(self._shards) for j, o in enumerate(s["order"])]
        index.sort()
        self._index = [(si, j) for _, si, j in index]
        self.ids: list[str] = [self._shards[si]["ids"][j] for si, j in self._index]
        self.lengths: list[int] = [self._shards[si]["lengths"][j] for si, j in self._index]
        self._starts = {}  # shard -> local start offsets (from the manifest lengths)
        for si, s in enumerate(self._shards):
            starts = [0]
            for n in s["lengths"]:
                starts.append(starts[-1] + n)
            self._starts[si] = starts
        self._verified: set[int] = set()
        self._open_idx: int | None = None
        self._open = None

    hidden_size = property(lambda self: self.manifest["hidden_size"])
    target_hidden_size = property(lambda self: self.manifest["target_hidden_size"])
    hf_indices = property(lambda self: list(self.manifest["hf_indices"]))  # h of the aux states (aux_layers.py)
    dtype = property(lambda self: self.manifest["dtype"])
    aux_dtype = property(lambda self: header_value(self.manifest, "aux_dtype"))
    meta = property(lambda self: self.manifest["meta"])
    num_tokens = property(lambda self: int(self.manifest["num_tokens"]))
    image_token_id = property(lambda self: self.manifest.get("image_token_id"))  # None: a text store
    image_rows = property(lambda self: header_value(self.manifest, "image_rows"))  # None | "fused" | "none"
    has_fused_image_rows = property(lambda self: self.image_rows == FUSED)  # store[i]["image_embeds"] exists

    def __len__(self) -> int:
        return len(self._index)

    def _shard(self, si: int):
        if self._open_idx == si:
            return self._open
        path = self.dir / self._shards[si]["file"]
        if self.verify == "sha256" and si not in self._verified:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            if h.hexdigest() != self._shards[si]["sha256"]:
                raise StoreError(f"{path}: sha256 mismatch with the manifest (corrupt shard); rerun capture")
            self._verified.add(si)
        try:
            handle = safe_open(str(path), framework="pt")
            offsets = handle.get_tensor("offsets").tolist()
        except Exception as e:
            raise StoreError(f"{path}: unreadable shard ({e}); rerun capture") from e
        if offsets != self._starts[si]:
            raise StoreError(f"{path}: offsets disagree with the manifest's sequence lengths (corrupt shard)")
        self._open_idx, self._open = si, handle
        return handle

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence index {i} out of range for a store of {len(self)}")
        si, j = self._index[i]
        a, b = self._starts[si][j], self._starts[si][j + 1]
        h = self._shard(si)
        try:
            item = {
                "id": self._shards[si]["ids"][j],
                "input_ids": h.get_slice("input_ids")[a:b].long(),
                "loss_mask": h.get_slice("loss_mask")[a:b].bool(),
                "aux": self._aux(h, a, b),
                "last": h.get_slice("last")[a:b],
                "target_argmax": h.get_slice("target_argmax")[a:b].long(),
            }
            if self.has_fused_image_rows:  # [n, H]: n = the sequence's image_token_id positions, in order
                ia, ib = h.get_slice("image_offsets")[j:j + 2].tolist()
                rows = h.get_slice("image_embeds")[ia:ib]
                if header_value(self.manifest, "image_dtype") == AUX_FP8:
                    rows = dequantise_rows(rows, h.get_slice("image_scale")[ia:ib], DTYPES[self.dtype])
                item["image_embeds"] = rows
                if ib - ia != int((item["input_ids"] == self.image_token_id).sum()):
                    raise StoreError(f"{ib - ia} image rows stored for "
                                     f"{int((item['input_ids'] == self.image_token_id).sum())} image positions")
            return item
        except Exception as e:
            raise StoreError(f"{self.dir / self._shards[si]['file']}: cannot read sequence "
                             f"{self._shards[si]['ids'][j]!r} ({e}); corrupt shard, rerun capture") from e

    def _aux(self, h, a: int, b: int) -> torch.Tensor:
        """Rows a:b of the shard's aux [T,3H] in the store dtype (fp8 codes dequantised with their scales)."""
        aux = h.get_slice("aux")[a:b]
        if self.aux_dtype != AUX_FP8:
            return aux
        scale = h.get_slice("aux_scale")[a:b]  # [T, layers]
        return dequantise_rows(aux.view(b - a, scale.shape[-1], -1), scale, DTYPES[self.dtype]).view(b - a, -1)

    def verify_all(self) -> None:
        """Hash every shard against the manifest (raises StoreError naming the first bad one)."""
        saved, self.verify = self.verify, "sha256"
        try:
            for si in range(len(self._shards)):
                self._shard(si)
        finally:
            self.verify = saved
