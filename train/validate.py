"""Periodic validation on the held-out store: loss and teacher-forced accuracy per TTT step (the
training objective's own positions, via the same TTT unroll), and the simulated accept length on a few
sequences (eagle3/replay/evaluate.py, the eval stage's replay).

Every rank runs the same number of forwards (FSDP all-gathers in each one): the rank's share
is padded by wrapping around, and the padding batches are run but not counted.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from eagle3.replay.evaluate import simulate_accept_length
from train.batches import batch_to_device, collate, plan_epoch, StoreSequences

log = logging.getLogger(__name__)


def validation_plan(lengths, max_tokens: int, max_length: int, rank: int, world: int,
                    max_batches: Optional[int]) -> list[tuple[list[int], bool]]:
    """(batch indices, counted) for this rank; a fixed order (seed 0) with one length-sorted window."""
    batches = plan_epoch(lengths, max_tokens, max_length, seed=0, epoch=0, bucket_window=len(lengths))
    if max_batches:
        batches = batches[:max_batches]
    counted = [True] * len(batches)
    while len(batches) % world:
        batches.append(batches[len(batches) % max(1, len(counted))])
        counted.append(False)
    return list(zip(batches[rank::world], counted[rank::world]))


@torch.no_grad()
def run_validation(accelerator, objective, store, lm_head_rows: torch.Tensor, config,
                   progress: bool = False) -> dict:
    """-> {"loss": per-step mean soft CE, "acc": per-step accuracy, "loss_weighted", "positions"}."""
    K = config.ttt_length
    plan = validation_plan(store.lengths, config.data.max_tokens_per_batch, config.data.max_length,
                           accelerator.process_index, accelerator.num_processes, config.val_max_batches)
    data = StoreSequences(store, config.data.max_length)
    device = accelerator.device
    loss_sum = torch.zeros(K, device=device)
    correct = torch.zeros(K, device=device)
    count = torch.zeros(K, device=device)
    was_training = objective.training
    objective.eval()
    it = plan
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(plan, desc="validation", leave=False, dynamic_ncols=True)
    for indices, counted in it:
        batch = batch_to_device(collate([data[i] for i in indices]), device)
        out = objective(batch, lm_head_rows)
        if counted:
            loss_sum += out.loss_sum
            correct += out.correct
            count += out.count
    objective.train(was_training)
    loss_sum, correct, count = (accelerator.reduce(t, reduction="sum") for t in (loss_sum, correct, count))
    mean = loss_sum / count.clamp(min=1)
    weights = torch.tensor([config.step_decay ** k for k in range(K)], device=device)
    return {"loss": mean.tolist(), "acc": (correct / count.clamp(min=1)).tolist(),
            "loss_weighted": float((weights * mean).sum()), "positions": count.long().tolist()}


def simulated_accept_length(drafter, store, max_sequences: int, image_embeddings: str = "placeholder"
                            ) -> Optional[dict]:
    """SGLang-convention accept length of the eval stage's replay (rank 0, unwrapped drafter), or None
    when not asked for or the replay failed. {knob label: accept length}. image_embeddings: what the
    drafter reads at image rows (the run's convention, eagle3/drafter/image_embeddings.py)."""
    if max_sequences <= 0:
        return None
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            res = simulate_accept_length(drafter, store, max_sequences=max_sequences, progress=False,
                                         image_embeddings=image_embeddings)
    except Exception as e:  # never lose a training run to the optional metric; say why it is missing
        log.warning("simulated accept length failed (%s: %s); continuing without it", type(e).__name__, e)
        return None
    finally:
        drafter.train(was_training)
    return {label: round(r["drafter"].accept_length, 4) for label, r in res.items()}
