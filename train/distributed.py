"""The accelerate side of training: the Accelerator (CPU / one GPU / DDP / FSDP), the optimizer
and schedule, and full (un-sharded) state dicts for checkpoints under any of those wrappers.

Everything that knows about accelerate or torch.distributed lives here; the drafter and the
objective (eagle3/) know nothing of it.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from train.optim import adamw
from train.schedule import resolve_warmup, warmup_cosine

log = logging.getLogger(__name__)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def prefer_expandable_segments() -> None:
    """CUDA memory grows in expandable segments (unless the environment already configures the
    allocator): long sequences' step then reserves little more than it allocates (measured on an H200 at
    T = 32768: 83.5 GiB reserved for 81.5 allocated, 88.8 GiB with the default segments; BENCHMARKS.md).
    Read when the CUDA allocator starts: call before the first CUDA allocation."""
    os.environ.setdefault(ALLOC_CONF, "expandable_segments:True")


def make_accelerator(config, precision: str):
    """The Accelerator of a run; `precision`: its resolved mixed_precision (bf16 | no, eagle3/config/resolve.py)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    kwargs = {}
    if config.fsdp:
        from accelerate import FullyShardedDataParallelPlugin

        # One FSDP unit over the whole objective (a one-layer drafter); use_orig_params because the
        # frozen target embedding sits next to trainable weights; full state dicts for checkpoints.
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=1, sharding_strategy="FULL_SHARD", use_orig_params=True,
            state_dict_type="FULL_STATE_DICT", sync_module_states=False, cpu_ram_efficient_loading=False)
    # Buffers (d2t / t2d) never change during training: no per-step broadcast.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False, find_unused_parameters=False)
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=config.grad_accum,
                       cpu=config.cpu, kwargs_handlers=[ddp], **kwargs)


def uses_fsdp(accelerator) -> bool:
    """Whether accelerate actually wrapped with FSDP (it does so on GPUs only; CPU runs get DDP)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def make_optimizer(params, optim_conf, device: torch.device) -> torch.optim.AdamW:
    return adamw(params, lr=optim_conf.lr, betas=optim_conf.betas, eps=optim_conf.eps,
                 weight_decay=optim_conf.weight_decay, fused=optim_conf.fused, device=device)


def _inner(optimizer):
    """The torch optimizer under accelerate's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_name(optimizer) -> str:
    """The class of the optimizer doing the step (under accelerate's wrapper), and whether it is fused:
    what a learning-quality A/B compares (pipeline/learning_ab.py reads it from the train manifest)."""
    inner = _inner(optimizer)
    fused = any(g.get("fused") for g in getattr(inner, "param_groups", []))
    return type(inner).__name__ + (" (fused)" if fused else "")


def clip_folds_into_step(optimizer, fsdp: bool) -> bool:
    """Whether clipping can ride on the optimizer step: a fused Adam/AdamW or train/optim.TritonAdamW
    (their kernels divide every gradient by `grad_scale` as they read it) over whole, un-sharded
    gradients (not FSDP, whose norm needs the other ranks' shards; under DDP every rank holds the
    all-reduced gradients)."""
    inner = _inner(optimizer)
    return (not fsdp and isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
            and bool(inner.defaults.get("fused") or getattr(inner, "applies_grad_scale", False)))


def clip_gradients(accelerator, optimizer, params, max_norm: float, fsdp: bool) -> torch.Tensor:
    """Clip the gradients to global L2 norm `max_norm` (torch's clip_grad_norm_: scale by
    min(1, max_norm / (norm + 1e-6))) and return the norm before clipping (0-dim, on the device).
    Where `clip_folds_into_step`, the scale is handed to the fused optimizer as its `grad_scale`
    (the divisor it applies to each gradient as it reads it) instead of a separate pass that
    rewrites every gradient (at Kimi-K2 size ~4.8 GB of fp32 read and written per step); the
    gradients themselves are then left unclipped. Call `optimizer_step` next. accelerator None:
    torch's own clip where it does not fold (no accelerate: benchmarks)."""
    if not clip_folds_into_step(optimizer, fsdp):
        if accelerator is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return accelerator.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    _inner(optimizer).grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    return norm


def optimizer_step(optimizer) -> None:
    """optimizer.step(), consuming a clip scale `clip_gradients` left for it (it applies to this step only)."""
    optimizer.step()
    inner = _inner(optimizer)
    if hasattr(inner, "grad_scale"):
        del inner.grad_scale


def make_scheduler(optimizer, optim_conf, total_steps: int) -> tuple[LambdaLR, int]:
    """Warmup + cosine over `total_steps`; stepped once per optimizer step (never through
    accelerate, whose scheduler wrapper steps num_processes times per call)."""
    warmup = resolve_warmup(total_steps, optim_conf.warmup_steps, optim_conf.warmup_ratio)
    min_ratio = optim_conf.min_lr_ratio
    return LambdaLR(optimizer, lambda s: warmup_cosine(s, total_steps, warmup, min_ratio)), warmup


def full_model_state(accelerator, model) -> Optional[dict]:
    """Full state dict of the (possibly wrapped) objective on rank 0 (None elsewhere); collective
    under FSDP, so every rank must call it."""
    state = accelerator.get_state_dict(model)
    return state if accelerator.is_main_process else None


def full_optimizer_state(accelerator, model, optimizer, fsdp: bool) -> Optional[dict]:
    """Un-sharded optimizer state on rank 0 (collective under FSDP)."""
    if not fsdp:
        return optimizer.state_dict() if accelerator.is_main_process else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, _inner(optimizer),
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if accelerator.is_main_process else None


def load_optimizer_state(model, optimizer, state: dict, fsdp: bool) -> None:
    inner = _inner(optimizer)
    if not fsdp:
        inner.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, inner, state, options=StateDictOptions(full_state_dict=True,
                                                                           broadcast_from_rank0=False))


def peak_memory() -> dict:
    """Peak allocated / reserved GiB since the last call (CUDA only), then reset the peaks."""
    if not torch.cuda.is_available():
        return {}
    out = {"gpu_mem_peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
           "gpu_mem_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return out
