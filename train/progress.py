"""Per-interval training statistics (reduced over ranks at logging time only, so the steps in
between never wait on the host) and the progress bar."""
from __future__ import annotations

import time

import torch

from train.distributed import peak_memory


class StepStats:
    """Sums of per-step soft CE, correct and valid positions over a logging interval (device
    tensors), plus real / padded tokens and grad norms."""

    def __init__(self, ttt_length: int, device: torch.device, step_decay: float = 0.8):
        self.K, self.device, self.decay = ttt_length, device, step_decay
        self._reset_interval()
        self._reset_window()

    def _reset_interval(self) -> None:
        z = lambda: torch.zeros(self.K, device=self.device)  # noqa: E731
        self.loss_sum, self.correct, self.count = z(), z(), z()
        self.tokens = self.padded = 0
        self.steps = 0
        self.grad_norms: list[float] = []
        self.t0 = time.perf_counter()

    def _reset_window(self) -> None:
        z = lambda: torch.zeros(self.K, device=self.device)  # noqa: E731
        self.w_loss, self.w_correct, self.w_count = z(), z(), z()
        self.w_tokens = self.w_padded = 0

    def add_micro(self, out, batch: dict) -> None:
        self.w_loss += out.loss_sum
        self.w_correct += out.correct
        self.w_count += out.count
        self.w_tokens += int(batch["lengths"].sum())
        self.w_padded += int(batch["input_ids"].numel())

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training steps (validation, checkpoints) out of tokens/s."""
        self.t0 += seconds

    def window_tokens(self) -> int:
        return self.w_tokens

    def reset(self) -> None:
        """Drop the current window (an update that was skipped)."""
        self._reset_window()

    def end_step(self, grad_norm: float) -> None:
        self.loss_sum += self.w_loss
        self.correct += self.w_correct
        self.count += self.w_count
        self.tokens += self.w_tokens
        self.padded += self.w_padded
        self.steps += 1
        self.grad_norms.append(grad_norm)
        self._reset_window()

    def summary(self, accelerator, **extra) -> dict:
        """Interval metrics over all ranks; resets the interval."""
        sums = torch.cat([self.loss_sum, self.correct, self.count,
                          torch.tensor([self.tokens, self.padded], device=self.device, dtype=torch.float32)])
        sums = accelerator.reduce(sums, reduction="sum")
        K = self.K
        loss_sum, correct, count = sums[:K], sums[K:2 * K], sums[2 * K:3 * K]
        tokens, padded = float(sums[3 * K]), float(sums[3 * K + 1])
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        mean = loss_sum / count.clamp(min=1)
        weights = torch.tensor([self.decay ** k for k in range(K)], device=self.device)
        row = {"loss": mean.tolist(), "acc": (correct / count.clamp(min=1)).tolist(),
               "loss_weighted": float((weights * mean).sum()),
               "grad_norm": sum(self.grad_norms) / max(1, len(self.grad_norms)),
               "tokens_per_s": tokens / elapsed, "padding_efficiency": tokens / max(1.0, padded),
               "step_s": elapsed / max(1, self.steps), **extra, **peak_memory()}
        self._reset_interval()
        return row


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


def progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
