"""The capture stage's variation point: a `CaptureBackend` runs the target over a split and writes its
hidden-state store; `BACKENDS` is the lookup table capture.backend names a key of.

Adding a backend is one new module (a class with the members below) and one line in BACKENDS (plus its
name in eagle3/config/choices.py CAPTURE_BACKENDS, which the config schema validates; tests/test_capture.py checks
the two agree). The stage (data/capture.py) calls, in order:
  - `check(cfg, hf_indices, num_layers, max_len, dist, image_token_id)`: before any work, so bad input fails
    fast (image_token_id: the image row id when the prepared data holds images, else None);
  - `open(cfg, text_cfg, max_len, dist)`: load the target or reach the engine;
  - `capture_split(ds, seqs, writer, cfg, hf_indices, dist, desc, image_token_id)`: one split into its
    store writer, resuming; returns this run's counts;
  - `close()`.
`image_rows` says what an image capture's store keeps at image rows (eagle3/formats/store_format.py: FUSED, the
fused input embeddings; NO_ROWS, none).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from data.capture_hf import HfBackend
from data.capture_vllm import VllmBackend


class CaptureBackend(Protocol):
    name: str
    image_rows: str

    def check(self, cfg: Any, hf_indices: list[int], num_layers: int, max_len: int, dist: Any,
              image_token_id: Optional[int] = None) -> None: ...

    def open(self, cfg: Any, text_cfg: dict, max_len: int, dist: Any) -> None: ...

    def capture_split(self, ds: Any, seqs: list, writer: Any, cfg: Any, hf_indices: list[int], dist: Any,
                      desc: str, image_token_id: Optional[int] = None) -> dict: ...

    def close(self) -> None: ...


BACKENDS: dict[str, Callable[[], CaptureBackend]] = {
    "hf": HfBackend,
    "vllm": VllmBackend,
}


def backend_for(name: str) -> CaptureBackend:
    if name not in BACKENDS:
        raise ValueError(f"capture backend {name!r}: expected one of {sorted(BACKENDS)}")
    return BACKENDS[name]()
