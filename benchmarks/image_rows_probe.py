"""Does the drafter read its image rows? The convention-mismatch question of issue 34, measured.

SGLang feeds an EAGLE-3 drafter the target's fused input embeddings at image positions, vLLM embeds
`<|media_pad|>` there (eagle3/drafter/image_embeddings.py). A drafter trained under one and served under the other
can only lose if it reads those rows. This probe takes a finished from-K2 training run on K2.5 (its manifest's
config is the recipe: same init, data, lr, batch), trains it again under both conventions for each of `--steps`,
and replays every drafter over the validation store's image-traffic sequences with the image rows fed three ways:

  fused        the target's fused rows (SGLang)
  placeholder  embed(<|media_pad|>) (vLLM)
  other-image  the fused rows of another validation picture: the rows' distribution kept, their content swapped

A drafter that takes the picture from its image rows loses accept length under `other-image`; one whose image
rows only shape the attention's background loses little to either swap. Since tau and step-0 accuracy move only
when a greedy draft flips, the probe also reads the step-0 distribution at the image sequences' loss positions: the
target token's log-prob, and against the trained feed the total variation and the share of argmax flips. Prints
one JSON line per (steps, trained convention) and appends it to `--json`; a table at the end.

    make demo                                                             # the runs it starts from
    python benchmarks/image_rows_probe.py --train-dir runs/stages/k25-mini/train-aqmedai_k2 \\
        --steps 40 200 600 --out runs/image-rows-probe --json runs/image-rows-probe/probe.jsonl
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from eagle3.config.conf import to_schema
from eagle3.config.schema.train import TrainConfig
from eagle3.drafter.image_embeddings import CONVENTIONS
from eagle3.drafter.vocab_map import draft_index_from_t2d
from eagle3.formats.manifest import read_manifest
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.replay.evaluate import evaluate_drafter, sequence_embeds, traffic_of
from eagle3.drafter.attention import TTTCache, ttt_position_ids
from eagle3.ttt.loss import loss_positions, shift_left

SERVED = (*CONVENTIONS, "other-image")
KNOB = SpecKnobs(2, 1, 3)  # the demo's primary knob (steps 2, topk 1, 3 draft tokens)


class StoreView:
    """A validation store seen through `items` (its image-traffic sequences), optionally with each sequence's fused
    image rows taken from another one (`swap`: item i reads the rows of item swap[i]). Everything else is the
    store's."""

    def __init__(self, store, items: list[int], swap: dict[int, int] | None = None):
        self.store, self.items, self.swap = store, items, swap or {}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        s = dict(self.store[self.items[i]])
        if i in self.swap:
            s["image_embeds"] = self.store[self.items[self.swap[i]]]["image_embeds"]
        return s

    def __getattr__(self, name):
        return getattr(self.store, name)


def image_items(store) -> list[int]:
    return [i for i in range(len(store)) if traffic_of(store, store[i]) == "image"]


def other_image_swap(store, items: list[int]) -> tuple[dict[int, int], int]:
    """For each image sequence, the next one (cyclically) whose fused rows have the same count: {view index: view
    index of the donor}, and how many found none (those keep their own rows and are counted, not hidden)."""
    counts = [int(store[i]["image_embeds"].shape[0]) for i in items]
    swap, alone = {}, 0
    for a in range(len(items)):
        donor = next((b for b in (*range(a + 1, len(items)), *range(a)) if counts[b] == counts[a]), None)
        if donor is None:
            alone += 1
        else:
            swap[a] = donor
    return swap, alone


@torch.no_grad()
def step0_logprobs(model, s: dict, embeds) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0 of the teacher-forced unroll (the replay's, eagle3/replay/evaluate.teacher_forced_hits) at its loss
    positions: the drafter's log-probs over the draft vocab [n, V_draft] and the draft index of the target's
    token there [n]. `embeds`: the input rows when not embed_tokens(input_ids)."""
    dev = model.fc.weight.device
    ids = s["input_ids"].long().to(dev)[None]
    T = ids.shape[1]
    argmax = s["target_argmax"].long().to(dev)[None]
    emb = None if embeds is None else shift_left(embeds[None].to(dev), 1, 0)
    prenorm = model.step(shift_left(ids, 1, 0), model.project_aux(s["aux"].to(dev)[None]),
                         ttt_position_ids(torch.arange(T, device=dev)[None], 0), TTTCache(), embeds=emb)
    valid = loss_positions(s["loss_mask"].bool().to(dev)[None], argmax, model.t2d, 0)[0, :T - 1]
    logp = model.logits(prenorm[:, :T - 1]).float().log_softmax(-1)[0][valid]
    return logp, draft_index_from_t2d(model.t2d)[argmax[0, 1:]][valid]  # valid: the target's token is in the draft vocab


def step0_shift(model, view, feed: str, reference: list[torch.Tensor] | None) -> tuple[dict, list[torch.Tensor]]:
    """How the drafter's step-0 prediction at the image sequences' loss positions moves under `feed` (a
    convention, as `view` presents the rows): the mean log-prob of the target's token, and against `reference`
    (the same positions' log-probs under the trained feed) the mean total variation and the share of argmax
    flips. These see a reliance on the image rows that moves no greedy draft (tau and acc0 do not)."""
    logps, right = [], []
    for i in range(len(view)):
        s = view[i]
        lp, tgt = step0_logprobs(model, s, sequence_embeds(model, view, s, feed))
        logps.append(lp.cpu())
        right.append(lp.gather(1, tgt[:, None])[:, 0].cpu())
    out = {"target_logp": float(torch.cat(right).mean())}
    if reference is not None:
        p, q = torch.cat(logps).exp(), torch.cat(reference).exp()
        out["tv"] = float(0.5 * (p - q).abs().sum(-1).mean())
        out["argmax_flips"] = float((p.argmax(-1) != q.argmax(-1)).float().mean())
    return out, logps


def train_config(cfg: TrainConfig, steps: int, convention: str, out: Path) -> TrainConfig:
    """The finished run's own config `cfg` (its manifest's), trained `steps` optimizer steps under `convention` into
    `out`, epochs unbounded so `steps` decides."""
    return replace(cfg, max_steps=steps, epochs=None, image_embeddings=convention, out_dir=str(out),
                   val_every=0, val_accept_sequences=0, progress=False,
                   wandb=replace(cfg.wandb, mode="disabled"))


def scores(report: dict) -> dict:
    part = report["by_traffic"]["image"]
    tau = part["accept"][KNOB.label]["drafter"]["accept_length"]
    return {"tau": float(tau), "acc0": float(part["accuracy"]["step_accuracy"][0])}


def probe(cfg: TrainConfig, embed: torch.Tensor, store, items: list[int], swap: dict[int, int]) -> dict:
    """Train (reusing a finished run of the same config), load (with the target's `embed` table), and replay
    under every served feed."""
    from eagle3.drafter.drafter_io import load_drafter_dir
    from train.stage import run_train

    t = time.time()
    final = Path(cfg.out_dir) / "final"
    if not (final / "config.json").is_file():
        run_train(cfg)
    train_s = time.time() - t
    device = "cuda" if torch.cuda.is_available() else "cpu"
    drafter = load_drafter_dir(final, embed_tokens=embed, device=device, dtype="float32").eval()
    out, reference = {}, None
    for served in (cfg.image_embeddings, *[x for x in SERVED if x != cfg.image_embeddings]):  # trained feed first
        view = StoreView(store, items, swap if served == "other-image" else None)
        feed = "fused" if served == "other-image" else served
        rep = evaluate_drafter(drafter, view, knobs=[KNOB], ngram=None, progress=False, image_embeddings=feed)
        shift, logps = step0_shift(drafter, view, feed, reference)
        reference = logps if reference is None else reference
        out[served] = {**scores(rep), **shift}
    return {"train_s": round(train_s, 1), "served": {x: out[x] for x in SERVED}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-dir", type=Path, required=True,
                   help="a finished K2.5 training run with image traffic (the demo's train-aqmedai_k2)")
    p.add_argument("--steps", type=int, nargs="+", default=[40, 200, 600], help="optimizer steps per trained drafter")
    p.add_argument("--out", type=Path, required=True, help="where the probe's training runs go (reused when finished)")
    p.add_argument("--split", default="", help="the store the drafters are replayed on (default: the run's "
                   "validation split; its training split reads the mechanism on more sequences, ones it trained on)")
    p.add_argument("--json", type=Path, default=None, help="append the result lines here")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    from eagle3.formats.store import HiddenStateStore
    from eagle3.target_model.target_io import load_embed_tokens

    a = parse_args(argv)
    base = to_schema(read_manifest(a.train_dir, "train")["config"], TrainConfig)
    split = a.split or base.data.val_split
    store = HiddenStateStore(Path(base.capture_dir) / split)
    if not store.has_fused_image_rows:
        raise SystemExit(f"{store.dir}: no fused image rows (image_rows={store.image_rows!r}); the probe needs an "
                         "HF image capture")
    items = image_items(store)
    if not items:
        raise SystemExit(f"{store.dir}: no image-traffic sequences in the {split} store")
    swap, alone = other_image_swap(store, items)
    embed = load_embed_tokens(base.target.path, base.target.layout)  # one target for every drafter
    lines = []
    for steps in a.steps:
        for trained in CONVENTIONS:
            cfg = train_config(base, steps, trained, a.out / f"train-{steps}-{trained}")
            line = {"steps": steps, "trained": trained, "split": split, "image_sequences": len(items),
                    "no_donor": alone, "knob": KNOB.label, **probe(cfg, embed, store, items, swap)}
            print(json.dumps(line), flush=True)
            if a.json:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                with a.json.open("a") as f:
                    f.write(json.dumps(line) + "\n")
            lines.append(line)
    print(table(lines), flush=True)
    return lines


def table(lines: list[dict]) -> str:
    """One row per (steps, trained, served): tau, acc0, the target token's step-0 log-prob, and against the trained
    feed the step-0 total variation and argmax flips."""
    rows = ["| steps | trained | served | image tau | image acc0 | target log-prob | TV vs trained feed | argmax flips |",
            "|---|---|---|---|---|---|---|---|"]
    for x in lines:
        for served, g in x["served"].items():
            rows.append(f"| {x['steps']} | {x['trained']} | {served} | {g['tau']:.3f} | {g['acc0']:.3f} | "
                        f"{g['target_logp']:.4f} | {g.get('tv', 0.0):.5f} | {g.get('argmax_flips', 0.0):.4f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
