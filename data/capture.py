"""Capture: run the target over the prepared dataset and write, per split, a hidden-state store
(eagle3/formats/store.py) holding per token the aux states of the configured layers [3H], the final
post-norm state [H], the target's argmax, the input id and the loss mask.

The backend that runs the target is a `CaptureBackend` (data/capture_backends.py: hf in this process,
data/capture_hf.py; vllm through an engine, data/capture_vllm.py). Order of work, so that bad input fails
before the (possibly 10-minute) model load:
  1. prepare manifest, target config, aux hidden-state indices h (eagle3/engines/aux_layers.py: from the init
     drafter's ids by init.aux_id_rule, or aux_hf_indices, or SGLang's default; checked), tokenizer fingerprint
     against the one the dataset was prepared with, dataset columns / token id range;
  2. reuse: a stage manifest matching config + inputs returns at once;
  3. the backend's own checks; then open it (load the target / reach the engine), capture each split,
     merge the parts of a multi-process run, write manifest.

Batching is global and deterministic (data/capture_plan.py); process r of N takes batches r, r+N, ...
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from data.capture_backends import backend_for
from data.capture_plan import CaptureError, plan_split
from eagle3 import fingerprints as fp
from eagle3.engines import aux_layers
from eagle3.target_model import target_io
from eagle3.engines.aux_layers import AuxChoice, AuxLayerError
from eagle3.drafter.drafter_io import DrafterLoadError, listed_aux_ids, read_config_dict
from eagle3.config.dtypes import torch_dtype
from eagle3.formats.manifest import read_json
from eagle3.formats.store import HiddenStateWriter, StoreMismatchError, merge_stores

@dataclass
class Dist:
    """Which slice of the work this process does. `barrier` waits for every process."""
    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_dataset(ds, split: str, vocab_size: int) -> None:
    """Columns, dtypes-as-stored, token id range and matching mask lengths (cheap Arrow ops)."""
    import pyarrow.compute as pc

    need = {"id", "input_ids", "loss_mask"}
    if missing := need - set(ds.column_names):
        raise CaptureError(f"prepared split {split!r} lacks columns {sorted(missing)} (has {ds.column_names}); "
                           f"rerun the prepare stage")
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
    if len(ds) == 0:
        return
    if pc.any(pc.not_equal(pc.list_value_length(ids_col), pc.list_value_length(mask_col))).as_py():
        raise CaptureError(f"prepared split {split!r}: input_ids and loss_mask lengths differ; rerun prepare")
    flat = pc.list_flatten(ids_col)
    lo, hi = pc.min(flat).as_py(), pc.max(flat).as_py()
    if lo is not None and (lo < 0 or hi >= vocab_size):
        raise CaptureError(f"prepared split {split!r}: token ids span [{lo}, {hi}] but the target's vocab_size is "
                           f"{vocab_size}: the dataset was prepared with another tokenizer")


def store_meta(cfg, fingerprints: dict, max_len: int, dist: Dist, split: str) -> dict:
    """What a store depends on: a resumed writer refuses to mix stores whose meta differs."""
    return {"split": split, **fingerprints, "target_dtype": cfg.target.dtype, "max_seq_len": max_len,
            "on_overlong": cfg.on_overlong, "limit": cfg.limit, "max_tokens_per_batch": cfg.max_tokens_per_batch,
            "world_size": dist.world, **({"backend": cfg.backend} if cfg.backend != "hf" else {})}


def open_writer(store_dir: Path, cfg, header: dict, meta: dict) -> HiddenStateWriter:
    try:
        return HiddenStateWriter(store_dir, **header, dtype=cfg.dtype, aux_dtype=cfg.aux_dtype,
                                 shard_tokens=cfg.shard_tokens, meta=meta, background=True)
    except StoreMismatchError as e:
        if not cfg.overwrite:
            raise CaptureError(f"{e}\n(set overwrite=true to delete it and capture again)") from e
        print(f"[capture] {store_dir}: written with other settings; overwrite=true, deleting it")
        shutil.rmtree(store_dir)
        return HiddenStateWriter(store_dir, **header, dtype=cfg.dtype, aux_dtype=cfg.aux_dtype,
                                 shard_tokens=cfg.shard_tokens, meta=meta, background=True)


def check_split_dir(split_dir: Path, cfg, dist: Dist) -> None:
    """A multi-process run over a store written with another number of processes (its shards sit
    elsewhere: in split_dir itself or in other part dirs) refuses, or with overwrite=true starts over.
    Every process reads the same manifest, so all take the same branch."""
    if dist.world == 1:
        return  # a one-process writer on split_dir compares the meta (world_size) itself
    path = split_dir / "manifest.json"
    old = read_json(path, CaptureError).get("meta", {}).get("world_size") if path.is_file() else dist.world
    dist.barrier()
    if old != dist.world:
        if not cfg.overwrite:
            raise CaptureError(f"{split_dir}: captured with {old} process(es), this run has {dist.world}; refusing "
                               f"to mix (set overwrite=true to start over, or use the same number of processes)")
        if dist.is_main:
            shutil.rmtree(split_dir)
    dist.barrier()


def summarize(manifest: dict, plan_counts: dict) -> dict:
    skipped = manifest["skipped"]
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    return {"sequences": manifest["num_sequences"], "tokens": manifest["num_tokens"],
            "loss_tokens": manifest["num_loss_tokens"], "shards": len(manifest["shards"]),
            "truncated": plan_counts["truncated"], "skipped": reasons,
            "skipped_ids": {r: [s["id"] for s in skipped if s["reason"] == r][:20] for r in reasons}}


def default_dist() -> Dist:
    """The process group of `accelerate launch` / `torchrun` (one process otherwise). CPU runs need
    PartialState(cpu=True) to join the group; a mismatch with WORLD_SIZE would make every process
    capture everything, so it is an error."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != world_env:
        raise CaptureError(f"launched as {world_env} processes (WORLD_SIZE) but accelerate sees "
                           f"{state.num_processes}; use `accelerate launch --multi_gpu --num_processes N` or torchrun")
    return Dist(state.process_index, state.num_processes, state.wait_for_everyone)


def check_tokenizer(cfg, prep_manifest: dict) -> str:
    """The target tokenizer's fingerprint, which must be the one the dataset was prepared with."""
    try:
        tokenizer = fp.tokenizer(target_io.load_tokenizer(cfg.target))
    except target_io.TargetError as e:
        raise CaptureError(str(e)) from e
    prepared = (prep_manifest.get("fingerprints") or {}).get("tokenizer")
    if prepared is None:
        raise CaptureError(f"{cfg.in_dir}/manifest.json records no tokenizer fingerprint; rerun the prepare stage")
    if prepared != tokenizer:
        raise CaptureError(f"{cfg.in_dir} was prepared with another tokenizer than target.tokenizer="
                           f"{cfg.target.tokenizer} (fingerprint {prepared[:12]} != {tokenizer[:12]}); "
                           f"rerun prepare for this target")
    return tokenizer


def capture_image_token_id(cfg, prep_manifest: dict) -> int | None:
    """The image row id when the prepared data holds images (an image capture: the store keeps the fused
    input embeddings of those rows), else None. The id prepare rendered must be the target's image_token_id
    (eagle3/media_tokens.py)."""
    if not (prep_manifest.get("counts") or {}).get("images"):
        return None
    from eagle3.media_tokens import K25_IMAGE_TOKEN_ID

    pad = (prep_manifest.get("media_token_ids") or {}).get("pad")
    full = target_io.read_full_config(cfg.target.path)
    if cfg.target.layout != "kimi_k25" or "vision_config" not in full:
        raise CaptureError(f"{cfg.in_dir} holds images but target {cfg.target.path} has no vision tower")
    want = int(full.get("image_token_id", K25_IMAGE_TOKEN_ID))
    if pad != want:
        raise CaptureError(f"{cfg.in_dir} renders images with id {pad}, the target's image_token_id is {want}")
    return want


def choose_aux_layers(cfg, num_layers: int) -> AuxChoice:
    """h to capture (aux_layers.choose_hf_indices): the +init drafter's listed ids read by init.aux_id_rule
    (its disagreement between SGLang versions printed), else capture.aux_hf_indices, else SGLang's default."""
    listed, where, rule = None, None, aux_layers.DEFAULT_RULE
    if cfg.init is not None and cfg.init.drafter_path:
        where, rule = cfg.init.drafter_path, cfg.init.aux_id_rule
        listed = listed_aux_ids(read_config_dict(where))
        note = aux_layers.disagreement_note(listed, rule, f"init drafter {where}")
        if note:
            print(f"[capture] WARNING {note}")
    return aux_layers.choose_hf_indices(listed, where, cfg.aux_hf_indices, num_layers, rule)


@dataclass
class CaptureSetup:
    """What a capture run reads before any work (both run_capture and the streaming producer use it)."""
    prep_manifest: dict
    text_cfg: dict
    aux: AuxChoice
    image_token_id: int | None
    max_len: int
    fingerprints: dict

    hf_indices = property(lambda self: self.aux.hf_indices)
    num_layers = property(lambda self: self.text_cfg["num_hidden_layers"])
    hidden_size = property(lambda self: self.text_cfg["hidden_size"])
    vocab_size = property(lambda self: self.text_cfg["vocab_size"])

    def header(self, backend) -> dict:
        return {"hidden_size": self.hidden_size, "target_hidden_size": self.hidden_size, "hf_indices": self.hf_indices,
                "aux_provenance": self.aux.provenance(), "image_token_id": self.image_token_id,
                "image_rows": backend.image_rows}


def capture_stage(cfg):
    """The capture's stage directory (eagle3/stage_dir.py): reads the inputs, decides reuse, publishes."""
    from eagle3.stage_dir import StageDir

    return StageDir(Path(cfg.out_dir), "capture", CaptureError)


def capture_setup(cfg, stage=None) -> CaptureSetup:
    """Step 1 of the module docstring: manifests, target config, aux layers, tokenizer fingerprint
    (`stage`: the capture's StageDir, which reads the input manifest)."""
    in_dir = Path(cfg.in_dir)
    prep_manifest = (stage or capture_stage(cfg)).input(in_dir, "prepare")
    try:
        text_cfg = target_io.read_text_config(cfg.target.path, cfg.target.layout)
        aux = choose_aux_layers(cfg, text_cfg["num_hidden_layers"])
    except (target_io.TargetError, DrafterLoadError, AuxLayerError) as e:
        raise CaptureError(str(e)) from e
    image_token_id = capture_image_token_id(cfg, prep_manifest)
    print(f"[capture] aux hidden states h = {aux.hf_indices} (HF output_hidden_states; from {aux.source}"
          + (f", ids {aux.listed_ids} read by rule {aux.rule!r}" if aux.rule else "") + ")")
    max_len = cfg.max_seq_len or int(text_cfg["max_position_embeddings"])
    fingerprints = {"target": fp.target_checkpoint(cfg.target.path),
                    "tokenizer": check_tokenizer(cfg, prep_manifest), "prepare": fp.stage_dir(in_dir)}
    return CaptureSetup(prep_manifest, text_cfg, aux, image_token_id, max_len, fingerprints)


def open_split(cfg, split: str, vocab_size: int):
    """The prepared split as a datasets.Dataset, checked (check_dataset)."""
    import datasets

    path = Path(cfg.in_dir) / split
    if not path.is_dir():
        raise CaptureError(f"{path}: prepared split missing; rerun the prepare stage")
    ds = datasets.load_from_disk(str(path))
    check_dataset(ds, split, vocab_size)
    return ds


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
