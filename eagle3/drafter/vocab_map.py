"""The draft vocabulary and its mapping to the target vocabulary (pure functions, torch only).

Conventions (docs/design.md "Vocab mapping", SGLang's `LlamaForCausalLMEagle3`):
- the draft vocab is the top-N target token ids by frequency, *sorted by id*;
- `d2t[i] = target_id(i) - i`, an int64 offset (SGLang computes `hot_token_id = d2t + arange(N)`);
- `t2d` is a bool mask over the target vocab [V], True for ids in the draft vocab.
Ties in frequency are broken by id (the lower id wins), so the result is deterministic.
With fewer distinct tokens than N, the vocab is filled with the lowest-id unseen tokens
(count 0), so its size is always exactly N: the drafter's `lm_head` shape and the config's
`draft_vocab_size` never depend on the data (the number filled is reported by `coverage`).
"""
from __future__ import annotations

import torch

from eagle3.errors import StageError

class VocabMapError(StageError, ValueError):
    """A d2t / t2d pair that does not describe a valid draft vocabulary."""


def masked_token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Frequency of every target token id among the positions where `loss_mask` is set.

    input_ids: [T] integer ids (any int dtype); loss_mask: [T] bool/uint8. Returns int64 [V]."""
    if input_ids.shape != loss_mask.shape:
        raise VocabMapError(f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    ids = input_ids[loss_mask.bool()].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise VocabMapError(f"token ids span [{int(ids.min())}, {int(ids.max())}], outside the target vocab [0, {vocab_size})")
    return torch.bincount(ids, minlength=vocab_size)


def top_n_vocab(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The N most frequent target ids (ties: lower id first), returned sorted by id. int64 [N].

    counts: int [V]. A stable sort of the counts in descending order keeps equal counts in id
    order, which both breaks ties by id and fills with the lowest unseen ids when fewer than N
    tokens occur."""
    if counts.dim() != 1:
        raise VocabMapError(f"counts must be 1-D [V], got shape {tuple(counts.shape)}")
    if not 0 < n <= counts.numel():
        raise VocabMapError(f"draft vocab size {n} must be in [1, V={counts.numel()}]")
    order = torch.sort(counts, descending=True, stable=True).indices
    return torch.sort(order[:n]).values.long()


def d2t_from_ids(ids: torch.Tensor) -> torch.Tensor:
    """Offsets d2t[i] = ids[i] - i for draft ids sorted by target id. int64 [N]."""
    _check_sorted_unique(ids, "draft vocab ids")
    return ids.long() - torch.arange(ids.numel(), dtype=torch.long)


def mapping_from_ids(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [N], t2d [V]) of a draft vocab given as its target ids sorted by id (checked: sorted, unique, in range)."""
    return d2t_from_ids(ids), t2d_from_ids(ids, vocab_size)


def ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Inverse of d2t_from_ids: target id of every draft id, d2t + arange(N). int64 [N], on d2t's device."""
    return d2t.long() + torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device)


def draft_index_from_t2d(t2d: torch.Tensor) -> torch.Tensor:
    """Draft id of every target id [V] (-1 where t2d is False): draft ids are the draft vocab's target ids in
    ascending order, so a target id's draft id is its rank among the True entries. Inverse of ids_from_d2t."""
    index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d.bool(), index, torch.full_like(index, -1))


def t2d_from_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool mask [V], True at the target ids in the draft vocab."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise VocabMapError(f"draft ids span [{int(ids.min())}, {int(ids.max())}], outside the target vocab [0, {vocab_size})")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids.long()] = True
    return t2d


def mapping_problems(d2t: torch.Tensor, t2d: torch.Tensor | None = None, draft_vocab_size: int | None = None,
                     vocab_size: int | None = None) -> list[str]:
    """Why d2t (offsets [N]) and t2d (mask [V]) do not describe one draft vocabulary; [] if they do.

    The project's one check of what a mapping means, whoever stores or loads it (vocab stage, drafter,
    loader, compatibility check, export): both 1-D, of the sizes given; the target ids d2t + arange(N)
    inside [0, V) (V = t2d's length, else `vocab_size`) and distinct; t2d, when given, true exactly at
    them. Values only: a uint8 t2d or an int32 d2t holding the same ids passes. What a use adds on top
    is its own small check: `validate_mapping` (integer / bool storage, id order) and the export's
    dtypes (export/spec.py) call `order_problems` for the order."""
    out = []
    if d2t.dim() != 1:
        out.append(f"d2t must be 1-D [draft_vocab_size], got shape {list(d2t.shape)}")
    elif draft_vocab_size is not None and d2t.numel() != draft_vocab_size:
        out.append(f"d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}] (draft_vocab_size)")
    if t2d is not None:
        if t2d.dim() != 1:
            out.append(f"t2d must be 1-D [vocab_size], got shape {list(t2d.shape)}")
        elif vocab_size is not None and t2d.numel() != vocab_size:
            out.append(f"t2d has shape {list(t2d.shape)}, expected [{vocab_size}] (the target vocab)")
    if out:
        return out
    v = t2d.numel() if t2d is not None else vocab_size
    ids = ids_from_d2t(d2t)                                                    # [N]
    if v is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
        return [f"d2t maps draft ids to target ids [{int(ids.min())}, {int(ids.max())}], outside [0, {v})"]
    if ids.unique().numel() != ids.numel():
        out.append("d2t maps two draft ids to the same target id")
    if t2d is not None:
        mask = t2d.to(torch.bool)
        marked = int(mask.sum())
        if marked != ids.numel():
            out.append(f"t2d marks {marked} target ids, expected {ids.numel()} (one per d2t entry)")
        else:
            missed = ids[~mask[ids.to(mask.device)].to(ids.device)]
            if missed.numel():
                out.append(f"t2d does not mark the target ids that d2t maps to (False at target ids "
                           f"{missed[:5].tolist()})")
    return out


def order_problems(d2t: torch.Tensor) -> list[str]:
    """[] if the draft vocab is sorted by target id (d2t + arange(N) strictly increasing), as the vocab
    stage writes it and as loaders that read `logits[..., t2d]` (id order) assume; else why not. A d2t that
    is not 1-D is `mapping_problems`' finding, not this one's."""
    if d2t.dim() != 1:
        return []
    problem = _sorted_unique_problem(ids_from_d2t(d2t), "target ids d2t + arange(N)")
    return [problem] if problem else []


def validate_mapping(d2t: torch.Tensor, t2d: torch.Tensor | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """Raise VocabMapError unless d2t is an integer offset table of a draft vocab sorted by target id and,
    when given, t2d a bool mask agreeing with it (`mapping_problems`). Returns the target ids [N]."""
    if d2t.dim() != 1 or d2t.dtype not in (torch.int64, torch.int32):
        raise VocabMapError(f"d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d is not None and (t2d.dim() != 1 or t2d.dtype != torch.bool):
        raise VocabMapError(f"t2d must be a 1-D bool tensor, got {t2d.dtype} {tuple(t2d.shape)}")
    problems = order_problems(d2t) + mapping_problems(d2t, t2d, vocab_size=vocab_size)
    if problems:
        raise VocabMapError("; ".join(problems))
    return ids_from_d2t(d2t)


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> dict:
    """How much of the counted (loss-masked) token mass the vocab `ids` covers."""
    total = int(counts.sum())
    covered = int(counts[ids.long()].sum())
    return {
        "loss_tokens": total,
        "covered_tokens": covered,
        "coverage": covered / total if total else 0.0,
        "distinct_tokens_seen": int((counts > 0).sum()),
        "vocab_entries_unseen": int((counts[ids.long()] == 0).sum()),  # filled entries (count 0)
    }


def compare_vocabs(new_ids: torch.Tensor, old_ids: torch.Tensor, counts: torch.Tensor, top_k: int = 50) -> dict:
    """Compare a new draft vocab with an old one (both target ids sorted by id).

    Returns sizes, the overlap, how many d2t entries differ (position by position, over the
    longer of the two; extra positions count as differing), coverage of the old vocab on the
    new counts, and the `top_k` most frequent token ids in the new data the old vocab lacks,
    as (id, count) pairs ordered by count (ties by id)."""
    v = counts.numel()
    new_mask = t2d_from_ids(new_ids, v)
    old_in_range = old_ids[(old_ids >= 0) & (old_ids < v)]
    old_mask = t2d_from_ids(old_in_range, v)
    new_d2t = d2t_from_ids(new_ids)
    old_d2t = old_ids.long() - torch.arange(old_ids.numel(), dtype=torch.long)
    m = min(new_d2t.numel(), old_d2t.numel())
    differing = int((new_d2t[:m] != old_d2t[:m]).sum()) + abs(new_d2t.numel() - old_d2t.numel())
    missing = (counts > 0) & ~old_mask
    missing_ids = torch.nonzero(missing).flatten()
    order = torch.sort(counts[missing_ids], descending=True, stable=True).indices[:top_k]
    top_missing = [(int(i), int(counts[i])) for i in missing_ids[order]]
    old_cov = coverage(counts, old_in_range)
    return {
        "new_size": int(new_ids.numel()),
        "old_size": int(old_ids.numel()),
        "in_both": int((new_mask & old_mask).sum()),
        "only_new": int((new_mask & ~old_mask).sum()),
        "only_old": int((old_mask & ~new_mask).sum()) + int(old_ids.numel() - old_in_range.numel()),
        "old_ids_outside_target_vocab": int(old_ids.numel() - old_in_range.numel()),
        "d2t_entries_differing": differing,
        "old_coverage": old_cov["coverage"],
        "new_coverage": coverage(counts, new_ids)["coverage"],
        "loss_tokens_missing_from_old": int(counts[missing].sum()),
        "top_missing_from_old": top_missing,
    }


def _check_sorted_unique(ids: torch.Tensor, what: str) -> None:
    problem = _sorted_unique_problem(ids, what)
    if problem:
        raise VocabMapError(problem)


def _sorted_unique_problem(ids: torch.Tensor, what: str) -> str | None:
    if ids.dim() != 1:
        return f"{what} must be 1-D, got shape {tuple(ids.shape)}"
    if ids.numel() > 1:
        steps = ids[1:] - ids[:-1]
        if not bool((steps > 0).all()):
            at = int(torch.nonzero(steps <= 0)[0])
            return (f"{what} must be strictly increasing (the draft vocab sorted by target id, no repeats); "
                    f"position {at + 1} has {int(ids[at + 1])} after {int(ids[at])}")
    return None
