"""Host-to-device copies overlapped with compute.

The DataLoader's workers read and pad the next micro-batches from the store and its pin-memory
thread pins them; `DevicePrefetcher` then starts each batch's copy to the GPU on a side CUDA
stream as soon as the previous one is handed out, so the ~235 MB of aux + last states of a
4096-token Kimi batch cross PCIe while the current step computes. The consumer's stream waits
for that copy only when it takes the batch, and the device tensors are tied to the consumer's
stream (`record_stream`) so the caching allocator never reuses them early.

It yields `(host_batch, device_batch)`: the host copy serves the cheap CPU-side checks and counts
(token ids, loss positions) without a device sync. On CPU the device batch is the host batch.
`peek_hosts(n)` shows the host copies of the next n batches without copying them to the device
(a gradient-accumulation step counts its loss positions over all its micro-batches first).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


class DevicePrefetcher:
    """Wraps an iterator of host batches (dicts of tensors + other values); keeps `depth` batches
    in flight on the device."""

    def __init__(self, batches: Iterator[dict], device: torch.device, depth: int = 1):
        if depth < 1:
            raise ValueError(f"DevicePrefetcher depth={depth}: must be >= 1")
        self.batches = iter(batches)
        self.device = torch.device(device)
        self.depth = depth
        self.stream: Optional[torch.cuda.Stream] = (torch.cuda.Stream(device=self.device)
                                                    if self.device.type == "cuda" else None)
        self.queue: list[tuple[dict, dict]] = []  # (host, device) pairs whose copies have started
        self.pending: list[dict] = []  # host batches pulled ahead by peek_hosts, no device copy yet
        self._fill()

    def _pull(self) -> Optional[dict]:
        if self.pending:
            return self.pending.pop(0)
        return next(self.batches, None)

    def _fill(self) -> None:
        while len(self.queue) < self.depth:
            host = self._pull()
            if host is None:
                return
            if self.stream is None:
                self.queue.append((host, host))
                continue
            with torch.cuda.stream(self.stream):
                self.queue.append((host, _to_device(host, self.device)))

    def peek_hosts(self, n: int) -> list[dict]:
        """The host copies of the next `n` batches (fewer at the end of the data), in the order
        `next` will hand them out, without starting device copies beyond `depth`: a step that must
        see all its micro-batches first (the loss denominators) holds them in pinned host memory,
        and only `depth` + the one in use on the device."""
        while len(self.queue) + len(self.pending) < n:
            host = next(self.batches, None)
            if host is None:
                break
            self.pending.append(host)
        return ([h for h, _ in self.queue] + self.pending)[:n]

    def __iter__(self):
        return self

    def __next__(self) -> tuple[dict, dict]:
        if not self.queue:
            raise StopIteration
        host, dev = self.queue.pop(0)
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for v in dev.values():
                if torch.is_tensor(v):
                    v.record_stream(current)
        self._fill()  # the next copy starts now, behind this batch's compute
        return host, dev
