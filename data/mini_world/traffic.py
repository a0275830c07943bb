"""How much language a side's traffic holds (issue 44): pure functions over token-id sequences.

A world whose target loops ("The "The "The ...) gives a drafter nothing to transfer; these figures say so before
any drafter is trained. Every figure is over loss tokens, the tokens a drafter is scored on."""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence


def _checked(seqs: Iterable[Sequence[int]]) -> list[list[int]]:
    out = [list(s) for s in seqs]
    if not any(out):
        raise ValueError("traffic figures need at least one non-empty token sequence")
    return out


def distinct_tokens(seqs: Iterable[Sequence[int]]) -> int:
    """How many different token ids occur."""
    return len({t for s in _checked(seqs) for t in s})


def top_k_share(seqs: Iterable[Sequence[int]], k: int = 5) -> float:
    """The share of all tokens that are one of the `k` most frequent ids."""
    if k < 1:
        raise ValueError(f"k={k}: must be >= 1")
    counts = Counter(t for s in _checked(seqs) for t in s)
    return sum(c for _, c in counts.most_common(k)) / sum(counts.values())


def repeat_ngram_share(seqs: Iterable[Sequence[int]], n: int = 4) -> float:
    """The share of tokens that end an n-gram already seen earlier in their own sequence (a loop's tokens do;
    the first n-1 tokens of a sequence never can). Over every token, so short sequences count as not repeating."""
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    seqs = _checked(seqs)
    repeated = 0
    for s in seqs:
        seen: set[tuple[int, ...]] = set()
        for i in range(n - 1, len(s)):
            gram = tuple(s[i - n + 1: i + 1])
            repeated += gram in seen
            seen.add(gram)
    return repeated / sum(len(s) for s in seqs)


def traffic_figures(seqs: Iterable[Sequence[int]], top: int = 5, n: int = 4) -> dict:
    """The figures of one side: loss tokens, distinct ids, top-`top` share, `n`-gram repeat share."""
    seqs = _checked(seqs)
    return {"loss_tokens": sum(len(s) for s in seqs), "distinct": distinct_tokens(seqs),
            f"top{top}_share": round(top_k_share(seqs, top), 4), f"repeat_{n}gram_share": round(repeat_ngram_share(seqs, n), 4)}


def format_figures(name: str, f: dict) -> str:
    return (f"{name}: {f['distinct']:,} distinct of {f['loss_tokens']:,} loss tokens, top-5 {f['top5_share']:.1%}, "
            f"repeating an earlier 4-gram {f['repeat_4gram_share']:.1%}"
            + (f", held-out perplexity {f['ppl']:.1f}" if "ppl" in f else ""))


def loss_token_sequences(input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each conversation's loss tokens (its answers, in order), from prepare's rows."""
    if len(input_ids) != len(loss_masks):
        raise ValueError(f"{len(input_ids)} input_ids rows but {len(loss_masks)} loss_mask rows")
    out = []
    for ids, mask in zip(input_ids, loss_masks):
        if len(ids) != len(mask):
            raise ValueError(f"a row of {len(ids)} tokens has a loss_mask of {len(mask)}")
        out.append([t for t, m in zip(ids, mask) if m])
    return out


def prepared_figures(prepare_dir) -> dict:
    """The traffic figures of a prepare stage's output (both splits): what that side's drafter learns from."""
    from pathlib import Path

    import datasets

    rows_ids, rows_mask = [], []
    for split in ("train", "validation"):
        d = Path(prepare_dir) / split
        if d.is_dir():
            ds = datasets.load_from_disk(str(d))
            rows_ids += ds["input_ids"]
            rows_mask += ds["loss_mask"]
    if not rows_ids:
        raise ValueError(f"{prepare_dir}: no prepared rows (train/ or validation/) to measure")
    return traffic_figures(loss_token_sequences(rows_ids, rows_mask))
