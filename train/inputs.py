"""What the train stage reads, opened and cross-checked before any work: the capture stage's
stores and the vocab stage's mapping (the drafter is checked against them where it is built:
train/model_setup.py).

Every mismatch is reported with the file and what to change: the splits' aux layers / hidden size
against each other, the store's target vs the configured target (config sha), target vocab size vs
t2d, empty splits.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from eagle3 import fingerprints as fp
from eagle3.formats.manifest import ManifestError, read_manifest
from eagle3.formats.store import HiddenStateStore, StoreError
from train.input_errors import TrainInputError  # noqa: F401 (its home; re-exported: train.inputs.TrainInputError)
from train.setup import StreamConf

log = logging.getLogger(__name__)
VOCAB_FILE = "vocab.safetensors"




@dataclass
class TrainInputs:
    train: HiddenStateStore              # or, for data.source=stream, a train/spool_source.SpoolStore
    val: Optional[HiddenStateStore]
    d2t: torch.Tensor            # int64 [draft_V]
    t2d: torch.Tensor            # bool [V]
    capture_manifest: dict
    vocab_manifest: dict
    fingerprints: dict           # role -> manifest sha256 of each input stage directory
    warnings: list


def load_vocab(vocab_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(vocab_dir) / VOCAB_FILE
    if not path.is_file():
        raise TrainInputError(f"{path}: missing; run the vocab stage (make vocab) first")
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise TrainInputError(f"{path}: unreadable ({e}); rerun the vocab stage") from e
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise TrainInputError(f"{path}: lacks {missing}")
    from eagle3.drafter.vocab_map import VocabMapError, validate_mapping

    try:  # the file's own d2t and t2d must describe the same vocab before anything uses them
        validate_mapping(tensors["d2t"], tensors["t2d"])
    except VocabMapError as e:
        raise TrainInputError(f"{path}: its d2t/t2d mapping is inconsistent ({e}); the file is damaged: "
                              f"rerun the vocab stage") from e
    return tensors["d2t"].long(), tensors["t2d"].bool()


def open_inputs(config, stream: StreamConf) -> TrainInputs:
    """The run's inputs; `stream`: its StreamConf (train/setup.py stream_conf)."""
    capture_dir, vocab_dir = Path(config.capture_dir), Path(config.vocab_dir)
    if stream.source == "stream":  # the producer captures the held-out split first, then writes the manifest
        from train.spool_source import wait_for_producer

        wait_for_producer(stream, lambda: (capture_dir / "manifest.json").is_file(),
                          "the capture manifest (the producer captures the held-out split first)")
    try:
        capture_manifest = read_manifest(capture_dir, "capture")
        vocab_manifest = read_manifest(vocab_dir, "vocab")
        fps = {"capture": fp.stage_dir(capture_dir), "vocab": fp.stage_dir(vocab_dir)}
    except ManifestError as e:
        raise TrainInputError(str(e)) from e
    warnings, stores, splits = [], {}, []  # splits: (role, the store directory to open)
    if stream.source == "stream":
        from train.spool_source import open_spool

        stores["train"] = open_spool(stream)
    else:
        splits.append(("train", capture_dir / config.data.train_split))
    if config.data.val_split:
        vdir = capture_dir / config.data.val_split
        if (vdir / "manifest.json").is_file():
            splits.append(("validation", vdir))
        else:
            warnings.append(f"no validation store at {vdir}: validation is skipped")
    for role, path in splits:  # each opened (verify: data.verify) and non-empty, train first
        try:
            stores[role] = HiddenStateStore(path, verify=stream.verify)
        except StoreError as e:
            raise TrainInputError(f"{role} store: {e}") from e
        if len(stores[role]) == 0:
            raise TrainInputError(f"{role} store {path} holds no sequences (empty split); capture more data "
                                  f"or point capture_dir elsewhere")
    train, val = stores["train"], stores.get("validation")
    d2t, t2d = load_vocab(vocab_dir)
    _check_target_of_capture(config, capture_manifest, t2d, warnings)
    prep_c = (capture_manifest.get("inputs") or {}).get("prepare", {}).get("fingerprint")
    prep_v = (vocab_manifest.get("inputs") or {}).get("prepare", {}).get("fingerprint")
    if prep_c and prep_v and prep_c != prep_v:
        warnings.append(f"vocab ({vocab_dir}) and capture ({capture_dir}) were built from different prepared "
                        f"datasets; fine if both use the same tokenizer, otherwise rebuild the vocab")
    for role, store in stores.items():
        if store.hf_indices != train.hf_indices or store.hidden_size != train.hidden_size:
            raise TrainInputError(f"{role} store {store.dir}: aux hidden states h = {store.hf_indices} / hidden "
                                  f"{store.hidden_size} differ from the train store's (h = {train.hf_indices} / "
                                  f"{train.hidden_size}); capture both splits with the same settings")
    return TrainInputs(train, val, d2t, t2d, capture_manifest, vocab_manifest, fps, warnings)


def _check_target_of_capture(config, capture_manifest: dict, t2d: torch.Tensor, warnings: list) -> None:
    tgt = capture_manifest.get("target") or {}
    cfg_path = Path(config.target.path) / "config.json"
    if tgt.get("config_sha256") and cfg_path.is_file():
        if fp.input_file(cfg_path) != tgt["config_sha256"]:  # the rule capture recorded it with
            raise TrainInputError(f"the hidden states in {config.capture_dir} were captured from {tgt.get('path')}, "
                                  f"whose config.json differs from the configured target {config.target.path}; "
                                  f"use the matching target=... or recapture")
    V = tgt.get("vocab_size")
    if V is not None and int(V) != t2d.numel():
        raise TrainInputError(f"vocab stage's t2d covers {t2d.numel()} ids but the captured target's vocab is {V} "
                              f"({config.vocab_dir} vs {config.capture_dir}); rebuild the vocab for this target")
