"""The vocab stage: token frequencies over the loss-masked tokens of the prepared split ->
top-N draft vocab (eagle3.drafter.vocab_map) -> `vocab.safetensors` (`d2t` int64 [N], `t2d` bool [V],
`counts` int64 [V]) + `report.json` + `manifest.json`.

Counting is vectorised: the Arrow list columns are read as flat numpy buffers (no Python
object per token), masked, and counted with `torch.bincount` a chunk at a time, so memory
stays bounded by `chunk_tokens` whatever the dataset size.

With `+init=aqmedai_k2` (and the drafter directory present) the report compares the new
mapping with the init drafter's (`d2t` from `<init.drafter_path>/model.safetensors`; its
`t2d`, when there, is checked for consistency): that is what `lm_head` rows are remapped by.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from eagle3 import fingerprints as fp
from eagle3.formats.weight_files import weight_files
from eagle3.errors import StageError
from eagle3.formats.manifest import atomic_write_json, sha256_file
from eagle3.drafter.vocab_map import (VocabMapError, compare_vocabs, coverage, d2t_from_ids, masked_token_counts,
                                      t2d_from_ids, top_n_vocab, validate_mapping)

VOCAB_FILE = "vocab.safetensors"
REPORT_FILE = "report.json"


class VocabStageError(StageError, RuntimeError):
    """The vocab stage cannot run on its inputs; the message says which and why."""


def iter_flat_chunks(dataset_dir: Path, chunk_rows: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids [n], loss_mask [n]) flat numpy views over consecutive rows of a prepared
    split, without materialising Python lists."""
    import datasets

    ds = datasets.load_from_disk(str(dataset_dir))
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise VocabStageError(f"{dataset_dir}: prepared split lacks columns {sorted(missing)} (has {ds.column_names})")
    table = ds.with_format("arrow")
    for start in range(0, len(ds), chunk_rows):
        batch = table[start: start + chunk_rows]  # a pyarrow Table slice
        ids = batch.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        mask = batch.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        if ids.shape != mask.shape:
            raise VocabStageError(f"{dataset_dir}: rows {start}..{start + chunk_rows} have {ids.size} input_ids "
                                  f"but {mask.size} loss_mask entries")
        yield ids, mask


def count_loss_tokens(chunks, vocab_size: int, chunk_tokens: int = 1 << 24) -> torch.Tensor:
    """Sum of masked_token_counts over (ids, mask) chunks, regrouped to ~chunk_tokens each."""
    import warnings

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in chunks:
        for s in range(0, len(ids), chunk_tokens):
            with warnings.catch_warnings():  # Arrow buffers are read-only; they are only read here
                warnings.simplefilter("ignore", UserWarning)
                t_ids = torch.from_numpy(np.ascontiguousarray(ids[s: s + chunk_tokens]))
                t_mask = torch.from_numpy(np.ascontiguousarray(mask[s: s + chunk_tokens])).bool()
            counts += masked_token_counts(t_ids, t_mask, vocab_size)
    return counts


def target_vocab_size(cfg) -> int:
    """V: the configured value, else the target's (text) config.json vocab_size."""
    if cfg.target_vocab_size:
        return int(cfg.target_vocab_size)
    from eagle3.target_model.target_io import TargetError, read_text_config

    try:
        return int(read_text_config(cfg.target.path, cfg.target.layout)["vocab_size"])
    except TargetError as e:
        raise VocabStageError(f"cannot tell the target vocab size ({e}); set target_vocab_size=V") from e


def read_init_mapping(drafter_dir: Path, vocab_size: int) -> tuple[torch.Tensor, dict]:
    """Target ids of an existing drafter's draft vocab, from its `d2t` (and `t2d` if present)."""
    from eagle3.drafter.drafter_io import DrafterLoadError, read_named_tensors

    try:  # the shard that holds d2t, by the rules a load follows
        found = read_named_tensors(drafter_dir, ("d2t", "t2d"))
    except DrafterLoadError as e:
        raise VocabStageError(f"init drafter {drafter_dir}: {e}") from e
    if "d2t" not in found:
        raise VocabStageError(f"init drafter {drafter_dir}: no `d2t` tensor in its weights "
                              f"{sorted({p.name for p in weight_files(drafter_dir)})}")
    d2t, path = found["d2t"]
    t2d = found["t2d"][0] if "t2d" in found else None
    note = {"path": str(path), "has_t2d": t2d is not None}
    try:
        ids = validate_mapping(d2t, t2d if t2d is not None and t2d.numel() == vocab_size else None)
    except VocabMapError as e:
        raise VocabStageError(f"{path}: inconsistent d2t/t2d: {e}") from e
    if t2d is not None and t2d.numel() != vocab_size:
        note["t2d_size_mismatch"] = f"t2d has {t2d.numel()} entries, the target vocab has {vocab_size}"
    return ids, note


def _decode(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids] if tokenizer is not None else [""] * len(ids)


def build_report(counts: torch.Tensor, ids: torch.Tensor, n: int, old: Optional[tuple[torch.Tensor, dict]],
                 tokenizer, top_k: int) -> dict:
    cov = coverage(counts, ids)
    report = {"draft_vocab_size": n, "target_vocab_size": int(counts.numel()), **cov,
              "fill_rule": "fewer distinct tokens than N: the vocab is filled with the lowest unseen ids "
                           "(count 0), so it always has exactly N entries",
              "filled_with_unseen": cov["vocab_entries_unseen"]}
    if old is None:
        report["init_comparison"] = None
        return report
    old_ids, note = old
    cmp = compare_vocabs(ids, old_ids, counts, top_k)
    decoded = _decode(tokenizer, [i for i, _ in cmp["top_missing_from_old"]])
    cmp["top_missing_from_old"] = [{"id": i, "count": c, "token": t}
                                   for (i, c), t in zip(cmp["top_missing_from_old"], decoded)]
    report["init_comparison"] = {**note, **cmp}
    return report


def run_vocab(cfg) -> Path:
    """The vocab stage (`cfg`: eagle3.config.schema.vocab.VocabConfig). Returns the stage dir."""
    from eagle3.stage_dir import StageDir

    in_dir, out = Path(cfg.in_dir), Path(cfg.out_dir)
    stage = StageDir(out, "vocab", VocabStageError)
    prep = stage.input(in_dir, "prepare")
    split_dir = in_dir / cfg.split
    if not split_dir.is_dir():
        raise VocabStageError(f"{in_dir}: no {cfg.split}/ split (is the prepare stage complete?)")
    init_dir = Path(cfg.init.drafter_path) if cfg.init is not None and cfg.init.drafter_path else None
    init_fp = fp.drafter_weights(init_dir)
    inputs_fp = {"prepare": fp.stage_dir(in_dir), "init_drafter": init_fp}
    if stage.reused({"config": cfg, "fingerprints": inputs_fp}, needs=[VOCAB_FILE]):
        print(f"[vocab] {out} is up to date with this config and input; reusing it")
        return out

    v, n = target_vocab_size(cfg), cfg.draft_vocab_size
    if n > v:
        raise VocabStageError(f"draft_vocab_size={n} exceeds the target vocab size {v}")
    counts, count_s = _count(split_dir, v, cfg.chunk_tokens)
    ids = top_n_vocab(counts, n)
    d2t, t2d = d2t_from_ids(ids), t2d_from_ids(ids, v)
    validate_mapping(d2t, t2d, v)
    old = None
    if init_dir is not None:
        if init_fp is None:
            print(f"[vocab] init drafter {init_dir} not found: report has no comparison")
        else:
            old = read_init_mapping(init_dir, v)
    report = build_report(counts, ids, n, old, _load_tokenizer(cfg.target), cfg.report_top_missing)
    report["count_seconds"] = round(count_s, 3)

    with stage.staging() as tmp:
        _write_vocab(tmp / VOCAB_FILE, d2t, t2d, counts)
        atomic_write_json(tmp / REPORT_FILE, report)
        stage.publish(cfg, staged=tmp, members=[VOCAB_FILE, REPORT_FILE], inputs={"prepare": in_dir},
                      fingerprints=inputs_fp,
                      counts={"loss_tokens": report["loss_tokens"], "distinct_tokens_seen": report["distinct_tokens_seen"],
                              "draft_vocab_size": n, "target_vocab_size": v,
                              "filled_with_unseen": report["filled_with_unseen"],
                              "prepared_conversations": prep.get("splits", {}).get(cfg.split, {}).get("conversations")},
                      coverage=report["coverage"], files={VOCAB_FILE: sha256_file(tmp / VOCAB_FILE)})
    print(summary(report))
    return out


def _count(split_dir: Path, v: int, chunk_tokens: int) -> tuple[torch.Tensor, float]:
    """The loss-token counts of a prepared split (and the seconds the count took)."""
    import time

    import datasets  # noqa: F401  (imported before the clock starts: the count is what is timed)

    t0 = time.perf_counter()
    try:
        counts = count_loss_tokens(iter_flat_chunks(split_dir), v, chunk_tokens)
    except VocabMapError as e:
        raise VocabStageError(f"{split_dir}: {e} (is target_vocab_size right for this tokenizer?)") from e
    count_s = time.perf_counter() - t0
    if int(counts.sum()) == 0:
        raise VocabStageError(f"{split_dir}: no loss-masked tokens to count")
    return counts, count_s


def _write_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous(), "counts": counts.contiguous()}, str(path),
              metadata={"format": "pt", "convention": "target_id = d2t[i] + i"})


def _load_tokenizer(target):
    from eagle3.target_model.target_io import TargetError, load_tokenizer

    try:
        return load_tokenizer(target)
    except TargetError as e:  # decoding tokens is for the report only; never fail the stage on it
        print(f"[vocab] could not load the tokenizer ({e}); report lists token ids only")
        return None


def summary(report: dict) -> str:
    lines = [f"[vocab] draft vocab {report['draft_vocab_size']:,} of {report['target_vocab_size']:,}: covers "
             f"{report['coverage']:.2%} of {report['loss_tokens']:,} loss tokens "
             f"({report['distinct_tokens_seen']:,} distinct seen, {report['filled_with_unseen']:,} filled unseen)"]
    c = report.get("init_comparison")
    if c:
        lines.append(f"[vocab] vs init drafter: {c['in_both']:,} in both, {c['only_new']:,} only new, "
                     f"{c['only_old']:,} only old, {c['d2t_entries_differing']:,} d2t entries differ; "
                     f"old vocab covers {c['old_coverage']:.2%}")
        top = ", ".join(repr(t["token"]) for t in c["top_missing_from_old"][:10])
        lines.append(f"[vocab] most frequent tokens the init vocab lacks: {top}")
    return "\n".join(lines)
