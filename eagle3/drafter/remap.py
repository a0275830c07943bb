"""Moving a drafter's lm_head to a new draft vocabulary (pure: tensors in, tensors out).

A drafter's lm_head row r scores draft id r, i.e. target token old_ids[r]. When the draft vocab
changes (K2 -> K2.5 token frequencies), the row of every token present in both vocabularies must
move to that token's new draft id, so its logit is unchanged for any hidden state. Overwriting
`d2t` alone (the known bug of other tools) leaves row r in place and silently re-labels its logit
as a different token.

Rows of tokens new to the draft vocab follow `new_row_init`:
- "target_lm_head" (default): the target's lm_head row of that token, all new rows multiplied by
  one factor so that their mean L2 norm equals the mean norm of the old drafter rows. Why: the
  drafter is trained to approximate the target's post-norm state, so the target's row gives the
  right *direction* (the token's place among its neighbours, and it is exactly the teacher's
  head); but the drafter's final norm weight sets a different logit scale, so raw target rows
  would be over- or under-confident next to the kept rows. One common factor keeps the target's
  relative row norms (frequent tokens have larger rows) while matching the drafter's scale.
- "mean": the mean of the old rows (every new token starts with the drafter's average logit).
- "zeros": zero rows (logit 0 until trained).
"""
from __future__ import annotations

from typing import Optional

import torch

from eagle3.config.choices import NEW_ROW_RULES  # init.new_row_init's choices


def _positions(ids: torch.Tensor, size: int) -> torch.Tensor:
    """Dense inverse index: pos[token] = index of token in `ids`, -1 where absent. int64 [size]."""
    pos = torch.full((size,), -1, dtype=torch.long)
    pos[ids] = torch.arange(ids.numel(), dtype=torch.long)
    return pos


def shared_token_positions(old_ids: torch.Tensor, new_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(new_pos, old_pos): indices into new_ids / old_ids of the tokens both contain, in new order."""
    old_ids, new_ids = old_ids.long().cpu(), new_ids.long().cpu()
    size = int(max(old_ids.max(), new_ids.max())) + 1 if old_ids.numel() and new_ids.numel() else 1
    src = _positions(old_ids, size)[new_ids]  # [N_new]: old row of each new token, -1 if new
    new_pos = (src >= 0).nonzero().squeeze(1)
    return new_pos, src[new_pos]


def remap_lm_head(old_weight: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor,
                  new_row_init: str = "target_lm_head",
                  target_lm_head_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """old_weight [N_old, H] (row r = target token old_ids[r]); new_ids [N_new] target ids of the new
    draft vocab; target_lm_head_rows [N_new, H] the target's lm_head rows *for new_ids* (needed for
    "target_lm_head"). Returns (new_weight [N_new, H] in old_weight's dtype, stats).
    Shared tokens' rows are copied bit for bit."""
    if new_row_init not in NEW_ROW_RULES:
        raise ValueError(f"new_row_init={new_row_init!r}: expected one of {NEW_ROW_RULES}")
    if old_weight.dim() != 2 or old_ids.shape != (old_weight.shape[0],):
        raise ValueError(f"old lm_head {tuple(old_weight.shape)} and old_ids {tuple(old_ids.shape)} disagree "
                         "(one target id per row expected)")
    for name, ids in (("old_ids", old_ids), ("new_ids", new_ids)):
        if ids.dim() != 1 or (ids.numel() and int(ids.min()) < 0):
            raise ValueError(f"{name} must be a 1-D tensor of non-negative target ids")
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"{name} holds a target id twice")
    N_new, H = new_ids.numel(), old_weight.shape[1]
    new_pos, old_pos = shared_token_positions(old_ids, new_ids)
    is_new = torch.ones(N_new, dtype=torch.bool)
    is_new[new_pos] = False
    fresh = is_new.nonzero().squeeze(1)  # [N_fresh] rows to initialise

    old_norms = old_weight.float().norm(dim=1)
    stats = {"rule": new_row_init, "n_old": int(old_ids.numel()), "n_new": N_new, "n_shared": int(new_pos.numel()),
             "n_fresh": int(fresh.numel()), "n_dropped": int(old_ids.numel() - new_pos.numel()),
             "old_mean_row_norm": float(old_norms.mean()) if old_norms.numel() else 0.0}
    out = torch.zeros(N_new, H, dtype=old_weight.dtype, device=old_weight.device)
    out[new_pos.to(out.device)] = old_weight[old_pos.to(out.device)]  # bit-identical copies
    if fresh.numel():
        if new_row_init == "target_lm_head":
            if target_lm_head_rows is None or tuple(target_lm_head_rows.shape) != (N_new, H):
                got = None if target_lm_head_rows is None else tuple(target_lm_head_rows.shape)
                raise ValueError(f"new_row_init=target_lm_head needs target_lm_head_rows [{N_new}, {H}] "
                                 f"(the target's rows for new_ids), got {got}")
            rows = target_lm_head_rows[fresh.to(target_lm_head_rows.device)].float()
            mean_norm = rows.norm(dim=1).mean()
            scale = stats["old_mean_row_norm"] / float(mean_norm) if float(mean_norm) > 0 else 0.0
            stats["target_row_scale"] = scale
            init = rows * scale
        elif new_row_init == "mean":
            init = old_weight.float().mean(dim=0, keepdim=True).expand(fresh.numel(), H)
        else:
            init = torch.zeros(fresh.numel(), H)
        out[fresh.to(out.device)] = init.to(device=out.device, dtype=out.dtype)
    return out, stats
