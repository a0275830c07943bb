"""The drafter training starts from, checked against its inputs before any work, and the
writing of drafter directories (checkpoints and `final/`) from the live or gathered weights."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from eagle3.target_model import target_io
from eagle3.drafter.drafter_io import save_drafter_dir
from eagle3.drafter.image_embeddings import CONFIG_KEY, check_convention
from eagle3.drafter.initial import build_training_drafter
from eagle3.drafter.model import Eagle3Drafter
from eagle3.drafter.vocab_map import ids_from_d2t
from train.inputs import VOCAB_FILE, TrainInputError, open_inputs
from train.setup import stream_conf


def build_drafter(config, inputs) -> tuple[Eagle3Drafter, dict]:
    """(fp32 drafter on CPU, report). The report carries `lm_head_rows` [draft_V, H]: the target's
    lm_head rows of the draft vocab, read once from the checkpoint with the rest of the target (the teacher)."""
    store = inputs.train
    try:
        drafter, report = build_training_drafter(
            config.init.name, config.init.drafter_path, config.target.path, config.target.layout,
            ids_from_d2t(inputs.d2t), hf_indices=store.hf_indices, new_row_init=config.init.new_row_init,
            dtype="float32", aux_id_rule=config.init.aux_id_rule, seed=config.seed)
    except (ValueError, target_io.TargetError) as e:  # the drafter built is also checked against the target there
        raise TrainInputError(f"cannot build the init={config.init.name} drafter: {e}") from e
    check_fits_drafter(inputs, drafter, report["lm_head_rows"], config.vocab_dir)
    return drafter, report


def check_fits_drafter(inputs, drafter: Eagle3Drafter, lm_head_rows: torch.Tensor, vocab_dir) -> None:
    """The inputs are the drafter's: the vocab stage's mapping is the one it installed, each store's widths are
    its widths (fc input 3 x target H, hidden H; its aux layers against the store's are the compatibility
    check's), and the teacher's rows are draft vocab x store hidden."""
    cfg = drafter.config
    d2t, t2d = inputs.d2t, inputs.t2d
    if d2t.numel() != cfg.draft_vocab_size or t2d.numel() != cfg.vocab_size:
        raise TrainInputError(f"{vocab_dir}/{VOCAB_FILE}: d2t [{d2t.numel()}] / t2d [{t2d.numel()}] do not fit the "
                              f"drafter (draft_vocab_size {cfg.draft_vocab_size}, vocab_size {cfg.vocab_size})")
    if not torch.equal(drafter.d2t.cpu(), d2t) or not torch.equal(drafter.t2d.cpu(), t2d):
        raise TrainInputError(f"the drafter's d2t/t2d differ from {vocab_dir}/{VOCAB_FILE}: the init must install "
                              f"the vocab stage's mapping (and move lm_head rows accordingly)")
    for store, role in ((inputs.train, "train"), (inputs.val, "validation")):
        if store is None:
            continue
        problems = []
        aux_width = len(store.hf_indices) * store.target_hidden_size
        if aux_width != drafter.fc.in_features:
            problems.append(f"aux width {len(store.hf_indices)} x {store.target_hidden_size} = {aux_width} != the "
                            f"drafter's fc input {drafter.fc.in_features}")
        if store.hidden_size != cfg.hidden_size:
            problems.append(f"`last` width (target hidden) {store.hidden_size} != drafter hidden_size {cfg.hidden_size}")
        if problems:
            raise TrainInputError(f"{role} store {store.dir} does not fit the drafter: " + "; ".join(problems)
                                  + ". Recapture with the drafter's settings or pick the matching init.")
    if tuple(lm_head_rows.shape) != (cfg.draft_vocab_size, inputs.train.hidden_size):
        raise TrainInputError(f"target lm_head rows {tuple(lm_head_rows.shape)} do not match the draft vocab x store "
                              f"hidden ({cfg.draft_vocab_size} x {inputs.train.hidden_size})")


def init_drafter(config) -> Eagle3Drafter:
    """The drafter a train run with this config starts from (0 training tokens), its inputs opened and
    checked as the run would: the study's first curve point (pipeline/study.py)."""
    drafter, _ = build_drafter(config, open_inputs(config, stream_conf(config)))
    return drafter


def drafter_from_state(drafter: Eagle3Drafter, state: dict[str, torch.Tensor]) -> None:
    """Load checkpoint weights (all but the frozen embeddings) into the drafter, strictly."""
    missing, unexpected = drafter.load_state_dict({k: v.to(drafter.fc.weight.dtype) if v.is_floating_point() else v
                                                   for k, v in state.items()}, strict=False)
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise TrainInputError(f"checkpoint weights do not fit the drafter: missing {missing}, unexpected {unexpected}")


def write_drafter_dir(drafter: Eagle3Drafter, full_state: Optional[dict], out_dir: Path,
                      image_embeddings: Optional[str] = None) -> Path:
    """Write a drafter directory (fp32 master weights; export casts for serving). `full_state` is
    the gathered state of the wrapped objective (keys `drafter.*`), needed when the live modules
    hold only shards (FSDP); otherwise the live drafter is written directly. image_embeddings: the run's
    convention, recorded in config.json (eagle3/drafter/image_embeddings.CONFIG_KEY; the export carries it)."""
    extra = {} if image_embeddings is None else {CONFIG_KEY: check_convention(image_embeddings)}
    if full_state is None or _is_live(drafter, full_state):
        return save_drafter_dir(drafter, out_dir, dtype=torch.float32, config_overrides=extra)
    with torch.device("meta"):
        copy = Eagle3Drafter(drafter.config)
    copy = copy.to_empty(device="cpu")
    state = {k[len("drafter."):]: v.detach().cpu() for k, v in full_state.items() if k.startswith("drafter.")}
    state.pop("embed_tokens.weight", None)
    missing, unexpected = copy.load_state_dict(state, strict=False)
    if [k for k in missing if k != "embed_tokens.weight"] or unexpected:
        raise RuntimeError(f"gathered state does not fit the drafter: missing {missing}, unexpected {unexpected}")
    return save_drafter_dir(copy, out_dir, dtype=torch.float32, config_overrides=extra)


def _is_live(drafter: Eagle3Drafter, full_state: dict) -> bool:
    """True when the drafter's own parameters hold the full weights (no sharding)."""
    w = full_state.get("drafter.fc.weight")
    return w is not None and tuple(drafter.fc.weight.shape) == tuple(w.shape)
