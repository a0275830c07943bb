"""The serve commands an export prints and writes to SERVE.md, and the choice of speculative knobs
behind them (the eval stage's best setting, with the simulated accept length and predicted speed-up
that justify it; the configured defaults when no eval report is there).

SGLang's knobs: `--speculative-num-steps` (draft depth), `--speculative-eagle-topk` (branching per step),
`--speculative-num-draft-tokens` (tokens verified per cycle, the root included). vLLM's speculators
format drafts a chain of `num_speculative_tokens` = num_steps tokens.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from eagle3.engines.serve_launch import ServeChoice, shell


def _first(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if isinstance(d, Mapping) and d.get(k) is not None:
            return d[k]
    return None


def choice_from_report(report: Mapping[str, Any], source: str) -> Optional[ServeChoice]:
    """The eval report's best setting, or None when it names none. Reads `best` (or `recommended`):
    {num_steps, topk, num_draft_tokens} directly or under `knobs`, the accept length / speed-up beside
    them; else picks from `accept` ({label: {knobs, drafter: {accept_length}, [prediction]: {speedup}}})
    the setting with the highest predicted speed-up, or the longest accept length without predictions."""
    best = _first(report, "best", "recommended", "best_setting")
    if isinstance(best, Mapping):
        return _choice(best, source, report)
    entries = [e for e in (report.get("accept") or {}).values() if isinstance(e, Mapping) and "knobs" in e]
    if not entries:
        return None
    flat = [{**e, **_flatten_prediction(e)} for e in entries]
    scored = [e for e in flat if e.get("speedup") is not None]
    if scored:
        pick = max(scored, key=lambda e: float(e["speedup"]))
        why = f"the highest predicted speed-up of {len(entries)} settings in the eval report"
    else:
        pick = max(flat, key=lambda e: float(e.get("accept_length") or 0.0))
        why = f"the longest simulated accept length of {len(entries)} settings (no speed-up prediction in the report)"
    choice = _choice(pick, source, report)
    if choice is not None:
        choice.note = why
    return choice


def _flatten_prediction(entry: Mapping[str, Any]) -> dict:
    """accept_length from the drafter's replay, speed-up etc. from a nested prediction/cost block."""
    out = {}
    drafter = entry.get("drafter")
    if isinstance(drafter, Mapping) and drafter.get("accept_length") is not None:
        out["accept_length"] = drafter["accept_length"]
    for key in ("prediction", "cost", "cost_model", "predicted"):
        block = entry.get(key)
        if isinstance(block, Mapping):
            out.update({k: v for k, v in block.items() if v is not None and not isinstance(v, Mapping)})
    return out


def _choice(best: Mapping[str, Any], source: str, report: Mapping[str, Any]) -> Optional[ServeChoice]:
    knobs = best.get("knobs") if isinstance(best.get("knobs"), Mapping) else best
    try:
        steps, topk, draft = (int(knobs[k]) for k in ("num_steps", "topk", "num_draft_tokens"))
    except (KeyError, TypeError, ValueError):
        return None

    def num(*keys: str) -> Optional[float]:
        v = _first(best, *keys)
        return None if v is None else float(v)

    return ServeChoice(
        num_steps=steps, topk=topk, num_draft_tokens=draft, source=source,
        accept_length=num("accept_length", "simulated_accept_length", "mean_accept_length"),
        speedup=num("speedup", "predicted_speedup"),
        predicted_tok_s=num("predicted_tok_s", "tok_s"),
        baseline_tok_s=num("baseline_tok_s") or _float_or_none(_first(report, "baseline_tok_s")),
        break_even_accept_length=num("break_even_accept_length", "break_even"),
        verdict=str(best.get("verdict") or ""),
    )


def _float_or_none(v: Any) -> Optional[float]:
    return None if v is None else float(v)


def read_serve_choice(eval_dir: str | Path, defaults: Any, use_report: bool = True) -> ServeChoice:
    """The knobs for SERVE.md: the eval report's best setting if present (and `use_report`), else
    `defaults` (an object with num_steps / topk / num_draft_tokens), saying why."""
    path = Path(eval_dir) / "report.json"
    fallback = ServeChoice(defaults.num_steps, defaults.topk, defaults.num_draft_tokens, source="config")
    if not use_report:
        fallback.note = "eval report not used (use_eval_report=false); knobs from config"
        return fallback
    if not path.is_file():
        fallback.note = f"no eval report at {path}; knobs from config, accept length not measured (run `make eval`)"
        return fallback
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: unreadable eval report ({e}); rerun `make eval` or set use_eval_report=false") from e
    choice = choice_from_report(report, str(path))
    if choice is None:
        fallback.note = f"{path} names no best setting; knobs from config"
        return fallback
    return choice


def speculators_embed_note(shipped: bool) -> str:
    """When the speculators directory needs the target's embedding: vLLM shares the target's; speculators 0.9.0's
    `Eagle3DraftModel.from_pretrained` reads a missing one from the verifier checkpoint (transformers 5.24 here) and
    was seen by an outside check to keep zeros instead (issue 20)."""
    if shipped:
        return ("`speculators/` also holds the target's `embed_tokens.weight` (export.speculators_embed=true, checked "
                "equal to the target's), for speculators' own Python API (evaluation, further training). vLLM 0.34.0 "
                "compares a shipped embedding with the target's and, finding it equal, shares the target's "
                "(the directory is about 2.3 GB larger for Kimi-K2.5 in bf16).")
    return ("`speculators/` holds no embedding: vLLM serving shares the target's. To evaluate or train this drafter "
            "through speculators' own Python API, export with `speculators_embed=true`: without it speculators "
            "0.9.0's `Eagle3DraftModel.from_pretrained` must read the embedding from the verifier checkpoint named in "
            "the config, and has been seen to keep an all-zero embedding without an error instead.")


def serve_markdown(*, name: str, target: Any, choice: ServeChoice, sglang_cmd: Optional[list[str]],
                   vllm_cmd: Optional[list[str]], facts: Mapping[str, Any], speculators_embed: bool = False,
                   images: Sequence[str] = ()) -> str:
    """SERVE.md: the commands, the knobs and the evidence behind them, image traffic (`images`: its lines,
    export/image_convention.py), what was checked."""
    def fmt(v: Optional[float], spec: str = ".2f") -> str:
        return "not measured" if v is None else format(v, spec)

    lines = [f"# Serving the `{name}` EAGLE-3 drafter", "",
             f"Target: `{target.path}` ({target.name}).", ""]
    if sglang_cmd:
        lines += ["## SGLang", "", "```bash", shell(sglang_cmd), "```", ""]
    if vllm_cmd:
        lines += ["## vLLM (speculators format)", "", "```bash", shell(vllm_cmd), "```", ""]
        if choice.topk > 1:
            lines += [f"vLLM drafts a chain of num_speculative_tokens = num_steps = {choice.num_steps}; the tree "
                      f"setting (topk {choice.topk}) and its accept length below apply to SGLang only.", ""]
        lines += [speculators_embed_note(speculators_embed), ""]
    lines += ["## Why these knobs", "",
              f"- num_steps / topk / num_draft_tokens: **{choice.num_steps} / {choice.topk} / "
              f"{choice.num_draft_tokens}** (from {choice.source})",
              f"- simulated accept length (tokens per verify cycle, bonus included): {fmt(choice.accept_length)}",
              f"- predicted speed-up over no speculation: {fmt(choice.speedup)}"
              + ("" if choice.speedup is None else
                 (" (predicted to beat no speculation)" if choice.speedup > 1 else
                  " (**predicted slower than no speculation**: do not deploy as is)")),
              ]
    if choice.predicted_tok_s is not None:
        lines.append(f"- predicted tok/s: {fmt(choice.predicted_tok_s, '.1f')} vs baseline {fmt(choice.baseline_tok_s, '.1f')}")
    if choice.break_even_accept_length is not None:
        lines.append(f"- break-even accept length on that server: {fmt(choice.break_even_accept_length)}")
    if choice.verdict:
        lines.append(f"- eval verdict: {choice.verdict}")
    if choice.note:
        lines.append(f"- note: {choice.note}")
    if images:
        lines += ["", "## Image traffic", "", *images]
    lines += ["", "## What the export checked", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items()]
    return "\n".join(lines) + "\n"
