"""The hidden-state store's writer (capture) and the merge of part stores (several capture
processes). The format and its crash-safety rules are described in eagle3/formats/store.py.

Imports only torch (core code runs on the GPU machine); shards are written in the safetensors
format by hand, straight from the host buffers.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import torch

from eagle3.formats.fp8 import FP8_DTYPE, quantise_rows
from eagle3.formats.manifest import atomic_write_bytes
from eagle3.formats.store_format import (AUX_FP8, DTYPES, FUSED, IMAGE_ROWS, MANIFEST, NO_ROWS, STORE_FORMAT, STORE_VERSION,
                                         NonFiniteHiddenStateError, StoreError, StoreMismatchError, header_diff,
                                         read_store_manifest)


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
              torch.uint8: "U8", torch.int64: "I64", FP8_DTYPE: "F8_E4M3"}


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file straight from the (host) tensors' memory, hashing as it goes (no
    serialised copy of a multi-GB shard in memory): temp name, fsync, rename. -> (bytes, sha256)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
    blocks = [len(hb).to_bytes(8, "little"), hb] + [
        memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") for t in tensors.values() if t.numel()]
    # Hash in a second thread while this one writes: both release the GIL, so the shard costs
    # max(hash, write) instead of their sum (each ~1 GB/s on the GPU host we measured).
    h = hashlib.sha256()
    hasher = threading.Thread(target=lambda: [h.update(b) for b in blocks], name="store-sha256")
    hasher.start()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for block in blocks:
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        hasher.join()
        os.replace(tmp, path)
    except BaseException:
        hasher.join()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return 8 + len(hb) + offset, h.hexdigest()


class _ShardBuffer:
    """The shard being filled: preallocated host tensors, pinned when CUDA is in use so that
    device->host copies are asynchronous DMA on a side stream (overlapping the next forward)."""

    def __init__(self, columns: dict[str, tuple[int, torch.dtype]], capacity: int, pinned: bool):
        self.columns, self.pinned = columns, pinned
        self.tensors: dict[str, torch.Tensor] = {}
        self.capacity = self.used = 0
        self.seqs: list[tuple[str, int, int, int]] = []  # (id, order, length, loss tokens)
        self.images: list[torch.Tensor] = []  # per sequence: its image rows' fused embeddings [n_i, H] (CPU)
        self.events: list = []  # CUDA events of the copies in flight
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self.sync()
        new = {k: torch.empty((capacity, w) if w else (capacity,), dtype=dt, pin_memory=self.pinned)
               for k, (w, dt) in self.columns.items()}
        for k, t in self.tensors.items():
            new[k][: self.used].copy_(t[: self.used])
        self.tensors, self.capacity = new, capacity

    def put(self, values: dict[str, torch.Tensor], streams: dict) -> None:
        T = values["input_ids"].shape[0]
        if self.used + T > self.capacity:
            self._grow(self.used + T)
        for k, src in values.items():
            dst = self.tensors[k][self.used: self.used + T]
            if src.is_cuda and self.pinned:
                stream = streams.setdefault(src.device, torch.cuda.Stream(src.device))
                stream.wait_stream(torch.cuda.current_stream(src.device))
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                src.record_stream(stream)  # keep src's memory from reuse until the copy is done
                ev = torch.cuda.Event()
                ev.record(stream)
                self.events.append(ev)
            else:
                dst.copy_(src)
        self.used += T

    def sync(self) -> None:
        for ev in self.events:
            ev.synchronize()
        self.events.clear()

    def reset(self) -> None:
        self.sync()
        self.used, self.seqs, self.images = 0, [], []


_HELD_LOCKS: dict[str, list] = {}  # store dir -> [lock file, owning writer's id] (this process)


def _lock_dir(store_dir: Path, owner: int) -> None:
    """An exclusive advisory lock on `store_dir/.lock` against a second *process* writing the same
    store (they would interleave shards). The kernel drops it when the process dies, so a killed
    capture never leaves it stale. Within one process a new writer takes over an abandoned one
    (a rerun after a failed write)."""
    import fcntl

    key = str(store_dir.resolve())
    held = _HELD_LOCKS.get(key)
    if held is not None and not held[0].closed:
        held[1] = owner
        return
    f = open(store_dir / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StoreError(f"{store_dir}: another process is writing this store (.lock is held); "
                         f"two captures into one out_dir would interleave shards") from None
    _HELD_LOCKS[key] = [f, owner]


def _unlock_dir(store_dir: Path, owner: int) -> None:
    """Release (and remove: a complete store needs no lock) if `owner` still holds it."""
    key = str(store_dir.resolve())
    held = _HELD_LOCKS.get(key)
    if held is not None and held[1] == owner:
        (store_dir / ".lock").unlink(missing_ok=True)
        held[0].close()
        del _HELD_LOCKS[key]


class HiddenStateWriter:
    """Append sequences; every `shard_tokens` tokens a shard is committed. Re-opening a directory
    with a store in it resumes: `done_ids` are the sequences already committed (in shards, or
    recorded as skipped); anything not in the manifest is deleted and must be re-added."""

    def __init__(self, out_dir: str | Path, *, hidden_size: int, target_hidden_size: int,
                 hf_indices: list[int], dtype: str = "bfloat16", aux_dtype: str | None = None,
                 shard_tokens: int = 8192, meta: dict | None = None, aux_provenance: dict | None = None,
                 background: bool = False, image_token_id: int | None = None, image_rows: str = FUSED):
        """hf_indices: the Hugging Face hidden-state indices h of the aux states, in fc's order (the physical
        truth; eagle3/engines/aux_layers.py). aux_provenance: how they were chosen (engine rule, source, the ids a
        drafter config listed), recorded in the manifest but not compared on resume. image_token_id: the
        target's image row id (eagle3/media_tokens.py) when the store keeps the fused input embeddings of
        image rows (`add(..., image_embeds=)`); None for a text store. image_rows (an image store): FUSED keeps
        those rows (in fp8 with a scale per row when aux_dtype is fp8, else in `dtype`), NO_ROWS keeps none (a
        capture whose engine cannot give them: only the placeholder convention can train on it)."""
        if dtype not in DTYPES:
            raise ValueError(f"store dtype {dtype!r}: expected one of {sorted(DTYPES)}")
        aux_dtype = aux_dtype or dtype
        if aux_dtype not in (dtype, AUX_FP8):
            raise ValueError(f"store aux_dtype {aux_dtype!r}: expected null (= dtype {dtype!r}) or {AUX_FP8!r}")
        if image_rows not in IMAGE_ROWS:
            raise ValueError(f"image_rows {image_rows!r}: expected one of {IMAGE_ROWS}")
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens={shard_tokens}: must be >= 1")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        _lock_dir(self.dir, id(self))  # held until finish() (or process exit, even on SIGKILL)
        self.torch_dtype = DTYPES[dtype]
        self.aux_fp8 = aux_dtype == AUX_FP8
        self.aux_width = len(hf_indices) * target_hidden_size
        self.aux_rows = (len(hf_indices), target_hidden_size)  # fp8 scales: one per (token, layer) row
        self.hidden_size = hidden_size
        header = {"hidden_size": hidden_size, "target_hidden_size": target_hidden_size,
                  "hf_indices": [int(h) for h in hf_indices], "dtype": dtype,
                  "aux_dtype": aux_dtype, "shard_tokens": shard_tokens, "meta": json.loads(json.dumps(meta or {}))}
        if image_token_id is not None:  # (absent for text stores: those written before images stay valid)
            header["image_token_id"] = int(image_token_id)
            header["image_rows"] = image_rows
            if image_rows == FUSED:
                header["image_dtype"] = aux_dtype  # the fused rows follow aux: fp8 codes + scales, or dtype
        self.image_token_id = image_token_id
        self.keep_image_rows = image_token_id is not None and image_rows == FUSED
        self.manifest = {"format": STORE_FORMAT, "version": STORE_VERSION, **header, "complete": False,
                         "num_sequences": 0, "num_tokens": 0, "num_loss_tokens": 0, "shards": [], "skipped": []}
        if (self.dir / MANIFEST).is_file():
            old = read_store_manifest(self.dir)
            diff = header_diff(old, header)
            if diff:
                raise StoreMismatchError(f"{self.dir}: an existing store was written with other settings; "
                                         f"refusing to mix ({'; '.join(diff)}). Use a fresh out_dir or delete it.")
            self.manifest = old
        if aux_provenance is not None:
            self.manifest["aux_provenance"] = json.loads(json.dumps(aux_provenance))
        self._discard_unlisted_files()
        self._pending: dict[str, None] = {}  # ids of the sequences buffered for the next shard (ordered)
        self._pending_skips: list[dict] = []
        self._pending_tokens = 0
        self.done_ids: set[str] = {i for s in self.manifest["shards"] for i in s["ids"]}
        self.done_ids |= {s["id"] for s in self.manifest["skipped"]}
        self._next_order = max((o for s in self.manifest["shards"] for o in s["order"]), default=-1) + 1
        # background=True: shards are concatenated, hashed and written by one worker thread while
        # the caller computes the next batch (at most one shard in flight, so memory stays bounded).
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer") if background else None
        self._inflight: Future | None = None
        self._columns = {"aux": (self.aux_width, FP8_DTYPE if self.aux_fp8 else self.torch_dtype),
                         "last": (hidden_size, self.torch_dtype),
                         "input_ids": (0, torch.int32), "loss_mask": (0, torch.uint8), "target_argmax": (0, torch.int32)}
        if self.aux_fp8:
            self._columns["aux_scale"] = (len(hf_indices), torch.float32)
        self._buffers: list[_ShardBuffer] = []  # allocated at the first add (two: fill one, write the other)
        self._buf: _ShardBuffer | None = None
        self._last_written: _ShardBuffer | None = None
        self._streams: dict = {}

    def _discard_unlisted_files(self) -> None:
        """Temp files and shards renamed but never listed (killed between rename and manifest)."""
        listed = {s["file"] for s in self.manifest["shards"]}
        for p in self.dir.iterdir():
            if p.is_file() and ((p.name.startswith(".shard-") and p.name.endswith(".tmp"))
                                or (p.name.startswith("shard-") and p.name not in listed)):
                p.unlink()

    def add(self, seq_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
            last: torch.Tensor, target_argmax: torch.Tensor, *, order: int | None = None,
            check_finite: bool = True, image_embeds: torch.Tensor | None = None) -> None:
        """Buffer one sequence (T tokens). `order` is its global position (multi-process capture);
        by default sequences are ordered as added. Raises NonFiniteHiddenStateError (nothing is
        buffered) when aux/last hold NaN/inf after the cast to the store dtype; a caller that checked
        that already (on the GPU, where it is cheap) passes check_finite=False."""
        seq_id = str(seq_id)
        if seq_id in self.done_ids or seq_id in self._pending:
            raise StoreError(f"{self.dir}: sequence {seq_id!r} added twice")
        T = int(input_ids.shape[0])
        expect = {"input_ids": (T,), "loss_mask": (T,), "aux": (T, self.aux_width),
                  "last": (T, self.hidden_size), "target_argmax": (T,)}
        got = {"input_ids": input_ids, "loss_mask": loss_mask, "aux": aux, "last": last, "target_argmax": target_argmax}
        for name, shape in expect.items():
            if tuple(got[name].shape) != shape:
                raise StoreError(f"sequence {seq_id!r}: {name} has shape {tuple(got[name].shape)}, expected {shape}")
        if T == 0:
            raise StoreError(f"sequence {seq_id!r}: empty sequence")
        image_rows = self._image_rows(seq_id, input_ids, image_embeds)
        aux, last = aux.detach().to(self.torch_dtype), last.detach().to(self.torch_dtype)
        for name, t in (("aux", aux), ("last", last)) if check_finite else ():
            if not bool(torch.isfinite(t).all()):
                raise NonFiniteHiddenStateError(seq_id, name)
        # A shard holds at most shard_tokens tokens (unless one sequence alone is longer).
        if self._pending_tokens and self._pending_tokens + T > self.manifest["shard_tokens"]:
            self._flush()
        if self._buf is None:
            self._buf = self._take_buffer(aux.is_cuda)
        order = self._next_order if order is None else int(order)
        mask = loss_mask.detach().to("cpu", torch.uint8)
        values = {"aux": aux, "last": last, "input_ids": input_ids.detach().to("cpu", torch.int32),
                  "loss_mask": mask, "target_argmax": target_argmax.detach().to("cpu", torch.int32)}
        if self.aux_fp8:  # on aux's device (cheap on the GPU), from the finite store-dtype values
            codes, scale = quantise_rows(aux.reshape(T, *self.aux_rows))
            values["aux"], values["aux_scale"] = codes.reshape(T, self.aux_width), scale
        self._buf.put(values, self._streams)
        self._buf.seqs.append((seq_id, order, T, int(mask.sum())))
        if image_rows is not None:
            self._buf.images.append(image_rows)
        self._pending[seq_id] = None
        self._next_order = max(self._next_order, order) + 1
        self._pending_tokens += T

    def _image_rows(self, seq_id: str, input_ids: torch.Tensor, image_embeds: torch.Tensor | None):
        """The sequence's image rows [n, H] in the store dtype on the CPU (n = its image_token_id positions,
        in order), or None for a text store (which refuses image_embeds)."""
        if not self.keep_image_rows:
            if image_embeds is not None:
                why = "without image_token_id" if self.image_token_id is None else f"with image_rows={NO_ROWS!r}"
                raise StoreError(f"sequence {seq_id!r}: image_embeds given to a store opened {why}")
            return None
        n = int((input_ids == self.image_token_id).sum())
        if image_embeds is None and n == 0:
            return torch.empty(0, self.hidden_size, dtype=self.torch_dtype)
        if image_embeds is None or tuple(image_embeds.shape) != (n, self.hidden_size):
            got = None if image_embeds is None else tuple(image_embeds.shape)
            raise StoreError(f"sequence {seq_id!r}: {n} image rows (id {self.image_token_id}) need image_embeds of "
                             f"shape {(n, self.hidden_size)}, got {got}")
        return image_embeds.detach().to("cpu", self.torch_dtype)

    def _take_buffer(self, cuda: bool) -> _ShardBuffer:
        """A free shard buffer: a new one while there are fewer than two, else the one not in flight
        (never waits: the shard in flight is written while this one fills)."""
        if len(self._buffers) < 2:
            self._buffers.append(_ShardBuffer(self._columns, self.manifest["shard_tokens"],
                                              pinned=cuda and torch.cuda.is_available()))
            return self._buffers[-1]
        # The other buffer is the one in flight (or already written); this one's write finished
        # before that one was submitted (_flush waits for the previous job first).
        buf = self._buffers[0] if self._buffers[1] is self._last_written else self._buffers[1]
        buf.reset()
        return buf

    def skip(self, seq_id: str, reason: str) -> None:
        """Record a sequence that will not be stored (committed with the next shard, so a resumed
        run treats it as done exactly when it would treat its neighbours as done)."""
        self._pending_skips.append({"id": str(seq_id), "reason": reason})

    def _flush(self) -> None:
        if not self._pending and not self._pending_skips:
            return
        job = (self._buf if self._pending else None, self._pending_skips)
        self.done_ids.update(self._pending)
        self.done_ids.update(s["id"] for s in self._pending_skips)
        self._pending, self._pending_skips, self._pending_tokens = {}, [], 0
        if job[0] is not None:
            self._last_written, self._buf = job[0], None
        if self._worker is None:
            self._commit(*job)
        else:
            self._wait()
            self._inflight = self._worker.submit(self._commit, *job)

    def _wait(self) -> None:
        """Wait for the shard in flight; its exception (disk full, ...) surfaces here."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            fut.result()

    def _commit(self, buf: _ShardBuffer | None, skips: list[dict]) -> None:
        """Write one shard (temp name, fsync, rename), then the manifest that lists it."""
        shards = self.manifest["shards"]
        self.manifest["complete"] = False
        if buf is not None:
            buf.sync()  # device->host copies done
            ids = [q[0] for q in buf.seqs]
            lengths = [q[2] for q in buf.seqs]
            offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
            tensors = {k: t[: buf.used] for k, t in buf.tensors.items()}
            tensors["offsets"] = offsets
            if self.keep_image_rows:  # image rows of sequence s: image_offsets[s]:image_offsets[s+1]
                rows = torch.cat(buf.images) if buf.images else torch.empty(0, self.hidden_size, dtype=self.torch_dtype)
                if self.aux_fp8:  # [M, H] codes + [M] scales, from the finite store-dtype rows (eagle3/formats/fp8.py)
                    rows, tensors["image_scale"] = quantise_rows(rows)
                tensors["image_embeds"] = rows
                counts = torch.tensor([len(x) for x in buf.images], dtype=torch.int64)
                tensors["image_offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
            name = f"shard-{len(shards):05d}.safetensors"
            nbytes, sha = _write_shard(self.dir / name, tensors, {"ids": json.dumps(ids)})
            shards.append({"file": name, "bytes": nbytes, "sha256": sha, "num_tokens": buf.used,
                           "loss_tokens": sum(q[3] for q in buf.seqs), "ids": ids, "lengths": lengths,
                           "order": [q[1] for q in buf.seqs]})
        self.manifest["skipped"].extend(skips)
        self.manifest["num_sequences"] = sum(len(s["ids"]) for s in shards)
        self.manifest["num_tokens"] = sum(s["num_tokens"] for s in shards)
        self.manifest["num_loss_tokens"] = sum(s["loss_tokens"] for s in shards)
        _write_json(self.dir / MANIFEST, self.manifest)

    def finish(self, **extra: Any) -> dict:
        """Commit the last partial shard and mark the store complete; `extra` fields (counts,
        reports) go into the manifest. Returns the manifest."""
        self._flush()
        self._wait()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        self.manifest.update(json.loads(json.dumps(extra)))
        self.manifest["complete"] = True
        _write_json(self.dir / MANIFEST, self.manifest)
        _unlock_dir(self.dir, id(self))
        return self.manifest


def merge_stores(out_dir: str | Path, part_dirs: Iterable[str | Path], **extra: Any) -> dict:
    """Write `out_dir/manifest.json` listing the shards of complete part stores (which must lie
    under out_dir and share one header). The shards stay where they are."""
    out_dir = Path(out_dir)
    parts = [Path(p) for p in part_dirs]
    merged: dict | None = None
    seen: dict[str, Path] = {}
    for part in parts:
        m = read_store_manifest(part)
        if not m.get("complete"):
            raise StoreError(f"{part}: part store is not complete; its capture process did not finish")
        rel = part.resolve().relative_to(out_dir.resolve())
        if merged is None:
            merged = {**m, "shards": [], "skipped": [], "parts": []}
        elif diff := header_diff(merged, m):
            raise StoreMismatchError(f"{part}: part written with other settings than {parts[0]} ({'; '.join(diff)})")
        for s in m["shards"]:
            for i in s["ids"]:
                if i in seen:
                    raise StoreError(f"sequence {i!r} is in both {seen[i]} and {part}")
                seen[i] = part
            merged["shards"].append({**s, "file": f"{rel.as_posix()}/{s['file']}"})
        merged["skipped"].extend(m["skipped"])
        merged["parts"].append(rel.as_posix())
    if merged is None:
        raise StoreError(f"{out_dir}: no part stores to merge")
    merged["num_sequences"] = sum(len(s["ids"]) for s in merged["shards"])
    merged["num_tokens"] = sum(s["num_tokens"] for s in merged["shards"])
    merged["num_loss_tokens"] = sum(s["loss_tokens"] for s in merged["shards"])
    merged.update(json.loads(json.dumps(extra)))
    merged["complete"] = True
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / MANIFEST, merged)
    return merged
