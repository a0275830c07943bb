"""What a capture run captures, in which batches: the sequence plan of a split and its batching,
shared by both capture backends (data/capture_hf.py runs the target itself, data/capture_vllm.py drives a
vLLM engine), and the stage's error.

Batching is global and deterministic: the sequences of a split are sorted by length (longest
first, ties by dataset index) and cut into batches of at most `max_tokens_per_batch` padded
tokens; process r of N takes batches r, r+N, ... . A batch is computed the same way whatever N
is, and a resumed run recomputes exactly the batches it had not committed, so resumed and
multi-process stores read identically to an uninterrupted one-process store.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle3.errors import StageError


class CaptureError(StageError, RuntimeError):
    """A capture that cannot start or continue, with the reason."""


@dataclass
class Seq:
    index: int  # row in the prepared split
    id: str
    length: int  # after truncation
    order: int = -1  # position in the length-sorted list: the store's global order


def plan_split(ds, limit: int | None, max_len: int, on_overlong: str) -> tuple[list[Seq], dict]:
    """Sequences to capture, length-sorted (longest first), and the overlong counts."""
    import pyarrow.compute as pc

    n = len(ds) if limit is None else min(limit, len(ds))
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    lengths = pc.list_value_length(table.column("input_ids")).to_pylist()[:n]
    ids = table.column("id").to_pylist()[:n]
    seqs, skipped_overlong, truncated = [], [], 0
    for i, (sid, T) in enumerate(zip(ids, lengths)):
        if T > max_len:
            if on_overlong == "skip":
                skipped_overlong.append(str(sid))
                continue
            truncated += 1
            T = max_len
        seqs.append(Seq(i, str(sid), int(T)))
    seqs.sort(key=lambda s: (-s.length, s.index))
    for k, s in enumerate(seqs):
        s.order = k
    return seqs, {"truncated": truncated, "skipped_overlong": skipped_overlong}


def make_batches(seqs: list[Seq], max_tokens: int) -> list[list[Seq]]:
    """Consecutive runs of the (longest-first) list with len(batch) * longest <= max_tokens;
    a sequence longer than the budget gets a batch of its own."""
    batches, cur = [], []
    for s in seqs:
        if cur and (len(cur) + 1) * cur[0].length > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    return batches
