"""Training batches from a hidden-state store: length-bucketed by a token budget, seeded random
order, sharded per rank, resumable at any micro-batch.

A micro-batch is a list of store indices whose padded size `B * max(len)` stays within
`max_tokens_per_batch`. Within each epoch the order is a seeded permutation; the permutation is
cut into windows of `bucket_window` sequences, each window is sorted by length and cut greedily
into batches (so a batch holds sequences of similar length: little padding), and the batches are
shuffled again. The plan is a pure function of (lengths, seed, epoch), so a resumed run rebuilds
it and skips the micro-batches it already consumed: the data position is one integer.

Ranks: every epoch's batch list is padded by wrapping around to a multiple of the world size
and rank r takes batches r, r+W, r+2W, ...; each rank's stream of micro-batches runs epoch after
epoch without end, and the loop takes `grad_accum` of them per optimizer step.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch


def plan_epoch(lengths: Sequence[int], max_tokens: int, max_length: int, seed: int, epoch: int,
               bucket_window: int = 1024) -> list[list[int]]:
    """All micro-batches of one epoch (lists of store indices), in training order."""
    if not lengths:
        raise ValueError("plan_epoch: the store has no sequences")
    if max_length > max_tokens:
        raise ValueError(f"max_length={max_length} exceeds max_tokens_per_batch={max_tokens}: a longest sequence "
                         f"could never fit a batch")
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    order = torch.randperm(len(lengths), generator=g).tolist()
    clipped = [min(int(n), max_length) for n in lengths]
    batches: list[list[int]] = []
    for start in range(0, len(order), bucket_window):
        window = sorted(order[start:start + bucket_window], key=lambda i: (-clipped[i], i))
        cur: list[int] = []
        cur_max = 0
        for i in window:  # descending lengths: the first sequence of a batch sets its width
            width = max(cur_max, clipped[i])
            if cur and width * (len(cur) + 1) > max_tokens:
                batches.append(cur)
                cur, width = [], clipped[i]
            cur.append(i)
            cur_max = width
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[j] for j in perm]


def shard_for_rank(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Rank `rank`'s share of an epoch, after wrapping the list to a multiple of `world_size` so
    that every rank takes the same number of steps (DDP needs every rank in every step)."""
    if world_size > 1 and len(batches) % world_size:
        extra = world_size - len(batches) % world_size
        batches = batches + [batches[i % len(batches)] for i in range(extra)]
    return batches[rank::world_size]


@dataclass
class BatchStream:
    """The rank's endless stream of micro-batches, epoch after epoch; `position` counts micro-batches
    already handed out (what a checkpoint records)."""
    lengths: Sequence[int]
    max_tokens: int
    max_length: int
    seed: int
    rank: int = 0
    world_size: int = 1
    bucket_window: int = 1024

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        return shard_for_rank(plan_epoch(self.lengths, self.max_tokens, self.max_length, self.seed, epoch,
                                         self.bucket_window), self.rank, self.world_size)

    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(0))

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, index within the epoch) of micro-batch number `position` of the stream."""
        epoch = 0
        while True:
            n = len(self.epoch_batches(epoch))
            if position < n:
                return epoch, position
            position -= n
            epoch += 1

    def iterate(self, start: int = 0) -> Iterator[tuple[int, list[int]]]:
        """Yield (epoch, batch indices) from micro-batch `start` on, forever."""
        epoch, index = self.locate(start)
        while True:
            batches = self.epoch_batches(epoch)
            for b in batches[index:]:
                yield epoch, b
            epoch, index = epoch + 1, 0


def plan_window(lengths: Sequence[int], max_tokens: int, max_length: int, seed: int, window: int, reuse: int,
                bucket_window: int = 1024) -> list[list[int]]:
    """All micro-batches of one window (window-local indices): `reuse` passes over its sequences, each
    a plan_epoch of its own (shuffled within the window only), one after the other."""
    out: list[list[int]] = []
    for r in range(reuse):
        out += plan_epoch(lengths, max_tokens, max_length, seed, window * reuse + r, bucket_window)
    return out


@dataclass
class WindowedStream:
    """data.order=windows (always for data.source=stream): the stream positions 0, 1, ... are cut into
    windows of `window` sequences; window w is trained `reuse` times (plan_window) before window w+1
    starts, so a sequence is needed only while its window trains. `window_lengths(w)` gives window w's
    lengths ([] past the end; a spool blocks until the window has arrived). Unlike BatchStream the stream
    ends with the data. `position` semantics are BatchStream's: micro-batches handed out to this rank."""
    window_lengths: Callable[[int], list]
    window: int
    reuse: int
    max_tokens: int
    max_length: int
    seed: int
    rank: int = 0
    world_size: int = 1
    bucket_window: int = 1024

    def __post_init__(self):
        self._counts: dict[int, int] = {}

    def window_batches(self, w: int) -> list[list[int]]:
        lengths = self.window_lengths(w)
        if not lengths:
            return []
        local = shard_for_rank(plan_window(lengths, self.max_tokens, self.max_length, self.seed, w, self.reuse,
                                           self.bucket_window), self.rank, self.world_size)
        self._counts[w] = len(local)
        return [[w * self.window + i for i in b] for b in local]

    def _count(self, w: int) -> int:
        if w not in self._counts:
            self.window_batches(w)
            self._counts.setdefault(w, 0)
        return self._counts[w]

    def iterate(self, start: int = 0) -> Iterator[tuple[int, list[int]]]:
        w, index = 0, start
        while True:
            if index >= self._count(w):
                if self._counts[w] == 0:
                    return
                index -= self._counts[w]
                w += 1
                continue
            batches = self.window_batches(w)
            for b in batches[index:]:
                yield w, b
            w, index = w + 1, 0

    def windows_done(self, position: int) -> int:
        """Windows whose every micro-batch of this rank is among the first `position` (only windows that
        have arrived are counted)."""
        w, end = 0, 0
        while w in self._counts and self._counts[w] and end + self._counts[w] <= position:
            end += self._counts[w]
            w += 1
        return w

    def all_batches(self) -> list[list[int]]:
        """Every micro-batch of this rank (only for a stream whose lengths are all known: the planned ones)."""
        out, w = [], 0
        while batches := self.window_batches(w):
            out += batches
            w += 1
        return out

    def batches_per_epoch(self) -> int:  # the whole stream is one "epoch"
        return len(self.all_batches())

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        return self.all_batches()


class StoreSequences(torch.utils.data.Dataset):
    """Map-style view of a HiddenStateStore, truncating sequences to `max_length`."""

    def __init__(self, store, max_length: int):
        self.store = store
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> dict:
        item = self.store[i]
        n = self.max_length
        out = {k: (v[:n] if torch.is_tensor(v) and k != "image_embeds" else v) for k, v in item.items()}
        if "image_embeds" in item:  # [n_img, H]: the rows of the image positions kept by the cut
            out["image_embeds"] = item["image_embeds"][: int((out["input_ids"] == self.store.image_token_id).sum())]
        return out


def collate(items: list[dict], pin_memory: bool = False) -> dict:
    """Right-pad a list of store items into a batch.

    Returns input_ids Long [B,T], loss_mask Bool [B,T] (False on padding), target_argmax Long [B,T],
    aux [B,T,3Ht] and last [B,T,H] in the store dtype (zeros on padding), lengths Long [B],
    ids (list of sequence ids); from an image store also image_embeds [M, H]: the items' fused image rows
    in row-major order over [B, T] (what eagle3/drafter/image_embeddings.token_embeddings scatters). Right padding
    needs no attention mask (see eagle3/ttt/unroll.py).
    pin_memory: allocate the batch in page-locked memory (one copy from the store's memory map
    straight into memory the GPU can read asynchronously)."""
    B = len(items)
    T = max(int(it["input_ids"].shape[0]) for it in items)
    first = items[0]

    def buf(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, pin_memory=pin_memory)

    out = {
        "input_ids": buf(B, T, dtype=torch.long),
        "loss_mask": buf(B, T, dtype=torch.bool),
        "target_argmax": buf(B, T, dtype=torch.long),
        "aux": buf(B, T, first["aux"].shape[-1], dtype=first["aux"].dtype),
        "last": buf(B, T, first["last"].shape[-1], dtype=first["last"].dtype),
        "lengths": torch.zeros(B, dtype=torch.long),
        "ids": [it["id"] for it in items],
    }
    for b, it in enumerate(items):
        n = int(it["input_ids"].shape[0])
        out["lengths"][b] = n
        for key in ("input_ids", "loss_mask", "target_argmax", "aux", "last"):
            out[key][b, :n] = it[key]
            if n < T:
                out[key][b, n:] = 0  # padding: zeros (False for the mask)
    if "image_embeds" in first:
        rows = [it["image_embeds"] for it in items]
        out["image_embeds"] = buf(sum(len(r) for r in rows), rows[0].shape[-1], dtype=rows[0].dtype)
        torch.cat(rows, out=out["image_embeds"])
    return out


def batch_to_device(batch: dict, device: torch.device, non_blocking: bool = True) -> dict:
    return {k: (v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v) for k, v in batch.items()}


def make_loader(store, stream: BatchStream, start: int, max_length: int, num_workers: int = 0,
                pin_memory: bool = False):
    """Collated batches of the stream from micro-batch `start`, read ahead of the training step.

    pin_memory (GPU): one background thread reads each batch from the store's memory map straight
    into page-locked memory, `max(2, num_workers)` batches ahead: one copy per byte, no worker
    processes (a DataLoader's workers would copy a 235 MB Kimi batch three more times: into
    shared memory, out of it, and into pinned memory). Otherwise a DataLoader with `num_workers`."""
    sequences = StoreSequences(store, max_length)
    if pin_memory:
        return BackgroundBatches(lambda idx: collate([sequences[i] for i in idx], pin_memory=True),
                                 (b for _, b in stream.iterate(start)), depth=max(2, num_workers))
    batch_sampler = (b for _, b in stream.iterate(start))
    return torch.utils.data.DataLoader(sequences, batch_sampler=_Iterable(batch_sampler),
                                       collate_fn=collate, num_workers=num_workers, pin_memory=pin_memory,
                                       prefetch_factor=4 if num_workers else None,
                                       persistent_workers=False)


class _Iterable:
    """DataLoader wants a re-iterable batch_sampler; ours is a one-shot generator (one loader per run)."""

    def __init__(self, gen):
        self.gen = gen

    def __iter__(self):
        return self.gen


class BackgroundBatches:
    """Builds batches in a daemon thread, `depth` ahead (torch's copies release the GIL, so the
    reads overlap the training step). An error in the thread is raised in the consumer."""

    def __init__(self, make_batch: Callable[[list[int]], dict], plan: Iterator[list[int]], depth: int = 2):
        if depth < 1:
            raise ValueError(f"BackgroundBatches depth={depth}: must be >= 1")
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(make_batch, plan), daemon=True,
                                       name="eagle3-batches")
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, make_batch, plan) -> None:
        try:
            for idx in plan:
                if not self._put(("batch", make_batch(idx))):
                    return
            self._put(("end", None))
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(("error", e))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        kind, value = self.queue.get()
        if kind == "error":
            raise value
        if kind == "end":
            raise StopIteration
        return value

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
