"""Schema of the learning-quality A/B (`conf/learning_ab.yaml`, pipeline/learning_ab.py): one world, one
init, the same seeds and steps, trained once per arm (a list of train overrides); the curves and the
final difference with its interval decide whether the arms learn the same."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from eagle3.config.choices import DEVICES, INITS
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import PathsConf, WandbConf
from eagle3.config.schema.demo import ForwardedSettings, StageOverrides, check_step_budgets, forward_settings
from eagle3.config.schema.study import CurveConf

REFERENCE_PATH = ["unroll=reference", "compile=false", "optim.fused=false"]  # the trainer's reference numerics


@dataclass
class ArmConf:
    """One code path: its name and the train overrides that select it (empty = the defaults)."""
    name: str
    train: List[str] = field(default_factory=list)


@dataclass
class LearningABConfig(ForwardedSettings):
    paths: PathsConf
    out_dir: str                      # report.md / report.json / plot, records/
    stage_dir: str                    # the A/B's own train runs (train-<arm>-seed<k>/)
    train_steps: int                  # optimizer steps per run (the demo size's budget)
    k2_drafter_steps: int             # the K2 drafter's own budget (the demo size's; eagle3/config/schema/demo.py)
    overrides: StageOverrides = field(default_factory=StageOverrides)
    # arm 0 is the baseline, arm 1 the path under test (the report gives arm 1 - arm 0)
    arms: List[ArmConf] = field(default_factory=lambda: [ArmConf("gpu_default", []),
                                                         ArmConf("reference", list(REFERENCE_PATH))])
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])
    world_seed: int = 0
    seed: int = 0                     # unused by the A/B itself (world_seed picks the world); kept for build_experiment
    init: str = "aqmedai_k2"
    primary_knob: str = "2/1/3"
    confidence: float = 0.95
    bar: float = 0.01                 # |final difference| in sim tau below which the arms count as the same
    eval_device: str = "auto"
    curve: CurveConf = field(default_factory=lambda: CurveConf(points=5))
    wandb: WandbConf = field(default_factory=lambda: WandbConf(project="eagle3-learning-ab"))
    report_only: bool = False
    num_threads: int = 0

    def validate(self) -> None:
        forward_settings(self, {f"train.{k}": "the A/B sets it for every run (seeds=[...], train_steps, arms)"
                                for k in ("seed", "out_dir", "max_steps", "checkpoint_every", "keep_checkpoints",
                                          "val_every", "wandb")} | {"mini_world.seed": "use world_seed=<k>"})
        names = [a.name for a in self.arms]
        if len(self.arms) != 2 or len(set(names)) != 2 or not all(n.replace("_", "").isalnum() for n in names):
            raise ConfigError(f"arms={names}: exactly two arms with distinct names of letters, digits and _")
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds={self.seeds}: at least two distinct seeds (an interval needs two per arm)")
        check_choice("init", self.init, INITS)
        check_step_budgets(self)
        if self.train_steps < self.curve.points - 1:
            raise ConfigError(f"curve.points={self.curve.points} needs train_steps >= {self.curve.points - 1}")
        if self.primary_knob not in [f"{k.num_steps}/{k.topk}/{k.num_draft_tokens}" for k in self.curve.knobs]:
            raise ConfigError(f"primary_knob={self.primary_knob!r} is not one of curve.knobs")
        if self.bar < 0 or not 0.5 <= self.confidence < 1:
            raise ConfigError(f"bar={self.bar} must be >= 0 and confidence={self.confidence} in [0.5, 1)")
        if self.eval_device not in DEVICES or self.num_threads < 0 or self.world_seed < 0:
            raise ConfigError(f"eval_device={self.eval_device!r} (one of {DEVICES}), num_threads >= 0, world_seed >= 0")


register_stage("learning_ab", LearningABConfig)
