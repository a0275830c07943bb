"""What a live SGLang or vLLM server says about speculative decoding: the ONE home of every field and
counter name `make bench-serve` reads, per engine version, and of the readings built on them.
An engine rename is a fix here; the bench-serve stage (eval/bench_serve.py) and the test stand-ins
(tests/standins/serve_standin.py) only call these functions. Standard library only.

SGLang, read from the PyPI wheels (python/sglang/srt/managers/tokenizer_manager.py,
`_calculate_spec_decoding_metrics`, and entrypoints/http_server.py) of 0.5.2, 0.5.3, 0.5.4, 0.5.5,
0.5.6, 0.5.7, 0.5.8, 0.5.9, 0.5.10, 0.5.11, 0.5.12, 0.5.13, 0.5.16, 0.5.19, 0.5.20, 0.5.21 and 0.5.23.
The final `/generate` reply's `meta_info` of a request served with speculation:
  0.5.2 - 0.5.3    spec_verify_ct only
  0.5.4 - 0.5.5    + spec_accept_rate (its divisor: verify_ct * num_steps), spec_accept_length
  0.5.6 - 0.5.10   + spec_accept_token_num / spec_draft_token_num (divisor: verify_ct * (num_draft_tokens - 1));
                   spec_accept_histogram from 0.5.9
  0.5.11           spec_accepted_drafts / spec_proposed_drafts, spec_accept_histogram
  0.5.12 - 0.5.20  spec_num_correct_drafts / spec_num_proposed_drafts, spec_correct_drafts_histogram,
                   the 0.5.11 names kept as aliases ("remove in next release")
  0.5.21 -         spec_num_correct_drafts / spec_num_proposed_drafts, spec_correct_drafts_histogram only
Everywhere spec_accept_length = completion_tokens / spec_verify_ct: the prefill's token is counted
too, so it reads above the replay's tokens per cycle (eagle3/replay/accept_sim.py, whose first generated
token is the prefill's, no cycle); `decode_tokens_per_verify` is the comparable figure. A histogram
entry i counts verify steps that accepted i drafts (no bonus). `/get_server_info` (deprecated from
0.5.2x in favour of `/server_info`, same body) holds the server args at the top level
(`speculative_algorithm`, `speculative_num_steps`, ..., `speculative_draft_model_path`, `model_path`),
`version`, and `internal_states[i].avg_spec_accept_length` (cumulative since start, but computed in the
scheduler's decode log: absent until 40 decode batches with the default `--decode-log-interval` 40, then
refreshed only every 40, so it can lag the last requests of a run). From 0.5.6 every spec key of
meta_info, `spec_verify_ct` included, is written inside `if spec_verify_ct > 0`: a request that never
reached a verify step (one token, or EOS at prefill) carries none; 0.5.4-0.5.5 write spec_verify_ct 0,
spec_accept_rate 0.0 and spec_accept_length 0. The aux-id rule of eagle3/engines/aux_layers.py changed in 0.5.13 (deepseek_v2.py:
`if layer_ids and layer_ids[0] == 1` first there; 0.5.12 adds 1 always): `sglang_aux_rule`.

vLLM 0.34.0 (the PyPI wheel, commit g62d4bc3c7; vllm/v1/spec_decode/metrics.py, v1/metrics/loggers.py
labelnames ["model_name", "engine"]): Prometheus counters on `/metrics`, exposed with `_total`:
spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos
{position="0".."k-1"}; mean acceptance length = 1 + accepted / drafts (its docstring), per-position
acceptance = accepted_per_pos / drafts. Counters exist only on a server started with speculation.
Completions: `return_token_ids` -> `choices[0].token_ids` (streamed: the delta tokens per chunk).
None of this has been exercised against a running engine here (no GPU); tests/test_serve_protocol.py
checks the stand-ins speak exactly these names.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

SGLANG_VERSIONS_READ = ("0.5.2", "0.5.3", "0.5.4", "0.5.5", "0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10",
                        "0.5.11", "0.5.12", "0.5.13", "0.5.16", "0.5.19", "0.5.20", "0.5.21", "0.5.23")
VLLM_VERSION_READ = "0.34.0"
SGLANG_AUX_RULE_SINCE = (0, 5, 13)   # PR #25454 first in the 0.5.13 wheel

# SGLang meta_info names
VERIFY_CT = "spec_verify_ct"
COMPLETION_TOKENS = "completion_tokens"
PROMPT_TOKENS = "prompt_tokens"
ACCEPT_LENGTH = "spec_accept_length"
ACCEPT_RATE = "spec_accept_rate"
# (accepted, proposed) draft-count names, newest first: the reader takes the first pair present
DRAFT_COUNT_NAMES = (("spec_num_correct_drafts", "spec_num_proposed_drafts"),   # 0.5.12 -
                     ("spec_accepted_drafts", "spec_proposed_drafts"),          # 0.5.11 (aliases to 0.5.20)
                     ("spec_accept_token_num", "spec_draft_token_num"))         # 0.5.6 - 0.5.10
HISTOGRAM_NAMES = ("spec_correct_drafts_histogram", "spec_accept_histogram")   # 0.5.12 - ; 0.5.9 - 0.5.20
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")  # newest first; the old one answers everywhere read
AVG_ACCEPT_LENGTH = "avg_spec_accept_length"              # internal_states[i]
SPEC_ALGORITHM = "speculative_algorithm"
SPEC_DRAFT_PATH = "speculative_draft_model_path"
SPEC_KNOB_ARGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")

# vLLM Prometheus names as exposed (a prometheus_client Counter adds `_total`)
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_POSITION_LABEL = "position"
VLLM_LABELS = ("model_name", "engine")


def version_tuple(v: str) -> tuple[int, ...]:
    """'0.5.12.post1' -> (0, 5, 12)."""
    nums = re.findall(r"\d+", v.split("post")[0].split("rc")[0].split("+")[0])
    if not nums:
        raise ValueError(f"not a version: {v!r}")
    return tuple(int(n) for n in nums[:3])


def sglang_aux_rule(version: Optional[str]) -> Optional[str]:
    """The eagle3/engines/aux_layers.py rule a SGLang version reads drafter aux ids by (None: version unknown)."""
    if not version:
        return None
    return "sglang" if version_tuple(version) >= SGLANG_AUX_RULE_SINCE else "sglang_legacy"


def sglang_meta_fields(version: str) -> tuple[str, ...]:
    """The speculative fields a finished /generate reply's meta_info carries in that SGLang version."""
    v = version_tuple(version)
    if v < (0, 5, 2):
        raise ValueError(f"SGLang {version}: older than any version read ({SGLANG_VERSIONS_READ[0]})")
    names = [VERIFY_CT]
    if v >= (0, 5, 4):
        names += [ACCEPT_RATE, ACCEPT_LENGTH]
    if (0, 5, 6) <= v < (0, 5, 11):
        names += list(DRAFT_COUNT_NAMES[2])
    if v >= (0, 5, 12):
        names += list(DRAFT_COUNT_NAMES[0])
    if (0, 5, 11) <= v < (0, 5, 21):
        names += list(DRAFT_COUNT_NAMES[1])
    if v >= (0, 5, 12):
        names.append(HISTOGRAM_NAMES[0])
    if (0, 5, 9) <= v < (0, 5, 21):
        names.append(HISTOGRAM_NAMES[1])
    return tuple(names)


def sglang_spec_meta(version: str, *, verify_ct: int, completion_tokens: int, correct_drafts: int,
                     num_steps: int, num_draft_tokens: int, histogram: Sequence[int]) -> dict:
    """The speculative part of meta_info as that SGLang version computes it (for the stand-in)."""
    fields = sglang_meta_fields(version)
    out: dict = {VERIFY_CT: verify_ct}
    v = version_tuple(version)
    if verify_ct <= 0:
        if v >= (0, 5, 6):   # every key sits inside `if spec_verify_ct > 0`
            return {}
        return out if v < (0, 5, 4) else {**out, ACCEPT_RATE: 0.0, ACCEPT_LENGTH: 0}
    old_rate = v < (0, 5, 6)
    proposed = verify_ct * (num_steps if old_rate else num_draft_tokens - 1)
    if ACCEPT_RATE in fields:
        out[ACCEPT_RATE] = correct_drafts / proposed
        out[ACCEPT_LENGTH] = completion_tokens / verify_ct
    for acc, prop in DRAFT_COUNT_NAMES:
        if acc in fields:
            out[acc], out[prop] = correct_drafts, proposed
    for name in HISTOGRAM_NAMES:
        if name in fields and histogram:
            out[name] = list(histogram)
    return out


@dataclass
class SpecCounts:
    """One request's (or a whole run's) speculative counts, whichever engine reported them."""
    verify_steps: int                       # SGLang spec_verify_ct; vLLM num_drafts
    completion_tokens: int
    accepted: Optional[int] = None          # accepted drafts (no bonus); None: the version does not say
    proposed: Optional[int] = None
    per_position: Optional[list] = None     # accepted drafts at depth j+1 (vLLM), or from a histogram
    naming: str = ""                        # which names were read
    requests: int = 1                       # requests summed here (each has one prefill token)

    @property
    def engine_accept_length(self) -> float:
        """completion_tokens / verify steps: SGLang's spec_accept_length (prefill token included)."""
        return self.completion_tokens / self.verify_steps if self.verify_steps else float("nan")

    @property
    def decode_tokens_per_verify(self) -> float:
        """(completion_tokens - one per request) / verify steps: tokens per cycle after each prefill's token,
        the replay's convention (eagle3/replay/accept_sim.py)."""
        return (self.completion_tokens - self.requests) / self.verify_steps if self.verify_steps else float("nan")

    @property
    def drafts_accept_length(self) -> float:
        """1 + accepted / verify steps (vLLM's definition; SGLang where the counts are given)."""
        if self.accepted is None or not self.verify_steps:
            return float("nan")
        return 1.0 + self.accepted / self.verify_steps


def read_sglang_meta(meta: Mapping) -> Optional[SpecCounts]:
    """SpecCounts from a finished /generate meta_info; None when it carries no speculation."""
    if VERIFY_CT not in meta:
        return None
    naming = [VERIFY_CT]
    accepted = proposed = None
    for acc, prop in DRAFT_COUNT_NAMES:
        if acc in meta:
            accepted, proposed = int(meta[acc]), int(meta[prop]) if prop in meta else None
            naming.append(f"{acc}/{prop}")
            break
    per_pos = None
    for name in HISTOGRAM_NAMES:
        if meta.get(name):
            per_pos = per_position_from_histogram(meta[name])
            naming.append(name)
            break
    return SpecCounts(int(meta[VERIFY_CT]), int(meta[COMPLETION_TOKENS]), accepted, proposed, per_pos,
                      ", ".join(naming))


def per_position_from_histogram(histogram: Sequence[int]) -> list[int]:
    """hist[i] = verify steps that accepted i drafts -> accepted drafts at depth j+1 = steps with > j."""
    return [sum(histogram[j + 1:]) for j in range(max(len(histogram) - 1, 0))]


def server_info_speculation(info: Mapping) -> dict:
    """What /get_server_info says of speculation: algorithm (None: off), knobs, draft path, version, and
    avg_spec_accept_length of the first internal state that has it."""
    states = info.get("internal_states") or []
    avg = next((s[AVG_ACCEPT_LENGTH] for s in states if isinstance(s, Mapping) and AVG_ACCEPT_LENGTH in s), None)
    algo = info.get(SPEC_ALGORITHM)
    return {"algorithm": algo if algo not in ("", "NONE", "None") else None,
            "knobs": [info.get(k) for k in SPEC_KNOB_ARGS], "draft_model_path": info.get(SPEC_DRAFT_PATH),
            "model_path": info.get("model_path"), "version": info.get("version"), "avg_spec_accept_length": avg}


# --- vLLM /metrics --------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text exposition -> [(name, labels, value)] (comments skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), float(m.group(4))))
    return out


@dataclass
class VllmCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: dict = field(default_factory=dict)   # position -> accepted tokens
    present: bool = False                              # the spec-decode counters exist (speculation on)

    def minus(self, before: "VllmCounters") -> "VllmCounters":
        pos = {p: v - before.per_position.get(p, 0.0) for p, v in self.per_position.items()}
        return VllmCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, pos, self.present)

    def counts(self, completion_tokens: int) -> SpecCounts:
        per_pos = [int(round(self.per_position[p])) for p in sorted(self.per_position)] or None
        return SpecCounts(int(round(self.drafts)), completion_tokens, int(round(self.accepted)),
                          int(round(self.draft_tokens)), per_pos,
                          f"{VLLM_DRAFTS}, {VLLM_DRAFT_TOKENS}, {VLLM_ACCEPTED}, {VLLM_ACCEPTED_PER_POS}")


def read_vllm_counters(text: str) -> VllmCounters:
    """The spec-decode counters summed over engines / models (a server serves one model here)."""
    c = VllmCounters()
    for name, labels, value in parse_prometheus(text):
        if name == VLLM_DRAFTS:
            c.drafts += value
            c.present = True
        elif name == VLLM_DRAFT_TOKENS:
            c.draft_tokens += value
        elif name == VLLM_ACCEPTED:
            c.accepted += value
        elif name == VLLM_ACCEPTED_PER_POS:
            p = int(labels[VLLM_POSITION_LABEL])
            c.per_position[p] = c.per_position.get(p, 0.0) + value
    return c


def vllm_metrics_text(model_name: str, drafts: int, draft_tokens: int, accepted: int,
                      accepted_per_pos: Sequence[int], engine: int = 0) -> str:
    """The spec-decode part of vLLM 0.34.0's /metrics as prometheus_client writes it (for the stand-in)."""
    lab = f'engine="{engine}",model_name="{model_name}"'
    lines = []
    for base, doc, value in (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts),
                             ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", draft_tokens),
                             ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted)):
        lines += [f"# HELP {base}_total {doc}", f"# TYPE {base}_total counter", f"{base}_total{{{lab}}} {float(value)}"]
    base = "vllm:spec_decode_num_accepted_tokens_per_pos"
    lines += [f"# HELP {base}_total Accepted tokens per draft position.", f"# TYPE {base}_total counter"]
    lines += [f'{base}_total{{{lab},position="{p}"}} {float(v)}' for p, v in enumerate(accepted_per_pos)]
    return "\n".join(lines) + "\n"


def pooled(counts: Sequence[SpecCounts]) -> SpecCounts:
    """Sum of requests (the engines' pooled figure: totals over totals)."""
    acc = [c.accepted for c in counts]
    pos = [c.per_position for c in counts]
    width = max((len(p) for p in pos if p), default=0)
    per_pos = [sum((p[j] if p and j < len(p) else 0) for p in pos) for j in range(width)] if width else None
    return SpecCounts(sum(c.verify_steps for c in counts), sum(c.completion_tokens for c in counts),
                      None if any(a is None for a in acc) else sum(acc),
                      None if any(c.proposed is None for c in counts) else sum(c.proposed for c in counts),
                      per_pos, counts[0].naming if counts else "", sum(c.requests for c in counts))


def mean_finite(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")
