"""What a capture run reads and checks before any work, once for the capture stage (data/capture.py) and the
streaming producer (data/stream_capture.py): the process slice (Dist), the prepare manifest, the target config,
the aux hidden-state indices h, the tokenizer and image-row checks and the fingerprints (CaptureSetup), each
prepared split opened and checked, and the store a split is written into (its meta, the writer resumed or
overwritten, the multi-process check).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from data.capture_plan import CaptureError
from eagle3 import fingerprints as fp
from eagle3.engines import aux_layers
from eagle3.target_model import target_io
from eagle3.engines.aux_layers import AuxChoice, AuxLayerError
from eagle3.drafter.drafter_io import DrafterLoadError, listed_aux_ids, read_config_dict
from eagle3.formats.manifest import read_json
from eagle3.formats.store import HiddenStateWriter, StoreMismatchError


@dataclass
class Dist:
    """Which slice of the work this process does. `barrier` waits for every process."""
    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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
