"""The drafter that training starts from, for a target and a new draft vocab.

init=aqmedai_k2 (start from an older relative's drafter, e.g. AQ-MedAI's Kimi-K2 EAGLE-3):
  1. read the old drafter's config and check it against the target BEFORE loading anything big
     (hidden size, fc width, vocab size, its aux layer ids read by `aux_id_rule` vs the captured h): a clear error;
  2. load it; check the drafter it becomes (new vocab, the store's h, the target's context) against the target;
     move its lm_head rows to the new draft vocab (eagle3.drafter.remap: shared tokens keep their rows, new
     tokens follow `new_row_init`), install the new d2t / t2d;
  3. the target's embeddings (frozen), and max_position_embeddings from the target
     (131072 -> 262144 for K2.5; rope numerics do not depend on it).
init=scratch: a fresh one-layer drafter shaped from the target's text config:
  hidden / heads / KV heads / intermediate from the target; head_dim = v_head_dim for MLA
  targets (DeepSeek-V3 / Kimi, whose `head_dim` key is the rope part only), else head_dim or
  hidden/heads; rms_norm_eps and rope_theta from the target (a YaRN rope_scaling is not
  carried over: the drafter's rope is plain, as in the published K2.5 drafter); Llama init
  N(0, initializer_range) for the linear layers and ones for the norms; embeddings from the
  target; lm_head rows = the target's lm_head rows of the draft vocab, unscaled. Why those rows:
  at init every norm weight is 1 and the drafter learns to approximate the target's post-norm
  state, whose logits are exactly target_head(state); starting from that head means step-0
  logits are the teacher's as soon as the hidden state is right, instead of learning
  32,000 rows from noise.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from eagle3.engines import aux_layers
from eagle3.target_model import target_io
from eagle3.config.choices import INITS
from eagle3.drafter.drafter_io import assert_compatible, load_checked_drafter, torch_dtype
from eagle3.drafter.model import ROPE_TYPES, DrafterConfig, Eagle3Drafter, rope_settings, rope_type_of
from eagle3.drafter.remap import remap_lm_head
from eagle3.drafter.vocab_map import mapping_from_ids

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")


def scratch_config(text: dict, draft_vocab_size: int, hf_indices: list[int]) -> tuple[DrafterConfig, list[str]]:
    """A drafter config shaped from the target's text config dict; notes say what was adapted."""
    notes = []
    H, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    if text.get("model_type") in MLA_MODEL_TYPES or "v_head_dim" in text:
        head_dim = int(text.get("v_head_dim") or H // heads)
        notes.append(f"MLA target: head_dim = v_head_dim = {head_dim}")
    else:
        head_dim = int(text.get("head_dim") or H // heads)
    theta, scaling = rope_settings(text)
    if rope_type_of(scaling) not in ROPE_TYPES:
        notes.append(f"target rope_scaling {rope_type_of(scaling)!r} not carried to the drafter (plain rope, "
                     f"theta {theta})")
        scaling = None
    cfg = DrafterConfig(
        hidden_size=H, intermediate_size=int(text["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
        vocab_size=int(text["vocab_size"]), draft_vocab_size=int(draft_vocab_size), target_hidden_size=H,
        aux_hf_indices=list(hf_indices), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=int(text["max_position_embeddings"]),
        bos_token_id=text.get("bos_token_id"), eos_token_id=text.get("eos_token_id"),
        torch_dtype="bfloat16", initializer_range=float(text.get("initializer_range", 0.02)))
    return cfg, notes


def build_training_drafter(init_name: str, init_drafter_path: Optional[str | Path], target_path: str | Path,
                           layout: str, new_ids: torch.Tensor, hf_indices: Optional[list[int]] = None,
                           new_row_init: str = "target_lm_head", *, dtype: str | torch.dtype = "float32",
                           device: str | torch.device = "cpu", aux_id_rule: str = aux_layers.DEFAULT_RULE,
                           seed: int = 0) -> tuple[Eagle3Drafter, dict]:
    """(drafter ready to train, report). new_ids: int64 [N] target ids of the new draft vocab, sorted
    (the vocab stage's `d2t + arange(N)`); hf_indices: the hidden-state indices h the store holds (None:
    the init drafter's, or SGLang's default for scratch); aux_id_rule: how the init drafter's config
    ids are read as h (must give the store's h); seed: the random initialisation of a scratch drafter
    (the training run's seed, so that seeds differ in every random choice). The target is read once
    (target_io.read_target_parts); the report carries its lm_head rows of the draft vocab as `lm_head_rows`
    [N, H] (the training teacher's head). Each init checks the drafter it makes against the target and
    `hf_indices` (CompatibilityError; the warnings are the report's `compatibility`)."""
    if init_name not in INITS:
        raise ValueError(f"init={init_name!r}: expected one of {INITS}")
    if init_name != "scratch" and not init_drafter_path:
        raise ValueError("init=aqmedai_k2 needs init_drafter_path (the old drafter directory)")
    new_ids = torch.as_tensor(new_ids, dtype=torch.long).cpu()
    dtype = torch_dtype(dtype)
    target = target_io.read_target_parts(target_path, layout, new_ids)  # ids out of the head's range: TargetError
    d2t, t2d = mapping_from_ids(new_ids, int(target.text["vocab_size"]))  # checks sorted / unique
    default_h = aux_layers.sglang_default_hf_indices(int(target.text["num_hidden_layers"]))
    report: dict = {"init": init_name, "target": str(target_path), "draft_vocab_size": int(new_ids.numel())}
    if init_name == "scratch":
        model, rep, warnings = _scratch(target, new_ids, hf_indices or default_h, hf_indices, dtype, seed)
    else:
        model, rep, warnings = _from_drafter(Path(init_drafter_path), target, new_ids, hf_indices, default_h,
                                             target_path, new_row_init, dtype, aux_id_rule)
    report.update(rep)
    model.set_vocab_mapping(d2t, t2d)
    model.embed_tokens.weight.requires_grad_(False)
    report["compatibility"] = [str(w) for w in warnings]
    report["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report["lm_head_rows"] = target.lm_head_rows
    return model.to(device), report


def _scratch(target: target_io.TargetParts, new_ids, h, captured, dtype, seed: int = 0):
    """The scratch drafter with reading h, and the warnings of its check against the target and `captured`."""
    cfg, notes = scratch_config(target.text, new_ids.numel(), h)
    with torch.random.fork_rng(devices=[]):  # deterministic init, caller's RNG state untouched
        torch.manual_seed(seed)
        model = Eagle3Drafter(cfg).to(dtype)
    model.set_embeddings(target.embed_tokens.to(dtype))
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head_rows.to(dtype))
    warnings = assert_compatible(cfg, target.text, captured)
    return model, {"config_notes": notes, "lm_head": "target lm_head rows of the draft vocab",
                   "aux_hf_indices": list(h)}, warnings


def _from_drafter(old_dir, target: target_io.TargetParts, new_ids, hf_indices, default_h, target_path,
                  new_row_init, dtype, id_rule):
    """The old drafter read, checked and loaded once; the drafter it becomes (new vocab, h, the target's context)
    checked against the target before its lm_head rows move to the new vocab."""
    text = target.text
    checked = load_checked_drafter(old_dir, text, hf_indices, f"init drafter {old_dir} cannot start training on "
                                   f"target {target_path}", id_rule=id_rule, embed_tokens=target.embed_tokens,
                                   dtype=dtype)
    old, old_cfg = checked.model, checked.config
    cfg = old_cfg.replace(draft_vocab_size=int(new_ids.numel()),
                          aux_hf_indices=list(hf_indices or old_cfg.aux_hf_indices or default_h),
                          max_position_embeddings=int(text["max_position_embeddings"]))
    warnings = assert_compatible(cfg, text, hf_indices)
    target_rows = target.lm_head_rows if new_row_init == "target_lm_head" else None
    weight, stats = remap_lm_head(old.lm_head.weight.detach(), checked.target_ids, new_ids, new_row_init, target_rows)
    state = {k: v for k, v in old.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    state.update({"lm_head.weight": weight, "d2t": torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
                  "t2d": torch.zeros(cfg.vocab_size, dtype=torch.bool)})  # real mapping installed by the caller
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    model.load_state_dict(state, strict=True, assign=True)  # adopts the old drafter's tensors: no copy
    return model, {"init_drafter": str(old_dir), "compatibility_warnings": [str(m) for m in checked.warnings],
                   "lm_head_remap": stats, "aux_hf_indices": list(cfg.aux_hf_indices), "aux_id_rule": id_rule,
                   "max_position_embeddings": {"old": old_cfg.max_position_embeddings, "new": cfg.max_position_embeddings},
                   "load": old.load_report}, warnings
