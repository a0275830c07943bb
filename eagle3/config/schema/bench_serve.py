"""Schema of the bench-serve stage config (`conf/bench_serve.yaml`): live servers measured (a baseline
without speculation, one or more with), the replay of their own generations, the cost split fitted
from their timings and the knob search under it (eval/bench_serve.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from eagle3.config.choices import DEVICES, FLOAT_DTYPES, SERVE_ENGINES
from eagle3.config.conf import ConfigError, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf, WandbConf
from eagle3.config.schema.study import KnobGridConf
from eagle3.engines.serve_launch import SpecKnobs


@dataclass
class ServerConf:
    """One running server. Speculative ones state the knobs they were started with (SGLang's
    --speculative-num-steps / -eagle-topk / -num-draft-tokens; vLLM: num_speculative_tokens = num_steps,
    a chain: topk 1, num_draft_tokens = num_steps + 1)."""
    name: str = "baseline"
    url: str = "http://127.0.0.1:30000"
    engine: str = "sglang"            # sglang | vllm
    speculative: bool = False
    num_steps: int = 2
    topk: int = 1
    num_draft_tokens: int = 3
    port: Optional[int] = None        # for the printed launch line; default: the url's port

    @property
    def label(self) -> str:
        return f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}" if self.speculative else "baseline"

    def validate(self) -> None:
        if self.engine not in SERVE_ENGINES:
            raise ConfigError(f"server {self.name}: engine={self.engine!r}, expected one of {SERVE_ENGINES}")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"server {self.name}: url={self.url!r} is not an http(s) URL")
        if self.speculative:
            try:
                SpecKnobs(self.num_steps, self.topk, self.num_draft_tokens)
            except ValueError as e:
                raise ConfigError(f"server {self.name}: {e}") from e
            if self.engine == "vllm" and (self.topk != 1 or self.num_draft_tokens != self.num_steps + 1):
                raise ConfigError(f"server {self.name}: vLLM drafts a chain of num_speculative_tokens = num_steps: "
                                  f"topk 1 and num_draft_tokens = num_steps + 1 (got {self.label})")


@dataclass
class RequestConf:
    num_prompts: int = 8              # held-out prompts: the split's text before each first assistant token
    max_new_tokens: int = 64
    temperature: float = 0.0          # 0: greedy (what the replay can check)
    timeout_s: float = 300.0          # per request
    retries: int = 2                  # per request, after a timeout / connection error / 5xx
    backoff_s: float = 1.0

    def validate(self) -> None:
        if self.num_prompts < 1 or self.max_new_tokens < 2:
            raise ConfigError(f"request: num_prompts >= 1 and max_new_tokens >= 2 needed "
                              f"(got {self.num_prompts}, {self.max_new_tokens})")
        if self.temperature < 0 or self.timeout_s <= 0 or self.retries < 0:
            raise ConfigError("request: temperature >= 0, timeout_s > 0 and retries >= 0 needed")


@dataclass
class CompareConf:
    """The replay of the servers' own generations (eagle3/real_loop/check.py) with the same knobs."""
    enabled: bool = True
    device: str = "auto"
    dtype: str = "float32"
    gap_sigmas: float = 3.0           # a served-vs-replayed gap beyond this many standard errors is a finding

    def validate(self) -> None:
        if self.device not in DEVICES or self.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"compare: device in {DEVICES}, dtype in {FLOAT_DTYPES}")


@dataclass
class LaunchConf:
    """What the printed launch lines name (the stage never starts a server)."""
    tp: Optional[int] = None          # null: 8 for the real Kimi-K2.5 (eagle3/engines/serve_launch.tensor_parallel)
    speculators_dir: Optional[str] = None   # vLLM's drafter directory (export's speculators dir)


@dataclass
class BenchServeConfig:
    paths: PathsConf
    target: TargetConf
    name: str                         # bench-serve-<name>
    drafter_dir: str                  # the drafter the speculative servers load (the replay loads it too)
    capture_dir: str                  # prompts come from <capture_dir>/<split>
    out_dir: str
    split: str = "validation"
    baseline: ServerConf = field(default_factory=ServerConf)
    servers: List[ServerConf] = field(default_factory=lambda: [
        ServerConf("spec-2-1-3", "http://127.0.0.1:30001", speculative=True, num_steps=2, topk=1, num_draft_tokens=3),
        ServerConf("spec-3-1-3", "http://127.0.0.1:30002", speculative=True, num_steps=3, topk=1, num_draft_tokens=3)])
    request: RequestConf = field(default_factory=RequestConf)
    compare: CompareConf = field(default_factory=CompareConf)
    anchor_baseline: bool = True      # the plain decode step is a one-token verify in the cost fit (eagle3/replay/cost_fit.py)
    knob_grid: KnobGridConf = field(default_factory=KnobGridConf)   # the knob search under the measured costs
    launch: LaunchConf = field(default_factory=LaunchConf)
    wandb: WandbConf = field(default_factory=WandbConf)
    progress: bool = True
    only: List[str] = field(default_factory=list)   # measure just these servers now (one GPU machine serves one
                                                    # setting at a time); servers with complete logs need not be up
    force: bool = False               # drop finished requests (of the servers measured now) and measure again
    seed: int = 0
    init: Optional[InitConf] = None

    def validate(self) -> None:
        if not self.servers:
            raise ConfigError("servers: give at least one speculative server")
        if self.baseline.speculative:
            raise ConfigError("baseline.speculative=true: the baseline is the server without speculation")
        self.baseline.validate()
        names = [self.baseline.name] + [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ConfigError(f"server names must differ: {names}")
        for s in self.servers:  # to_schema's tree walk does not descend into lists
            if not s.speculative:
                raise ConfigError(f"server {s.name}: servers lists speculative servers (speculative: true)")
            s.validate()
        unknown = [n for n in self.only if n not in names]
        if unknown:
            raise ConfigError(f"only={list(self.only)}: {unknown} name no server (servers: {names})")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: a non-empty directory name (bench-serve-<name>) is needed")


register_stage("bench_serve", BenchServeConfig)
