"""Capture: run the target over the prepared dataset and write, per split, a hidden-state store
(eagle3/formats/store.py) holding per token the aux states of the configured layers [3H], the final
post-norm state [H], the target's argmax, the input id and the loss mask.

The backend that runs the target is a `CaptureBackend` (data/capture_backends.py: hf in this process,
data/capture_hf.py; vllm through an engine, data/capture_vllm.py). Order of work, so that bad input fails
before the (possibly 10-minute) model load:
  1. prepare manifest, target config, aux hidden-state indices h (eagle3/engines/aux_layers.py: from the init
     drafter's ids by init.aux_id_rule, or aux_hf_indices, or SGLang's default; checked), tokenizer fingerprint
     against the one the dataset was prepared with, dataset columns / token id range (data/capture_setup.py,
     shared with the streaming producer);
  2. reuse: a stage manifest matching config + inputs returns at once;
  3. the backend's own checks; then open it (load the target / reach the engine), capture each split,
     merge the parts of a multi-process run, write manifest.

Batching is global and deterministic (data/capture_plan.py); process r of N takes batches r, r+N, ...
"""
from __future__ import annotations

from pathlib import Path

import torch

from data.capture_backends import backend_for
from data.capture_plan import plan_split
from data.capture_setup import (CaptureSetup, Dist, capture_setup, capture_stage, check_split_dir, default_dist,
                                open_split, open_writer, store_meta)
from eagle3 import fingerprints as fp
from eagle3.config.dtypes import torch_dtype
from eagle3.formats.store import merge_stores


def run_capture(cfg, dist: Dist | None = None) -> Path:
    """The capture stage (`cfg`: eagle3.config.schema.capture.CaptureConfig). Returns the stage dir."""
    out, stage = Path(cfg.out_dir), capture_stage(cfg)
    setup = capture_setup(cfg, stage)
    dist = dist or default_dist()
    if stage.reused({"config": cfg, "fingerprints": setup.fingerprints, "world_size": dist.world},
                    needs=[f"{split}/manifest.json" for split in cfg.splits]):
        print(f"[capture] {out} is up to date with this config, target and dataset; reusing it")
        return out
    backend = backend_for(cfg.backend)  # data/capture_backends.py; checked before any work
    backend.check(cfg, setup.hf_indices, setup.num_layers, setup.max_len, dist, setup.image_token_id)
    splits = {split: open_split(cfg, split, setup.vocab_size) for split in cfg.splits}

    dist.barrier()  # every process has read the old stage manifest; it no longer describes what is on disk
    if dist.is_main:
        stage.begin()
    backend.open(cfg, setup.text_cfg, setup.max_len, dist)
    results = {split: capture_one_split(cfg, setup, backend, dist, split, ds) for split, ds in splits.items()}
    backend.close()
    if dist.is_main:
        stage.publish(cfg, inputs={"prepare": Path(cfg.in_dir)}, **capture_record(cfg, setup, backend, dist, results))
    dist.barrier()
    return out


def capture_one_split(cfg, setup: CaptureSetup, backend, dist: Dist, split: str, ds) -> dict:
    """One split through the backend into its store (resumed where a killed run stopped); its summary."""
    out = Path(cfg.out_dir)
    seqs, plan_counts = plan_split(ds, cfg.limit, setup.max_len, cfg.on_overlong)
    split_dir = out / split
    store_dir = split_dir if dist.world == 1 else split_dir / f"part-{dist.rank}"
    check_split_dir(split_dir, cfg, dist)
    writer = open_writer(store_dir, cfg, setup.header(backend),
                         store_meta(cfg, setup.fingerprints, setup.max_len, dist, split))
    if dist.is_main:
        for sid in plan_counts["skipped_overlong"]:
            if sid not in writer.done_ids:
                writer.skip(sid, "overlong")
    run = backend.capture_split(ds, seqs, writer, cfg, setup.hf_indices, dist, f"capture {split}",
                                setup.image_token_id)
    manifest = writer.finish()
    dist.barrier()
    if dist.world > 1 and dist.is_main:
        manifest = merge_stores(split_dir, [split_dir / f"part-{r}" for r in range(dist.world)])
    result = {**summarize(manifest, plan_counts), "this_run": run}
    if dist.is_main:
        print(f"[capture] {split}: {result['sequences']:,} sequences, {result['tokens']:,} tokens "
              f"in {result['shards']} shards; truncated {plan_counts['truncated']}, skipped "
              f"{result['skipped'] or 0}; this run {run['tokens_run']:,} tokens in {run['seconds']:.1f}s")
    return result


def summarize(manifest: dict, plan_counts: dict) -> dict:
    skipped = manifest["skipped"]
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    return {"sequences": manifest["num_sequences"], "tokens": manifest["num_tokens"],
            "loss_tokens": manifest["num_loss_tokens"], "shards": len(manifest["shards"]),
            "truncated": plan_counts["truncated"], "skipped": reasons,
            "skipped_ids": {r: [s["id"] for s in skipped if s["reason"] == r][:20] for r in reasons}}


def capture_record(cfg, setup: CaptureSetup, backend, dist: Dist, results: dict) -> dict:
    """The capture manifest's fields besides config and inputs."""
    H, n_aux = setup.hidden_size, len(setup.hf_indices)
    state_bytes = torch.finfo(torch_dtype(cfg.dtype)).bits // 8
    aux_bytes = n_aux * (H + 4) if cfg.aux_dtype == "float8_e4m3fn" else n_aux * H * state_bytes
    return {"fingerprints": setup.fingerprints, "hf_indices": setup.hf_indices, "aux_layers": setup.aux.provenance(),
            "image_token_id": setup.image_token_id,
            "image_rows": backend.image_rows if setup.image_token_id is not None else None,
            "target": {"path": cfg.target.path, "layout": cfg.target.layout, "num_hidden_layers": setup.num_layers,
                       "hidden_size": H, "vocab_size": setup.vocab_size, "config_sha256": fp.input_file(Path(cfg.target.path) / "config.json")},
            "world_size": dist.world, "store_dtype": cfg.dtype, "store_aux_dtype": cfg.aux_dtype or cfg.dtype,
            "max_seq_len": setup.max_len, "bytes_per_token": aux_bytes + H * state_bytes + 9, "splits": results}
