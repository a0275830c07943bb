"""Schema of `make export` (conf/export.yaml): the trained drafter -> a directory SGLang serves (and a
vLLM speculators one), checked by a logit round trip, with SERVE.md's launch command."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from eagle3.config.choices import EXPORT_FORMAT_CHOICES, FLOAT_DTYPES
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf
from eagle3.config.schema.eval import KnobConf, check_knobs

@dataclass
class ServeConf(KnobConf):
    """SGLang speculative knobs for SERVE.md when the eval report names no best setting (a KnobConf:
    its defaults and checks), and the launch flags that are not the drafter's business (tensor
    parallelism, extra arguments)."""
    tp: Optional[int] = None              # --tp / --tensor-parallel-size; null: 8 for kimi_k25, else omitted
    extra_args: list[str] = field(default_factory=list)

    def validate(self) -> None:
        check_knobs([self], "export.serve")


@dataclass
class ExportConfig:
    paths: PathsConf
    target: TargetConf
    name: str                             # train-<name>/final: the init's name (+init=scratch exports the scratch run)
    checkpoint_dir: str
    capture_dir: str                      # its layer ids go into the config; its validation split feeds the round trip
    eval_dir: str                         # the eval stage's report.json names the best knobs (absent: `serve`)
    out_dir: str
    format: str = "both"                  # sglang | speculators | both (speculators goes to <out_dir>/speculators)
    dtype: str = "bfloat16"               # weights; d2t is always int64, t2d bool
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
        check_choice("export.format", self.format, EXPORT_FORMAT_CHOICES)
        check_choice("export.dtype", self.dtype, FLOAT_DTYPES)
        if self.verify_sequences < 0 or self.verify_tokens < 2:
            raise ConfigError(f"verify_sequences={self.verify_sequences} must be >= 0 and "
                              f"verify_tokens={self.verify_tokens} >= 2")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ConfigError(f"max_position_embeddings={self.max_position_embeddings} must be positive (or null)")


register_stage("export", ExportConfig)
