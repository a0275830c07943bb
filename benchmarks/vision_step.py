"""Profile one joint step of k25-mini's vision training (data/mini_world/vision.py), phase by phase.

The step is the world's: `--batch` image conversations (collated from a pool of seeded scenes) through
transformers' `Kimi_K25ForConditionalGeneration` (tower, projector, fused-embedding scatter, LM, loss), plus
`--text-batch` text blocks through the same LM, summed, backward, clip, AdamW. The vision sizes come from a
demo_size preset (default gpu: 112-pixel scenes, a 128-wide 2-layer tower, 64 images + 8 text blocks of 256);
the LM is the ci world's (hidden 32, vocab 512) unless `--lm cpu` (hidden 128) or `--lm preset` (the preset's
own, hidden 512 for gpu), so it runs in seconds on a CPU: the per-step overhead under study (aten ops dispatched,
host syncs, Python loops) does not depend on the LM's width.

Prints, per step path, ms per step and the per-step count of aten ops (each a kernel launch or a view on
CUDA: a step of small kernels is bound by how many it launches) and host syncs (scalar reads, less the CPU-only
ones of CPU_ONLY_READS), then a phase table (each phase timed alone, synchronised on CUDA) and, with
`--profile`, torch.profiler's top ops and cProfile's top Python functions.

Paths: `baseline` = the loop as it was before the vision-step work (collate per step, the wrapper's own
multimodal forward, `loss.item()` twice per step); `world` = data/mini_world/vision.py's step as the world runs
it now. Both draw the same batches in the same order; the script checks their losses are identical.

    python benchmarks/vision_step.py                           # CPU, gpu preset's vision, CPU LM
    python benchmarks/vision_step.py --device cuda --lm preset # the H200: the gpu preset exactly
    python benchmarks/vision_step.py --profile                 # + torch.profiler / cProfile tables
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import json
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from data.mini_world import scenes
from data.mini_world import vision as eyes
from data.mini_world.lm import BatchSampler
from data.mini_world.vision_step import JointStep
from eagle3.world import deterministic_algorithms


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo-size", default="gpu", help="the preset whose vision.* settings are profiled")
    p.add_argument("--lm", choices=("ci", "cpu", "preset"), default="ci",
                   help="ci: the ci world's LM (hidden 32, vocab 512; default, seconds per step on a CPU); "
                        "cpu: the CPU world's (hidden 128, vocab 8192); preset: the preset's model.* too")
    p.add_argument("--device", default="cpu")
    p.add_argument("--pool", type=int, default=256, help="pool examples (the world draws from vision.pool_examples)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per path (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--paths", default="baseline,world")
    p.add_argument("--no-deterministic", action="store_true", help="run outside eagle3.world.deterministic_algorithms")
    p.add_argument("--profile", action="store_true", help="torch.profiler and cProfile tables of the world path")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def world_config(demo_size: str, lm: str):
    """The mini world config with the preset's vision.* overrides and the LM of `lm`: ci = the ci preset's
    model.* and tokenizer.vocab_size (hidden 32, vocab 512: the step's op count at a CPU-friendly cost),
    cpu = the CPU world's defaults (hidden 128, vocab 8192), preset = the preset's own model.*."""
    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.demo import DemoConfig
    from eagle3.config.schema.mini_world import MiniWorldConfig

    def overrides(size):
        return to_schema(compose("demo", [f"demo_size={size}"]), DemoConfig).overrides.mini_world

    chosen = [o for o in overrides(demo_size) if o.startswith("vision.")]
    if lm == "ci":
        chosen += [o for o in overrides("ci") if o.startswith(("model.", "tokenizer.vocab_size"))]
    elif lm == "preset":
        chosen += [o for o in overrides(demo_size) if o.startswith("model.")]
    return to_schema(compose("mini_world", chosen), MiniWorldConfig)


def build(cfg, pool_n: int, tmp: Path):
    """A tokenizer trained on scene conversations (the world's vocab size, media tokens added), a random
    k25-mini text model of the config's shape wrapped with the config's vision tower, the pool, text blocks."""
    from data.mini_world import checkpoints as ck
    from data.mini_world.build import _text_model
    from data.mini_world.lm import pack_blocks
    from data.mini_world.tokenizer import add_media_tokens_to, train_tokenizer

    rng = random.Random(0)
    texts = [f"{q} {a}" for _ in range(2000) for q, a in scenes.question_pairs(scenes.random_scene(rng), rng, 2)]
    train_tokenizer(texts, cfg.tokenizer.vocab_size, tmp / "tok")
    tok = add_media_tokens_to(tmp / "tok")
    model = _text_model(cfg, tok, seed=0)
    v = cfg.vision
    vcfg = ck.seeing_vision_config(v.image_size, hidden_size=v.hidden_size, num_hidden_layers=v.num_hidden_layers,
                                   num_attention_heads=v.num_attention_heads, intermediate_size=v.intermediate_size)
    wrapper = ck.build_kimi_k25(model, vcfg, seed=1, image_token_id=eyes.media_pad_id(tok))
    eyes.calm_position_table(wrapper)
    pool = eyes.example_pool(tok, pool_n, seed=10, size=v.image_size, max_turns=v.max_turns)
    seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    blocks = pack_blocks(seqs, v.train.seq_len)
    return tok, wrapper, pool, blocks


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def baseline_loss(wrapper, tok, pool, images, texts, text_blocks, device, record: list):
    """The step's loss as the world computed it before this work (a copy of the old `loss_at`)."""
    batch = eyes.collate([pool[i] for i in images.next().tolist()], tok.pad_token_id)
    loss = wrapper(**{k: v.to(device) for k, v in batch.items()}).loss
    record.append(loss.item())
    blocks = text_blocks[texts.next()].to(device)
    return loss + wrapper(input_ids=blocks, labels=blocks).loss


def run_path(name: str, wrapper, tok, pool, blocks, cfg, device, steps: int, warmup: int) -> dict:
    """`warmup + steps` optimizer steps of one path from the same start (weights, samplers, AdamW state);
    ms per timed step, the image losses, and the final weights' checksum."""
    v = cfg.vision
    model = _fresh_copy(wrapper).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    images = BatchSampler(len(pool), min(v.train.batch_size, len(pool)), 3)
    texts = BatchSampler(len(blocks), min(v.text_batch_size, len(blocks)), 4)
    record: list = []
    if name == "world":
        step_loss = JointStep(model, pool, blocks, tok.pad_token_id, images, texts, device)
        totals: list = []
    model.train()
    times, counts = [], {}
    for step in range(warmup + steps + 1):  # the last step is counted by the profiler, not timed
        sync(device)
        t0 = time.perf_counter()
        if step == warmup + steps:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
        if name == "baseline":
            loss = baseline_loss(model, tok, pool, images, texts, blocks, device, record)
            bad = not torch.isfinite(loss)
        else:
            loss = step_loss(step)
            bad = False
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if name == "baseline":
            record.append(loss.item())
        else:
            totals.append(loss.detach())  # read once at the end, as the world's loop does
        sync(device)
        if step == warmup + steps:
            prof.__exit__(None, None, None)
            counts = _counts(prof)
        elif step >= warmup:
            times.append(time.perf_counter() - t0)
        if bad:
            raise FloatingPointError(f"{name}: loss not finite at step {step}")
    if name == "world":
        record = [x for pair in zip(step_loss.image_losses(), torch.stack(totals).tolist()) for x in pair]
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"path": name, "ms_per_step": 1000 * statistics.median(times), "min_ms": 1000 * min(times), **counts,
            "losses": record, "weights_checksum": checksum}


def _fresh_copy(wrapper):
    import copy

    return copy.deepcopy(wrapper)


def op_counts(fn) -> dict:
    """aten ops and host syncs dispatched by `fn()` (torch.profiler, CPU side)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return _counts(prof)


# scalar reads that are not device syncs on CUDA: torch._grouped_mm's CPU path reads its offsets, the
# single-tensor AdamW of a CPU run reads its step counters (on CUDA both stay on the device or the host)
CPU_ONLY_READS = ("aten::_grouped_mm", "Optimizer.step")


def _is_host_sync(event) -> bool:
    """A scalar read (`aten::_local_scalar_dense`, i.e. `.item()`, `bool(t)`, `.tolist()`) outside CPU_ONLY_READS."""
    if event.name != "aten::_local_scalar_dense":
        return False
    p = event.cpu_parent
    while p is not None:
        if any(k in p.name for k in CPU_ONLY_READS):
            return False
        p = p.cpu_parent
    return True


def _counts(prof) -> dict:
    ev = prof.key_averages()
    return {"aten_ops": sum(e.count for e in ev if e.key.startswith("aten::")),
            "host_syncs": sum(_is_host_sync(e) for e in prof.events()),
            "nonzero": sum(e.count for e in ev if e.key == "aten::nonzero"),
            "sdpa_calls": sum(e.count for e in ev if e.key == "aten::scaled_dot_product_attention")}


def phases(wrapper, tok, pool, blocks, cfg, device, reps: int) -> list[tuple[str, float, dict]]:
    """Each part of one joint step timed alone (median of `reps`, synchronised): collate, host-to-device,
    the tower + projector, the fused-embedding scatter, the LM on the image batch (+ loss), the text
    blocks' forward, backward of the sum, clip + AdamW; and each part's op / sync counts."""
    v = cfg.vision
    model = _fresh_copy(wrapper).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    idx = BatchSampler(len(pool), min(v.train.batch_size, len(pool)), 3).next().tolist()
    tidx = BatchSampler(len(blocks), min(v.text_batch_size, len(blocks)), 4).next()
    m = model.model
    state: dict = {}

    def collate():
        state["batch"] = eyes.collate([pool[i] for i in idx], tok.pad_token_id)

    def h2d():
        state["dev"] = {k: t.to(device) for k, t in state["batch"].items()}

    def tower():
        d = state["dev"]
        state["img"] = torch.cat(m.get_image_features(d["pixel_values"], d["image_grid_thw"]).pooler_output)

    def scatter():
        d = state["dev"]
        ids = d["input_ids"]
        mask = ids == m.config.image_token_id
        emb = m.get_input_embeddings()(ids.masked_fill(mask, 0))
        state["emb"] = emb.masked_scatter(mask.unsqueeze(-1), state["img"].to(emb.dtype))

    def lm_image():
        d = state["dev"]
        out = m.language_model(inputs_embeds=state["emb"], attention_mask=d["attention_mask"])
        logits = model.lm_head(out.last_hidden_state)
        state["loss"] = model.loss_function(logits=logits, labels=d["labels"],
                                            vocab_size=model.config.text_config.vocab_size)

    def text():
        b = blocks[tidx].to(device)
        state["total"] = state["loss"] + model(input_ids=b, labels=b).loss

    def backward():
        opt.zero_grad(set_to_none=True)
        state["total"].backward()

    def optimizer():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    order = [("collate (CPU)", collate), ("host -> device", h2d), ("tower + projector (fwd)", tower),
             ("embed + masked_scatter (fwd)", scatter), ("LM + loss, image batch (fwd)", lm_image),
             ("text blocks: LM + loss (fwd)", text), ("backward (both)", backward), ("clip + AdamW", optimizer)]
    times: dict[str, list] = {n: [] for n, _ in order}
    counts: dict[str, dict] = {}
    for r in range(reps + 2):  # a warm-up pass, a counted pass (profiler overhead kept out), `reps` timed passes
        for n, fn in order:
            sync(device)
            t0 = time.perf_counter()
            if r == 1:
                counts[n] = op_counts(fn)
                continue
            fn()
            sync(device)
            if r > 1:
                times[n].append(time.perf_counter() - t0)
    return [(n, 1000 * statistics.median(times[n]), counts[n]) for n, _ in order]


def python_hot_spots(fn, top: int = 15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = world_config(args.demo_size, args.lm)
    v = cfg.vision
    ctx = contextlib.nullcontext() if args.no_deterministic else deterministic_algorithms([])
    with tempfile.TemporaryDirectory() as tmp, ctx:
        tok, wrapper, pool, blocks = build(cfg, args.pool, Path(tmp))
        tokens = [len(e.ids) for e in pool]
        print(f"# {args.demo_size} vision: {v.image_size}px ({pool[0].grid.tolist()} patches), tower {v.hidden_size} x "
              f"{v.num_hidden_layers}; {v.train.batch_size} images + {v.text_batch_size} text blocks of "
              f"{v.train.seq_len}; LM hidden {cfg.model.hidden_size} ({sum(p.numel() for p in wrapper.parameters()) / 1e6:.1f}M "
              f"params, vocab {wrapper.config.text_config.vocab_size}); image conversations {min(tokens)}-{max(tokens)} "
              f"tokens; device {device.type}, {torch.get_num_threads()} threads", flush=True)
        results = [run_path(p, wrapper, tok, pool, blocks, cfg, device, args.steps, args.warmup)
                   for p in args.paths.split(",")]
        print(f"\n{'path':10s} {'ms/step':>9s} {'min ms':>9s} {'aten ops':>9s} {'syncs':>6s} {'sdpa':>5s}  weights checksum")
        for r in results:
            print(f"{r['path']:10s} {r['ms_per_step']:9.1f} {r['min_ms']:9.1f} {r['aten_ops']:9d} {r['host_syncs']:6d} "
                  f"{r['sdpa_calls']:5d}  {r['weights_checksum']!r}")
        if len(results) == 2:
            a, b = results
            same = a["losses"] == b["losses"] and a["weights_checksum"] == b["weights_checksum"]
            print(f"{a['path']} / {b['path']}: {a['ms_per_step'] / b['ms_per_step']:.2f}x time, "
                  f"{a['aten_ops'] / b['aten_ops']:.2f}x aten ops, {a['host_syncs']} -> {b['host_syncs']} syncs; "
                  f"losses and weights identical: {same}")
        table = phases(wrapper, tok, pool, blocks, cfg, device, reps=max(1, args.steps))
        print(f"\n{'baseline step, each part timed alone':40s} {'ms':>8s} {'aten ops':>9s} {'syncs':>6s} {'sdpa':>5s}")
        for n, ms, c in table:
            print(f"{n:40s} {ms:8.1f} {c['aten_ops']:9d} {c['host_syncs']:6d} {c['sdpa_calls']:5d}")
        print(f"{'sum':40s} {sum(ms for _, ms, _ in table):8.1f} {sum(c['aten_ops'] for *_, c in table):9d} "
              f"{sum(c['host_syncs'] for *_, c in table):6d}")
        if args.profile:
            _profiles(wrapper, tok, pool, blocks, cfg, device)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "paths": results,
                                                   "phases": [[n, ms, c] for n, ms, c in table]}, indent=2))


def _profiles(wrapper, tok, pool, blocks, cfg, device) -> None:
    from torch.profiler import ProfilerActivity, profile

    v = cfg.vision
    model = _fresh_copy(wrapper).to(device).train()
    images = BatchSampler(len(pool), min(v.train.batch_size, len(pool)), 3)
    texts = BatchSampler(len(blocks), min(v.text_batch_size, len(blocks)), 4)
    step = JointStep(model, pool, blocks, tok.pad_token_id, images, texts, device)

    def one():
        step(0).backward()

    one()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        one()
    sort = "cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print("\n" + prof.key_averages().table(sort_by=sort, row_limit=20))
    print(python_hot_spots(one))


if __name__ == "__main__":
    main()
