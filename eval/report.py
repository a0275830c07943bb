"""The eval report, measured (eval/stage.py is the recipe around it): the drafter loaded on the capture's
validation store, its teacher-forced accuracy and replayed accept length (eagle3/replay/evaluate.py), the cost
model's verdict per knob setting from the configured server (`cost`), the best setting, and the real speculative
loop against the target on the store's first prompts.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from eagle3.config.conf import as_plain_dict
from eagle3.config.schema.eval import EvalConfig
from eagle3.drafter.image_embeddings import rows_problem
from eagle3.engines.serve_costs import Latencies, resolve_preset
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.replay.cost_model import predict
from eagle3.replay.evaluate import EvalInputError, NgramSettings, evaluate_drafter


def evaluate(cfg: EvalConfig, resolved: dict, store_dir: Path, drafter_dir: Path) -> dict:
    """The report: accuracy and replayed accept length on the store, the cost model, the real loop."""
    from eagle3.drafter.drafter_io import load_drafter_dir
    from eagle3.formats.store import HiddenStateStore
    from eagle3.target_model.target_io import load_embed_tokens

    t0 = time.time()
    device, image_embeddings = resolved["device"], resolved["image_embeddings"]
    knobs = [SpecKnobs(k.num_steps, k.topk, k.num_draft_tokens) for k in cfg.knobs]
    torch.manual_seed(cfg.seed)
    store = HiddenStateStore(store_dir)
    if problem := rows_problem(image_embeddings, store, cfg.image_embeddings):  # a vLLM capture has no fused rows
        raise EvalInputError(problem)
    embed = load_embed_tokens(cfg.target.path, cfg.target.layout)
    drafter = load_drafter_dir(drafter_dir, embed_tokens=embed, device=device, dtype=cfg.dtype).eval()
    report = {"name": cfg.name, "drafter_dir": str(drafter_dir), "store": str(store_dir), "device": device}
    report.update(evaluate_drafter(drafter, store, knobs=knobs, ttt_length=cfg.ttt_length,
                                   max_sequences=cfg.max_sequences,
                                   ngram=NgramSettings(cfg.ngram.max_ngram, cfg.ngram.min_ngram, cfg.ngram.prefer),
                                   progress=cfg.progress, image_embeddings=image_embeddings))
    report["cost"] = cost_section(report, knobs, latencies_from_config(cfg.cost))
    report["best"] = best_setting(report, knobs)
    if cfg.real_loop.enabled and cfg.real_loop.num_prompts > 0:
        _real_loop(cfg, report, store, drafter, knobs, device, image_embeddings)
    report["seconds"] = time.time() - t0
    return report


def _real_loop(cfg: EvalConfig, report: dict, store, drafter, knobs: list[SpecKnobs], device: str,
               image_embeddings: str) -> None:
    """The real speculative loop against the target on the first validation prompts, into `report`."""
    from eagle3.real_loop.check import real_vs_simulated
    from eagle3.target_model.target_io import load_target, read_text_config

    prompts = prompts_from_store(store, cfg.real_loop.num_prompts)
    if store.image_token_id is not None and not store.has_fused_image_rows:
        report["warnings"].append("real loop on text prompts only: the store holds no fused image rows "
                                  "(image_rows='none', a vLLM capture), which the target's prefill of an "
                                  "image prompt reads")
    if not prompts:
        report["warnings"].append("real loop skipped: no validation sequence has a prompt before its first "
                                  "assistant token")
        return
    target, _ = load_target(cfg.target.path, cfg.target.layout, cfg.target.dtype, cfg.target.device_map,
                            cfg.target.trust_remote_code)
    if cfg.target.device_map is None:
        target.to(device)
    eos = read_text_config(cfg.target.path, cfg.target.layout).get("eos_token_id") \
        if cfg.real_loop.stop_at_eos else None
    images = prompt_images_from_store(store, cfg.real_loop.num_prompts, image_embeddings)
    report["real_loop"] = real_vs_simulated(target, drafter, prompts, knobs, cfg.real_loop.max_new_tokens, eos,
                                            images=images)
    bad = [k for k, r in report["real_loop"]["knobs"].items() if not r["lossless"]]
    if bad:
        report["warnings"].append(f"the real speculative loop was NOT lossless for {bad}: its output differs "
                                  f"from the target's greedy decode (numerics of the verify pass?)")


def latencies_from_config(cfg) -> Latencies:
    """The `cost` section: a named preset with per-field overrides."""
    base = resolve_preset(cfg.preset)
    pick = (lambda name, default=0.0: getattr(cfg, name) if getattr(cfg, name) is not None
            else (getattr(base, name) if base is not None else default))
    baseline_ms = 1000.0 / cfg.baseline_tok_s if cfg.baseline_tok_s is not None else base.baseline_token_ms
    changed = [n for n in ("baseline_tok_s", "verify_ms", "verify_ms_per_token", "draft_step_ms", "draft_extend_ms")
               if getattr(cfg, n) is not None]
    source = (f"preset {cfg.preset}" if cfg.preset else "config") + (f" with {', '.join(changed)} from config"
                                                                     if cfg.preset and changed else "")
    return Latencies(baseline_token_ms=baseline_ms, verify_ms=pick("verify_ms"),
                     verify_ms_per_token=pick("verify_ms_per_token"), draft_step_ms=pick("draft_step_ms"),
                     draft_extend_ms=pick("draft_extend_ms"), source=source)


def cost_section(report: dict, knobs: list[SpecKnobs], lat: Latencies) -> dict:
    """Predictions from the replayed accept length; where no cycle could be replayed (sequences not
    generated by the target), from the teacher-forced chain estimate, marked as such. The ceiling's
    prediction is what a drafter that is always right would gain on this store: the most any could."""
    by_knob = {}
    estimates = (report.get("accuracy") or {}).get("chain_estimate") or {}
    for k in knobs:
        entry = report["accept"][k.label]
        by_knob[k.label] = {}
        for name in ("drafter", "ngram", "ceiling"):
            if name not in entry:
                continue
            tau, source = entry[name]["accept_length"], "replay"
            if not (tau == tau) and name == "drafter" and k.label in estimates:  # NaN: no cycles
                tau, source = estimates[k.label], "teacher-forced chain estimate (no replayable cycle)"
            if tau == tau and tau >= 1.0:
                by_knob[k.label][name] = {**predict(tau, lat, k.num_steps, k.num_draft_tokens).to_dict(),
                                          "accept_length_source": source}
    return {"latencies": as_plain_dict(lat.__dict__), "by_knob": by_knob}


def best_setting(report: dict, knobs: list[SpecKnobs]) -> Optional[dict]:
    """The knob setting with the highest predicted speed-up for the drafter (what export's SERVE.md uses)."""
    scored = [(k, report["cost"]["by_knob"][k.label]["drafter"]) for k in knobs
              if "drafter" in report["cost"]["by_knob"].get(k.label, {})]
    if not scored:
        return None
    k, pred = max(scored, key=lambda kp: kp[1]["speedup"])
    return {"label": k.label, "num_steps": k.num_steps, "topk": k.topk, "num_draft_tokens": k.num_draft_tokens,
            "accept_length": pred["accept_length"], "speedup": pred["speedup"], "predicted_tok_s": pred["spec_tok_s"],
            "baseline_tok_s": pred["baseline_tok_s"], "break_even_accept_length": pred["break_even_accept_length"],
            "wins": pred["wins"], "verdict": pred["verdict"]}


def _prompt_items(store, n: int) -> list[tuple[dict, int]]:
    """(store item, prompt length) of the first n validation sequences with a prompt before an assistant token.
    A store without fused image rows (a vLLM capture) gives text prompts only: the target's prefill of an image
    prompt reads those rows (eagle3/real_loop/chain.py PromptImages)."""
    out = []
    blind = store.image_token_id is not None and not store.has_fused_image_rows
    for i in range(len(store)):
        if len(out) >= n:
            break
        s = store[i]
        where = s["loss_mask"].bool().nonzero()
        if blind and where.numel() and bool((s["input_ids"][: int(where[0])] == store.image_token_id).any()):
            continue
        if where.numel() and int(where[0]) >= 1:
            out.append((s, int(where[0])))
    return out


def prompts_from_store(store, n: int) -> list[torch.Tensor]:
    """The text before each validation sequence's first assistant token (what a user would send)."""
    return [s["input_ids"][:L].long() for s, L in _prompt_items(store, n)]


def prompt_images_from_store(store, n: int, convention: str) -> list:
    """Per prompt of prompts_from_store(store, n): its image rows (PromptImages: the store's fused rows of the
    prompt's image positions, read by the drafter under `convention`), or None for a text prompt."""
    from eagle3.real_loop.chain import PromptImages

    image_id, out = store.image_token_id, []
    for s, L in _prompt_items(store, n):
        k = 0 if image_id is None else int((s["input_ids"][:L] == image_id).sum())
        out.append(PromptImages(image_id, s["image_embeds"][:k], convention) if k else None)
    return out
