"""How a drafter is launched on a server: the image rows each engine feeds it (ENGINE_DEFAULT), SGLang's three
speculative knobs and their rule (SpecKnobs), the knobs chosen for it (ServeChoice) and the SGLang / vLLM launch lines (standard library only). Shared by the export's
SERVE.md (export/serving.py), bench-serve (eval/serve_measure.py), the config schemas and the replay."""
from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

# What each engine feeds the drafter at image rows (eagle3/drafter/image_embeddings.py): SGLang the target's fused
# input embeddings, vLLM's Eagle3LlamaForCausalLM the drafter's own embedding of the placeholder token.
ENGINE_DEFAULT = {"sglang": "fused", "vllm": "placeholder"}
EXPORT_ENGINE = "sglang"  # the engine `auto` follows: the export's SGLang directory is the one SERVE.md serves first


def default_for_engine(engine: str) -> str:
    """The image-row convention an engine serves with (SGLang fused, vLLM placeholder)."""
    if engine not in ENGINE_DEFAULT:
        raise ValueError(f"engine {engine!r}: no image embedding convention known (one of {sorted(ENGINE_DEFAULT)})")
    return ENGINE_DEFAULT[engine]


@dataclass(frozen=True)
class SpecKnobs:
    """SGLang's --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens."""
    num_steps: int = 2
    topk: int = 1
    num_draft_tokens: int = 3

    def __post_init__(self):
        if self.num_steps < 1 or self.topk < 1:
            raise ValueError(f"{self}: num_steps and topk must be >= 1")
        if not 2 <= self.num_draft_tokens <= 1 + self.num_candidates:
            raise ValueError(f"{self}: num_draft_tokens must be in [2, {1 + self.num_candidates}] "
                             f"(the verified token plus at most topk + (num_steps-1)*topk^2 candidates)")

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def max_depth(self) -> int:
        """Deepest draft position a tree can reach (a chain of num_draft_tokens-1 nodes at most)."""
        return min(self.num_steps, self.num_draft_tokens - 1)

    @property
    def label(self) -> str:
        return f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}"


@dataclass
class ServeChoice:
    num_steps: int
    topk: int
    num_draft_tokens: int
    source: str                                  # where the knobs came from (report path or "config")
    accept_length: Optional[float] = None        # simulated, SGLang convention (bonus token included)
    speedup: Optional[float] = None              # predicted tok/s with speculation / without
    predicted_tok_s: Optional[float] = None
    baseline_tok_s: Optional[float] = None
    break_even_accept_length: Optional[float] = None
    verdict: str = ""                            # the eval stage's go / no-go sentence
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def tensor_parallel(target: Any, tp: Optional[int]) -> Optional[int]:
    """`tp` when given; 8 for the real Kimi-K2.5 (one replica spans 8 GPUs, it needs remote code);
    None (flag omitted) for models that fit one GPU."""
    if tp is not None:
        return int(tp)
    return 8 if (target.layout == "kimi_k25" and target.trust_remote_code) else None


def sglang_command(target: Any, draft_dir: str | Path, choice: ServeChoice, tp: Optional[int],
                   extra_args: list[str]) -> list[str]:
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(target.path),
           "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
           "--speculative-num-steps", str(choice.num_steps), "--speculative-eagle-topk", str(choice.topk),
           "--speculative-num-draft-tokens", str(choice.num_draft_tokens)]
    if target.trust_remote_code:
        cmd.append("--trust-remote-code")
    if tp:
        cmd += ["--tp", str(tp)]
    return cmd + list(extra_args)


def vllm_command(target: Any, speculators_dir: str | Path, choice: ServeChoice, tp: Optional[int]) -> list[str]:
    spec = {"method": "eagle3", "model": str(speculators_dir), "num_speculative_tokens": choice.num_steps}
    cmd = ["vllm", "serve", str(target.path), "--speculative-config", json.dumps(spec)]
    if target.trust_remote_code:
        cmd.append("--trust-remote-code")
    if tp:
        cmd += ["--tensor-parallel-size", str(tp)]
    return cmd


def shell(cmd: list[str]) -> str:
    """A copy-pasteable multi-line shell command (flags on their own lines)."""
    parts, line = [], [shlex.quote(cmd[0])]
    for tok in cmd[1:]:
        if tok.startswith("--") and line:
            parts.append(" ".join(line))
            line = []
        line.append(shlex.quote(tok))
    parts.append(" ".join(line))
    return " \\\n    ".join(parts)
