"""The round-trip check: an exported directory, loaded back, must compute what the checkpoint computes.

Exact criterion: the exported weights are the checkpoint's rounded to the export dtype, so the loaded
export must equal the checkpoint *rounded the same way* tensor for tensor, and its logits (computed in
fp32) must match that rounded checkpoint's to float noise. The difference to the unrounded checkpoint
is reported (max |logit diff|, top-1 agreement) but is not an error: it is what bf16 costs.

Logits are computed for two draft steps (step 0 from fc(aux), step 1 from step 0's pre-norm output),
so every exported tensor (fc, the layer, norm, lm_head) and the recurrent path are exercised.
"""
from __future__ import annotations

from pathlib import Path

import torch

# exported vs rounded checkpoint, relative to the logits' scale: float noise only
LOGIT_RTOL = 1e-5


def validation_batches(store, num_sequences: int, max_tokens: int) -> list[dict]:
    """The first `num_sequences` sequences of `store` (an open HiddenStateStore; cut to `max_tokens`), as step-0
    drafter inputs: hidden from aux at t, the embedding of token t+1 (DESIGN's TTT indexing, k = 0)."""
    batches = []
    for i in range(min(num_sequences, len(store))):
        seq = store[i]
        T = min(int(seq["input_ids"].numel()), max_tokens)
        if T < 3:
            continue
        batches.append({"id": seq["id"],
                        "aux": seq["aux"][: T - 1].float()[None],            # [1, T-1, 3Ht]
                        "input_ids": seq["input_ids"][1:T][None],              # [1, T-1]
                        "next_ids": seq["input_ids"][2:T][None]})              # [1, T-2] for step 1
    return batches


@torch.no_grad()
def drafter_logits(model, batches: list[dict]) -> list[torch.Tensor]:
    """Per batch: cat of step-0 logits [T-1, dV] and step-1 logits [T-2, dV] along dim 0."""
    model.eval()
    out = []
    for b in batches:
        T = b["input_ids"].shape[1]
        pos = torch.arange(T)[None]
        h0 = model.step(b["input_ids"], model.project_aux(b["aux"]), pos)          # [1, T-1, H] pre-norm
        h1 = model.step(b["next_ids"], h0[:, :-1], pos[:, : T - 1] + 1)            # step 1: own output fed back
        out.append(torch.cat([model.logits(h0)[0], model.logits(h1)[0]]).float())
    return out


@torch.no_grad()
def round_weights_(model, dtype: torch.dtype) -> None:
    """Round every exported floating tensor to `dtype` and back, in place (embeddings excluded: they are
    the target's and not exported)."""
    for name, t in model.state_dict().items():
        if name != "embed_tokens.weight" and t.is_floating_point():
            t.copy_(t.to(dtype).to(t.dtype))


def weight_problems(exported, reference) -> list[str]:
    """Tensors of the export that differ from the (rounded) reference at all."""
    ref, got = reference.export_state_dict(), exported.export_state_dict()
    out = []
    for name in sorted(set(ref) | set(got)):
        if name not in ref or name not in got:
            out.append(f"tensor {name!r} is only in the {'export' if name in got else 'checkpoint'}")
        elif not torch.equal(got[name].to(ref[name].dtype), ref[name]):
            out.append(f"tensor {name!r} differs from the checkpoint's (max |diff| "
                       f"{(got[name].double() - ref[name].double()).abs().max().item():.3g})")
    return out


class RoundTripReference:
    """The checkpoint's side of the check, computed once for every format: its logits at full precision,
    then (weights rounded in place to the export dtype: no second copy of a large drafter) again."""

    def __init__(self, reference, batches: list[dict], dtype: torch.dtype):
        self.batches, self.dtype = batches, dtype
        self.logits_full = drafter_logits(reference, batches)
        round_weights_(reference, dtype)
        self.reference = reference
        self.logits_rounded = drafter_logits(reference, batches)

    def check(self, exported) -> tuple[list[str], dict]:
        """(problems, stats) of an exported drafter (see the module doc)."""
        problems = weight_problems(exported, self.reference)
        got = drafter_logits(exported, self.batches)
        stats = {"sequences": len(got), "positions": int(sum(g.shape[0] for g in got))}
        if not got:
            stats["note"] = "no validation sequences: weights compared, logits not"
            return problems, stats
        worst, worst_full, agree, n = 0.0, 0.0, 0, 0
        for g, r, f, b in zip(got, self.logits_rounded, self.logits_full, self.batches):
            if not bool(torch.isfinite(r).all()):
                problems.append(f"sequence {b['id']!r}: the checkpoint itself gives non-finite logits on it "
                                f"(non-finite stored states or weights); cannot vouch for the export")
                continue
            if not bool(torch.isfinite(g).all()):
                problems.append(f"sequence {b['id']!r}: the export gives non-finite logits where the checkpoint does not")
                continue
            scale = max(1.0, r.abs().max().item())
            worst = max(worst, (g - r).abs().max().item() / scale)
            worst_full = max(worst_full, (g - f).abs().max().item())
            agree += int((g.argmax(-1) == f.argmax(-1)).sum())
            n += g.shape[0]
        if worst > LOGIT_RTOL:
            problems.append(f"logits differ from the checkpoint's (rounded to the export dtype) by {worst:.3g} "
                            f"of their scale (> {LOGIT_RTOL}) on stored validation data")
        stats.update(max_rel_diff_vs_rounded=worst, max_abs_diff_vs_checkpoint=worst_full,
                     top1_agreement_vs_checkpoint=agree / max(n, 1))
        return problems, stats


def describe(stats: dict, store_dir: Path) -> str:
    """One line of SERVE.md / the manifest: what the round trip compared and found (stats of `check`)."""
    if "note" in stats:
        return f"weights identical to the checkpoint's; {stats['note']}"
    return (f"weights identical to the checkpoint's rounded to the export dtype; logits on {stats['sequences']} "
            f"sequences / {stats['positions']} positions of {store_dir} (2 draft steps) equal theirs "
            f"(max rel diff {stats['max_rel_diff_vs_rounded']:.1e}); vs the unrounded checkpoint: max |diff| "
            f"{stats['max_abs_diff_vs_checkpoint']:.3g}, top-1 agreement {stats['top1_agreement_vs_checkpoint']:.1%}")
