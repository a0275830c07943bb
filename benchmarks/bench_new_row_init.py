"""Which rule should initialise the lm_head rows of tokens new to the draft vocab? Measured on the
mini world (or any target whose capture + vocab stages and old drafter exist).

For each rule (target_lm_head, mean, zeros) it builds the init=aqmedai_k2 training drafter
(eagle3.drafter.initial), then reports on the validation capture, before and after the same short
fine-tune (same seed, same batches, AdamW on all trainable weights):
  * TTT-step soft CE and accuracy over all loss positions;
  * step-0 accuracy on the positions whose target token is NEW to the draft vocab (the rows
    the rule sets; shared tokens are bit-identical under every rule).

    python benchmarks/bench_new_row_init.py                       # runs/ mini world, k25_mini
    python benchmarks/bench_new_row_init.py --root /big/runs --train-steps 200
    # no aqmedai-k2-mini yet: train a stand-in on the k2_mini capture + vocab stages first
    python benchmarks/bench_new_row_init.py --make-old runs/mini_world/aqmedai-k2-mini-standin
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.target_model import target_io
from eagle3.drafter.drafter_io import load_drafter_dir, save_drafter_dir
from eagle3.drafter.initial import build_training_drafter
from eagle3.ttt.loss import loss_positions, shift_left
from eagle3.formats.store import HiddenStateStore
from eagle3.drafter.attention import TTTCache
from eagle3.ttt.unroll import ttt_unroll
from eagle3.drafter.vocab_map import ids_from_d2t, masked_token_counts, top_n_vocab

RULES = ("target_lm_head", "mean", "zeros")


def batch_of(store, idx, max_len):
    """Right-padded batch of sequences idx (cut to max_len)."""
    items = [store[i] for i in idx]
    T = min(max_len, max(len(x["input_ids"]) for x in items))
    B = len(items)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "target_argmax": torch.zeros(B, T, dtype=torch.long),
           "aux": torch.zeros(B, T, items[0]["aux"].shape[-1]), "last": torch.zeros(B, T, items[0]["last"].shape[-1])}
    for b, x in enumerate(items):
        n = min(T, len(x["input_ids"]))
        for k in out:
            out[k][b, :n] = x[k][:n].to(out[k].dtype)
    return out


@torch.no_grad()
def evaluate(model, store, lm_rows, fresh_mask, ttt, max_len, bs):
    sums = counts = correct = None
    fresh_ok = fresh_n = 0
    for s in range(0, len(store), bs):
        b = batch_of(store, range(s, min(len(store), s + bs)), max_len)
        out = ttt_unroll(model, b["aux"], b["input_ids"], b["last"], b["target_argmax"], b["loss_mask"], lm_rows, ttt)
        sums = out.loss_sum if sums is None else sums + out.loss_sum
        counts = out.count if counts is None else counts + out.count
        correct = out.correct if correct is None else correct + out.correct
        # step 0 on positions whose target token is new to the draft vocab
        T = b["input_ids"].shape[1]
        pre = model.step(shift_left(b["input_ids"], 1, 0), model.project_aux(b["aux"]),
                         torch.arange(T).expand_as(b["input_ids"]), TTTCache())
        pred = model.draft_ids_to_target(model.logits(pre).argmax(-1))
        tgt = shift_left(b["target_argmax"], 1, 0)
        m = loss_positions(b["loss_mask"], b["target_argmax"], model.t2d, 0) & fresh_mask[tgt]
        fresh_ok += int(((pred == tgt) & m).sum())
        fresh_n += int(m.sum())
    c = counts.clamp(min=1)
    return {"loss": [round(float(x), 4) for x in sums / c], "acc": [round(float(x), 4) for x in correct / c],
            "new_token_acc_step0": round(fresh_ok / max(fresh_n, 1), 4), "new_token_positions": fresh_n}


def fine_tune(model, store, lm_rows, steps, lr, bs, max_len, ttt, seed=0):
    """AdamW (betas 0.9/0.95, clip 0.5) on random batches of `store`, same batches for every rule."""
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=lr, betas=(0.9, 0.95))
    rng = random.Random(seed)
    for _ in range(steps):
        b = batch_of(store, rng.sample(range(len(store)), min(bs, len(store))), max_len)
        out = ttt_unroll(model, b["aux"], b["input_ids"], b["last"], b["target_argmax"], b["loss_mask"], lm_rows, ttt)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 0.5)
        opt.step()
    return out


def train_old_drafter(args):
    """--make-old OUT: a scratch drafter trained on the OLD target's capture (the stand-in for
    AQ-MedAI's K2 drafter when the demo has not exported aqmedai-k2-mini yet)."""
    root = Path(args.root)
    stages = root / "stages" / args.old_target
    target = Path(args.old_target_dir or root / "mini_world" / "k2-mini")
    train = HiddenStateStore(stages / "capture" / "train", allow_incomplete=args.allow_incomplete)
    vocab_file = stages / "vocab" / "vocab.safetensors"
    if vocab_file.is_file():
        new_ids = ids_from_d2t(load_file(str(vocab_file))["d2t"])
    else:  # no vocab stage for the old target: top-N of the store's own loss-masked tokens
        V = int(target_io.read_text_config(target, "causal_lm")["vocab_size"])
        counts = sum(masked_token_counts(train[i]["input_ids"], train[i]["loss_mask"], V) for i in range(len(train)))
        new_ids = top_n_vocab(counts, args.old_vocab_size)
    lm_rows = target_io.load_lm_head_rows(target, "causal_lm", new_ids).float()
    model, _ = build_training_drafter("scratch", None, target, "causal_lm", new_ids, train.hf_indices)
    out = fine_tune(model, train, lm_rows, args.old_steps, args.lr * 2, args.batch, args.max_len, args.ttt)
    save_drafter_dir(model, args.make_old, dtype="bfloat16")
    print(json.dumps({"old_drafter": args.make_old, "steps": args.old_steps, "last_step_acc": out.step_acc.tolist()}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1] / "runs"))
    ap.add_argument("--target", default="k25_mini")
    ap.add_argument("--target-dir", default=None, help="default <root>/mini_world/k25-mini")
    ap.add_argument("--layout", default="kimi_k25")
    ap.add_argument("--init-drafter", default=None, help="default <root>/mini_world/aqmedai-k2-mini")
    ap.add_argument("--train-steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--rules", nargs="+", default=list(RULES))
    ap.add_argument("--make-old", default=None, help="train the old-relative drafter into this dir and exit")
    ap.add_argument("--old-target", default="k2_mini")
    ap.add_argument("--old-target-dir", default=None, help="default <root>/mini_world/k2-mini")
    ap.add_argument("--old-steps", type=int, default=300)
    ap.add_argument("--old-vocab-size", type=int, default=2048, help="when the old target has no vocab stage")
    ap.add_argument("--allow-incomplete", action="store_true", help="old target's capture may be unfinished")
    args = ap.parse_args()
    if args.make_old:
        return train_old_drafter(args)
    root = Path(args.root)
    stages = root / "stages" / args.target
    target = Path(args.target_dir or root / "mini_world" / "k25-mini")
    old = Path(args.init_drafter or root / "mini_world" / "aqmedai-k2-mini")
    train, val = HiddenStateStore(stages / "capture" / "train"), HiddenStateStore(stages / "capture" / "validation")
    d2t = load_file(str(stages / "vocab" / "vocab.safetensors"))["d2t"]
    new_ids = ids_from_d2t(d2t)
    lm_rows = target_io.load_lm_head_rows(target, args.layout, new_ids).float()
    old_model = load_drafter_dir(old, dtype="float32")
    fresh_mask = torch.zeros(old_model.config.vocab_size, dtype=torch.bool)  # [V]: new to the draft vocab
    fresh_mask[new_ids] = True
    fresh_mask[old_model.draft_ids_to_target(torch.arange(old_model.config.draft_vocab_size))] = False
    del old_model
    results = {}
    for rule in args.rules:
        torch.manual_seed(0)
        model, report = build_training_drafter("aqmedai_k2", old, target, args.layout, new_ids, train.hf_indices,
                                               rule)
        before = evaluate(model, val, lm_rows, fresh_mask, args.ttt, args.max_len, args.batch)
        t0 = time.perf_counter()
        fine_tune(model, train, lm_rows, args.train_steps, args.lr, args.batch, args.max_len, args.ttt)
        after = evaluate(model, val, lm_rows, fresh_mask, args.ttt, args.max_len, args.batch)
        results[rule] = {"remap": report["lm_head_remap"], "before": before, "after": after,
                         "train_s": round(time.perf_counter() - t0, 1)}
        print(json.dumps({rule: results[rule]}), flush=True)
    print(json.dumps({"summary": {r: {"acc0_before": v["before"]["acc"][0], "acc0_after": v["after"]["acc"][0],
                                      "new_tok_acc_before": v["before"]["new_token_acc_step0"],
                                      "new_tok_acc_after": v["after"]["new_token_acc_step0"],
                                      "loss0_after": v["after"]["loss"][0]} for r, v in results.items()},
                      "train_steps": args.train_steps, "val_sequences": len(val)}, indent=1))


if __name__ == "__main__":
    main()
