"""Benchmark of the vocab stage's counting: loss-masked token frequencies over N tokens on one
CPU core (goal: 100M tokens in under a minute).

Measures (1) the pure count (`eagle3.drafter.vocab_map.masked_token_counts` over in-memory chunks) and
(2) the stage's path from a prepared `datasets` directory on disk (Arrow list columns read as
flat buffers by `data.vocab.iter_flat_chunks`, then counted), checked against each other.

    python benchmarks/bench_vocab.py                       # 100M tokens, Kimi-K2.5 vocab 163,840
    python benchmarks/bench_vocab.py --tokens 10000000 --no-disk
"""
import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from data.vocab import count_loss_tokens, iter_flat_chunks


def synthetic(tokens: int, vocab: int, seq_len: int, seed: int = 0):
    """Zipf-like ids (a few frequent tokens, a long tail) and a ~60% loss mask."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.2, tokens) % vocab).astype(np.int32)
    mask = (rng.random(tokens) < 0.6).astype(np.uint8)
    return ids, mask


def write_dataset(ids, mask, seq_len: int, out: Path) -> None:
    import datasets
    import pyarrow as pa

    offsets = pa.array(np.arange(0, len(ids) + 1, seq_len, dtype=np.int32))
    n = len(offsets) - 1
    table = pa.table({"id": pa.array([str(i) for i in range(n)]),
                      "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids[: n * seq_len])),
                      "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask[: n * seq_len])),
                      "prompt_len": pa.array(np.zeros(n, dtype=np.int32))})
    datasets.Dataset(table).save_to_disk(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--vocab", type=int, default=163_840)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-disk", action="store_true", help="skip the on-disk dataset measurement")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ids, mask = synthetic(a.tokens, a.vocab, a.seq_len)

    t0 = time.perf_counter()
    mem_counts = count_loss_tokens([(ids, mask)], a.vocab)
    mem_s = time.perf_counter() - t0
    print(f"in-memory: {a.tokens:,} tokens in {mem_s:.2f} s = {a.tokens / mem_s / 1e6:.1f} M tokens/s "
          f"({a.threads} thread(s)); {int(mem_counts.sum()):,} loss tokens counted")
    if a.no_disk:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train"
        t0 = time.perf_counter()
        write_dataset(ids, mask, a.seq_len, path)
        print(f"(wrote the {a.tokens // a.seq_len:,}-row dataset in {time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
        disk_counts = count_loss_tokens(iter_flat_chunks(path), a.vocab)
        disk_s = time.perf_counter() - t0
    n_disk = (a.tokens // a.seq_len) * a.seq_len
    ref = count_loss_tokens([(ids[:n_disk], mask[:n_disk])], a.vocab)
    assert torch.equal(disk_counts, ref), "on-disk count differs from the in-memory count"
    print(f"from disk: {n_disk:,} tokens in {disk_s:.2f} s = {n_disk / disk_s / 1e6:.1f} M tokens/s "
          f"(datasets dir -> flat Arrow buffers -> bincount); counts match the in-memory count")


if __name__ == "__main__":
    main()
