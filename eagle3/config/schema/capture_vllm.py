"""Schema of `capture.vllm` (conf/capture.yaml): the engine behind `capture.backend=vllm`
(data/capture_vllm.py; the protocol's facts are in eagle3/engines/vllm_protocol.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.config.choices import DEVICES, VLLM_ENGINES
from eagle3.config.conf import ConfigError, check_choice


@dataclass
class VllmCaptureConf:
    engine: str = "server"  # server: a running `vllm serve` at `url`; inprocess: vllm.LLM(...) in this process
    url: str = "http://127.0.0.1:8000"  # the server (its /v1/completions and /v1/models)
    model: Optional[str] = None  # the server's model name; null = target.path (what `vllm serve <path>` names it)
    # Where the engine's connector writes one file per request (a directory both sides see); the backend
    # uses <storage_dir>/ids-<layer ids>/ so that an engine started for other layers is noticed.
    storage_dir: Optional[str] = None  # null: <out_dir>/vllm_hidden_states
    tensor_parallel_size: int = 8
    max_model_len: Optional[int] = None  # null: the capture's max sequence length + 1 (<= max_position_embeddings)
    concurrency: int = 16  # server: requests in flight
    timeout_s: float = 600.0  # server: one request
    lock_timeout_s: float = 120.0  # how long to wait for the connector to finish writing a file
    retries: int = 2  # asking the engine again for a sequence whose file is missing or truncated
    head_device: str = "auto"  # final norm + lm_head argmax: auto = cuda if available, else cpu

    def validate(self) -> None:
        check_choice("vllm.engine", self.engine, VLLM_ENGINES)
        check_choice("vllm.head_device", self.head_device, DEVICES)
        for name in ("tensor_parallel_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"vllm.{name}={getattr(self, name)}: must be >= 1")
        if self.retries < 0 or self.timeout_s <= 0 or self.lock_timeout_s <= 0:
            raise ConfigError("vllm: retries >= 0, timeout_s > 0 and lock_timeout_s > 0 are required")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"vllm.max_model_len={self.max_model_len}: must be >= 2 or null")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"vllm.url={self.url!r}: expected http(s)://host:port")
