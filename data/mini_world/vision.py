"""k25-mini learns to see (`train_and_save`, called by the world builder; `seeing_check` for its report): a tiny Kimi-K2.5 vision tower + projector in front of the trained text model,
trained jointly with it on seeded synthetic scenes (data/mini_world/scenes.py), and the held-out image
conversations of the K2.5 corpus.

An image conversation is rendered exactly as prepare renders it (eagle3/media_tokens.py: the image block
before the user turn's text, one `<|media_pad|>` per LM position, the count from K2.5's rule), tokenized
piecewise at the role tokens (specials, so the pieces tokenize as the whole), with loss on the assistant
answers and their `<|im_end|>` only. The images go through eagle3/target_model/images.py (the PNG bytes prepare would
store) and the wrapper's own multimodal forward, so what k25-mini learns from is what capture replays.
"""
from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from data.mini_world import checkpoints as ck
from data.mini_world import scenes
from data.mini_world.lm import BatchSampler, optimise, pack_blocks, resolve_device
from data.mini_world.tokenizer import IM_END
from data.mini_world.vision_step import IGNORE, JointStep  # noqa: F401 (IGNORE: the labels' fill, re-exported)
from eagle3.cpu_threads import small_op_threads, torch_threads
from eagle3.target_model import images as img_rule
from eagle3.media_tokens import MEDIA_PAD, user_content


@dataclass
class ImageExample:
    """One tokenized image conversation: ids, labels (IGNORE outside the answers), its image's PNG and
    that PNG's pixel_values [N, 3, 14, 14] / image_grid_thw [3] by K2.5's rule (made once)."""
    ids: list[int]
    labels: list[int]
    png: bytes
    pixels: torch.Tensor
    grid: torch.Tensor


def conversation_turns(scene: scenes.Scene, rng: random.Random, max_turns: int) -> list[tuple[str, str]]:
    return scenes.question_pairs(scene, rng, rng.randint(1, max_turns))


def encode_example(tok, turns: list[tuple[str, str]], png: bytes) -> ImageExample:
    """The conversation (image on the first user turn) -> ids and answer-only labels."""
    n_pads = img_rule.media_pad_count(img_rule.grid_thw(*_png_size(png)[::-1]))
    msgs: list[dict] = []
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    for i, (q, a) in enumerate(turns):
        msgs.append({"role": "user", "content": user_content([n_pads], q) if i == 0 else q})
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        piece = tok(prompt[len(rendered):], add_special_tokens=False)["input_ids"]
        ids += piece
        labels += [IGNORE] * len(piece)
        answer = tok(a + IM_END, add_special_tokens=False)["input_ids"]
        ids += answer
        labels += answer
        msgs.append({"role": "assistant", "content": a})
        rendered = tok.apply_chat_template(msgs, tokenize=False)
    pixels, grid = pixel_batch([png])
    return ImageExample(ids, labels, png, pixels, grid[0])


def _png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from the PNG header."""
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def example_pool(tok, n: int, *, seed: int, size: int, max_turns: int) -> list[ImageExample]:
    """`n` training conversations about seeded scenes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        scene = scenes.random_scene(rng)
        out.append(encode_example(tok, conversation_turns(scene, rng, max_turns),
                                  scenes.png(scenes.draw_scene(scene, size))))
    return out


def pixel_batch(pngs: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [N, 3, 14, 14], image_grid_thw [n, 3]) by K2.5's rule (eagle3/target_model/images.py)."""
    import numpy as np

    pv, thw = img_rule.preprocess_many([img_rule.decode_image(p) for p in pngs])
    return torch.from_numpy(np.ascontiguousarray(pv)), torch.from_numpy(np.asarray(thw, dtype=np.int64))


def collate(examples: list[ImageExample], pad_id: int) -> dict:
    """Right-padded ids / labels / attention mask and the images, for the wrapper's forward."""
    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        mask[i, : len(e.ids)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values": torch.cat([e.pixels for e in examples]),
            "image_grid_thw": torch.stack([e.grid for e in examples])}


def calm_position_table(wrapper, std: float = 0.02) -> None:
    """transformers draws the tower's learned position table with std 1, which drowns the pixels of a tiny
    tower (the features of two different scenes then differ by a few percent): redraw it at `std`. And the
    projector's output starts ~50x larger than the trained token embeddings, so an image row's residual stream
    is its feature at every layer: scale the last projection to the embeddings' size. And a white patch (most
    of a scene) gives the patch stem a large constant response that dwarfs the shapes: start every stem filter
    at zero mean (a uniform grey patch reads 0), so what the tower sees first is colour and ink."""
    table = wrapper.model.vision_tower.patch_embed.pos_emb.position_embeddings
    out = wrapper.model.mm_projector.out_proj
    emb = wrapper.model.language_model.embed_tokens.weight
    conv = wrapper.model.vision_tower.patch_embed.proj
    with torch.no_grad():
        table.mul_(std / table.std().clamp_min(1e-12))
        conv.weight.sub_(conv.weight.mean(dim=(1, 2, 3), keepdim=True))
        conv.bias.zero_()
        scale = float(emb.std() / out.weight.std().clamp_min(1e-12)) / out.in_features ** 0.5
        out.weight.mul_(scale)
        out.bias.mul_(scale)


def is_tower_param(name: str) -> bool:
    return ".vision_tower." in f".{name}"


def is_vision_param(name: str) -> bool:
    """The tower's and the projector's parameters (what the world adds to the text model)."""
    return is_tower_param(name) or ".mm_projector." in f".{name}"


def vision_lr_scale(name: str, cfg) -> float:
    """A parameter's learning rate as a multiple of the LM's: the tower `vision_lr_scale` x `tower_lr_scale`, the
    projector `vision_lr_scale`, the LM 1."""
    if not is_vision_param(name):
        return 1.0
    return cfg.vision_lr_scale * cfg.tower_lr_scale if is_tower_param(name) else cfg.vision_lr_scale


def train_seeing(wrapper, tok, pool: list[ImageExample], text_blocks: torch.Tensor, cfg, *, seed: int,
                 device: torch.device) -> dict:
    """Train the whole wrapper (tower, projector, LM) on `cfg.train.batch_size` image conversations and
    `cfg.text_batch_size` text blocks per step; the loss is the image loss + `cfg.text_loss_weight` x the text
    loss. The new tower and projector learn at `cfg.vision_lr_scale` x the LM's rate (the LM is trained already),
    the tower at `cfg.tower_lr_scale` x that again (0: the tower is not trained at all).
    Returns loss figures."""
    t = cfg.train
    calm_position_table(wrapper)
    images = BatchSampler(len(pool), min(t.batch_size, len(pool)), seed)
    texts = BatchSampler(len(text_blocks), min(cfg.text_batch_size, len(text_blocks)), seed + 1) \
        if cfg.text_batch_size and len(text_blocks) else None
    # the pool on the device once, the tower's index tensors once, no host sync per step: the same numbers as
    # wrapper(**collate(batch)) + the text blocks' loss (data/mini_world/vision_step.py, tests/test_vision_step.py)
    step = JointStep(wrapper, pool, text_blocks, tok.pad_token_id, images, texts, device,
                     text_weight=cfg.text_loss_weight)
    # tower_lr_scale=0: the tower is left out of the step (no gradients, not in the optimizer or the clip's norm),
    # as the measured frozen-tower runs did (benchmarks/seeing_recipe.py --freeze-tower)
    held = [p for n, p in wrapper.named_parameters() if is_tower_param(n) and p.requires_grad] \
        if cfg.tower_lr_scale == 0 else []
    for p in held:
        p.requires_grad = False
    try:
        stats = optimise(wrapper, t, step, desc=f"k25-mini vision ({device.type})", device=device,
                         lr_scale=lambda name: vision_lr_scale(name, cfg))
    finally:
        for p in held:
            p.requires_grad = True
    image_losses = step.image_losses()
    tail = image_losses[-max(1, len(image_losses) // 10):]
    return {**stats, "image_examples": t.steps * t.batch_size, "first_image_loss": image_losses[0],
            "final_image_loss": sum(tail) / len(tail)}


def corpus_records(n: int, *, seed: int, size: int, max_turns: int) -> list[dict]:
    """`n` held-out image conversations as OpenAI-style records: the image as a data URI part before the
    first question, the true answers as the assistant turns (regeneration replaces them by the target's)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        scene = scenes.random_scene(rng)
        turns = conversation_turns(scene, rng, max_turns)
        uri = "data:image/png;base64," + base64.b64encode(scenes.png(scenes.draw_scene(scene, size))).decode()
        msgs: list[dict] = []
        for j, (q, a) in enumerate(turns):
            content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": q}] if j == 0 else q
            msgs += [{"role": "user", "content": content}, {"role": "assistant", "content": a}]
        out.append({"id": f"image_{seed}_{i}", "messages": msgs})
    return out


def interleave(text_records: list[dict], image_records: list[dict], every: int) -> list[dict]:
    """Every `every`-th record an image conversation, while both last; the rest appended."""
    out, t, m = [], 0, 0
    while t < len(text_records) or m < len(image_records):
        if (len(out) + 1) % every == 0 and m < len(image_records) or t >= len(text_records):
            out.append(image_records[m])
            m += 1
        else:
            out.append(text_records[t])
            t += 1
    return out


@torch.no_grad()
def greedy_answers(wrapper, tok, pngs: list[bytes], question: str, max_new_tokens: int = 16) -> list[str]:
    """The wrapper's greedy answer to `question` about each image (one conversation per image)."""
    from data.hf_generator import HFGenerator
    from eagle3.target_model.images import data_uri

    gen = HFGenerator(wrapper.eval(), tok, max_new_tokens=max_new_tokens)
    prompts = [[{"role": "user", "content": question, "images": [data_uri(p)]}] for p in pngs]
    return [text for text, _, _ in gen.generate(prompts)]


def media_pad_id(tok) -> int:
    return tok.convert_tokens_to_ids(MEDIA_PAD)


def vision_threads(pinned: int, device: torch.device) -> int:
    """Torch threads for the joint vision step: `pinned` when the config pins a count (num_threads > 0), else on
    the CPU the small-op rule (eagle3/cpu_threads.py: one thread when idle threads sleep), else the current count."""
    if pinned:
        return pinned
    now = torch.get_num_threads()
    return small_op_threads(now) if device.type == "cpu" else now


def train_and_save(cfg, out_dir: Path, tok, model, train_seqs, device) -> dict:
    """Wrap the text-trained k25-mini in the Kimi-K2.5 layout with a random tiny vision tower, train the
    whole on seeded scenes (and K2.5 text), save it, and copy the trained LM back into `model` (the text
    model the perplexity table scores)."""
    v = cfg.vision
    vision_config = ck.seeing_vision_config(v.image_size, hidden_size=v.hidden_size,
                                            num_hidden_layers=v.num_hidden_layers,
                                            num_attention_heads=v.num_attention_heads,
                                            intermediate_size=v.intermediate_size)
    wrapper = ck.build_kimi_k25(model, vision_config, seed=cfg.seed, image_token_id=media_pad_id(tok))
    pool = example_pool(tok, v.pool_examples, seed=cfg.seed + 10, size=v.image_size, max_turns=v.max_turns)
    blocks = pack_blocks(train_seqs, v.train.seq_len)
    print(f"[mini-world] k25-mini vision: {sum(p.numel() for p in wrapper.model.vision_tower.parameters()) / 1e6:.3f}M "
          f"tower params; {len(pool):,} scenes of {v.image_size}px, {v.train.steps} steps of {v.train.batch_size} "
          f"images + {v.text_batch_size} text blocks", flush=True)
    threads = vision_threads(cfg.num_threads, device)
    with torch_threads(threads):
        stats = train_seeing(wrapper, tok, pool, blocks, v, seed=cfg.seed + 3, device=device)
    stats["torch_threads"] = threads
    ck.save_kimi_k25_wrapper(wrapper, out_dir.parent / "tokenizer", out_dir)
    model.model.load_state_dict(wrapper.model.language_model.state_dict())
    model.lm_head.load_state_dict(wrapper.lm_head.state_dict())
    return stats


def answers_by_kind(wrapper, tok, shown: list[scenes.Scene], size: int, max_new_tokens: int = 24) -> dict:
    """The wrapper's greedy answers about `shown` scenes (drawn at `size` pixels), one question of every kind:
    `by_kind` = the fraction exactly right per kind (caption, count, colour, shape, text), `caption_exact` /
    `caption_distinct` (distinct captions: answers that depend on the image), `examples` = three
    [truth, caption] pairs."""
    pngs = [scenes.png(scenes.draw_scene(s, size)) for s in shown]
    by_kind, captions = {}, []
    for kind, questions in scenes.QUESTIONS.items():
        answers = [a.strip() for a in greedy_answers(wrapper, tok, pngs, questions[0], max_new_tokens)]
        truth = [scenes.answer(s, kind) for s in shown]
        by_kind[kind] = sum(a == t for a, t in zip(answers, truth)) / len(shown)
        if kind == "caption":
            captions = list(zip(truth, answers))
    return {"by_kind": by_kind, "caption_exact": sum(a == t for t, a in captions),
            "caption_distinct": len({a for _, a in captions}), "examples": [[t, a] for t, a in captions[:3]]}


def seeing_check(cfg, ckpt: Path, tok, n: int = 12) -> dict:
    """k25-mini's greedy answers about `n` held-out scenes (`answers_by_kind`): for the caption, how many are
    exactly right and how many differ; for every question kind, the fraction exactly right, so a world that
    sees some facts and not others says which."""
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    rng = random.Random(cfg.seed + 30)
    shown = [scenes.random_scene(rng) for _ in range(n)]
    wrapper = Kimi_K25ForConditionalGeneration.from_pretrained(str(ckpt)).to(resolve_device(cfg.device))
    scored = answers_by_kind(wrapper, tok, shown, cfg.vision.image_size)
    return {"vision_params": sum(p.numel() for p in wrapper.model.vision_tower.parameters())
            + sum(p.numel() for p in wrapper.model.mm_projector.parameters()),
            "question": scenes.QUESTIONS["caption"][0], "scenes": n, "exact": scored["caption_exact"],
            "distinct": scored["caption_distinct"], "by_kind": scored["by_kind"], "examples": scored["examples"]}
