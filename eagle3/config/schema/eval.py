"""Schema of the eval stage config (`conf/eval.yaml`): teacher-forced accuracy, simulated accept
length (drafter and n-gram), the real speculative-decoding check, and the cost model's verdict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from eagle3.config.choices import DEVICES, FLOAT_DTYPES, IMAGE_EMBEDDINGS, NGRAM_PREFER
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf, WandbConf
from eagle3.engines.serve_costs import preset_problem
from eagle3.engines.serve_launch import SpecKnobs


@dataclass
class KnobConf:
    """SGLang's --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens."""
    num_steps: int = 2
    topk: int = 1
    num_draft_tokens: int = 3

    def validate(self) -> None:
        try:
            SpecKnobs(self.num_steps, self.topk, self.num_draft_tokens)
        except ValueError as e:
            raise ConfigError(str(e)) from e


def default_knobs() -> List[KnobConf]:
    """The knob settings measured unless a config names others (eval's `knobs`, the study's `curve.knobs`):
    the account's setting, AQ-MedAI's published one, and a small tree."""
    return [KnobConf(2, 1, 3), KnobConf(3, 1, 4), KnobConf(3, 2, 6)]


def check_knobs(knobs: List[KnobConf], where: str) -> None:
    """At least one knob setting, each valid (to_schema's tree walk does not descend into lists)."""
    if not knobs:
        raise ConfigError(f"{where}: give at least one {{num_steps, topk, num_draft_tokens}} setting")
    for k in knobs:
        try:
            KnobConf.validate(k)  # the knob check itself (ServeConf.validate comes here too)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from e


@dataclass
class NgramConf:
    max_ngram: int = 3
    min_ngram: int = 1
    prefer: str = "recent"  # recent | first (Hugging Face prompt lookup)

    def validate(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"ngram: need 1 <= min_ngram ({self.min_ngram}) <= max_ngram ({self.max_ngram})")
        check_choice("ngram.prefer", self.prefer, NGRAM_PREFER)


@dataclass
class RealLoopConf:
    enabled: bool = True
    num_prompts: int = 4        # prompts = the validation sequences' text before their first assistant token
    max_new_tokens: int = 48
    stop_at_eos: bool = True

    def validate(self) -> None:
        if self.num_prompts < 0 or self.max_new_tokens < 2:
            raise ConfigError(f"real_loop: num_prompts >= 0 and max_new_tokens >= 2 needed "
                              f"(got {self.num_prompts}, {self.max_new_tokens})")


@dataclass
class CostConf:
    """Latencies for the verdict. `preset` names eagle3.engines.serve_costs.PRESETS or is `measured:<file>` (a preset
    `make bench-serve` measured on a live server; eagle3/engines/serve_costs.py); a non-null field overrides it."""
    preset: Optional[str] = "account_8gpu_pcie"  # 82 tok/s baseline, ~30 ms per verify cycle (8 GPUs over PCIe)
    baseline_tok_s: Optional[float] = None
    verify_ms: Optional[float] = None
    verify_ms_per_token: Optional[float] = None
    draft_step_ms: Optional[float] = None
    draft_extend_ms: Optional[float] = None

    def validate(self) -> None:
        if (problem := preset_problem(self.preset)) is not None:
            raise ConfigError(problem)
        if self.preset is None and (self.baseline_tok_s is None or self.verify_ms is None):
            raise ConfigError("cost: without a preset give at least cost.baseline_tok_s and cost.verify_ms")


@dataclass
class EvalConfig:
    paths: PathsConf
    target: TargetConf
    name: str                   # eval-<name>; default: the init's name
    drafter_dir: str            # default: train-<name>/final
    train_dir: Optional[str]    # for the accept-length-over-training plot (its metrics.jsonl), if present
    capture_dir: str            # the capture stage directory; the store read is <capture_dir>/<split>
    out_dir: str
    split: str = "validation"
    device: str = "auto"        # auto | cpu | cuda
    dtype: str = "float32"      # the drafter's dtype during eval
    max_sequences: Optional[int] = None  # null: the whole split
    ttt_length: int = 7
    # what the drafter embeds at image rows, in the replay and the real loop: fused (SGLang: the store's fused
    # rows) | placeholder (vLLM: embed(<|media_pad|>)) | auto (the export's engine, SGLang: fused);
    # eagle3/drafter/image_embeddings.py. Text-only stores read the same under all three.
    image_embeddings: str = "auto"
    knobs: List[KnobConf] = field(default_factory=default_knobs)  # SGLang's three speculative knobs
    ngram: NgramConf = field(default_factory=NgramConf)
    real_loop: RealLoopConf = field(default_factory=RealLoopConf)
    cost: CostConf = field(default_factory=CostConf)  # the server the verdict is for; null fields come from the preset
    wandb: WandbConf = field(default_factory=WandbConf)
    progress: bool = True
    force: bool = False         # redo even when a finished eval with the same config and inputs exists
    seed: int = 0
    init: Optional[InitConf] = None

    def validate(self) -> None:
        check_choice("device", self.device, DEVICES)
        check_choice("dtype", self.dtype, FLOAT_DTYPES)
        check_choice("image_embeddings", self.image_embeddings, IMAGE_EMBEDDINGS)
        check_knobs(self.knobs, "knobs")
        if self.ttt_length < 1:
            raise ConfigError(f"ttt_length={self.ttt_length}: must be >= 1")
        if self.max_sequences is not None and self.max_sequences < 1:
            raise ConfigError(f"max_sequences={self.max_sequences}: must be >= 1 or null")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: a non-empty directory name (eval-<name>) is needed")


register_stage("eval", EvalConfig)
