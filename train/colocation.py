"""Co-location: the streaming producer and the trainer on the same GPUs (issue 43, docs/online_training.md).

The producer holds a fixed share of each card: vLLM's `--gpu-memory-utilization`, or the hf producer's target
on the trainer's device. The user names that share as `data.producer_gpu_fraction`. Before the first step the
trainer adds its own estimated need to it, and refuses with both numbers when the card cannot hold them; the
first step would otherwise die in an out-of-memory error with the producer's memory already taken.

The trainer's need is an estimate, `trainer_need_bytes`:
- the trainable parameters at 16 bytes each (fp32 weights and gradients, and AdamW's two fp32 moments);
- plus a per-token term and a fixed rest (activations, the frozen embeddings, the logits' workspace, allocator
  slack), scaled by the drafter's hidden size from what was measured at Kimi-K2 drafter dimensions (hidden
  7168, 1.19B trainable) on one H200: 44.4 GiB reserved at 8,192 tokens per batch and 83.3 GiB at 32,768
  (BENCHMARKS.md, "Training step at Kimi-K2 drafter dimensions" and issue 22's goal 4).
The estimate lies between those two measurements at Kimi dimensions and is only as good as that scaling
elsewhere. On CPU (no card) there is nothing to check.
"""
from __future__ import annotations

from typing import Optional

from eagle3.config.conf import ConfigError

GIB = 1024 ** 3
KIMI_HIDDEN, KIMI_TRAINABLE = 7168, 1.19e9
STATE_BYTES_PER_PARAM = 16
# fitted to the two measured points above: need(T) = state + REST + PER_TOKEN * T at Kimi dimensions
KIMI_PER_TOKEN_BYTES = (83.3 - 44.4) * GIB / (32768 - 8192)
KIMI_REST_BYTES = 44.4 * GIB - KIMI_TRAINABLE * STATE_BYTES_PER_PARAM - KIMI_PER_TOKEN_BYTES * 8192
CARD_HEADROOM = 0.03  # of the card: the CUDA context, NCCL buffers, fragmentation


def trainer_need_bytes(trainable_params: int, hidden_size: int, tokens_per_batch: int) -> int:
    """The trainer's estimated peak reservation on one card (module docstring)."""
    scale = hidden_size / KIMI_HIDDEN
    return int(trainable_params * STATE_BYTES_PER_PARAM + scale * (KIMI_REST_BYTES + KIMI_PER_TOKEN_BYTES *
                                                                  tokens_per_batch))


def colocation_problem(card_bytes: int, producer_fraction: float, need_bytes: int) -> Optional[str]:
    """Why the producer's share and the trainer's need do not fit one card (None when they do)."""
    producer = producer_fraction * card_bytes
    room = (1 - CARD_HEADROOM) * card_bytes
    if producer + need_bytes <= room:
        return None
    fits = (room - need_bytes) / card_bytes
    hint = (f"lower the producer's share to at most {fits:.2f} (vLLM: --gpu-memory-utilization {fits:.2f}, and "
            f"data.producer_gpu_fraction={fits:.2f})" if fits > 0 else
            "the trainer alone does not fit beside any producer: run the producer on other GPUs")
    return (f"co-location: the producer holds {producer / GIB:.1f} GiB (data.producer_gpu_fraction="
            f"{producer_fraction:g} of a {card_bytes / GIB:.1f} GiB card) and the trainer needs ~{need_bytes / GIB:.1f} "
            f"GiB (an estimate: its parameters' state, activations and the rest at this batch; train/colocation.py): "
            f"together more than the card's {room / GIB:.1f} GiB usable; {hint}, or lower data.max_tokens_per_batch")


def card_bytes(device) -> Optional[int]:
    """The card's total memory (None off CUDA: nothing to check)."""
    import torch
    if getattr(device, "type", str(device)) != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def check_colocation(fraction: Optional[float], trainable_params: int, hidden_size: int, tokens_per_batch: int,
                     device, main: bool = True) -> Optional[dict]:
    """Refuse (ConfigError) a producer share and trainer need that cannot fit this rank's card; the figures
    checked, for the manifest (None: not co-located, or no card to check)."""
    if fraction is None:
        return None
    card = card_bytes(device)
    if card is None:
        if main:
            print(f"[train] data.producer_gpu_fraction={fraction:g}: not checked on {device} (no GPU card)")
        return None
    need = trainer_need_bytes(trainable_params, hidden_size, tokens_per_batch)
    problem = colocation_problem(card, fraction, need)
    if problem:
        raise ConfigError(problem)
    figures = {"card_gib": round(card / GIB, 1), "producer_gib": round(fraction * card / GIB, 1),
               "trainer_need_gib_estimate": round(need / GIB, 1)}
    if main:
        print(f"[train] co-location: producer {figures['producer_gib']} GiB + trainer ~{figures['trainer_need_gib_estimate']}"
              f" GiB (estimate) of a {figures['card_gib']} GiB card")
    return figures
