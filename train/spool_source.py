"""The train stage's windowed sources (data.order=windows): the spool a running producer fills
(data.source=stream, `SpoolStore`) and an offline store read in the same stream order (`StoreWindows`),
and the one function that builds the batch stream for either (`make_stream`). What they read of the config is
one StreamConf (train/setup.py), resolved once.

Stream positions are the stored sequences in stream order (prepared row index, recapture passes one after
another; a skipped sample has no position). So a spool and an offline store of the same sequences give the
same windows, the same plan and the same bits. A rank frees a chunk once the checkpoint that covers the
last window using it is written (`release`): a resume never needs a deleted chunk, and no sequence is
trained more often than its policy says.
"""
from __future__ import annotations

import bisect
import time
from pathlib import Path

from eagle3.formats.manifest import read_json
from eagle3.formats.spool import PLAN, Spool, SpoolError, last_use, stored_in
from eagle3.formats.store import HiddenStateStore, StoreError
from train.batches import BatchStream, WindowedStream
from train.input_errors import TrainInputError

PAUSED_DEADLOCK_S = 5.0  # a producer paused this long while the trainer waits can never resume (see _wait_for)
PRODUCER_HINT = 'make capture-hidden ARGS="stream.enabled=true ..." (the same capture config)'


def wait_for_producer(conf, ready, what: str) -> None:
    """Wait, as a spool consumer waits, for something the producer writes (status lines, the timeout)."""
    SpoolStore.waiter(conf.spool, conf.timeout_s, conf.status_s)._wait_for(ready, what)


def open_spool(conf) -> "SpoolStore":
    """The train split a producer streams into the spool of `conf` (a StreamConf)."""
    return SpoolStore(conf.spool, conf.verify, conf.timeout_s, conf.status_s)


def live_figures(producer: dict, used_bytes: int, trainer_wait_s: float, trainer_elapsed_s: float) -> dict:
    """What the progress bar, wandb and the manifest show of a stream: the producer's capture rate and idle
    share (time paused by backpressure, over its whole life), the spool's occupancy against its cap, and the
    trainer's idle share (time starved, in this process)."""
    p_elapsed, cap = float(producer.get("elapsed_s") or 0.0), int(producer.get("cap_bytes") or 0)
    return {"capture_tok_s": round(producer.get("tokens_captured", 0) / p_elapsed, 1) if p_elapsed else None,
            "producer_idle": round(producer.get("wait_s", 0.0) / p_elapsed, 4) if p_elapsed else None,
            "spool_gb": round(used_bytes / 1e9, 4), "spool_pct": round(100 * used_bytes / cap, 2) if cap else None,
            "trainer_idle": round(trainer_wait_s / trainer_elapsed_s, 4) if trainer_elapsed_s > 0 else None}


def live_postfix(fig: dict) -> dict:
    """The progress bar's short form of `live_figures`."""
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    return {"cap": "-" if fig["capture_tok_s"] is None else f"{fig['capture_tok_s']:,.0f}tok/s",
            "spool": f"{fig['spool_gb']:.2f}GB" + ("" if fig["spool_pct"] is None else f"({fig['spool_pct']:.0f}%)"),
            "idle": f"{pct(fig['producer_idle'])}/{pct(fig['trainer_idle'])}"}


class SpoolStore:
    """The train split as a producer streams it: the store header (from plan.json) and `store[p]` for
    stream position p, waiting for the chunk that holds it. `lengths` are the planned ones (before skips):
    what the LR schedule is sized on."""

    def __init__(self, root: str | Path, verify: str, timeout_s: float, status_s: float, main: bool = True):
        self._setup_wait(root, timeout_s, status_s, main)
        self.verify = verify
        self._wait_for(lambda: (self.dir / PLAN).is_file(), "its plan (no producer has started)")
        self.plan = read_json(self.dir / PLAN, TrainInputError)
        self.manifest = {**self.plan["header"], "dtype": self.plan["dtype"], "aux_dtype": self.plan["aux_dtype"],
                         "complete": False}
        self.lengths = [n for _, _, n in self.plan["sequences"]] * self.plan["recapture"]
        self._starts: list[int] = [0]  # stream position of each logged chunk's first sequence, then the end
        self._ended = False
        self._open: dict[int, HiddenStateStore] = {}

    hidden_size = property(lambda self: self.manifest["hidden_size"])
    target_hidden_size = property(lambda self: self.manifest["target_hidden_size"])
    hf_indices = property(lambda self: list(self.manifest["hf_indices"]))
    image_token_id = property(lambda self: self.manifest.get("image_token_id"))
    image_rows = property(lambda self: self.manifest.get("image_rows") if self.image_token_id is not None else None)
    has_fused_image_rows = property(lambda self: self.image_rows == "fused")
    dtype = property(lambda self: self.manifest["dtype"])
    ended = property(lambda self: self._ended)

    def __len__(self) -> int:
        return len(self.lengths)

    def _setup_wait(self, root, timeout_s: float, status_s: float, main: bool = True) -> None:
        self.dir, self.spool = Path(root), Spool(root)
        self.timeout_s, self.status_s, self.main = timeout_s, status_s, main
        self.wait_s, self._chunks = 0.0, []  # the logged chunks, in order
        self.opened_at = time.monotonic()  # the trainer's idle share counts from here: its first wait is before the loop

    @classmethod
    def waiter(cls, root, timeout_s: float, status_s: float) -> "SpoolStore":
        """Only the waiting part (before the plan exists)."""
        obj = cls.__new__(cls)
        obj._setup_wait(root, timeout_s, status_s)
        return obj

    # ---- arrival ---------------------------------------------------------------------------------
    def _refresh(self) -> None:
        try:
            entries = self.spool.entries()
        except SpoolError as e:
            raise TrainInputError(str(e)) from e
        for e in entries[len(self._chunks) + (1 if self._ended else 0):]:
            if e.get("end"):
                self._ended = True
            elif not self._ended:
                self._chunks.append(e)
                self._starts.append(self._starts[-1] + len(e["ids"]))

    def _wait_for(self, ready, what: str):
        """Poll until ready(); a status line every status_s; an error naming the producer after timeout_s
        without a heartbeat or a new chunk."""
        t0 = last_line = time.monotonic()
        paused_since, last_beat, beat_moved_at = None, None, None
        while not ready():
            now = time.monotonic()
            status = self.spool.status()
            beat = status.get("heartbeat", 0) if status else 0
            if last_beat is not None and beat != last_beat:
                beat_moved_at = now
            last_beat = beat
            # a pause counts only while its producer's heartbeat keeps moving: the status a killed producer left
            # behind says "paused" until its restart, which may take longer than the deadline
            live_pause = (bool(status) and status.get("state") == "paused" and beat_moved_at is not None
                          and now - beat_moved_at <= PAUSED_DEADLOCK_S)
            paused_since = (paused_since or now) if live_pause else None
            if paused_since is not None and now - paused_since > PAUSED_DEADLOCK_S:
                raise TrainInputError(
                    f"{self.dir}: the spool is full (the producer is paused: {status.get('used_bytes', 0) / 1e6:.1f} MB "
                    f"on disk, it resumes below its low watermark) while this run waits for {what}, which needs "
                    f"more chunks than that: nothing can be freed until the window is complete. Raise the "
                    f"producer's stream.max_gb (or stream.low), or lower data.window_sequences "
                    f"({self.window_hint()})")
            quiet = min(now - t0, time.time() - beat) if status else now - t0
            who = (f"producer pid {status['pid']} ({status.get('state')}, last heard {time.time() - beat:.0f}s ago)"
                   if status else "no producer")
            if quiet > self.timeout_s:
                raise TrainInputError(f"{self.dir}: waited {now - t0:.0f}s for {what}; {who} has said nothing for "
                                      f"{quiet:.0f}s (data.stream_timeout_s={self.timeout_s:g}): it died or hangs. "
                                      f"Restart it: {PRODUCER_HINT}; this run resumes from its last checkpoint")
            if status and status.get("state") == "failed":
                raise TrainInputError(f"{self.dir}: the {who} failed: {status.get('error')}; fix it and restart: "
                                      f"{PRODUCER_HINT}")
            if self.main and now - last_line >= self.status_s:
                print(f"[train] waiting {now - t0:.0f}s for {what} from {self.dir}: {who}")
                last_line = now
            time.sleep(0.05)
        self.wait_s += time.monotonic() - t0
        return True

    def window_hint(self) -> str:
        status = self.spool.status() or {}
        per_seq = [e["bytes"] / max(1, len(e["ids"])) for e in self._chunks]
        if not per_seq or not status.get("cap_bytes"):
            return "the chunks' sizes are not known yet"
        return (f"a chunk holds ~{sum(per_seq) / len(per_seq) * self.plan['chunk_sequences'] / 1e6:.2f} MB; "
                f"the cap is {status['cap_bytes'] / 1e6:.1f} MB")

    def _arrived(self, position: int) -> bool:
        """Position `position` is logged (or the stream has ended); the log is read again only when what is
        known already does not answer (every item read asks)."""
        if not (self._ended or self._starts[-1] > position):
            self._refresh()
        return self._ended or self._starts[-1] > position

    def window_lengths(self, w: int, size: int) -> list[int]:
        """Stored lengths at positions [w*size, (w+1)*size) once they have all arrived ([] past the end)."""
        end = (w + 1) * size
        self._wait_for(lambda: self._arrived(end - 1), f"window {w} (stream positions < {end})")
        out = []
        for p in range(w * size, min(end, self._starts[-1])):
            c = bisect.bisect_right(self._starts, p) - 1
            out.append(self._chunks[c]["lengths"][p - self._starts[c]])
        return out

    # ---- items ------------------------------------------------------------------------------------
    def __getitem__(self, p: int) -> dict:
        self._wait_for(lambda: self._arrived(p), f"stream position {p}")
        if p >= self._starts[-1]:
            raise IndexError(f"stream position {p} past the end of the stream ({self._starts[-1]} sequences)")
        c = bisect.bisect_right(self._starts, p) - 1
        chunk = stored_in(self._chunks[c])  # a later pass served from a kept first-pass chunk reads that one
        try:
            if chunk not in self._open:  # kept open until released: a window shuffles across chunks, and a
                # reopened store would hash its shard again (verify=sha256 hashes each shard once per open)
                self._open[chunk] = HiddenStateStore(self.spool.chunk_dir(chunk), verify=self.verify)
            item = self._open[chunk][p - self._starts[c]]
        except StoreError as e:  # never trained on: the run stops at the last checkpoint
            raise TrainInputError(f"spool chunk {chunk}: {e}. Stop the producer, delete chunk {chunk} and later ones "
                                  f"with their lines in {self.spool.root / 'log.jsonl'}, restart it; this run then "
                                  f"resumes from its last checkpoint") from e
        if item["id"] != self._chunks[c]["ids"][p - self._starts[c]]:
            raise TrainInputError(f"spool chunk {chunk} holds {item['id']!r} where its log line says "
                                  f"{self._chunks[c]['ids'][p - self._starts[c]]!r}: a damaged spool")
        return item

    # ---- freeing ----------------------------------------------------------------------------------
    def chunks_before(self, position: int | None) -> int:
        """Leading chunks whose every sequence sits before stream position `position` (None: every chunk)."""
        self._refresh()
        return len(self._chunks) if position is None else bisect.bisect_right(self._starts, position) - 1

    def release(self, rank: int, stream_position: int | None) -> None:
        """Rank `rank` needs no chunk wholly before `stream_position` (None: none at all) any more."""
        done = self.chunks_before(stream_position)
        for k in [k for k in self._open if last_use(self._chunks[k]) < done]:
            del self._open[k]
        self.spool.ack(rank, done)

    def reclaim(self, world_size: int) -> int:
        return self.spool.reclaim(world_size)

    def live(self) -> dict:
        return live_figures(self.spool.status() or {}, self.spool.used_bytes(), self.wait_s,
                            time.monotonic() - self.opened_at)

    def summary(self) -> dict:
        status = self.spool.status() or {}
        end = self.spool.end() or {}
        return {"spool": str(self.dir), "chunks_seen": len(self._chunks), "stream_complete": self._ended,
                "trainer_wait_s": round(self.wait_s, 3), "target_passes": self.plan["recapture"],
                **{k: end.get(k, status.get(k)) for k in ("tokens_captured", "tokens_from_cache", "chunks_kept",
                                                          "peak_bytes", "cap_bytes", "producer_wait_s", "pauses",
                                                          "disk_full")}}


class StoreWindows:
    """An offline store read in stream order (prepared row index): `view[p]` is the store's sequence at
    stream position p, so data.order=windows on a store trains exactly what the stream of it would."""

    def __init__(self, store: HiddenStateStore, prepared_split: Path):
        import datasets

        rows = {sid: i for i, sid in enumerate(datasets.load_from_disk(str(prepared_split))["id"])}
        missing = [sid for sid in store.ids if sid not in rows]
        if missing:
            raise TrainInputError(f"{store.dir}: sequences {missing[:3]} are not in the prepared split {prepared_split}")
        self.store = store
        self.order = sorted(range(len(store)), key=lambda i: rows[store.ids[i]])
        self.lengths = [store.lengths[i] for i in self.order]
        self.image_token_id = store.image_token_id

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, p: int) -> dict:
        return self.store[self.order[p]]


def make_stream(conf, items, rank: int, world_size: int):
    """The batch stream of this run (`conf`: its StreamConf). A spool's windows take the lengths of what was
    stored (its skips, waiting for each window); an offline store's, the planned ones."""
    if conf.order == "epochs":
        return BatchStream(items.lengths, conf.max_tokens_per_batch, conf.max_length, conf.seed, rank, world_size,
                           conf.bucket_window)
    if not isinstance(items, SpoolStore):
        return planned_stream(conf, items, rank, world_size)
    return _windowed(conf, lambda w: items.window_lengths(w, conf.window_sequences), rank, world_size)


def sized_streams(conf, items, rank: int, world_size: int):
    """(the batch stream, the stream the LR schedule is sized on): for windows the planned lengths (a stream's
    skips end it a little early), for epochs the stream itself."""
    planned = planned_stream(conf, items, rank, world_size) if conf.order != "epochs" else None
    stream = make_stream(conf, items, rank, world_size)
    return stream, planned or stream


def planned_stream(conf, items, rank: int, world_size: int) -> WindowedStream:
    """The stream the planned lengths give (every length known up front): what total steps are sized on."""
    S = conf.window_sequences
    return _windowed(conf, lambda w: [min(n, conf.max_length) for n in items.lengths[w * S:(w + 1) * S]], rank,
                     world_size)


def _windowed(conf, lengths, rank: int, world_size: int) -> WindowedStream:
    """This run's windowed stream over `lengths(w)`, the lengths of window w."""
    return WindowedStream(lengths, conf.window_sequences, conf.reuse, conf.max_tokens_per_batch, conf.max_length,
                          conf.seed, rank, world_size, conf.bucket_window)
