"""The training-time-test (TTT) unroll of one batch through the drafter.

Indexing (ARCHITECTURE.md, "TTT indexing"): at step k and position t the drafter reads the hidden
h_t (fc(aux_t) at k=0, its own pre-norm output of step k-1 at t otherwise) and the embedding of
x_{t+k+1}, at sequence position t+k (`eagle3.drafter.attention.ttt_position_ids`); it predicts x_{t+k+2} against
the teacher softmax(lm_head_target(last_{t+k+1})[draft vocab]) on positions
`loss_mask[t+k+2] & t2d[argmax_{t+k+1}]`. The attention pattern (step-0 keys causal + own-position
keys of steps 1..k) lives in `eagle3.drafter.attention.TTTCache`. Gradients flow through the hidden states
from step to step, as in EAGLE-3 / SpecForge.

Loss normalisation (see eagle3/ttt/loss.py's docstring): L = sum_k 0.8^k * S_k / N_k with S_k the
summed soft CE of step k and N_k its number of valid positions. By default N_k counts this batch;
a training loop that accumulates gradients over several micro-batches (and ranks) passes the
counts of the whole optimizer step as `step_denominators`, so the gradient is the same however
the tokens are split into micro-batches or ranks.

Imports only torch (core code).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from eagle3.config.choices import UNROLLS
from eagle3.ttt.fast_unroll import ttt_unroll_fast
from eagle3.ttt.loss import loss_positions, shift_left, soft_cross_entropy_rows, step_weights
from eagle3.drafter.attention import TTTCache, ttt_position_ids
from eagle3.drafter.image_embeddings import token_embeddings
from eagle3.ttt.unroll_common import UnrollOutput, check_unroll_inputs, embedding_strip, teacher_probs


def step_position_counts(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor,
                         ttt_length: int) -> torch.Tensor:
    """Valid loss positions of each TTT step, fp32 [K] (cheap: no model). Used by the loop to
    normalise over a whole optimizer step before running the micro-batches."""
    return torch.stack([loss_positions(loss_mask, target_argmax, t2d, k).sum() for k in range(ttt_length)]
                       ).to(torch.float32)


def ttt_unroll(model: nn.Module, aux: torch.Tensor, input_ids: torch.Tensor, last: torch.Tensor,
               target_argmax: torch.Tensor, loss_mask: torch.Tensor, lm_head_rows: torch.Tensor,
               ttt_length: int = 7, *, step_decay: float = 0.8,
               attention_mask: Optional[torch.Tensor] = None,
               position_ids: Optional[torch.Tensor] = None,
               step_denominators: Optional[torch.Tensor] = None,
               input_embeds: Optional[torch.Tensor] = None) -> UnrollOutput:
    """Unroll the drafter `ttt_length` steps over a batch and return the weighted soft-CE loss.

    model: an Eagle3Drafter (project_aux / step / logits, buffers d2t [draft_V] and t2d [V]).
    aux [B,T,3Ht] (store dtype), input_ids Long [B,T], last [B,T,H] target post-norm states,
    target_argmax Long [B,T], loss_mask Bool [B,T] (False on padding), lm_head_rows [draft_V, H]
    (target lm_head rows of the draft vocab). Batches are right-padded: causality alone keeps real
    queries off padded keys, so `attention_mask` [B,T] is only needed for left padding.
    position_ids Long [B,T]: step-0 positions (default arange(T)).
    step_denominators fp32 [K]: N_k to divide each step's sum by (default: this batch's counts).
    input_embeds [B,T,H]: the input embeddings when not embed_tokens(input_ids) (image rows under
    image_embeddings=fused), shifted by one like the ids (eagle3/ttt/unroll_common.embedding_strip).
    """
    B, T = input_ids.shape
    check_unroll_inputs("ttt_unroll", aux, input_ids, last, target_argmax, loss_mask, ttt_length)
    device = input_ids.device
    d2t, t2d = model.d2t, model.t2d
    if position_ids is None:
        position_ids = torch.arange(T, device=device).expand(B, T)
    weights = step_weights(ttt_length, step_decay).to(device)

    teacher_p, row_of = teacher_probs(last, lm_head_rows, loss_mask, target_argmax, t2d)
    argmax_flat = target_argmax.reshape(-1).long()

    hidden = model.project_aux(aux)  # [B, T, H]; casts the store dtype to fc's
    strip = None
    if input_embeds is not None:  # x_{t+k+1}'s input embedding at t is strip[:, k + t]
        ids_strip = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, ttt_length)], dim=1)
        strip = embedding_strip(model.embed_tokens(ids_strip), input_embeds)
    cache = TTTCache(attention_mask)
    sums, corrects, counts = [], [], []
    for k in range(ttt_length):
        step_ids = shift_left(input_ids, k + 1, 0)                            # x_{t+k+1} at t
        prenorm = model.step(step_ids, hidden, ttt_position_ids(position_ids, k), cache,
                             embeds=None if strip is None else strip[:, k:k + T])  # [B, T, H]
        with torch.no_grad():
            b_idx, t_idx = loss_positions(loss_mask, target_argmax, t2d, step=k).nonzero(as_tuple=True)  # [N]
            src = b_idx * T + t_idx + (k + 1)                                  # teacher position, flat
        # lm_head + softmax only on the N valid positions (prompt and padding rows never reach it).
        logits = model.logits(prenorm[b_idx, t_idx])                          # [N, draft_V]
        # with no valid position (N = 0) this is a zero that still reaches lm_head and the norm: DDP needs every
        # parameter's gradient from every rank (the fast path adds the same zero, eagle3/ttt/fused_ce.py)
        sums.append(soft_cross_entropy_rows(logits, teacher_p[row_of[src]]))
        with torch.no_grad():
            top = logits.detach().argmax(dim=-1)
            corrects.append(((top + d2t[top]) == argmax_flat[src]).sum().to(torch.float32))
        counts.append(torch.tensor(float(src.numel()), device=device))
        hidden = prenorm
    loss_sum = torch.stack(sums)                       # [K], differentiable
    count = torch.stack(counts)
    denom = count if step_denominators is None else step_denominators.to(device=device, dtype=torch.float32)
    loss = (weights * loss_sum / denom.clamp(min=1)).sum()
    return UnrollOutput(loss=loss, loss_sum=loss_sum.detach(), correct=torch.stack(corrects), count=count)


class TTTObjective(nn.Module):
    """The drafter plus its TTT objective as one module, so DDP / FSDP wrappers see a single
    `forward` (they only sync/unshard around `forward`, not around `project_aux`/`step`).
    Holds no state of its own; `lm_head_rows` is passed in (frozen teacher rows, not trained)."""

    IMPLS = UNROLLS  # the train config's `unroll` choices (eagle3/config/choices.py)

    def __init__(self, drafter: nn.Module, ttt_length: int = 7, step_decay: float = 0.8, impl: str = "auto",
                 compile: bool = False, attention_kernel: str = "auto", image_embeddings: str = "placeholder",
                 image_token_id: Optional[int] = None):
        """impl: "reference" = `ttt_unroll` (the drafter stepped as at inference); "fast" =
        `eagle3.ttt.fast_unroll.ttt_unroll_fast` (same function, flash attention + shared embedding
        projections + fused loss); "auto" = fast on CUDA, reference elsewhere.
        compile: the fast path's memory-bound pieces through torch.compile (eagle3/ttt/fast_kernels.py).
        attention_kernel: the fast path's causal attention kernel, auto | flash | cudnn (eagle3/ttt/ttt_flash.py).
        image_embeddings: what the drafter reads at image rows (input_ids == image_token_id), fused | placeholder
        (eagle3/drafter/image_embeddings.py); under fused a batch carries `image_embeds` [M, H], its image rows in
        row-major order (train/batches.py collate). A text-only batch trains the same under both."""
        super().__init__()
        if impl not in self.IMPLS:
            raise ValueError(f"TTTObjective impl={impl!r}: expected one of {self.IMPLS}")
        self.drafter = drafter
        self.ttt_length = ttt_length
        self.step_decay = step_decay
        self.impl = impl
        self.compile = compile
        self.attention_kernel = attention_kernel
        self.image_embeddings = image_embeddings
        self.image_token_id = image_token_id

    def resolved_impl(self, batch: dict) -> str:
        if self.impl != "auto":
            return self.impl
        fast = batch["input_ids"].is_cuda and batch.get("attention_mask") is None
        return "fast" if fast else "reference"

    def forward(self, batch: dict, lm_head_rows: torch.Tensor,
                step_denominators: Optional[torch.Tensor] = None) -> UnrollOutput:
        unroll, extra = ttt_unroll, {}
        if self.resolved_impl(batch) == "fast":
            unroll = ttt_unroll_fast
            extra = {"compiled": self.compile, "attention_kernel": self.attention_kernel}
        input_embeds = token_embeddings(self.drafter.embed_tokens, batch["input_ids"], self.image_embeddings,
                                        self.image_token_id, batch.get("image_embeds"))
        return unroll(self.drafter, batch["aux"], batch["input_ids"], batch["last"], batch["target_argmax"],
                      batch["loss_mask"], lm_head_rows, self.ttt_length, step_decay=self.step_decay,
                      attention_mask=batch.get("attention_mask"), step_denominators=step_denominators,
                      input_embeds=input_embeds, **extra)
