"""Schema of the vocab stage config (`conf/vocab.yaml`): the top-N draft vocabulary from the
token frequencies of the prepared train split's loss-masked tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.config.choices import SPLITS
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class VocabConfig:
    paths: PathsConf
    target: TargetConf
    in_dir: str  # the prepare stage directory
    out_dir: str
    # N: 2048 for the mini world (its ~8K-token tokenizer); Kimi-K2.5: draft_vocab_size=32000 (the AQ-MedAI /
    # published drafters' size)
    draft_vocab_size: int = 2048
    split: str = "train"  # which prepared split is counted
    target_vocab_size: Optional[int] = None  # V; default: the target's config.json (text_config) vocab_size
    report_top_missing: int = 50  # how many of the most frequent tokens absent from the init vocab to list
    chunk_tokens: int = 1 << 24  # tokens counted per bincount call (bounds memory)
    seed: int = 0
    init: Optional[InitConf] = None  # +init=aqmedai_k2: compare with that drafter's mapping

    def validate(self) -> None:
        if self.draft_vocab_size < 1:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size}: must be >= 1")
        check_choice("split", self.split, SPLITS)
        if self.chunk_tokens < 1 or self.report_top_missing < 0:
            raise ConfigError("chunk_tokens must be >= 1 and report_top_missing >= 0")


register_stage("vocab", VocabConfig)
