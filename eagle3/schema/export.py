from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from eagle3.conf import ConfigError
from eagle3.schema.common import InitConf, PathsConf, TargetConf

EXPORT_FORMATS = ("sglang", "speculators", "both")
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ServeConf:
    """SGLang speculative knobs for SERVE.md when the eval report names no best setting, and the
    launch flags that are not the drafter's business (tensor parallelism, extra arguments)."""
    num_steps: int = 2
    topk: int = 1
    num_draft_tokens: int = 3
    tp: Optional[int] = None              # --tp / --tensor-parallel-size; null: 8 for kimi_k25, else omitted
    extra_args: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.num_steps < 1 or self.topk < 1 or self.num_draft_tokens < 2:
            raise ConfigError(f"export.serve: num_steps={self.num_steps}, topk={self.topk}, "
                              f"num_draft_tokens={self.num_draft_tokens}: need >= 1, >= 1, >= 2")
        if self.topk == 1 and self.num_draft_tokens > self.num_steps + 1:
            raise ConfigError(f"export.serve: a chain (topk=1) of num_steps={self.num_steps} has at most "
                              f"{self.num_steps + 1} draft tokens, got num_draft_tokens={self.num_draft_tokens}")


@dataclass
class ExportConfig:
    paths: PathsConf
    target: TargetConf
    name: str
    checkpoint_dir: str
    capture_dir: str
    eval_dir: str
    out_dir: str
    format: str = "both"
    dtype: str = "bfloat16"
    # null: the target's context length (its max_position_embeddings); a larger value is allowed
    max_position_embeddings: Optional[int] = None
    # also write the target's embed_tokens.weight into speculators/: speculators' own Python API
    # (Eagle3DraftModel.from_pretrained) needs it; vLLM serving shares the target's and does not
    speculators_embed: bool = False
    # logit round trip on this many stored validation sequences (0 = skip), each cut to verify_tokens
    verify_sequences: int = 4
    verify_tokens: int = 256
    use_eval_report: bool = True          # take the knobs from eval_dir/report.json when it has them
    serve: ServeConf = field(default_factory=ServeConf)
    seed: int = 0
    init: Optional[InitConf] = None

    def validate(self) -> None:
        if self.format not in EXPORT_FORMATS:
            raise ConfigError(f"export.format={self.format!r}: expected one of {EXPORT_FORMATS}")
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError(f"export.dtype={self.dtype!r}: expected one of {EXPORT_DTYPES}")
        if self.verify_sequences < 0 or self.verify_tokens < 2:
            raise ConfigError(f"verify_sequences={self.verify_sequences} must be >= 0 and "
                              f"verify_tokens={self.verify_tokens} >= 2")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ConfigError(f"max_position_embeddings={self.max_position_embeddings} must be positive (or null)")
