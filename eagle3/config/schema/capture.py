"""Schema of the capture stage config (`conf/capture.yaml`): run the target over the prepared
dataset and store, per token, the aux hidden states of the configured layers, the final post-norm
state and the target's argmax (the hidden-state store of eagle3/formats/store.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from eagle3.engines import aux_layers
from eagle3.config.choices import AUX_DTYPES, CAPTURE_BACKENDS, FLOAT_DTYPES, OVERLONG_POLICIES, SPLITS
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf
from eagle3.config.schema.capture_vllm import VllmCaptureConf
from eagle3.config.watermarks import WatermarkError, Watermarks


@dataclass
class StreamConf:
    """Online capture (`stream.enabled=true`): the train split goes into a capped spool that the train stage
    (data.source=stream) reads while the producer runs (eagle3/formats/spool.py); the validation split is
    captured offline first, as usual."""
    enabled: bool = False
    dir: str = "spool"                # inside out_dir (or an absolute path: local NVMe, /dev/shm)
    max_gb: float = 50.0              # the cap on chunk bytes on disk
    high: float = 0.9                 # pause above high x max_gb ...
    low: float = 0.7                  # ... resume at or below low x max_gb
    chunk_sequences: int = 64         # sequences per published chunk (the unit of writing, acking, deleting)
    recapture: int = 1                # passes of the target over the prompts (peers re-capture per epoch)
    # With recapture >= 2: keep up to this many GB of the first pass's chunks on the spool, and serve the later
    # passes of those chunks from them instead of running the target again (the rest is captured each pass).
    # Counts against max_gb, so it must leave room below the low watermark for the windows being trained.
    cache_first_pass_gb: float = 0.0
    poll_s: float = 0.5               # how often a paused producer looks again

    def validate(self) -> None:
        try:  # the watermarks' own rule (eagle3/config/watermarks.py)
            Watermarks.from_gb(self.max_gb, self.high, self.low)
        except WatermarkError as e:
            raise ConfigError(str(e)) from None
        if self.chunk_sequences < 1 or self.recapture < 1 or self.poll_s <= 0:
            raise ConfigError("stream: chunk_sequences >= 1, recapture >= 1, poll_s > 0")
        if self.cache_first_pass_gb < 0:
            raise ConfigError(f"stream.cache_first_pass_gb={self.cache_first_pass_gb}: must be >= 0")
        if self.cache_first_pass_gb > 0 and self.recapture < 2:
            raise ConfigError(f"stream.cache_first_pass_gb={self.cache_first_pass_gb:g} serves passes 2.. of "
                              f"stream.recapture from the first; with recapture={self.recapture} there is none")
        if self.cache_first_pass_gb >= self.low * self.max_gb:
            raise ConfigError(f"stream.cache_first_pass_gb={self.cache_first_pass_gb:g} leaves no room below the low "
                              f"watermark ({self.low:g} x stream.max_gb={self.max_gb:g} = {self.low * self.max_gb:g} "
                              f"GB) for the windows being trained; lower it or raise stream.max_gb")


@dataclass
class CaptureConfig:
    paths: PathsConf
    target: TargetConf
    in_dir: str  # the prepare stage directory (train/, validation/)
    out_dir: str
    # The 3 hidden states to capture, as HF output_hidden_states indices h (h = i + 1: the output of decoder
    # layer i; Kimi's "layers 2/30/58" are h = [2, 30, 58]). null: the init drafter's ids read by
    # init.aux_id_rule if +init=... lists some, else SGLang's default h = [2, L//2, L-3]. Typed Any so
    # that a bad override gets the one-line message of aux_layers.as_int_list, not OmegaConf's.
    aux_hf_indices: Optional[Any] = None
    splits: List[str] = field(default_factory=lambda: ["train", "validation"])
    dtype: str = "bfloat16"  # stored aux / last states: bfloat16 | float16 | float32 (the target runs in target.dtype)
    # null: aux in `dtype`; float8_e4m3fn: aux as fp8 with one fp32 scale per (token, layer) row, about half
    # the store's aux bytes, dequantised to `dtype` on read (`last` stays in `dtype`: the teacher's input;
    # benchmarks/FP8_STORE.md)
    aux_dtype: Optional[str] = None
    # padded tokens per forward pass (sequences sorted by length); raise on big GPUs: 16384+ for K2.5 on 8 x H200
    max_tokens_per_batch: int = 8192
    # tokens per store shard (K2.5: 65536 x 57 KB = 3.7 GB shards; on GPU two shard buffers are pinned
    # host memory: 2 x 3.7 GB per process)
    shard_tokens: int = 65536
    limit: Optional[int] = None  # at most this many sequences per split (null = all)
    max_seq_len: Optional[int] = None  # null: the target's max_position_embeddings
    on_overlong: str = "truncate"  # truncate | skip (counted either way)
    argmax_chunk_tokens: int = 4096  # tokens per lm_head call for the argmax (full logits never kept)
    overwrite: bool = False  # a store written with other settings: false = refuse, true = delete and redo
    progress: bool = True
    seed: int = 0
    init: Optional[InitConf] = None  # +init=aqmedai_k2: take the aux layer ids from that drafter
    # hf: transformers forward with hooks | vllm: a vLLM engine's extract_hidden_states (data/capture_vllm.py;
    # docs/engines.md "Capture through vLLM")
    backend: str = "hf"
    vllm: VllmCaptureConf = field(default_factory=VllmCaptureConf)  # the engine of backend=vllm
    stream: StreamConf = field(default_factory=StreamConf)  # online capture into a capped spool

    def validate(self) -> None:
        check_choice("backend", self.backend, CAPTURE_BACKENDS)
        check_choice("dtype", self.dtype, FLOAT_DTYPES)
        if self.aux_dtype is not None and self.aux_dtype not in AUX_DTYPES:
            raise ConfigError(f"aux_dtype={self.aux_dtype!r}: expected null (= dtype) or one of {AUX_DTYPES}")
        check_choice("on_overlong", self.on_overlong, OVERLONG_POLICIES)
        for name in ("max_tokens_per_batch", "shard_tokens", "argmax_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.limit is not None and self.limit < 0:
            raise ConfigError(f"limit={self.limit}: must be >= 0 or null")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError(f"max_seq_len={self.max_seq_len}: must be >= 1 or null")
        bad = [s for s in self.splits if s not in SPLITS]
        if bad or not self.splits:
            raise ConfigError(f"splits={self.splits}: expected a non-empty subset of {list(SPLITS)}")
        if self.aux_hf_indices is not None:
            try:  # the count/type/duplicate checks; the range needs the target's layer count (capture checks it)
                self.aux_hf_indices = aux_layers.as_int_list(self.aux_hf_indices, "aux_hf_indices")
                aux_layers.validate_hf_indices(self.aux_hf_indices, None, "aux_hf_indices")
            except aux_layers.AuxLayerError as e:
                raise ConfigError(str(e)) from e


register_stage("capture", CaptureConfig)
