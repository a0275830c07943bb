"""Schema of `make demo` (conf/demo.yaml, pipeline/demo.py): the whole pipeline on the mini world. The
sizes (train_steps, k2_drafter_steps, the per-stage overrides) come from the demo_size group: cpu (default) | ci | gpu."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from eagle3.config.conf import ConfigError, register_stage
from eagle3.config.schema.common import PathsConf

# The stages whose settings the demo and the study forward from their own command line:
# `+train.unroll=reference +train.optim.fused=false` reaches the train stage as `unroll=reference
# optim.fused=false`, after the size preset's overrides (so it wins over them). One field each in
# ForwardedSettings below.
FORWARDED_STAGES = ("mini_world", "prepare", "capture", "vocab", "train", "eval", "export")


def setting_overrides(settings: Dict[str, Any], prefix: str = "") -> List[str]:
    """Nested settings as Hydra overrides: {'optim': {'fused': False}, 'unroll': 'reference'} ->
    ['optim.fused=false', 'unroll=reference'] (booleans and None as YAML writes them, lists as [a,b])."""
    def text(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if v is None:
            return "null"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(text(x) for x in v) + "]"
        return str(v)
    out: List[str] = []
    for key, v in settings.items():
        if isinstance(v, dict):
            out += setting_overrides(v, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={text(v)}")
    return out


def forward_settings(cfg, reserved: Dict[str, str]) -> None:
    """Move every forwarded stage setting of `cfg` (a demo or study config: one dict field per
    FORWARDED_STAGES entry) to the end of that stage's `cfg.overrides` list, once. `reserved`: the
    keys the orchestrator sets itself ('train.seed': 'use seeds=[...]'), refused with that hint."""
    for stage in FORWARDED_STAGES:
        settings = getattr(cfg, stage)
        over = setting_overrides(settings)
        for o in over:
            key = f"{stage}.{o.split('=', 1)[0]}"
            hint = next((h for k, h in reserved.items() if key == k or key.startswith(k + ".")), None)
            if hint is not None:
                raise ConfigError(f"+{key} is set by the {type(cfg).__name__.replace('Config', '').lower()} "
                                  f"itself: {hint}")
        getattr(cfg.overrides, stage).extend(over)
        settings.clear()


def check_step_budgets(cfg) -> None:
    """train_steps and k2_drafter_steps >= 1 (the demo's, the study's and the A/B's sizes)."""
    for key in ("train_steps", "k2_drafter_steps"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)}: must be >= 1")


@dataclass
class StageOverrides:
    """Extra Hydra overrides the demo passes to each stage (its size preset)."""
    mini_world: list[str] = field(default_factory=list)
    prepare: list[str] = field(default_factory=list)
    prepare_k25: list[str] = field(default_factory=list)  # after `prepare`, for the K2.5 side only (the experiment)
    capture: list[str] = field(default_factory=list)
    vocab: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    export: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class ForwardedSettings:
    """Stage settings given on the demo's or the study's command line (FORWARDED_STAGES):
    `+train.unroll=reference` reaches the train stage (forward_settings moves them into `overrides`)."""
    mini_world: Dict[str, Any] = field(default_factory=dict)
    prepare: Dict[str, Any] = field(default_factory=dict)
    capture: Dict[str, Any] = field(default_factory=dict)
    vocab: Dict[str, Any] = field(default_factory=dict)
    train: Dict[str, Any] = field(default_factory=dict)
    eval: Dict[str, Any] = field(default_factory=dict)
    export: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoConfig(ForwardedSettings):
    paths: PathsConf
    out_dir: str
    train_steps: int                  # optimizer steps of each K2.5 drafter (the comparison's equal budget)
    # optimizer steps of the K2 drafter built on k2-mini (aqmedai-k2-mini, build_experiment) alone: AQ-MedAI
    # trained theirs far longer than a fine-tune, and the question is whether such a drafter is a good start
    k2_drafter_steps: int
    overrides: StageOverrides = field(default_factory=StageOverrides)
    seed: int = 0                     # the world seed: the mini world's (its split, tokenizer data, models' weights)
    # torch threads for every stage; 0 = auto (eagle3/cpu_threads.py): all cores when idle OpenMP threads
    # sleep (pipeline/run_demo.py sets OMP_WAIT_POLICY=PASSIVE unless the environment sets one)
    num_threads: int = 0
    # with image traffic in the K2.5 validation split: the from-K2 init trained image_embeddings=placeholder too
    # and both replayed under both conventions (pipeline/image_traffic.py: one extra train run, three replays)
    image_mismatch: bool = True
    # one short online run: the from-K2 init trained through a capped spool (pipeline/online_demo.py)
    online_run: bool = True

    def validate(self) -> None:
        forward_settings(self, {"mini_world.seed": "use seed=<world seed>", "train.max_steps": "use train_steps=<n>"})
        # checked before the demo builds anything (the mini world alone takes minutes)
        check_step_budgets(self)
        if self.num_threads < 0:
            raise ConfigError(f"num_threads={self.num_threads}: must be >= 0 (0 = auto)")


register_stage("demo", DemoConfig)
