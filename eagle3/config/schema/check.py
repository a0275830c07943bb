"""Schema of `make check` (export/run_check.py): a drafter directory against a target."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.engines import aux_layers
from eagle3.config.conf import check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class CheckConfig:
    paths: PathsConf
    target: TargetConf
    drafter_dir: str                    # the drafter directory to check (default: the target's K2 drafter)
    capture_dir: Optional[str]          # when it holds a finished capture: the drafter's h must equal the captured h (null: no check)
    # how the drafter's config.json aux layer ids are read as HF hidden-state indices h: sglang (current
    # SGLang, PR #25454+) | sglang_legacy | vllm (eagle3/engines/aux_layers.py)
    aux_id_rule: str = aux_layers.DEFAULT_RULE
    fail_on_warnings: bool = False      # exit non-zero on warnings too (e.g. before shipping)
    seed: int = 0
    init: Optional[InitConf] = None

    def validate(self) -> None:
        check_choice("aux_id_rule", self.aux_id_rule, aux_layers.RULES)


register_stage("check", CheckConfig)
