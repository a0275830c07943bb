"""What every TTT unroll shares: its input check, the teacher it reads, and its result.

Two implementations compute the same function, `eagle3.ttt.unroll.ttt_unroll` (the reference: the drafter
stepped as at inference) and `eagle3.ttt.fast_unroll.ttt_unroll_fast`; `eagle3.ttt.unroll.TTTObjective` picks one.
Both import this module and neither imports the other's, so the dispatcher can import both without a cycle.

Imports only torch (core code).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eagle3.ttt.loss import loss_positions, teacher_logits


@dataclass
class UnrollOutput:
    loss: torch.Tensor          # fp32 scalar, differentiable: sum_k w_k * loss_sum[k] / denominators[k]
    loss_sum: torch.Tensor      # fp32 [K] summed soft CE per step (detached)
    correct: torch.Tensor       # fp32 [K] positions where the draft argmax (via d2t) == target argmax
    count: torch.Tensor         # fp32 [K] valid positions per step

    @property
    def step_loss(self) -> torch.Tensor:
        """Mean soft CE per step over this batch's valid positions, fp32 [K] (0 where none)."""
        return self.loss_sum / self.count.clamp(min=1)

    @property
    def step_acc(self) -> torch.Tensor:
        """Top-1 accuracy per step over this batch's valid positions, fp32 [K]."""
        return self.correct / self.count.clamp(min=1)


def check_unroll_inputs(name: str, aux, input_ids, last, target_argmax, loss_mask, ttt_length: int) -> None:
    """ValueError naming what disagrees: every per-position tensor is [B, T, ...] as input_ids."""
    B, T = input_ids.shape
    if aux.shape[:2] != (B, T) or last.shape[:2] != (B, T) or target_argmax.shape != (B, T) \
            or loss_mask.shape != (B, T):
        raise ValueError(f"{name}: batch shapes disagree: input_ids {tuple(input_ids.shape)}, aux "
                         f"{tuple(aux.shape)}, last {tuple(last.shape)}, target_argmax {tuple(target_argmax.shape)}, "
                         f"loss_mask {tuple(loss_mask.shape)}")
    if ttt_length < 1:
        raise ValueError(f"ttt_length={ttt_length}: must be >= 1")


@torch.no_grad()
def teacher_probs(last: torch.Tensor, lm_head_rows: torch.Tensor, loss_mask: torch.Tensor,
                  target_argmax: torch.Tensor, t2d: torch.Tensor,
                  flat: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher distribution where any TTT step needs it: positions s = t+k+1 with
    loss_mask[s+1] & t2d[argmax_s] (the step "-1" mask), computed once, M rows instead of B*T.
    flat: those positions (b * T + s, Long [M], ascending) when the caller already has them.
    Returns (fp32 [M, draft_V] probabilities, Long [B*T] row of each flat position, -1 where none)."""
    B, T = loss_mask.shape
    if flat is None:
        flat = loss_positions(loss_mask, target_argmax, t2d, step=-1).reshape(-1).nonzero().squeeze(1)  # [M]
    probs = torch.softmax(teacher_logits(last.reshape(B * T, -1)[flat], lm_head_rows), dim=-1)
    row_of = torch.full((B * T,), -1, dtype=torch.long, device=loss_mask.device)
    row_of[flat] = torch.arange(flat.numel(), device=loss_mask.device)
    return probs, row_of


def embedding_strip(strip: torch.Tensor, input_embeds: Optional[torch.Tensor]) -> torch.Tensor:
    """The drafter's input embeddings of x_{t+k+1} (k = 0..K-1) at t as one strip [B, T+K-1, H]: `strip` =
    embed_tokens of the ids' strip (input_ids[:, 1:] then K zeros); `input_embeds` [B, T, H] when the inputs
    are not embed_tokens(input_ids) (image rows under image_embeddings=fused, eagle3/drafter/image_embeddings.py):
    shifted by one like the ids, embed(0) past the end as before."""
    if input_embeds is None:
        return strip
    B, T = input_embeds.shape[:2]
    if input_embeds.shape[0] != strip.shape[0] or input_embeds.shape[-1] != strip.shape[-1] or strip.shape[1] < T - 1:
        raise ValueError(f"input_embeds {tuple(input_embeds.shape)} do not fit the embedding strip "
                         f"{tuple(strip.shape)}")
    return torch.cat([input_embeds[:, 1:].to(strip.dtype), strip[:, T - 1:]], dim=1)

