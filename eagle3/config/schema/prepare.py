"""Schema of the prepare stage config (`conf/prepare.yaml`): tokenise conversations with the
target's chat template, build the assistant-only loss mask, optionally regenerate the
assistant turns with the target first."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from eagle3.config.choices import OVERLONG_POLICIES, REGEN_BACKENDS
from eagle3.config.conf import ConfigError, check_choice, register_stage
from eagle3.config.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class OpenAIBackendConf:
    """Any OpenAI-compatible `/v1/chat/completions` server (SGLang, vLLM, data/openai_server.py)."""
    base_url: str = "http://127.0.0.1:30000/v1"
    model: str = "default"
    api_key_env: str = "OPENAI_API_KEY"  # name of the env var holding the key (never the key itself)
    concurrency: int = 8  # conversations in flight at once (threads)
    timeout_s: float = 300.0  # per request
    max_retries: int = 5  # per request, on 5xx / 429 / connection errors / timeouts / malformed replies
    backoff_s: float = 1.0  # first retry waits this long, doubling up to backoff_max_s (with jitter)
    backoff_max_s: float = 30.0

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"regenerate.openai.concurrency={self.concurrency}: must be >= 1")
        if self.max_retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ConfigError("regenerate.openai: max_retries >= 0, timeout_s > 0 and backoff_s >= 0 are required")


@dataclass
class RegenerateConf:
    backend: str = "none"  # none | hf (local, batched) | openai (any /v1/chat/completions server)
    temperature: float = 0.0  # 0 = greedy (the default: the drafter learns the target's argmax path)
    top_p: float = 1.0
    max_new_tokens: int = 256
    batch_size: int = 8  # hf backend: conversations generated together (left-padded)
    max_conversations: Optional[int] = None  # regenerate (and keep) only the first N valid conversations
    seed: int = 0
    # finished conversations (JSONL, appended + fsynced); null: <out_dir>/regenerated/<backend>-<settings hash>.jsonl
    out_file: Optional[str] = None
    # hf backend: keep (and generate) an answer only as far as its text re-tokenizes to the generated
    # tokens, so the stored turns are exactly the target's greedy output (data/round_trip.py)
    cut_at_round_trip: bool = True
    # hf backend: never complete an n-gram this long that the conversation already holds (transformers'
    # `no_repeat_ngram_size`; 0 = off). A small target's greedy text loops; the guard breaks the loop, and the
    # stored token differs from the target's argmax only where it fired (the accept sim counts those as
    # mismatches: eagle3/replay/accept_sim.py)
    no_repeat_ngram_size: int = 0
    # hf backend, temperature > 0: sample only the first N tokens of each answer, greedy after them (0: every token
    # sampled). A small target's greedy answers barely depend on the prompt; a sampled opening sets them apart
    # while the rest of each answer stays the target's argmax path
    sampled_opening_tokens: int = 0
    # hf backend: never pick a token whose answer text would not re-tokenize to the generated tokens; the next
    # candidate (greedy: the next most likely; sampled: the next under the same noise) is taken instead. A small
    # target often picks such tokens, and `cut_at_round_trip` would end the answer there; with this on, the answer
    # goes on, and the stored token differs from the argmax only where the veto fired (data/round_trip.py); the
    # manifest counts the refused picks (regenerate.canonical_vetoed_tokens)
    canonical_tokens: bool = False
    openai: OpenAIBackendConf = field(default_factory=OpenAIBackendConf)

    def validate(self) -> None:
        check_choice("regenerate.backend", self.backend, REGEN_BACKENDS)
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("regenerate: temperature >= 0 and 0 < top_p <= 1 are required")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ConfigError("regenerate: max_new_tokens and batch_size must be >= 1")
        if self.no_repeat_ngram_size < 0 or self.no_repeat_ngram_size == 1:
            raise ConfigError(f"regenerate.no_repeat_ngram_size={self.no_repeat_ngram_size}: 0 (off) or >= 2 "
                              "(1 would forbid every token already in the conversation)")
        if self.sampled_opening_tokens < 0 or (self.sampled_opening_tokens and self.temperature <= 0):
            raise ConfigError(f"regenerate.sampled_opening_tokens={self.sampled_opening_tokens}: >= 0, and it needs "
                              "temperature > 0 (the opening's temperature)")
        if (self.no_repeat_ngram_size or self.sampled_opening_tokens or self.canonical_tokens) and self.backend != "hf":
            raise ConfigError(f"regenerate.no_repeat_ngram_size={self.no_repeat_ngram_size}, sampled_opening_tokens="
                              f"{self.sampled_opening_tokens} and canonical_tokens={self.canonical_tokens} need "
                              "backend=hf: the OpenAI chat API (SGLang, vLLM) has no n-gram guard, sampled opening or "
                              "token veto, so the server's text would not be what the settings say")


@dataclass
class PrepareConfig:
    paths: PathsConf
    target: TargetConf
    input: str  # ShareGPT JSON array / JSONL file (the mini world's corpus by default), or a HF dataset directory
    out_dir: str
    # tokens per sequence after the chat template: 512 suits the mini world (its models train on the first
    # 384 tokens of a conversation); Kimi-K2.5: max_length=2048 or more (the README's commands pass it)
    max_length: int = 512
    on_overlong: str = "truncate"  # truncate: cut the tail; skip: drop records longer than max_length
    validation_fraction: float = 0.05  # share of conversations (by id hash) held out
    split_salt: str = "eagle3-split"  # changes the train/validation assignment
    max_records: Optional[int] = None  # read at most this many raw records (quick runs)
    num_examples_shown: int = 5  # skipped records listed per reason in the manifest
    regenerate: RegenerateConf = field(default_factory=RegenerateConf)
    seed: int = 0
    init: Optional[InitConf] = None  # unused; accepted so every stage composes with +init

    def validate(self) -> None:
        if self.max_length < 2:
            raise ConfigError(f"max_length={self.max_length}: must be >= 2")
        check_choice("on_overlong", self.on_overlong, OVERLONG_POLICIES)
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"validation_fraction={self.validation_fraction}: must be in [0, 1)")


register_stage("prepare", PrepareConfig)
