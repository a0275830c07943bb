"""Schemas of the shared config groups (paths, target, init) and of the parts several stages share
(wandb)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from eagle3.engines import aux_layers
from eagle3.config.choices import FLOAT_DTYPES, NEW_ROW_RULES, TARGET_LAYOUTS, WANDB_MODES
from eagle3.config.conf import ConfigError, check_choice, register_group


@dataclass
class PathsConf:
    root: str
    mini_world: str
    models: str
    stages: str


@dataclass
class TargetConf:
    name: str
    path: str
    tokenizer: str
    layout: str = "causal_lm"
    dtype: str = "float32"
    device_map: Optional[str] = None
    trust_remote_code: bool = False
    k2_drafter: Optional[str] = None

    def validate(self) -> None:
        check_choice("target.layout", self.layout, TARGET_LAYOUTS)
        check_choice("target.dtype", self.dtype, FLOAT_DTYPES)


@dataclass
class InitConf:
    name: str
    drafter_path: Optional[str] = None
    new_row_init: str = "target_lm_head"  # lm_head rows of tokens new to the draft vocab (eagle3/drafter/remap.py)
    # How the init drafter's config.json aux layer ids become hidden-state indices h: the reading of the
    # engine it was trained for (eagle3/engines/aux_layers.py). sglang = current SGLang (PR #25454+).
    aux_id_rule: str = aux_layers.DEFAULT_RULE

    def validate(self) -> None:
        check_choice("init.aux_id_rule", self.aux_id_rule, aux_layers.RULES)
        check_choice("init.new_row_init", self.new_row_init, NEW_ROW_RULES)
        if self.name != "scratch" and not self.drafter_path:
            raise ConfigError(f"init={self.name} needs init.drafter_path (the drafter directory to start from)")


@dataclass
class WandbConf:
    """Weights & Biases logging of a stage (train, eval, the study)."""
    mode: str = "offline"                 # offline: runs land under the stage's out_dir (`wandb sync` to upload) | online | disabled
    project: str = "eagle3-finetune"
    entity: Optional[str] = None
    name: Optional[str] = None            # default: the stage's own run name (train: its out_dir's name)
    group: Optional[str] = None           # runs that belong together on the dashboard (the study: the init)
    tags: list[str] = field(default_factory=list)

    def validate(self) -> None:
        check_choice("wandb.mode", self.mode, WANDB_MODES)


register_group("init", InitConf)
register_group("target", TargetConf)
