"""Schema of the train stage's config (conf/train.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from eagle3.config.choices import (ATTENTION_KERNELS, COMPILE_CHOICES, IMAGE_EMBEDDINGS, NONFINITE_POLICIES, PRECISIONS,
                                   STORE_VERIFY, UNROLLS)
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf, WandbConf


@dataclass
class TrainDataConf:
    train_split: str = "train"            # sub-directory of capture_dir holding the training store
    val_split: str = "validation"         # held-out store ("" or missing directory: no validation)
    max_tokens_per_batch: int = 8192      # padded tokens (rows x longest row) per micro-batch
    max_length: int = 2048                # longer sequences are truncated (counted in the manifest)
    bucket_window: int = 1024             # sequences sorted by length within windows of this many
    num_workers: int = -1                 # DataLoader workers reading the store ahead of the GPU; -1: 4 on GPU, 0 on CPU
    verify: str = "sha256"                # store check at open: sha256 (each shard hashed once: a same-size bit flip is caught) | size | none (cheaper)
    # store: the capture stage's finished store | stream: the spool a running producer fills
    # (make capture-hidden ARGS="stream.enabled=true"; data/stream_capture.py, train/spool_source.py)
    source: str = "store"
    # epochs: each epoch a permutation of the whole store | windows: consecutive windows of window_sequences
    # (prepared order), each trained `reuse` times before the next (what a stream needs) | auto: windows for a stream
    order: str = "auto"
    window_sequences: int = 1024
    reuse: int = 1                        # passes over each window (data.order=windows; epochs does not apply)
    spool_dir: str = "spool"              # the spool inside capture_dir (or an absolute path) for source=stream
    stream_timeout_s: float = 600.0       # a producer silent this long (no heartbeat, no chunk) is an error
    stream_status_s: float = 30.0         # a status line this often while waiting for the producer
    # source=stream: external = a producer you start (make capture-hidden ARGS="stream.enabled=true ...") |
    # local = this run starts it (data/run_capture.py, as its own process; `make train-online`), with the
    # target, init and paths of this config and `producer_args` (more capture overrides: stream.max_gb=...)
    producer: str = "external"
    producer_args: List[str] = field(default_factory=list)
    # The share of each of the trainer's GPUs the producer holds when both share them (vLLM's
    # --gpu-memory-utilization; the hf producer's target on the trainer's device); null: the producer runs on
    # other GPUs. Set, the trainer refuses to start when that share and its own need cannot fit
    # (train/colocation.py).
    producer_gpu_fraction: Optional[float] = None

    def resolved_order(self) -> str:
        """The one place data.order=auto is decided."""
        return ("windows" if self.source == "stream" else "epochs") if self.order == "auto" else self.order

    def validate(self) -> None:
        if self.max_tokens_per_batch < 1 or self.max_length < 2:
            raise ConfigError("data.max_tokens_per_batch must be >= 1 and data.max_length >= 2")
        if self.max_length > self.max_tokens_per_batch:
            raise ConfigError(f"data.max_length={self.max_length} > data.max_tokens_per_batch="
                              f"{self.max_tokens_per_batch}: the longest sequences would not fit a batch")
        if self.num_workers < -1 or self.bucket_window < 1:
            raise ConfigError(f"data.num_workers={self.num_workers} (>= -1) / data.bucket_window={self.bucket_window} (>= 1)")
        check_choice("data.verify", self.verify, STORE_VERIFY)
        check_choice("data.source", self.source, ("store", "stream"))
        check_choice("data.order", self.order, ("auto", "epochs", "windows"))
        if self.source == "stream" and self.resolved_order() != "windows":
            raise ConfigError("data.source=stream trains window by window: data.order must be windows (or auto)")
        check_choice("data.producer", self.producer, ("external", "local"))
        if self.producer_gpu_fraction is not None and not 0 < self.producer_gpu_fraction < 1:
            raise ConfigError(f"data.producer_gpu_fraction={self.producer_gpu_fraction}: a share of the card, "
                              f"between 0 and 1 (or null: the producer is on other GPUs)")
        if self.producer == "local" and self.source != "stream":
            raise ConfigError("data.producer=local starts a streaming producer: it needs data.source=stream")
        if self.window_sequences < 1 or self.reuse < 1 or self.stream_timeout_s <= 0:
            raise ConfigError("data.window_sequences >= 1, data.reuse >= 1, data.stream_timeout_s > 0")


@dataclass
class OptimConf:
    lr: float = 5e-5                      # fine-tuning default (EAGLE official recipe)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 0.5                # max global grad norm (0 = off)
    warmup_steps: Optional[int] = None    # None: warmup_ratio x total steps
    warmup_ratio: float = 0.02
    min_lr_ratio: float = 0.0             # cosine decays to lr x min_lr_ratio
    fused: Optional[bool] = None          # None: fused on CUDA (train/optim.TritonAdamW), foreach elsewhere

    def validate(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas}: expected two values in [0, 1)")
        if self.lr <= 0 or self.grad_clip < 0 or not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.warmup_ratio < 1:
            raise ConfigError("optim: lr > 0, grad_clip >= 0, min_lr_ratio in [0, 1], warmup_ratio in [0, 1)")


@dataclass
class TrainConfig:
    paths: PathsConf
    target: TargetConf
    capture_dir: str
    vocab_dir: str
    out_dir: str
    init: Optional[InitConf] = None       # chosen on the command line: +init=aqmedai_k2 or +init=scratch
    seed: int = 0
    ttt_length: int = 7                   # TTT unroll steps; step k weighs step_decay^k
    step_decay: float = 0.8
    # what the drafter embeds at image rows: fused (SGLang: the store's fused rows) | placeholder (vLLM:
    # embed(<|media_pad|>)) | auto (the export's engine, SGLang: fused); eagle3/drafter/image_embeddings.py
    image_embeddings: str = "auto"
    max_steps: Optional[int] = None       # optimizer steps; with epochs too, the smaller wins
    epochs: Optional[int] = 1
    grad_accum: int = 1                   # micro-batches per optimizer step (per rank)
    precision: str = "auto"               # auto: bf16 autocast on GPU, fp32 on CPU
    unroll: str = "auto"                  # TTT unroll: fast (flash + fused, eagle3/ttt/fast_unroll.py) | reference | auto (fast on GPU)
    compile: str = "auto"                 # torch.compile the fast unroll's memory-bound pieces: auto (on GPU) | true | false
    attention_kernel: str = "auto"        # fast unroll's causal attention: auto (cuDNN on Hopper+ at head_dim 128, else flash) | flash | cudnn
    cpu: bool = False                     # force CPU even when a GPU is present
    fsdp: bool = False                    # shard params/grads/optimizer (drafter too big per GPU)
    log_every: int = 10
    val_every: int = 500                  # optimizer steps between validations (0: only at start and end)
    val_max_batches: Optional[int] = None
    val_accept_sequences: int = 4         # sequences replayed for the simulated accept length (0: off; rank 0, slow)
    checkpoint_every: int = 500
    keep_checkpoints: int = 3             # newest checkpoints kept (0: all)
    on_nonfinite: str = "stop"            # stop: raise naming step and batch; skip: drop the step, count it
    max_nonfinite_skips: int = 20
    progress: bool = True
    data: TrainDataConf = field(default_factory=TrainDataConf)
    optim: OptimConf = field(default_factory=OptimConf)
    wandb: WandbConf = field(default_factory=WandbConf)  # offline runs land in <out_dir>/wandb

    def validate(self) -> None:
        if self.init is None:
            raise ConfigError("training needs an init choice: add +init=aqmedai_k2 or +init=scratch")
        if self.ttt_length < 1 or not 0 < self.step_decay <= 1:
            raise ConfigError(f"ttt_length={self.ttt_length} must be >= 1 and step_decay={self.step_decay} in (0, 1]")
        if self.max_steps is None and self.epochs is None:
            raise ConfigError("set max_steps or epochs (or both: the smaller wins)")
        if (self.max_steps is not None and self.max_steps < 1) or (self.epochs is not None and self.epochs < 1):
            raise ConfigError("max_steps and epochs must be >= 1 when set")
        if self.grad_accum < 1 or self.log_every < 1 or self.checkpoint_every < 1 or self.val_every < 0:
            raise ConfigError("grad_accum, log_every, checkpoint_every must be >= 1; val_every >= 0")
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("unroll", self.unroll, UNROLLS)
        check_choice("image_embeddings", self.image_embeddings, IMAGE_EMBEDDINGS)
        if str(self.compile).lower() not in COMPILE_CHOICES:
            raise ConfigError(f"compile={self.compile!r}: expected one of {COMPILE_CHOICES}")
        check_choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        check_choice("on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)


register_stage("train", TrainConfig)
