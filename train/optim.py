"""The AdamW the trainer and the benchmark build: torch.optim.AdamW, or on CUDA `TritonAdamW`.

`TritonAdamW` is torch.optim.AdamW (same hyper-parameters, same state and state_dict: checkpoints move
freely between the two) whose step on contiguous CUDA fp32 parameters runs one Triton kernel per
parameter (eagle3/ttt/triton_kernels.adamw_update): it reads the parameter, its gradient and both moments
once and writes the parameter and the moments. The clip factor `train.distributed.clip_gradients` leaves
as `grad_scale` divides each gradient as it is read. torch's fused AdamW takes the same factor but
writes the divided gradients back, 4 more bytes per parameter (at Kimi-K2 size ~4.8 GB per step); its
multi-tensor kernel also runs below the card's bandwidth here (BENCHMARKS.md: `bench_train_step.py --optimizer`).

Anything the kernel does not take (CPU, non-fp32 or sparse parameters, amsgrad, capturable,
differentiable, a tensor lr, `found_inf`) goes to torch's own step, with a pending `grad_scale`
applied to the gradients first, so the result is the same on every device.

Imports only torch (and Triton through eagle3/ttt/triton_kernels.py when it steps on CUDA).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from eagle3.ttt import triton_kernels


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW stepped by a Triton kernel on CUDA fp32 parameters (module docstring)."""

    applies_grad_scale = True  # train.distributed.clip_folds_into_step: the clip may ride on this step

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         foreach=None, fused=None)

    def _kernel_takes(self) -> bool:
        if getattr(self, "found_inf", None) is not None:
            return False
        for group in self.param_groups:
            if group["amsgrad"] or group["capturable"] or group["differentiable"] \
                    or isinstance(group["lr"], torch.Tensor):
                return False
            tensors = [t for p in group["params"] if p.grad is not None for t in (p, p.grad)]
            if not triton_kernels.adamw_usable(tensors):  # strided layout only: sparse gradients go to torch
                return False
        return True

    def _state_of(self, p: torch.Tensor) -> dict:
        """p's state, made as torch's AdamW makes it (a CPU fp32 step count, zero moments)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale: Optional[torch.Tensor] = self.__dict__.pop("grad_scale", None)  # this step's only
        if not self._kernel_takes():
            if scale is not None:
                grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
                if grads:
                    torch._foreach_div_(grads, scale.to(grads[0].device))
            super().step()
            return loss
        if scale is not None:
            scale = scale.reshape(()).to(torch.float32)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_of(p)
                state["step"] += 1
                triton_kernels.adamw_update(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], step=float(state["step"]),
                    grad_scale=scale if scale is None or scale.device == p.device else scale.to(p.device),
                    maximize=group["maximize"])
        return loss


def adamw(params: Iterable[torch.Tensor], *, lr: float, betas, eps: float, weight_decay: float,
          fused: Optional[bool], device: torch.device) -> torch.optim.AdamW:
    """The training AdamW. fused None: fused on CUDA. Fused on CUDA with Triton: `TritonAdamW`;
    fused elsewhere: torch's fused AdamW; unfused: torch's (foreach on CUDA)."""
    if fused is None:
        fused = device.type == "cuda"
    common = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if fused and device.type == "cuda" and triton_kernels.triton_available():
        return TritonAdamW(params, **common)
    extra = {"fused": True} if fused else {"foreach": device.type == "cuda"}
    return torch.optim.AdamW(params, **common, **extra)
