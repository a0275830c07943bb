"""The EAGLE-3 training objective, as pure tensor functions (no I/O, no model).

Indexing (docs/design.md "TTT", spelled out at the end of ARCHITECTURE.md): at TTT step k the drafter's
output at position t predicts token x_{t+k+2}. Its teacher is the target's distribution of that
token, i.e. the target's logits at position t+k+1 restricted to the draft vocab; the position
counts when `loss_mask[t+k+2]` (an assistant token is predicted) and `t2d[argmax_{t+k+1}]` (the
target's top token is in the draft vocab); positions whose indices run past the end are dropped.
Step k is weighted 0.8^k.

Normalisation (what `ttt_unroll` does with these pieces): per TTT step, the soft cross-entropy
is *averaged over that step's valid positions* (sum / count, counts taken over the whole
optimizer step when the caller supplies them), then the steps are combined as a weighted *sum*
`L = sum_k 0.8^k * mean_k`. SpecForge instead divides each step's masked sum by the number of
*all* positions (B*T, valid or not), so its loss scale moves with the padding and with the share
of masked tokens (and later steps, having fewer valid positions, weigh less than 0.8^k says).
Dividing by the valid count makes the loss a per-token cross-entropy whose value is comparable
across batches, datasets and TTT steps; only the scale of the gradient differs from SpecForge.
"""
from __future__ import annotations

import torch


def teacher_logits(last: torch.Tensor, lm_head_rows: torch.Tensor) -> torch.Tensor:
    """The target's logits over the draft vocab only, in fp32.

    last [..., H]: the target's final post-norm hidden state; lm_head_rows [draft_V, H]: the
    target lm_head rows of the draft-vocab tokens (ordered as the draft vocab, i.e.
    `rows[i]` is the row of target id `i + d2t[i]`). Returns fp32 [..., draft_V]. The full
    target-vocab logits (163,840 wide for Kimi) are never formed: the target argmax that the
    loss mask needs comes from the store.
    """
    if last.shape[-1] != lm_head_rows.shape[-1]:
        raise ValueError(f"teacher_logits: hidden size of `last` ({last.shape[-1]}) != lm_head rows "
                         f"width ({lm_head_rows.shape[-1]})")
    # fp32 even inside a bf16 autocast region (the teacher's distribution is the reference).
    # Both inputs bf16 (or both fp16) on a GPU: products of 16-bit floats are exact in fp32, so a
    # 16-bit GEMM that accumulates and returns fp32 computes the fp32 matmul at the 16-bit
    # tensor-core rate (an H200 at Kimi's 8192 x 7168 x 32000: 4.7 ms, TF32 8.9 ms). Mixed 16-bit inputs:
    # TF32, equally exact (their mantissas fit TF32's 10 bits). Else plain fp32.
    with torch.autocast(device_type=last.device.type, enabled=False):
        if last.is_cuda and last.dtype == lm_head_rows.dtype and last.dtype in (torch.bfloat16, torch.float16):
            flat = torch.mm(last.reshape(-1, last.shape[-1]), lm_head_rows.t(), out_dtype=torch.float32)
            return flat.reshape(*last.shape[:-1], lm_head_rows.shape[0])
        lossless_tf32 = last.is_cuda and {last.dtype, lm_head_rows.dtype} <= {torch.bfloat16, torch.float16}
        with _tf32_matmul(lossless_tf32):
            return torch.matmul(last.float(), lm_head_rows.float().t())


class _tf32_matmul:
    """Context: allow TF32 in CUDA matmuls (when `enabled`), restoring the previous setting."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        if self.enabled:
            torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def soft_cross_entropy(draft_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of the drafter against softmax(teacher) on masked positions, in fp32.

    draft_logits, teacher_logits [..., draft_V]; mask Bool [...].
    Returns (sum over valid positions of -sum_v p_v log q_v, number of valid positions); both
    fp32 scalars, so callers can aggregate over batches and ranks before dividing.
    """
    if draft_logits.shape != teacher_logits.shape:
        raise ValueError(f"soft_cross_entropy: draft logits {tuple(draft_logits.shape)} vs teacher "
                         f"logits {tuple(teacher_logits.shape)}")
    if mask.shape != draft_logits.shape[:-1]:
        raise ValueError(f"soft_cross_entropy: mask {tuple(mask.shape)} vs logits {tuple(draft_logits.shape)}")
    mask = mask.bool()
    # Select the valid rows first: fewer rows through log_softmax, and a non-finite logit at a
    # padding position cannot leak into the sum (0 * inf = nan).
    p = torch.softmax(teacher_logits[mask].float(), dim=-1)        # [N, V]
    return soft_cross_entropy_rows(draft_logits[mask], p), mask.sum().to(torch.float32)


def soft_cross_entropy_rows(draft_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """sum_n -sum_v p[n, v] log softmax(draft_logits[n])_v over rows already selected, fp32.
    draft_logits [N, draft_V] (any float dtype), teacher_probs fp32 [N, draft_V]."""
    if draft_logits.shape != teacher_probs.shape:
        raise ValueError(f"soft_cross_entropy_rows: draft logits {tuple(draft_logits.shape)} vs teacher probs "
                         f"{tuple(teacher_probs.shape)}")
    q_log = torch.log_softmax(draft_logits.float(), dim=-1)
    return -(teacher_probs * q_log).sum()


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """out[..., t] = x[..., t + n] along dim 1 (sequence), `fill` past the end. x [B, T, ...]."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def loss_positions(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor,
                   step: int = 0) -> torch.Tensor:
    """Valid loss positions of TTT step `step`, indexed by the drafter position t.

    loss_mask Bool/uint8 [B, T] (assistant tokens; zero on padding), target_argmax Long [B, T]
    (target top token at each position), t2d Bool [V]. Returns Bool [B, T]:
    `mask[b, t] = loss_mask[b, t+k+2] & t2d[target_argmax[b, t+k+1]]`, False where t+k+2 >= T.
    step=-1 gives the teacher positions s themselves (loss_mask[s+1] & t2d[argmax_s]): step k's mask
    is that one shifted left by k+1.
    """
    if step < -1:
        raise ValueError(f"loss_positions: step={step} (expected >= -1)")
    if loss_mask.shape != target_argmax.shape:
        raise ValueError(f"loss_positions: loss_mask {tuple(loss_mask.shape)} vs target_argmax "
                         f"{tuple(target_argmax.shape)}")
    if target_argmax.numel() and int(target_argmax.max()) >= t2d.numel():
        raise ValueError(f"loss_positions: target_argmax holds id {int(target_argmax.max())} but t2d covers "
                         f"{t2d.numel()} ids (store and vocab come from different targets?)")
    predicted_is_assistant = shift_left(loss_mask.bool(), step + 2, False)
    teacher_top_in_vocab = shift_left(t2d.bool()[target_argmax.long()], step + 1, False)
    return predicted_is_assistant & teacher_top_in_vocab


def all_loss_positions(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor,
                       steps: int) -> torch.Tensor:
    """`loss_positions` of step -1 (the teacher positions) and of steps 0..steps-1 at once, Bool
    [steps + 1, B, T] (index j is step j - 1), with one id check (one host sync) for all of them:
    step k's mask is step -1's shifted left by k + 1."""
    teacher = loss_positions(loss_mask, target_argmax, t2d, step=-1)
    return torch.stack([teacher] + [shift_left(teacher, k + 1, False) for k in range(steps)])


def step_weights(n: int, decay: float = 0.8) -> torch.Tensor:
    """Loss weights of TTT steps 0..n-1: decay^k (fp32 [n])."""
    return torch.tensor([decay ** k for k in range(n)], dtype=torch.float32)


def draft_accuracy(draft_logits: torch.Tensor, d2t: torch.Tensor, target_argmax: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 agreement with the target on masked positions.

    draft_logits [..., draft_V]; d2t Long [draft_V] offsets (target id = i + d2t[i]);
    target_argmax Long [...] already aligned with the draft positions (argmax_{t+k+1} at t);
    mask Bool [...]. Returns (number correct, number of valid positions), fp32 scalars.
    """
    draft_top = draft_logits.argmax(dim=-1)
    as_target = draft_top + d2t.to(draft_top.device)[draft_top]
    mask = mask.bool()
    correct = ((as_target == target_argmax.long()) & mask).sum()
    return correct.to(torch.float32), mask.sum().to(torch.float32)

