"""How fast does k25-mini learn to see under a vision-training recipe? A learning experiment, not a speed one.

Takes a built mini world's k25-mini (its LM, already trained on text), puts a fresh tiny vision tower and projector
of the asked size in front of it (data/mini_world/checkpoints.build_kimi_k25, as the world builder does), trains the
whole with the world's own joint step (data/mini_world/vision.train_seeing; no text blocks unless
`--text-blocks`), and scores greedy answers about `--scenes` held-out scenes per question kind (caption, count,
colour, shape, text: data/mini_world/vision.answers_by_kind). Prints one JSON line and appends it to `--json`.

    python data/run_mini_world.py out_dir=/tmp/world                    # the world to start from (cpu size)
    python benchmarks/seeing_recipe.py --world /tmp/world --steps 1000 --tag base1000 --json /tmp/seeing.jsonl
    python benchmarks/seeing_recipe.py --world /tmp/world --steps 800 --freeze-lm 200 --tag freeze200
    python benchmarks/seeing_recipe.py --world /tmp/world --steps 300 --kinds colour --tag colour-only

The LM the world saved has seen the world's own vision steps; its fresh tower here starts from scratch, so a run
measures the recipe's learning from the text model on (a world built with `vision.train.steps=1` is the cleanest
start).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from data.mini_world import checkpoints as ck
from data.mini_world import scenes
from data.mini_world import vision as eyes
from data.mini_world.lm import encode_conversations, pack_blocks
from data.mini_world.split import Conversation
from eagle3.config.schema.mini_world import MiniVisionConf


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=Path, required=True, help="a built mini world (tokenizer/, k25-mini/)")
    p.add_argument("--steps", type=int, default=1000, help="joint steps (after --freeze-lm steps)")
    p.add_argument("--batch", type=int, default=16, help="image conversations per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vision-lr-scale", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=MiniVisionConf().train.weight_decay,
                   help="AdamW weight decay on matrices (default: the world's)")
    p.add_argument("--pool", type=int, default=2048, help="training scenes")
    p.add_argument("--size", type=int, default=56, help="scene pixels per side (multiple of 28)")
    p.add_argument("--tower-hidden", type=int, default=32)
    p.add_argument("--tower-layers", type=int, default=2)
    p.add_argument("--tower-heads", type=int, default=2)
    p.add_argument("--tower-intermediate", type=int, default=64)
    p.add_argument("--freeze-lm", type=int, default=0, help="first train tower + projector alone for N steps")
    p.add_argument("--kinds", default="", help="train only on these question kinds (comma list); all are scored")
    p.add_argument("--text-blocks", type=int, default=0, help="K2.5 text blocks per step (needs the world's corpus)")
    p.add_argument("--text-weight", type=float, default=1.0, help="the text blocks' loss weight")
    p.add_argument("--scenes", type=int, default=24, help="held-out scenes scored per question kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="run")
    p.add_argument("--json", type=Path, default=None, help="append the result line here")
    return p.parse_args(argv)


def training_pool(tok, a: argparse.Namespace) -> list:
    """The seeded training scenes; with --kinds, their questions drawn from those kinds only."""
    kinds = [k for k in a.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(scenes.QUESTIONS))
    if unknown:
        raise SystemExit(f"--kinds: unknown question kinds {unknown}; choose from {sorted(scenes.QUESTIONS)}")
    if not kinds:
        return eyes.example_pool(tok, a.pool, seed=a.seed + 10, size=a.size, max_turns=2)
    rng = random.Random(a.seed + 10)
    pool = []
    for _ in range(a.pool):
        scene = scenes.random_scene(rng)
        turns = [(rng.choice(scenes.QUESTIONS[k]), scenes.answer(scene, k))
                 for k in rng.sample(kinds, rng.randint(1, min(2, len(kinds))))]
        pool.append(eyes.encode_example(tok, turns, scenes.png(scenes.draw_scene(scene, a.size))))
    return pool


def recipe(a: argparse.Namespace, steps: int) -> MiniVisionConf:
    """The world's vision config (the schema's defaults: weight decay, clip, lr floor, block length) with this
    run's knobs, for `steps` steps (warmup a tenth of them)."""
    base = MiniVisionConf()
    train = replace(base.train, steps=steps, lr=a.lr, warmup_steps=max(1, steps // 10), batch_size=a.batch,
                    weight_decay=a.weight_decay)
    return replace(base, train=train, text_batch_size=a.text_blocks, vision_lr_scale=a.vision_lr_scale,
                   text_loss_weight=a.text_weight)


def text_blocks(world: Path, tok, n: int, seq_len: int, max_tokens: int = 512, max_chars: int = 2000) -> torch.Tensor:
    """Blocks of `seq_len` tokens from the first 400 text conversations of the world's K2.5 corpus (ShareGPT
    records, rendered and cut as the world builder encodes text: data/mini_world/lm.encode_conversations), for
    `--text-blocks` (the world builder uses the K2.5 training part; the corpus is the same distribution)."""
    if not n:
        return torch.zeros(0, seq_len, dtype=torch.long)
    convs = []
    for line in (world / "corpus" / "k25_mini.jsonl").open():
        record = json.loads(line)
        if "conversations" in record:  # not an image conversation (OpenAI messages)
            convs.append(Conversation(record["id"], "", record["conversations"]))
        if len(convs) == 400:
            break
    return pack_blocks(encode_conversations(tok, convs, max_tokens=max_tokens, max_chars=max_chars), seq_len)


def main(argv=None) -> dict:
    a = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    torch.manual_seed(a.seed)
    world = a.world
    tok = AutoTokenizer.from_pretrained(str(world / "tokenizer"))
    saved = Kimi_K25ForConditionalGeneration.from_pretrained(str(world / "k25-mini"))
    text_model = SimpleNamespace(model=saved.model.language_model, lm_head=saved.lm_head,
                                 config=saved.config.text_config, dtype=torch.float32)
    tower = ck.seeing_vision_config(a.size, hidden_size=a.tower_hidden, num_hidden_layers=a.tower_layers,
                                    num_attention_heads=a.tower_heads, intermediate_size=a.tower_intermediate)
    wrapper = ck.build_kimi_k25(text_model, tower, seed=a.seed + 1, image_token_id=eyes.media_pad_id(tok))
    del saved
    pool = training_pool(tok, a)
    blocks = text_blocks(world, tok, a.text_blocks, MiniVisionConf().train.seq_len)
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    if a.freeze_lm:
        for name, p in wrapper.named_parameters():
            p.requires_grad = eyes.is_vision_param(name)
        eyes.train_seeing(wrapper, tok, pool, blocks, recipe(a, a.freeze_lm), seed=a.seed + 3, device=cpu)
        for p in wrapper.parameters():
            p.requires_grad = True
    stats = eyes.train_seeing(wrapper, tok, pool, blocks, recipe(a, a.steps), seed=a.seed + 3, device=cpu)
    seconds = time.perf_counter() - t0
    rng = random.Random(a.seed + 99)
    shown = [scenes.random_scene(rng) for _ in range(a.scenes)]
    scored = eyes.answers_by_kind(wrapper, tok, shown, a.size)
    out = {"tag": a.tag, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "train_s": round(seconds, 1), "first_image_loss": round(stats["first_image_loss"], 4),
           "final_image_loss": round(stats["final_image_loss"], 4), **scored}
    if a.text_blocks:  # the joint loss less the image loss, unweighted: how the LM keeps its text
        out["first_text_loss"] = round((stats["first_loss"] - stats["first_image_loss"]) / a.text_weight, 4)
        out["final_text_loss"] = round((stats["final_loss"] - stats["final_image_loss"]) / a.text_weight, 4)
    print(json.dumps(out), flush=True)
    if a.json:
        with a.json.open("a") as f:
            f.write(json.dumps(out) + "\n")
    return out


if __name__ == "__main__":
    main()
