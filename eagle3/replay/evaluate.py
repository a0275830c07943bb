"""Evaluate a drafter on a validation hidden-state store: a plain function (model + store in,
a JSON-friendly dict out) that `eval/stage.py` and training's periodic validation both call.

  * teacher-forced accuracy per TTT step, as training measures it (ARCHITECTURE.md "TTT
    indexing": same positions `loss_mask[t+k+2] & t2d[argmax_{t+k+1}]`, same d2t mapping), plus
    the conditional accuracy P(step k right | steps < k right at the same position), which is
    what a draft chain needs;
  * the simulated accept length (eagle3/replay/accept_sim.py) for each SGLang knob setting, with the real
    drafter (eagle3/replay/drafter_session.py) and with n-gram prompt lookup on the same sequences.

Imports only torch and eagle3 core modules (runs on the GPU machine without hydra/wandb).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from eagle3.engines import aux_layers
from eagle3.replay.accept_sim import (AcceptStats, build_sglang_tree, leading_hits, replay_chain_runs, replay_perfect,
                                      replay_sequence)
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.replay.cost_model import accept_length_from_acceptance
from eagle3.errors import StageError
from eagle3.drafter.image_embeddings import rows_problem, token_embeddings
from eagle3.ttt.loss import loss_positions, shift_left
from eagle3.replay.ngram import PromptLookup
from eagle3.replay.drafter_session import SequenceDrafter
from eagle3.replay.tree_batch import all_cycle_trees
from eagle3.drafter.attention import TTTCache, ttt_position_ids

DEFAULT_KNOBS = (SpecKnobs(2, 1, 3), SpecKnobs(3, 1, 4))
MISMATCH_WARN = 0.02  # share of assistant positions where the store is not the target's greedy choice
COVERAGE_WARN = 0.9   # share of the target's greedy tokens the draft vocab must hold before we warn


@dataclass(frozen=True)
class NgramSettings:
    max_ngram: int = 3
    min_ngram: int = 1
    prefer: str = "recent"


class EvalInputError(StageError, ValueError):
    """Drafter and store that cannot be evaluated together (the message says what differs)."""


def drafter_store_problems(model, store) -> list[str]:
    """Why this drafter cannot be scored on this store; [] if it can."""
    cfg, out = model.config, []
    aux_width = len(store.hf_indices) * int(store.manifest.get("target_hidden_size", store.hidden_size))
    if model.fc.in_features != aux_width:
        out.append(f"drafter fc reads {model.fc.in_features} features, the store's aux states are {aux_width} wide "
                   f"({len(store.hf_indices)} layers x target hidden)")
    differ = aux_layers.reading_mismatch(cfg.aux_hf_indices, store.hf_indices)
    if differ:
        out.append(f"{differ}: SGLang would feed it other states than it sees here")
    if len(store):
        s = store[0]  # token ids beyond the drafter's vocab: the store comes from another tokenizer/target
        top = max(int(s["input_ids"].max()), int(s["target_argmax"].max())) if s["input_ids"].numel() else -1
        if top >= cfg.vocab_size:
            out.append(f"store sequence {s['id']!r} holds token id {top} >= the drafter's vocab_size {cfg.vocab_size} "
                       f"(store and drafter come from different targets / tokenizers)")
    return out


def _sequences(store, max_sequences: Optional[int]) -> range:
    n = len(store) if max_sequences is None else min(len(store), max_sequences)
    return range(n)


def _progress(it: Iterable, desc: str, total: int, enabled: bool):
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, unit="seq", leave=False)


TRAFFIC = ("text", "image")  # the eval's traffic split: a sequence with any image token is image traffic


def traffic_of(store, s: dict) -> str:
    """'image' when store item `s` holds an image token (its store's image_token_id), else 'text'."""
    image_id = getattr(store, "image_token_id", None)
    return "image" if image_id is not None and bool((s["input_ids"] == image_id).any()) else "text"


@torch.no_grad()
def sequence_embeds(model, store, s: dict, image_embeddings: str = "placeholder") -> Optional[torch.Tensor]:
    """The input embeddings [T, H] the drafter reads for store item `s` under the image_embeddings convention
    (eagle3/drafter/image_embeddings.py), or None when they are embed_tokens(input_ids)."""
    dev = model.fc.weight.device
    with torch.no_grad():
        return token_embeddings(model.embed_tokens, s["input_ids"].long().to(dev), image_embeddings,
                                getattr(store, "image_token_id", None), s.get("image_embeds"))


def teacher_forced_hits(model, aux: torch.Tensor, input_ids: torch.Tensor, target_argmax: torch.Tensor,
                        loss_mask: torch.Tensor, ttt_length: int,
                        embeds: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The TTT unroll of one sequence, forward only. Returns (hits, valid), Bool [K, T]: at step k,
    drafter position t predicts x_{t+k+2}; hits[k, t] = (its argmax, via d2t) == target_argmax[t+k+1];
    valid[k, t] = training's loss positions (loss_mask[t+k+2] & t2d[argmax_{t+k+1}]). embeds [T, H]: the
    input embeddings when not embed_tokens(input_ids) (image rows under fused), shifted like the ids."""
    dev = model.fc.weight.device
    T = input_ids.numel()
    ids = input_ids.long().to(dev)[None]
    argmax = target_argmax.long().to(dev)[None]
    mask = loss_mask.bool().to(dev)[None]
    pos = torch.arange(T, device=dev)[None]
    hidden = model.project_aux(aux.to(dev)[None])
    cache = TTTCache()
    hits = torch.zeros(ttt_length, T, dtype=torch.bool, device=dev)
    valid = torch.zeros_like(hits)
    for k in range(ttt_length):
        emb = None if embeds is None else shift_left(embeds[None].to(dev), k + 1, 0)
        prenorm = model.step(shift_left(ids, k + 1, 0), hidden, ttt_position_ids(pos, k), cache, embeds=emb)
        n = T - (k + 1)
        if n > 0:
            as_target = model.draft_ids_to_target(model.logits(prenorm[:, :n]).argmax(-1))  # [1, n]
            valid[k, :n] = loss_positions(mask, argmax, model.t2d, k)[0, :n]
            hits[k, :n] = (as_target == argmax[:, k + 1:])[0]
        hidden = prenorm
    return hits.cpu(), valid.cpu()


def teacher_forced_correct(model, aux, input_ids, target_argmax, loss_mask, ttt_length, embeds=None):
    """(correct = hits & valid, valid), Bool [K, T]: what training's accuracy counts."""
    hits, valid = teacher_forced_hits(model, aux, input_ids, target_argmax, loss_mask, ttt_length, embeds)
    return hits & valid, valid


class AccuracyCounter:
    """Accuracy per TTT step and conditional accuracy (all steps < k right at the same position)."""

    def __init__(self, K: int):
        self.K = K
        self.right, self.count = torch.zeros(K), torch.zeros(K)
        self.chain_right, self.chain_base = torch.zeros(K), torch.zeros(K)

    def add(self, hits: torch.Tensor, valid: torch.Tensor) -> None:
        c, v = (hits & valid)[: self.K], valid[: self.K]
        self.right += c.sum(1).float()
        self.count += v.sum(1).float()
        chain = torch.cumprod(c.int(), dim=0).bool()                              # all steps <= k right
        prev = torch.cat([torch.ones(1, c.shape[1], dtype=torch.bool), chain[:-1]])  # all steps < k right
        self.chain_right += chain.sum(1).float()
        self.chain_base += (prev & v).sum(1).float()

    def to_dict(self) -> dict:
        return {"ttt_length": self.K, "step_accuracy": (self.right / self.count.clamp(min=1)).tolist(),
                "conditional_accuracy": (self.chain_right / self.chain_base.clamp(min=1)).tolist(),
                "positions": self.count.long().tolist(), "chain_positions": self.chain_base.long().tolist()}


def teacher_forced_accuracy(model, store, ttt_length: int = 7, max_sequences: Optional[int] = None,
                            progress: bool = True, image_embeddings: str = "placeholder") -> dict:
    """Accuracy per TTT step and conditional accuracy over the store's sequences."""
    acc = AccuracyCounter(ttt_length)
    idx = _sequences(store, max_sequences)
    for i in _progress(idx, "accuracy", len(idx), progress):
        s = store[i]
        if s["input_ids"].numel() >= 2:
            acc.add(*teacher_forced_hits(model, s["aux"], s["input_ids"], s["target_argmax"], s["loss_mask"],
                                         ttt_length, sequence_embeds(model, store, s, image_embeddings)))
    return acc.to_dict()


def _replay_one(model, s: dict, knobs: Sequence[SpecKnobs], out: dict, ngram: Optional[NgramSettings],
                hits: Optional[torch.Tensor], method: str, embeds: Optional[torch.Tensor] = None) -> None:
    ids, mask, argmax = s["input_ids"].long(), s["loss_mask"].bool(), s["target_argmax"].long()
    seq = None
    for k in knobs:
        res = out[k.label]
        res["ceiling"] += replay_perfect(ids, mask, argmax, k.max_depth)
        if model is not None:
            if k.topk == 1 and method == "auto":
                h = hits if hits is not None and hits.shape[0] >= k.max_depth else \
                    teacher_forced_hits(model, s["aux"], ids, argmax, mask, k.max_depth, embeds)[0]
                runs = leading_hits(h[: k.max_depth])
                res["drafter"] += replay_chain_runs(ids, mask, argmax, runs, k.max_depth)
            elif method == "auto":  # trees: every position's tree drafted in one batched pass
                trees = all_cycle_trees(model, s["aux"], ids, k, embeds=embeds)
                res["drafter"] += replay_sequence(ids, mask, argmax, trees.__getitem__, k.max_depth)
            else:
                if seq is None:
                    seq = SequenceDrafter(model, s["aux"], ids, max(kk.topk for kk in knobs), embeds)
                res["drafter"] += replay_sequence(ids, mask, argmax, lambda q: build_sglang_tree(seq.at(q), k),
                                                  k.max_depth)
        if ngram is not None:
            nd = k.num_draft_tokens - 1
            look = PromptLookup(ids, nd, ngram.max_ngram, ngram.min_ngram, ngram.prefer)
            res["ngram"] += replay_sequence(ids, mask, argmax, look.tree, nd)


def _stats(k: SpecKnobs, ngram: Optional[NgramSettings]) -> dict[str, AcceptStats]:
    """Empty replay counters of one knob setting: the drafter's, a perfect drafter's (the store's ceiling),
    and n-gram's unless ngram is None."""
    out = {"drafter": AcceptStats(k.max_depth), "ceiling": AcceptStats(k.max_depth)}
    if ngram is not None:
        out["ngram"] = AcceptStats(k.num_draft_tokens - 1)
    return out


def simulate_accept_length(model, store, knobs: Sequence[SpecKnobs] = DEFAULT_KNOBS,
                           max_sequences: Optional[int] = None, ngram: Optional[NgramSettings] = NgramSettings(),
                           progress: bool = True, method: str = "auto",
                           image_embeddings: str = "placeholder") -> dict[str, dict[str, AcceptStats]]:
    """Replay every knob setting over the store with the drafter (`model`; None: n-gram only) and with
    n-gram lookup (same verify budget: num_draft_tokens-1 proposed tokens; ngram=None: the drafter only).
    -> {label: {name: stats}}.

    method="auto": chains (topk=1) are read off one teacher-forced TTT unroll, trees of all positions
    are drafted in one batched pass (eagle3/replay/tree_batch.py). That is exact, not an approximation: in a
    chain, draft j+1 only matters when drafts 1..j were accepted, i.e. equal the target's greedy tokens, which inside
    a replay segment ARE the stored tokens the unroll feeds; its hidden inputs are the drafter's own
    outputs, its position q+j-1 is the unroll's t+k, and it attends to the prefix keys plus its own
    chain's keys, which is the TTT attention pattern (eagle3/drafter/attention.py). method="sequential" drafts
    every visited cycle step by step (eagle3/replay/drafter_session.py; the reference the tests compare
    against). image_embeddings: what the drafter embeds at image rows (eagle3/drafter/image_embeddings.py)."""
    if method not in ("auto", "sequential"):
        raise ValueError(f"method={method!r}: expected 'auto' or 'sequential'")
    out = {k.label: _stats(k, ngram) for k in knobs}
    K = max([k.max_depth for k in knobs if k.topk == 1], default=0) if method == "auto" and model is not None else 0
    idx = _sequences(store, max_sequences)
    for i in _progress(idx, "accept-length replay", len(idx), progress):
        s = store[i]
        if s["input_ids"].numel() >= 2:
            emb = sequence_embeds(model, store, s, image_embeddings) if model is not None else None
            hits = teacher_forced_hits(model, s["aux"], s["input_ids"], s["target_argmax"], s["loss_mask"], K,
                                       emb)[0] if K else None  # one unroll serves every chain knob
            _replay_one(model, s, knobs, out, ngram, hits, method, emb)
    return out


def evaluate_drafter(model, store, *, knobs: Sequence[SpecKnobs] = DEFAULT_KNOBS, ttt_length: int = 7,
                     max_sequences: Optional[int] = None, ngram: Optional[NgramSettings] = NgramSettings(),
                     accuracy: bool = True, progress: bool = True, image_embeddings: str = "placeholder") -> dict:
    """The drafter's offline evaluation on `store` (a HiddenStateStore, validation split).
    Raises EvalInputError for an empty store or a drafter that does not fit the store. ngram=None leaves
    the n-gram baseline out (it does not depend on the drafter: a caller scoring many drafters on one
    store replays it once)."""
    if len(store) == 0:
        raise EvalInputError(f"{getattr(store, 'dir', 'store')}: the validation store holds no sequences "
                             f"(empty split?); nothing to evaluate")
    problems = drafter_store_problems(model, store)
    if problems:
        raise EvalInputError("drafter and validation store do not fit:\n  - " + "\n  - ".join(problems))
    if problem := rows_problem(image_embeddings, store):  # every caller (eval stage, study, A/B) passes here
        raise EvalInputError(problem)
    was_training = model.training
    model.eval()
    try:
        idx = _sequences(store, max_sequences)
        report: dict = {"sequences": len(idx), "warnings": [], "image_embeddings": image_embeddings}
        # one teacher-forced unroll per sequence serves the accuracy and every chain knob
        K = max([ttt_length if accuracy else 0] + [k.max_depth for k in knobs if k.topk == 1])
        acc = AccuracyCounter(ttt_length)
        cover_hit = cover_n = 0
        sims = {k.label: _stats(k, ngram) for k in knobs}
        by = {tr: {"sequences": 0, "acc": AccuracyCounter(ttt_length), "sims": {k.label: _stats(k, ngram) for k in knobs}}
              for tr in TRAFFIC}
        for i in _progress(idx, "eval", len(idx), progress):
            s = store[i]
            if s["input_ids"].numel() < 2:
                continue
            part = by[traffic_of(store, s)]
            part["sequences"] += 1
            hits = None
            emb = sequence_embeds(model, store, s, image_embeddings)
            if K > 0:
                hits, valid = teacher_forced_hits(model, s["aux"], s["input_ids"], s["target_argmax"], s["loss_mask"],
                                                  K, emb)
                if accuracy:
                    acc.add(hits, valid)
                    part["acc"].add(hits, valid)
            one = {k.label: _stats(k, ngram) for k in knobs}  # this sequence's counts, added to its traffic's too
            _replay_one(model, s, knobs, one, ngram, hits, "auto", emb)
            for label, stats in one.items():
                for name, st in stats.items():
                    sims[label][name] += st
                    part["sims"][label][name] += st
            predicted = s["target_argmax"][:-1][s["loss_mask"][1:].bool()].long()   # greedy tokens of assistant positions
            cover_hit += int(model.t2d.cpu()[predicted].sum())
            cover_n += predicted.numel()
        if accuracy:
            report["accuracy"] = acc.to_dict()
            # SpecForge-style estimate from the conditional accuracy: valid even when the store is not the
            # target's greedy output (no replay possible), but blind to the cycle structure
            cond = report["accuracy"]["conditional_accuracy"]
            report["accuracy"]["chain_estimate"] = {
                k.label: accept_length_from_acceptance(cond[: k.max_depth]) for k in knobs
                if k.topk == 1 and k.max_depth <= len(cond)}
    finally:
        model.train(was_training)
    report["accept"] = {label: {"knobs": {"num_steps": k.num_steps, "topk": k.topk,
                                          "num_draft_tokens": k.num_draft_tokens},
                                **{name: st.to_dict() for name, st in sims[label].items()}}
                        for label, k in ((k.label, k) for k in knobs)}
    # text vs image traffic (a sequence with any image token is image traffic): the same measures, split
    report["by_traffic"] = {tr: {"sequences": part["sequences"],
                                 **({"accuracy": part["acc"].to_dict()} if accuracy else {}),
                                 "accept": {label: {name: st.to_dict() for name, st in part["sims"][label].items()}
                                            for label in part["sims"]}}
                            for tr, part in by.items()}
    report["vocab_coverage"] = cover_hit / cover_n if cover_n else float("nan")
    if cover_n and report["vocab_coverage"] < COVERAGE_WARN:
        report["warnings"].append(
            f"the drafter's draft vocab holds only {100 * report['vocab_coverage']:.1f}% of the target's greedy tokens "
            f"on this split: its vocab mapping (d2t/t2d) was not built for this target (rebuild it with `make vocab` "
            f"and remap the lm_head, i.e. train with +init=...); tokens outside it can never be drafted")
    label, by_name = next(iter(sims.items()))
    first = by_name["drafter"]
    rate = first.mismatches / first.assistant_positions if first.assistant_positions else 0.0
    report["mismatch_rate"] = rate
    if rate > MISMATCH_WARN:
        cap = by_name["ceiling"]
        report["warnings"].append(
            f"{100 * rate:.1f}% of assistant positions are not the target's greedy choice (input_ids[t+1] != "
            f"target_argmax[t]): the sequences were not generated greedily by this target (regenerate them in "
            f"the prepare stage). The replay only scores greedy-consistent stretches and restarts after each "
            f"mismatch, so its accept length is a lower-bound-like estimate on shortened generations"
            + (f": here no drafter could score above {cap.accept_length:.2f} at {label} (the ceiling)."
               if cap.cycles else "."))
    if first.cycles == 0:
        report["warnings"].append("no verify cycle could be replayed: no assistant span of 2+ greedy tokens")
    return report
