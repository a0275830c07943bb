"""Hand-written Triton kernels for the fast TTT step on CUDA, where Inductor's code for the same math
reads its operands more than once.

* The diagonal merge of the TTT attention (eagle3/ttt/fast_kernels.diagonal_merge_forward / _backward):
  each (position, head) row merges the causal block's output with that position's own keys/values of
  the later TTT steps, keys/values [S,B,T,h,d] with S <= 6. Compiled by Inductor the math splits into
  several kernels (reductions over d, then over S) that read the S keys/values two or three times;
  here one program takes a block of rows through all S steps in registers: keys/values are read once
  and dkeys/dvalues written once. Rounding differs only in order: the forward folds the steps into the
  log-sum-exp one at a time (online softmax); the backward adds each step's dq term in turn.
* One chunk of the fused soft cross-entropy (eagle3/ttt/fast_kernels.soft_ce_chunk): a row's logits and
  teacher probabilities are read twice (an online log-sum-exp with the argmax and the two sums, then
  the gradient), where Inductor's kernel reads them about three times. The loss of a row is
  sum(p) * lse - sum(p * logits), the same sum as sum(p * (lse - logits)) in another order.
* One AdamW update of an fp32 parameter (train/optim.py): torch's fused AdamW math (decoupled weight
  decay, bias-corrected moments) in one pass that reads the parameter, its gradient and both moments
  once and writes the parameter and the moments; a clip factor divides the gradient as it is read
  and the gradient is left as it was (torch's fused kernel writes the divided gradient back).

`usable(x)` says whether these kernels take a call (CUDA, Triton importable); eagle3/ttt/ttt_flash.py and
eagle3/ttt/fused_ce.py use them there when the fast path is compiled, and the compiled functions
elsewhere. tests/test_triton_kernels.py (CUDA only) checks them against the eager functions.

Imports torch; Triton (eagle3/ttt/triton_jit.py, the kernels) only when a kernel is first used.
"""
from __future__ import annotations

import functools

import torch

BLOCK_ROWS = 32  # rows (position, head) per program: 32 x d=128 fp32 values per operand in registers


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


_fast_path = {"on": True}  # benchmarks/bench_train_step.py --triton-kernels off turns the merge / soft-CE kernels off


def set_enabled(on: bool) -> None:
    """Let the merge and soft-CE kernels take calls (the default) or refuse every call, so the compiled
    functions run instead (an A/B switch for benchmarks; the AdamW kernel is chosen by train/optim.py)."""
    _fast_path["on"] = bool(on)


def usable(x: torch.Tensor, head_dim: int = 0) -> bool:
    """Whether the merge / soft-CE kernels take a call on x: enabled (`set_enabled`), CUDA, Triton
    present, x in bf16 / fp16 / fp32 (the kernels compute in fp32, where the eager functions keep fp64
    as fp64) and, for the merge, a head dim that is a power of two >= 16."""
    if not _fast_path["on"] or (head_dim and (head_dim < 16 or head_dim & (head_dim - 1))):
        return False
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_available()


@functools.lru_cache(maxsize=None)
def _kernels():
    from eagle3.ttt import triton_jit

    return (triton_jit.merge_forward_kernel, triton_jit.merge_backward_kernel, triton_jit.soft_ce_kernel,
            triton_jit.adamw_kernel)


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    if keys.shape[1:] != q.shape or values.shape != keys.shape:
        raise ValueError(f"diagonal merge: keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit "
                         f"queries {tuple(q.shape)} (want [S, *q.shape])")


def _grid(rows: int) -> tuple[int]:
    return (max(1, -(-rows // BLOCK_ROWS)),)


def merge_forward(q: torch.Tensor, o0: torch.Tensor, lse0: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`fast_kernels.diagonal_merge_forward` (same arguments and results: out in o0's dtype, lse fp32)."""
    _check(q, keys, values)
    q, o0, lse0, keys, values = (_dense(x) for x in (q, o0, lse0, keys, values))
    out = torch.empty_like(o0)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    rows, d = q.numel() // q.shape[-1], q.shape[-1]
    fwd = _kernels()[0]
    fwd[_grid(rows)](q, o0, lse0, keys, values, out, lse, rows, keys.shape[0], q.numel(), float(scale),
                     BLOCK_R=BLOCK_ROWS, D=d, num_warps=8)
    return out, lse


def merge_backward(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dq_block0: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fast_kernels.diagonal_merge_backward` (same arguments and results: dq, dkeys, dvalues)."""
    _check(q, keys, values)
    dout, q, out, lse, dq_block0, keys, values = (_dense(x) for x in (dout, q, out, lse, dq_block0, keys, values))
    dq = torch.empty_like(q)
    dkeys, dvalues = torch.empty_like(keys), torch.empty_like(values)
    rows, d = q.numel() // q.shape[-1], q.shape[-1]
    bwd = _kernels()[1]
    bwd[_grid(rows)](dout, q, out, lse, dq_block0, keys, values, dq, dkeys, dvalues, rows, keys.shape[0], q.numel(),
                     float(scale), BLOCK_R=BLOCK_ROWS, D=d, num_warps=8)
    return dq, dkeys, dvalues


SOFT_CE_BLOCK = 4096  # vocabulary columns per loop iteration of the soft-CE kernel


def soft_ce_chunk(logits: torch.Tensor, teacher_probs: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor):
    """`fast_kernels.soft_ce_chunk` (same arguments and results: summed soft CE fp32, the gradient in
    logits' dtype, argmax Long)."""
    n, V = logits.shape
    if teacher_probs.dim() != 2 or teacher_probs.shape[1] != V or rows.shape != (n,):
        raise ValueError(f"soft_ce_chunk: teacher probs {tuple(teacher_probs.shape)} / rows {tuple(rows.shape)} "
                         f"do not fit logits {tuple(logits.shape)}")
    logits, teacher_probs, rows = _dense(logits), _dense(teacher_probs), _dense(rows)
    g = torch.empty_like(logits)
    loss_rows = torch.empty(n, dtype=torch.float32, device=logits.device)
    top = torch.empty(n, dtype=torch.long, device=logits.device)
    if n:
        _kernels()[2][(n,)](logits, teacher_probs, rows, scale.to(torch.float32).reshape(1), g, loss_rows, top, V,
                            BLOCK_V=SOFT_CE_BLOCK, num_warps=8)
    return loss_rows.sum(), g, top


ADAMW_BLOCK = 4096  # elements per program of the AdamW kernel


def adamw_usable(tensors: list[torch.Tensor]) -> bool:
    """Whether `adamw_update` takes these tensors: plain tensors or parameters (not a DTensor's or other
    subclass's wrapper, whose pointer is not its data), CUDA fp32, contiguous, Triton present."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda and t.dtype == torch.float32
               and t.is_contiguous() and t.layout == torch.strided for t in tensors) and triton_available()


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                 grad_scale: torch.Tensor | None = None, maximize: bool = False) -> None:
    """One AdamW step of `param` in place (torch.optim.AdamW's update, the moments in place too), step
    the count after this update (1 on the first), grad_scale an optional 0-dim fp32 divisor of the
    gradient on param's device (read on the device: no host sync). The gradient is not written."""
    if not (param.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape):
        raise ValueError(f"adamw_update: param {tuple(param.shape)}, grad {tuple(grad.shape)}, moments "
                         f"{tuple(exp_avg.shape)} / {tuple(exp_avg_sq.shape)} differ")
    if not adamw_usable([param, grad, exp_avg, exp_avg_sq]):
        raise ValueError("adamw_update takes contiguous CUDA fp32 tensors (with Triton installed)")
    n = param.numel()
    if not n:
        return
    scale = grad_scale if grad_scale is not None else param  # a pointer the kernel never reads
    if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32
                                   or grad_scale.device != param.device):
        raise ValueError(f"adamw_update: grad_scale must be one fp32 value on {param.device}, got "
                         f"{tuple(grad_scale.shape)} {grad_scale.dtype} on {grad_scale.device}")
    bias1, bias2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    _kernels()[3][(-(-n // ADAMW_BLOCK),)](param, grad, exp_avg, exp_avg_sq, scale, n, beta1, beta2, eps,
                                           1.0 - lr * weight_decay, lr / bias1, bias2 ** 0.5,
                                           HAS_SCALE=grad_scale is not None, MAXIMIZE=maximize,
                                           BLOCK=ADAMW_BLOCK, num_warps=8)
