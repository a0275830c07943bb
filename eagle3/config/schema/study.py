"""Schema of the study's config (`conf/study.yaml`, sizes in `conf/study_size/`, which follows the
`demo_size` choice): learning curves over seeds for both inits, what fine-tuning forgets, and the
best SGLang knobs under the cost model (pipeline/study.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from eagle3.config.choices import DEVICES, INITS
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import PathsConf, WandbConf
from eagle3.config.schema.demo import ForwardedSettings, StageOverrides, check_step_budgets, forward_settings
from eagle3.config.schema.eval import CostConf, KnobConf, check_knobs, default_knobs


@dataclass
class CurveConf:
    """What is measured at every training-token budget (the saved checkpoints, plus the init at 0)."""
    points: int = 8                  # budgets from 0 to the full training budget, both ends included
    max_sequences: Optional[int] = None  # validation sequences replayed per point (null: all)
    knobs: List[KnobConf] = field(default_factory=default_knobs)

    def validate(self) -> None:
        if self.points < 2:
            raise ConfigError(f"curve.points={self.points}: at least 2 (the init and the end of training)")
        if self.max_sequences is not None and self.max_sequences < 1:
            raise ConfigError(f"curve.max_sequences={self.max_sequences}: >= 1 or null")
        check_knobs(self.knobs, "curve.knobs")


@dataclass
class RealCheckConf:
    """The real speculative loop run on every final drafter (eagle3/real_loop/check.py)."""
    num_prompts: int = 4
    max_new_tokens: int = 32
    knobs: List[KnobConf] = field(default_factory=lambda: [KnobConf(2, 1, 3), KnobConf(3, 2, 6)])

    def validate(self) -> None:
        if self.num_prompts < 0 or self.max_new_tokens < 2:
            raise ConfigError(f"real_check: num_prompts >= 0 and max_new_tokens >= 2 (got {self.num_prompts}, "
                              f"{self.max_new_tokens})")
        check_knobs(self.knobs, "real_check.knobs")


@dataclass
class KnobGridConf:
    """SGLang settings searched for every final drafter: chains num_steps/1/num_steps+1 and trees
    num_steps/topk/num_draft_tokens for every valid combination of the lists."""
    num_steps: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    topk: List[int] = field(default_factory=lambda: [1, 2, 4])
    num_draft_tokens: List[int] = field(default_factory=lambda: [4, 6, 8])  # trees only
    max_sequences: Optional[int] = None

    def validate(self) -> None:
        if not self.num_steps or not self.topk or min(self.num_steps + self.topk) < 1:
            raise ConfigError("knob_grid: num_steps and topk need at least one value >= 1 each")
        if any(n < 2 for n in self.num_draft_tokens):
            raise ConfigError(f"knob_grid.num_draft_tokens={self.num_draft_tokens}: every value >= 2")


@dataclass
class StudyConfig(ForwardedSettings):
    paths: PathsConf
    out_dir: str                      # report.md / report.json / plots
    stage_dir: str                    # the study's own train runs (train-<init>-seed<k>/)
    train_steps: int                  # optimizer steps per run (the demo size's budget)
    k2_drafter_steps: int             # the K2 drafter's own budget (the demo size's; eagle3/config/schema/demo.py)
    overrides: StageOverrides = field(default_factory=StageOverrides)
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])   # training seeds (data order, random inits)
    # world seeds: each builds its own mini world, K2 drafter and K2.5 data (pipeline/demo.py world_root); the
    # report gives the spread over seeds within a world and over worlds, or says it covers one world
    world_seeds: List[int] = field(default_factory=lambda: [0])
    inits: List[str] = field(default_factory=lambda: ["scratch", "aqmedai_k2"])  # each one of eagle3.config.choices.INITS
    primary_knob: str = "2/1/3"       # the setting the derived answers (token saving, final difference) use
    confidence: float = 0.95
    eval_device: str = "auto"         # auto | cpu | cuda
    curve: CurveConf = field(default_factory=CurveConf)
    forgetting_max_sequences: Optional[int] = None
    real_check: RealCheckConf = field(default_factory=RealCheckConf)
    knob_grid: KnobGridConf = field(default_factory=KnobGridConf)
    # The server the knobs are priced for (eagle3/engines/serve_costs.py): the account's 82 tok/s and ~30 ms 2/1/3 cycle, split
    # per verified token and per draft step by an ASSUMED rule (preset account_8gpu_pcie_split); a server measured by
    # `make bench-serve` replaces it with cost.preset=measured:<file>.
    cost: CostConf = field(default_factory=lambda: CostConf(preset="account_8gpu_pcie_split"))
    wandb: WandbConf = field(default_factory=lambda: WandbConf(project="eagle3-study"))  # every run of the study, grouped by init
    # the convention-mismatch cost on image traffic (pipeline/study_images.py): per seed, one extra run of the
    # from-K2 init trained image_embeddings=placeholder, replayed with its fused twin under both conventions
    image_mismatch: bool = True
    report_only: bool = False         # rebuild the report from <out_dir>/records/*.json without running anything
    seed: int = 0
    num_threads: int = 0              # torch threads for every stage; 0 = auto (eagle3/cpu_threads.py)

    def validate(self) -> None:
        forward_settings(self, {f"train.{k}": "the study sets it for every run (seeds=[...], train_steps, curve.points)"
                                for k in ("seed", "out_dir", "max_steps", "checkpoint_every", "keep_checkpoints",
                                          "val_every", "wandb")} | {"mini_world.seed": "use world_seeds=[...]"})
        if not self.world_seeds or len(set(self.world_seeds)) != len(self.world_seeds) or min(self.world_seeds) < 0:
            raise ConfigError(f"world_seeds={self.world_seeds}: one or more distinct seeds >= 0")
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds={self.seeds}: at least two distinct seeds (a spread needs two)")
        bad = [i for i in self.inits if i not in INITS]
        if bad or len(set(self.inits)) != len(self.inits) or not self.inits:
            raise ConfigError(f"inits={self.inits}: distinct values from {INITS}")
        check_step_budgets(self)
        if self.curve.points - 1 > self.train_steps:
            raise ConfigError(f"curve.points={self.curve.points} needs train_steps >= {self.curve.points - 1} "
                              f"(one checkpoint per budget), got {self.train_steps}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"confidence={self.confidence}: expected a level in [0.5, 1)")
        if self.primary_knob not in [f"{k.num_steps}/{k.topk}/{k.num_draft_tokens}" for k in self.curve.knobs]:
            raise ConfigError(f"primary_knob={self.primary_knob!r} is not one of curve.knobs")
        if self.num_threads < 0:
            raise ConfigError(f"num_threads={self.num_threads}: must be >= 0 (0 = auto)")
        check_choice("eval_device", self.eval_device, DEVICES)


register_stage("study", StudyConfig)
