"""Time and peak memory of the TTT attention implementations (eagle3.drafter.attention.TTTCache impl=explicit vs
sdpa_mask), forward + backward over a full unroll, and optionally of the whole drafter unroll.

    python benchmarks/bench_ttt_attention.py                       # Kimi-K2.5 drafter attention shape, CUDA
    python benchmarks/bench_ttt_attention.py --drafter             # + the full 1-layer drafter (1.19B params)
    python benchmarks/bench_ttt_attention.py --device cpu --heads 4 --seq 256   # a quick CPU run
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from eagle3.drafter.attention import TTTCache, ttt_position_ids


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def attention_unroll(impl, B, h, T, d, steps, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(3, B, h, T, d, device=device, dtype=dtype, generator=g, requires_grad=True)
              for _ in range(steps)]
    cache = TTTCache(impl=impl)
    loss = 0.0
    for k in range(steps):
        q, kk, vv = leaves[k]
        loss = loss + cache.attend(q, kk, vv).float().square().mean() * 0.8 ** k
    loss.backward()
    return leaves[0].grad


def drafter_unroll(model, impl, B, T, steps, device):
    cfg = model.config
    g = torch.Generator(device=device).manual_seed(0)
    aux = torch.randn(B, T, 3 * cfg.target_hidden_size, device=device, dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (B, T + steps), device=device, generator=g)
    pos = torch.arange(T, device=device).expand(B, T)
    cache = TTTCache(impl=impl)
    hidden = model.project_aux(aux)
    loss = 0.0
    for k in range(steps):
        hidden = model.step(ids[:, k:k + T], hidden, ttt_position_ids(pos, k), cache)
        loss = loss + model.logits(hidden).float().logsumexp(-1).mean() * 0.8 ** k
    loss.backward()


def measure(fn, device, repeats):
    fn()  # warm-up
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    ms = (time.perf_counter() - t0) / repeats * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return ms, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drafter", action="store_true", help="also time the full Kimi-K2.5-shaped drafter unroll")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for T in args.seq:
        for impl in ("explicit", "sdpa_mask"):
            try:
                ms, peak = measure(lambda: attention_unroll(impl, args.batch, args.heads, T, args.head_dim, args.steps,
                                                            device, dtype), device, args.repeats)
                rows.append({"what": "attention", "impl": impl, "T": T, "ms": round(ms, 2), "peak_GiB": round(peak, 2)})
            except torch.cuda.OutOfMemoryError:
                rows.append({"what": "attention", "impl": impl, "T": T, "ms": None, "peak_GiB": "OOM"})
                torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    if args.drafter:
        from eagle3.drafter.model import DrafterConfig, Eagle3Drafter

        cfg = DrafterConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                            head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
                            rope_theta=1e6, max_position_embeddings=262144)
        with torch.device(device):
            model = Eagle3Drafter(cfg).to(torch.bfloat16)
        for T in args.seq:
            for impl in ("explicit", "sdpa_mask"):
                try:
                    ms, peak = measure(lambda: drafter_unroll(model, impl, args.batch, T, args.steps, device),
                                       device, args.repeats)
                    tok_s = args.batch * T / (ms / 1e3)
                    rows.append({"what": "drafter", "impl": impl, "T": T, "ms": round(ms, 1), "peak_GiB": round(peak, 2),
                                 "train_tokens_per_s": round(tok_s)})
                except torch.cuda.OutOfMemoryError:
                    rows.append({"what": "drafter", "impl": impl, "T": T, "ms": None, "peak_GiB": "OOM"})
                    torch.cuda.empty_cache()
                model.zero_grad(set_to_none=True)
                print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                      "torch": torch.__version__, "steps": args.steps, "batch": args.batch}))


if __name__ == "__main__":
    main()
