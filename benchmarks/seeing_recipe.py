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
import copy
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
    p.add_argument("--tower-lr-scale", type=float, default=MiniVisionConf().tower_lr_scale,
                   help="the tower's lr x the vision lr (the projector keeps the vision lr)")
    p.add_argument("--freeze-tower-first", type=int, default=0, metavar="N",
                   help="first train N steps with the tower frozen as drawn (the projector and the LM train), then "
                        "--steps joint steps with the tower at --tower-lr-scale")
    p.add_argument("--freeze-tower", action="store_true",
                   help="keep the fresh tower as drawn (random features); the projector and the LM train")
    p.add_argument("--linear-probe", type=int, default=0, metavar="N",
                   help="before and after training, fit linear probes of colour / count / shape on the projector "
                        "rows of N seeded scenes (3/4 fit, 1/4 scored): what the rows carry, whether the LM reads it")
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


PROBED = {"colour": lambda s: sorted(scenes.COLOURS).index(s.colour), "count": lambda s: s.count - 1,
          "shape": lambda s: scenes.SHAPES.index(s.shape)}


@torch.no_grad()
def projector_rows(wrapper, shown: list, size: int) -> torch.Tensor:
    """The projector's rows of each scene, concatenated: [len(shown), rows x hidden] (fp32)."""
    from eagle3.target_model.target_images import image_features

    out = []
    for i in range(0, len(shown), 64):
        pngs = [scenes.png(scenes.draw_scene(s, size)) for s in shown[i:i + 64]]
        pv, thw = eyes.pixel_batch(pngs)
        out.append(image_features(wrapper, pv, thw).reshape(len(pngs), -1).float())
    return torch.cat(out)


def linear_probe(x: torch.Tensor, y: torch.Tensor, classes: int, steps: int = 500, seed: int = 0) -> float:
    """Held-out accuracy of a linear classifier (softmax regression, standardised inputs, small L2) fitted on the
    first 3/4 of the rows and scored on the last 1/4."""
    cut = max(1, 3 * len(y) // 4)
    mu, sd = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    z = (x - mu) / sd
    g = torch.Generator().manual_seed(seed)
    w = (0.01 * torch.randn(z.shape[1], classes, generator=g)).requires_grad_()
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(z[:cut] @ w + b, y[:cut]) + 1e-3 * w.square().sum()
            loss.backward()
            opt.step()
    return float(((z[cut:] @ w + b).argmax(-1) == y[cut:]).float().mean())


def probe_rows(wrapper, a: argparse.Namespace) -> dict:
    """{kind: held-out linear-probe accuracy} of colour, count and shape from the projector rows of
    `--linear-probe` scenes (their own seed: neither the training pool's nor the scored scenes')."""
    rng = random.Random(a.seed + 77)
    shown = [scenes.random_scene(rng) for _ in range(a.linear_probe)]
    x = projector_rows(wrapper, shown, a.size)
    return {kind: round(linear_probe(x, torch.tensor([fact(s) for s in shown]), n), 3)
            for kind, fact, n in ((k, f, len(c)) for (k, f), c in
                                  zip(PROBED.items(), (scenes.COLOURS, range(3), scenes.SHAPES)))}


def calmed_tower(wrapper) -> list[torch.Tensor]:
    """The tower's weights as training starts from them: train_seeing first calms the wrapper's fresh tower
    (eyes.calm_position_table), which is not a move of the tower's, so `tower_moved` measures from here."""
    ref = copy.deepcopy(wrapper)
    eyes.calm_position_table(ref)
    return [p.detach().clone() for p in ref.model.vision_tower.parameters()]


def set_lm_trainable(wrapper, on: bool) -> None:
    """Whether the LM (and lm_head) trains; the tower and the projector are left as they are."""
    for name, p in wrapper.named_parameters():
        if not eyes.is_vision_param(name):
            p.requires_grad = on


def recipe(a: argparse.Namespace, steps: int, tower_frozen: bool = False) -> MiniVisionConf:
    """The world's vision config (the schema's defaults: weight decay, clip, lr floor, block length) with this
    run's knobs, for `steps` steps (warmup a tenth of them). A frozen tower (`--freeze-tower`, or `tower_frozen` for
    one phase) is the world's own tower_lr_scale=0: train_seeing leaves it out of the step."""
    base = MiniVisionConf()
    train = replace(base.train, steps=steps, lr=a.lr, warmup_steps=max(1, steps // 10), batch_size=a.batch,
                    weight_decay=a.weight_decay)
    return replace(base, train=train, text_batch_size=a.text_blocks, vision_lr_scale=a.vision_lr_scale,
                   tower_lr_scale=0.0 if tower_frozen or a.freeze_tower else a.tower_lr_scale,
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
    probed_before = None
    if a.linear_probe:  # the rows training starts from: train_seeing calms the fresh tower first (idempotent)
        eyes.calm_position_table(wrapper)
        probed_before = probe_rows(wrapper, a)
    tower_start = calmed_tower(wrapper)
    t0 = time.perf_counter()
    if a.freeze_lm and a.freeze_tower_first:
        raise SystemExit("--freeze-lm and --freeze-tower-first are two kinds of first phase: choose one")
    if a.freeze_tower_first:  # a first phase: the tower as drawn, the projector and the LM read it (other batches)
        eyes.train_seeing(wrapper, tok, pool, blocks, recipe(a, a.freeze_tower_first, tower_frozen=True),
                          seed=a.seed + 4, device=cpu)
    if a.freeze_lm:  # a first phase: the LM frozen (and the tower too under --freeze-tower)
        set_lm_trainable(wrapper, False)
        eyes.train_seeing(wrapper, tok, pool, blocks, recipe(a, a.freeze_lm), seed=a.seed + 3, device=cpu)
        set_lm_trainable(wrapper, True)
    stats = eyes.train_seeing(wrapper, tok, pool, blocks, recipe(a, a.steps), seed=a.seed + 3, device=cpu)
    seconds = time.perf_counter() - t0
    rng = random.Random(a.seed + 99)
    shown = [scenes.random_scene(rng) for _ in range(a.scenes)]
    scored = eyes.answers_by_kind(wrapper, tok, shown, a.size)
    out = {"tag": a.tag, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "train_s": round(seconds, 1), "first_image_loss": round(stats["first_image_loss"], 4),
           "final_image_loss": round(stats["final_image_loss"], 4), **scored}
    moved = sum(float((p.detach() - q).square().sum()) for p, q in zip(wrapper.model.vision_tower.parameters(), tower_start))
    out["tower_moved"] = round((moved / sum(float(q.square().sum()) for q in tower_start)) ** 0.5, 4)  # |dW| / |W|
    if a.linear_probe:
        out["linear_probe"] = {"before": probed_before, "after": probe_rows(wrapper, a)}
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
