"""Capture throughput and its overhead over a bare forward pass of the same target.

A random-weight DeepSeek-V3-shaped causal LM (hidden 7168, MLA, MoE like Kimi-K2.5, but only a
few layers and fewer routed experts so it fits one GPU) runs three ways over the same batches:
  bare     model(input_ids, attention_mask): the target's plain forward, full logits
  capture  data.capture_hf.capture_batch: hooks on 3 layers + final norm, chunked lm_head argmax,
           finiteness check, states cast to the store dtype (left on the device)
  store    data.capture_hf.capture_split end to end: capture + HiddenStateWriter (async device->host
           copies into pinned shard buffers on a side stream; a background thread hashes and
           writes each shard) into a real store on local disk
and reports tokens/s of each, the overhead of capture and store over bare, and bytes stored per
token (measured from the shard files). The layer count matters: the capture cost is per token
(independent of depth) while the forward grows with depth, so the overhead on the 61-layer
target is about (layers here / 61) of the one measured here.

  GPU:  python3 benchmarks/bench_capture.py --layers 4 --experts 16 --batches 16
  CPU:  python benchmarks/bench_capture.py --tiny          (a smoke run of the same code)
  a real checkpoint instead (weights loaded with eagle3.target_model.target_io.load_target):
        python benchmarks/bench_capture.py --target runs/mini_world/k25-mini --layout kimi_k25 --seq-len 512
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from data.capture_setup import Dist
from data.capture_hf import capture_batch, capture_split
from data.capture_plan import Seq
from eagle3.engines import aux_layers
from eagle3.target_model import target_io
from eagle3.config.dtypes import torch_dtype
from eagle3.formats.store import HiddenStateStore, HiddenStateWriter


def k25_shaped_config(args):
    from transformers import DeepseekV3Config

    if args.tiny:
        return DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096,
                                num_mtp_layers=0, tie_word_embeddings=False)
    # Kimi-K2.5's text config, except num_hidden_layers and n_routed_experts (memory).
    return DeepseekV3Config(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=args.layers, num_attention_heads=64, num_key_value_heads=64,
                            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                            v_head_dim=128, n_routed_experts=args.experts, num_experts_per_tok=8, n_shared_experts=1,
                            first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
                            max_position_embeddings=262144, num_mtp_layers=0, tie_word_embeddings=False,
                            rms_norm_eps=1e-5)


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16, help="routed experts (K2.5 has 384; 8 active either way)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--aux-hf-indices", type=int, nargs=3, default=None,
                    help="HF hidden-state indices h (eagle3/engines/aux_layers.py); default: SGLang's for --layers")
    ap.add_argument("--store-dtype", default="bfloat16")
    ap.add_argument("--shard-tokens", type=int, default=16384)
    ap.add_argument("--store-dir", default=None, help="where the store goes (default: a temp dir, deleted)")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    ap.add_argument("--target", default=None, help="a target checkpoint dir to load instead of random weights")
    ap.add_argument("--layout", default="causal_lm", choices=list(target_io.LAYOUTS))
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.tiny:
        args.seq_len, args.tokens_per_batch = min(args.seq_len, 128), min(args.tokens_per_batch, 512)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    from transformers import DeepseekV3ForCausalLM

    if args.target:
        model, text = target_io.load_target(args.target, args.layout, str(dtype).replace("torch.", ""))
        model.to(device)
        cfg = SimpleNamespace(**{k: text.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size",
                                                          "n_routed_experts")})
    else:
        cfg = k25_shaped_config(args)
        torch.manual_seed(0)
        with torch.device(device):
            model = DeepseekV3ForCausalLM._from_config(cfg, dtype=dtype).eval()
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    hf_indices = aux_layers.choose_hf_indices(None, None, args.aux_hf_indices, L).hf_indices
    store_dtype = torch_dtype(args.store_dtype)
    per_batch = max(1, args.tokens_per_batch // args.seq_len)
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, V, (args.seq_len,), generator=g) for _ in range(per_batch)]
               for _ in range(args.batches)]
    tokens = args.batches * per_batch * args.seq_len
    tm = target_io.text_model(model)

    def bare():
        for b in batches:
            ids = torch.stack(b).to(device)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.argmax(-1).cpu()

    def capture():
        for b in batches:
            capture_batch(model, tm, b, hf_indices, store_dtype, 4096)

    store_root = Path(args.store_dir or tempfile.mkdtemp(prefix="bench-capture-"))

    def store():
        out = store_root / f"store-{time.time_ns()}"
        writer = HiddenStateWriter(out, hidden_size=H, target_hidden_size=H, hf_indices=hf_indices,
                                   dtype=args.store_dtype,
                                   shard_tokens=args.shard_tokens, background=True)
        rows = [{"input_ids": x, "loss_mask": torch.ones_like(x)} for b in batches for x in b]
        seqs = [Seq(i, f"s{i}", args.seq_len, i) for i in range(len(rows))]
        ccfg = SimpleNamespace(dtype=args.store_dtype, max_tokens_per_batch=args.tokens_per_batch,
                               argmax_chunk_tokens=4096, progress=False)
        capture_split(model, rows, seqs, writer, ccfg, hf_indices, Dist(), "bench")
        writer.finish()
        return out

    for _ in range(args.warmup):  # kernels, allocator, page cache
        batches_saved = batches
        batches = batches_saved[:1]
        bare(), capture()
        batches = batches_saved
    results = {}
    for name, fn in (("bare", bare), ("capture", capture), ("bare_again", bare)):
        secs = timed(fn, device)
        results[name] = {"seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 1)}
    secs = timed(lambda: results.setdefault("_out", store()), device)
    out = results.pop("_out")
    results["store"] = {"seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 1)}
    st = HiddenStateStore(out, verify="size")
    shard_bytes = sum((out / s["file"]).stat().st_size for s in st.manifest["shards"])
    bare_s = min(results["bare"]["seconds"], results["bare_again"]["seconds"])
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "target": args.target or "random DeepSeek-V3 (K2.5 shapes)",
        "model": {"hidden": H, "layers": L, "routed_experts": cfg.n_routed_experts, "vocab": V,
                  "dtype": str(dtype).replace("torch.", "")},
        "aux_hf_indices": hf_indices, "tokens": tokens, "tokens_per_batch": per_batch * args.seq_len,
        "seq_len": args.seq_len, **results,
        "capture_overhead_pct": round(100 * (results["capture"]["seconds"] / bare_s - 1), 2),
        "store_overhead_pct": round(100 * (results["store"]["seconds"] / bare_s - 1), 2),
        "bytes_per_token": round(shard_bytes / st.num_tokens, 1),
        "bytes_per_token_states": (len(hf_indices) + 1) * H * store_dtype.itemsize,
        "peak_gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
    }
    if not args.store_dir:
        shutil.rmtree(store_root, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
