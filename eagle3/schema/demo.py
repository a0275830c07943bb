"""Schema of `make demo` (conf/demo.yaml, eval/demo.py): the whole pipeline on the mini world. The
sizes (train_steps, the per-stage overrides) come from the demo_size group: cpu (default) | ci | gpu."""
from __future__ import annotations

from dataclasses import dataclass, field

from eagle3.conf import ConfigError, register_stage
from eagle3.schema.common import PathsConf


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


@dataclass
class DemoConfig:
    paths: PathsConf
    out_dir: str
    train_steps: int
    overrides: StageOverrides = field(default_factory=StageOverrides)
    seed: int = 0
    # torch threads for every stage; 0 = auto (eagle3/cpu_threads.py): all cores when idle OpenMP threads
    # sleep (eval/run_demo.py sets OMP_WAIT_POLICY=PASSIVE unless the environment sets one)
    num_threads: int = 0

    def validate(self) -> None:
        # checked before the demo builds anything (the mini world alone takes minutes)
        if self.train_steps < 1:
            raise ConfigError(f"train_steps={self.train_steps}: must be >= 1")
        if self.num_threads < 0:
            raise ConfigError(f"num_threads={self.num_threads}: must be >= 0 (0 = auto)")


register_stage("demo", DemoConfig)
