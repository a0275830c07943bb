"""The streaming producer (`make capture-hidden ARGS="stream.enabled=true ..."`): the capture backend
(hf or vllm, math unchanged) writes the train split chunk by chunk into a capped spool
(eagle3/formats/spool.py) while the train stage (data.source=stream) trains on it; the validation split
is captured offline first, as a normal capture.

Stream order is the prepared order (row index), `stream.recapture` passes one after another. Each chunk
is a complete hidden-state store with the offline store's header, fingerprints and fp8 option, written by
the same backend and `HiddenStateWriter` (so every sample is validated as capture validates it: prompt
ids, length, finite values, the file's integrity; a bad one is a counted skip naming its record). Before
each chunk the producer waits while the spool is above its high watermark (until the low one); a full disk
(ENOSPC) drops the unfinished chunk and waits the same way. Restarting resumes after the last published
chunk; the consumers' acks decide what is deleted.
"""
from __future__ import annotations

import dataclasses
import errno
import shutil
import time
from pathlib import Path

from data.capture import run_capture
from data.capture_setup import Dist, capture_setup, default_dist, open_split, open_writer, store_meta
from data.capture_backends import backend_for
from data.capture_plan import CaptureError, plan_split
from eagle3.formats.manifest import atomic_write_json, read_json
from eagle3.config.watermarks import Watermarks
from eagle3.formats.spool import PLAN, Spool, SpoolError, dir_bytes, must_pause
from eagle3.formats.store import HiddenStateStore

STREAM_SPLIT = "train"
SPOOL_FORMAT = "eagle3-spool"


def spool_dir(cfg) -> Path:
    """Where the spool of this capture config lives (absolute, or inside out_dir)."""
    d = Path(cfg.stream.dir)
    return d if d.is_absolute() else Path(cfg.out_dir) / d


def stream_plan(cfg, setup, header: dict, seqs) -> dict:
    """plan.json: everything the consumer needs before the first chunk, and what a restart must match."""
    return {"format": SPOOL_FORMAT, "version": 1, "split": STREAM_SPLIT, "header": header,
            "fingerprints": setup.fingerprints, "dtype": cfg.dtype, "aux_dtype": cfg.aux_dtype,
            "chunk_sequences": cfg.stream.chunk_sequences, "recapture": cfg.stream.recapture,
            "max_seq_len": setup.max_len, "on_overlong": cfg.on_overlong, "limit": cfg.limit,
            "sequences": [[s.index, s.id, s.length] for s in seqs]}


def _check_plan(spool: Spool, plan: dict, overwrite: bool) -> None:
    path = spool.root / PLAN
    if not path.is_file():
        spool.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, plan)
        return
    old = read_json(path, CaptureError)
    differ = [k for k in plan if old.get(k) != plan[k]]
    if not differ:
        return
    if not overwrite:
        raise CaptureError(f"{spool.root}: a spool of other settings is there ({', '.join(differ)} differ); set "
                           f"overwrite=true to delete it (its consumer must start over too), or stream.dir=...")
    print(f"[stream] {spool.root}: other settings ({', '.join(differ)}); overwrite=true, deleting it")
    shutil.rmtree(spool.root)
    _check_plan(spool, plan, overwrite=False)


class Producer:
    """Chunks [start, total) of the stream into the spool; the counts land in producer.json and the end line."""

    def __init__(self, cfg, spool: Spool, marks: Watermarks):
        self.cfg, self.spool, self.marks = cfg, spool, marks
        before = spool.status() or {}  # a restarted producer carries on the counts of the runs before it
        published = spool.chunks()
        self.paused = False
        self.wait_s, self.pauses = float(before.get("wait_s", 0.0)), int(before.get("pauses", 0))
        self.disk_full, self.peak_bytes = int(before.get("disk_full", 0)), int(before.get("peak_bytes", 0))
        captured = [e for e in published if "ref" not in e]  # what the target ran on (a ref line reuses a chunk)
        self.tokens = sum(e["tokens"] for e in captured)
        self.sequences = sum(len(e["ids"]) for e in captured)
        self.kept = {e["chunk"]: e for e in published if e.get("keep")}  # first-pass chunks kept for later passes
        self.cache_budget = int(cfg.stream.cache_first_pass_gb * 1e9)
        self.cached_tokens = sum(e["tokens"] for e in published if "ref" in e)
        self.prior_s, self.t0 = float(before.get("elapsed_s", 0.0)), time.monotonic()

    def status(self, state: str, **extra) -> None:
        """producer.json: the counts, waits and bytes so far (over restarts: elapsed_s and wait_s carry on)."""
        extra.setdefault("used_bytes", self.spool.used_bytes())
        self.spool.write_status(state=state, wait_s=round(self.wait_s, 3), pauses=self.pauses,
                                disk_full=self.disk_full, peak_bytes=self.peak_bytes, cap_bytes=self.marks.cap,
                                tokens_captured=self.tokens,
                                elapsed_s=round(self.prior_s + time.monotonic() - self.t0, 3), **extra)

    def wait_for_room(self, chunk: int) -> None:
        """Backpressure: hold while the spool is over its watermark (hysteresis), with a heartbeat."""
        t0 = time.monotonic()
        while True:
            used = self.spool.used_bytes()
            self.peak_bytes = max(self.peak_bytes, used)
            paused = must_pause(used, self.marks, self.paused)
            if paused and not self.paused:
                self.pauses += 1
            self.paused = paused
            if not paused:
                break
            self.status("paused", next_chunk=chunk, used_bytes=used)
            time.sleep(self.cfg.stream.poll_s)
        self.wait_s += time.monotonic() - t0

    def cached_bytes(self) -> int:
        return sum(e["bytes"] for e in self.kept.values())

    def publish_ref(self, g: int, e: int, kept: dict) -> None:
        """Log position g (pass e) is the kept first-pass chunk's sequences again."""
        if not self.spool.chunk_dir(kept["chunk"]).is_dir():
            raise SpoolError(f"{self.spool.root}: chunk {kept['chunk']}, kept for pass {e + 1}, is gone before its "
                             f"last use ({kept['last_use']}): the spool is damaged; delete it and capture again")
        self.spool.publish_ref(g, {"pass": e, "ref": kept["chunk"], "ids": kept["ids"], "lengths": kept["lengths"],
                                   "skipped": kept["skipped"], "tokens": kept["tokens"], "bytes": 0})
        self.cached_tokens += kept["tokens"]

    def run(self, backend, ds, seqs, setup, header: dict, dist: Dist, start: int) -> dict:
        cfg, C = self.cfg, self.cfg.stream.chunk_sequences
        per_pass = -(-len(seqs) // C)
        total = per_pass * cfg.stream.recapture
        meta = store_meta(cfg, setup.fingerprints, setup.max_len, dist, STREAM_SPLIT)
        g = start
        while g < total:
            e, c = divmod(g, per_pass)
            if e > 0 and c in self.kept:  # served from the first pass: no target time, no new bytes
                self.publish_ref(g, e, self.kept[c])
                g += 1
                continue
            chunk = sorted(seqs[c * C:(c + 1) * C], key=lambda s: (-s.length, s.index))  # the backend's batching
            self.wait_for_room(g)
            self.status("capturing", chunk=g, of=total)
            tmp = self.spool.new_tmp(g)
            try:
                writer = open_writer(tmp, cfg, header, {**meta, "chunk": g, "pass": e})
                backend.capture_split(ds, chunk, writer, cfg, setup.hf_indices, dist,
                                      f"stream chunk {g + 1}/{total}", setup.image_token_id)
                manifest = writer.finish()
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # never a half chunk: it is captured again
                self.disk_full += 1
                self.status("disk_full", chunk=g, error=str(err))
                print(f"[stream] disk full writing chunk {g} ({err}); waiting for the trainer to free space")
                self.paused = True
                continue
            self.peak_bytes = max(self.peak_bytes, self.spool.used_bytes())  # published + this one complete
            store = HiddenStateStore(tmp, verify="none")
            entry = {"pass": e, "ids": store.ids, "lengths": store.lengths, "skipped": manifest["skipped"],
                     "tokens": manifest["num_tokens"], "bytes": dir_bytes(tmp)}
            if e == 0 and cfg.stream.recapture > 1 and self.cached_bytes() + entry["bytes"] <= self.cache_budget:
                entry.update(keep=True, last_use=(cfg.stream.recapture - 1) * per_pass + c)
            self.spool.publish(tmp, g, entry)
            if entry.get("keep"):
                self.kept[g] = {"chunk": g, **entry}
            self.tokens += manifest["num_tokens"]
            self.sequences += len(store)
            g += 1
        return {"chunks": total, "target_passes": cfg.stream.recapture, "tokens_captured": self.tokens,
                "sequences_captured": self.sequences, "chunks_kept": len(self.kept),
                "tokens_from_cache": self.cached_tokens, "peak_bytes": self.peak_bytes, "cap_bytes": self.marks.cap,
                "producer_wait_s": round(self.wait_s, 3), "pauses": self.pauses, "disk_full": self.disk_full}


def run_stream_capture(cfg, dist: Dist | None = None) -> Path:
    """Validation offline, then the train split streamed into the spool. Returns the spool directory."""
    dist = dist or default_dist()
    if dist.world > 1:
        raise CaptureError("the streaming producer runs as one process (backend=vllm: several client workers via "
                           "vllm.concurrency); launch it without accelerate")
    held = [s for s in cfg.splits if s != STREAM_SPLIT]
    if not held:
        raise CaptureError(f"stream.enabled=true streams {STREAM_SPLIT!r} and captures the held-out split offline: "
                           f"keep it in splits (e.g. splits=[train,validation])")
    run_capture(dataclasses.replace(cfg, splits=held), dist)  # reused when already up to date
    setup = capture_setup(cfg)
    spool, marks = Spool(spool_dir(cfg)), Watermarks.from_gb(cfg.stream.max_gb, cfg.stream.high, cfg.stream.low)
    backend = backend_for(cfg.backend)
    backend.check(cfg, setup.hf_indices, setup.num_layers, setup.max_len, dist, setup.image_token_id)
    ds = open_split(cfg, STREAM_SPLIT, setup.vocab_size)
    seqs, _ = plan_split(ds, cfg.limit, setup.max_len, cfg.on_overlong)
    seqs.sort(key=lambda s: s.index)  # stream order: the prepared order
    for k, s in enumerate(seqs):
        s.order = k
    header = setup.header(backend)
    _check_plan(spool, stream_plan(cfg, setup, header, seqs), cfg.overwrite)
    published = spool.recover()
    if [e["chunk"] for e in published] != list(range(len(published))):
        raise CaptureError(f"{spool.root}: the log's chunks are not 0..{len(published) - 1} in order; delete the spool")
    if spool.end() is not None:
        print(f"[stream] {spool.root}: the stream is complete ({len(published)} chunks); nothing to do")
        return spool.root
    producer = Producer(cfg, spool, marks)
    producer.status("starting", resume_chunk=len(published))
    if published:
        print(f"[stream] resuming after chunk {len(published) - 1} (published chunks are kept)")
    backend.open(cfg, setup.text_cfg, setup.max_len, dist)
    try:
        summary = producer.run(backend, ds, seqs, setup, header, dist, start=len(published))
    except BaseException as e:
        producer.status("failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        backend.close()
    spool.finish(**summary)
    producer.status("done", chunks=summary["chunks"], sequences_captured=summary["sequences_captured"])
    print(f"[stream] done: {summary['chunks']} chunks, {summary['tokens_captured']:,} tokens; disk high-water "
          f"{summary['peak_bytes'] / 1e6:.1f} MB of a {marks.cap / 1e6:.1f} MB cap; waited {summary['producer_wait_s']:.1f}s")
    return spool.root
