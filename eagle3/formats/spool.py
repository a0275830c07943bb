"""The spool of online training: a directory that holds at most a capped amount of captured hidden
states while the drafter trains on them (the producer: data/stream_capture.py; the consumer:
train/spool_source.py). Standard library only; the chunks themselves are hidden-state stores.

Layout of a spool directory:
    plan.json          what the producer will capture (written once, before any chunk): the planned
                       sequences in stream order, chunk size, passes, the store header, fingerprints
    chunk-NNNNNN/      one finished chunk: a complete hidden-state store (eagle3/formats/store.py)
    .tmp-chunk-NNNNNN-<pid>/   a chunk being written (never read; removed by the producer's recovery)
    log.jsonl          one line per published chunk (ids, lengths, skips, bytes), appended and fsynced
                       AFTER the chunk directory is renamed into place: the log line is the done marker;
                       a last line without its newline is a torn write and ignored. An `end` line last.
                       With stream.cache_first_pass_gb, a first-pass line may say `keep` and `last_use` (the
                       log position of the last pass's line that reads it), and a later pass's line may say
                       `ref: c` instead of having a directory: its sequences are chunk c's, not captured again.
    acks/rank-R.json   {"chunks": n}: rank R no longer needs chunks < n (monotonic)
    producer.json      the producer's status: pid, state, heartbeat, bytes, waits (rewritten atomically)

Backpressure is hysteresis on the bytes on disk (`must_pause`): above the high watermark the producer
waits, and starts again only below the low one; it checks before each chunk, so the disk high-water mark
is at most high + one chunk in flight per producer (<= cap + one chunk). A chunk is deleted (renamed
aside, then removed) only once every rank's ack covers it, or, for a kept chunk, covers its last use.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from eagle3.config.watermarks import Watermarks
from eagle3.errors import StageError
from eagle3.formats.manifest import atomic_write_json

PLAN, LOG, STATUS, ACKS = "plan.json", "log.jsonl", "producer.json", "acks"
CHUNK, TMP, DELETING = "chunk-", ".tmp-chunk-", ".del-chunk-"


class SpoolError(StageError, RuntimeError):
    """A spool that cannot be used: unreadable log, settings that differ, a producer gone quiet."""


def must_pause(used: int, marks: Watermarks, paused: bool) -> bool:
    """Hysteresis: a running producer pauses above `high`; a paused one resumes only at or below `low`."""
    return used > marks.low if paused else used > marks.high


def stored_in(entry: dict) -> int:
    """The chunk whose directory holds a log line's sequences (itself, or the kept chunk it refers to)."""
    return entry.get("ref", entry["chunk"])


def last_use(entry: dict) -> int:
    """The log position after whose acknowledgement a chunk's directory may go."""
    return entry.get("last_use", entry["chunk"])


def chunk_name(i: int) -> str:
    return f"{CHUNK}{i:06d}"


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:  # removed while we walked (a reclaim)
                pass
    return total


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Spool:
    """One spool directory (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def chunk_dir(self, i: int) -> Path:
        return self.root / chunk_name(i)

    # ---- the log: what is published ---------------------------------------------------------------
    def entries(self) -> list[dict]:
        """Published chunks (and the end line), in order. A torn last line is ignored."""
        path = self.root / LOG
        if not path.is_file():
            return []
        text = path.read_text()
        lines = text.split("\n")
        if not text.endswith("\n"):
            lines = lines[:-1]  # the producer died mid-append: that chunk is not published
        out = []
        for k, line in enumerate(lines):
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SpoolError(f"{path}: line {k + 1} is not JSON ({e}); the spool is damaged: delete it and "
                                 f"capture again") from None
        return out

    def chunks(self) -> list[dict]:
        return [e for e in self.entries() if "chunk" in e]

    def end(self) -> dict | None:
        return next((e for e in self.entries() if e.get("end")), None)

    def _append(self, entry: dict) -> None:
        with open(self.root / LOG, "a") as f:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # ---- the producer's side ----------------------------------------------------------------------
    def recover(self) -> list[dict]:
        """On (re)start: drop chunks being written, chunks renamed but never logged, and reclaims cut short."""
        self.root.mkdir(parents=True, exist_ok=True)
        published = {e["chunk"] for e in self.chunks()}
        for p in self.root.iterdir():
            if p.name.startswith((TMP, DELETING)):
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(CHUNK) and int(p.name[len(CHUNK):]) not in published:
                shutil.rmtree(p, ignore_errors=True)
        return self.chunks()

    def new_tmp(self, i: int) -> Path:
        tmp = self.root / f"{TMP}{i:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        return tmp

    def publish(self, tmp: Path, i: int, entry: dict) -> None:
        """The finished chunk in `tmp` becomes chunk i: fsync, rename, fsync the directory, then the log line."""
        _fsync_tree(tmp)
        os.rename(tmp, self.chunk_dir(i))
        _fsync_dir(self.root)
        self._append({"chunk": i, **entry})

    def publish_ref(self, i: int, entry: dict) -> None:
        """Log position i reads a kept chunk's directory (entry["ref"]); nothing is written but the line."""
        self._append({"chunk": i, **entry})

    def finish(self, **fields) -> None:
        self._append({"end": True, **fields})

    def used_bytes(self) -> int:
        """Bytes of every chunk on disk, published or in flight (what the cap bounds)."""
        if not self.root.is_dir():
            return 0
        return sum(dir_bytes(p) for p in self.root.iterdir() if p.is_dir() and p.name.startswith((CHUNK, TMP, DELETING)))

    def write_status(self, **fields) -> None:
        atomic_write_json(self.root / STATUS, {"pid": os.getpid(), "heartbeat": time.time(), **fields})

    def status(self) -> dict | None:
        try:
            return json.loads((self.root / STATUS).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def live_status(self, timeout_s: float) -> dict | None:
        """The status of a producer that is running now: neither done nor failed, heard within timeout_s, and
        its process exists (a status left by a killed producer names a dead pid)."""
        s = self.status()
        if not s or s.get("state") in ("done", "failed") or time.time() - s.get("heartbeat", 0) > timeout_s:
            return None
        try:
            os.kill(int(s["pid"]), 0)
        except (OSError, KeyError, ValueError):
            return None
        return s

    # ---- the consumers' side ----------------------------------------------------------------------
    def acked(self, rank: int) -> int:
        try:
            return int(json.loads((self.root / ACKS / f"rank-{rank}.json").read_text())["chunks"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return 0

    def ack(self, rank: int, chunks: int) -> None:
        """Rank `rank` no longer needs chunks < `chunks` (never moves back)."""
        if chunks > self.acked(rank):
            atomic_write_json(self.root / ACKS / f"rank-{rank}.json", {"chunks": int(chunks)})

    def reclaim(self, world_size: int) -> int:
        """Delete the chunks every rank has acknowledged (a kept one: up to its last use); returns how many went."""
        done = min(self.acked(r) for r in range(world_size))
        gone = 0
        for e in self.chunks():
            d = self.chunk_dir(e["chunk"])
            if last_use(e) < done and d.is_dir():
                aside = self.root / f"{DELETING}{e['chunk']:06d}"
                os.rename(d, aside)  # gone from readers at once; removed below (or by recovery)
                shutil.rmtree(aside)
                gone += 1
        return gone
