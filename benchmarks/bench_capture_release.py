"""Capture from the Kimi-K2.5 release's own INT4 format at the real per-layer shape, through the
real path: a checkpoint written in the release format (eagle3/formats/release_format.py: routed experts of
layers >= 1 INT4 pack-quantized by compressed-tensors, group 32; bf16 elsewhere; the release's
names and quantization_config) with random weights, loaded by `eagle3.target_model.target_io.load_target`
(transformers + compressed-tensors, as `target=kimi_k25` does), then captured batch by batch by the
capture stage's own `data.capture_hf.capture_batch` (hooks, post-norm state, chunked argmax).

K2.5's text dims (hidden 7168, MLA q/kv ranks 1536/512, 64 heads, 384 routed experts of 2048 with 8
active, 1 shared expert, vocab 163840) with only `--layers` decoder layers: layer 0 dense as in the
release, the rest MoE. Per-layer figures come from CUDA events around every decoder layer; the
report extrapolates to 61 layers (1 dense + 60 MoE) on 8 GPUs with device_map, where the GPUs run
one after another, so a replica's time per batch is the sum of its layers' times.

  GPU:  python3 benchmarks/bench_capture_release.py --layers 3 --batches 6 --json $OUT/release.json
  CPU:  python benchmarks/bench_capture_release.py --tiny          (a smoke run of the same code)
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.bench_capture import k25_shaped_config
from data.capture_hf import capture_batch
from eagle3.formats import release_format
from eagle3.target_model import target_io

K25_LAYERS, K25_DENSE = 61, 1
H200_GB = 141.0  # per GPU (vendor figure; 139 GiB usable seen here)


def release_names(name: str, shape: torch.Size, num_experts: int):
    """(release name, shape) of every stored tensor behind one transformers parameter: the fused
    experts `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] are per-expert
    `experts.{e}.{gate,up,down}_proj.weight` in the checkpoint; text weights under `language_model.`."""
    full = "language_model." + name
    if name.endswith("mlp.experts.gate_up_proj"):
        base, inter = full[: -len("gate_up_proj")], shape[1] // 2
        return [(f"{base}{e}.{p}_proj.weight", (inter, shape[2])) for e in range(num_experts) for p in ("gate", "up")]
    if name.endswith("mlp.experts.down_proj"):
        base = full[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", (shape[1], shape[2])) for e in range(num_experts)]
    return [(full, tuple(shape))]


def random_tensor(name: str, shape, gen: torch.Generator, device) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def write_release_checkpoint(cfg, out: Path, device) -> dict:
    """A random checkpoint of text config `cfg` in the release format, one shard per decoder layer
    (experts quantised on `device` as they are generated, so no layer is ever held in bf16)."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    from data.mini_world.checkpoints import kimi_k25_config

    with torch.device("meta"):
        meta = DeepseekV3ForCausalLM(cfg)
    groups: dict[str, list] = {}
    for name, t in meta.state_dict().items():
        parts = name.split(".")
        shard = f"layer-{int(parts[2]):03d}" if parts[:2] == ["model", "layers"] else "embed-head"
        groups.setdefault(shard, []).extend(release_names(name, t.shape, cfg.n_routed_experts))
    gen = torch.Generator(device=device).manual_seed(0)
    scheme, weight_map, stored_bytes = release_format.release_scheme(), {}, {}
    out.mkdir(parents=True, exist_ok=True)
    for shard, names in groups.items():
        tensors = {}
        for name, shape in names:
            t = random_tensor(name, shape, gen, device)
            if release_format.is_int4_expert_weight(name, cfg.first_k_dense_replace):
                packed = release_format.quantize_expert_weight(t, scheme)
                tensors.update({name[: -len("weight")] + k: v.cpu() for k, v in packed.items()})
            else:
                tensors[name] = t.cpu()
        file = f"model-{shard}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        stored_bytes[shard] = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = release_format.with_release_quantization(kimi_k25_config(cfg).to_dict())
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return stored_bytes


class LayerTimer:
    """CUDA events (CPU: wall clock) around every decoder layer's forward."""

    def __init__(self, layers, cuda: bool):
        self.cuda, self.marks, self.handles = cuda, {}, []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._mark(i, 0)))
            self.handles.append(layer.register_forward_hook(lambda m, a, o, i=i: self._mark(i, 1)))

    def _mark(self, i, k):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.perf_counter()
        self.marks.setdefault(i, [None, None])[k] = ev

    def seconds(self) -> dict[int, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {i: a.elapsed_time(b) / 1e3 for i, (a, b) in self.marks.items()}
        return {i: b - a for i, (a, b) in self.marks.items()}


def module_bytes(m: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def mean(xs):
    return sum(xs) / len(xs)


def time_capture(model, layers, timer, cfg, hf_indices, tokens_per_batch, args, cuda, moe_ids) -> dict:
    """capture_batch over random batches of `tokens_per_batch` padded tokens: whole-batch wall time
    (synchronised) and each decoder layer's share (events), after `args.warmup` batches."""
    per_batch = max(1, tokens_per_batch // args.seq_len)
    g = torch.Generator().manual_seed(tokens_per_batch)
    batches = [[torch.randint(0, cfg.vocab_size, (args.seq_len,), generator=g) for _ in range(per_batch)]
               for _ in range(args.warmup + args.batches)]
    tm = target_io.text_model(model)
    per_layer, totals = [], []
    torch.cuda.reset_peak_memory_stats() if cuda else None
    for k, b in enumerate(batches):
        torch.cuda.synchronize() if cuda else None
        t = time.perf_counter()
        capture_batch(model, tm, b, hf_indices, torch.bfloat16, 4096)
        torch.cuda.synchronize() if cuda else None
        if k >= args.warmup:
            totals.append(time.perf_counter() - t)
            per_layer.append(timer.seconds())
    tokens = per_batch * args.seq_len
    layer_s = {i: mean([p[i] for p in per_layer]) for i in range(len(layers))}
    moe_s = mean([layer_s[i] for i in moe_ids])
    dense_s = mean([layer_s[i] for i in range(cfg.first_k_dense_replace)])
    total_s = mean(totals)
    return {"tokens_per_batch": tokens, "seq_len": args.seq_len, "batches_timed": len(totals),
            "batch_seconds": round(total_s, 4), "capture_tokens_per_s": round(tokens / total_s, 1),
            "seconds_per_batch": {"moe_layer": round(moe_s, 4), "dense_layer": round(dense_s, 4),
                                  "embed_norm_head_argmax_casts": round(total_s - sum(layer_s.values()), 4)},
            "tokens_per_s_per_moe_layer": round(tokens / moe_s, 1),
            "gpu_peak_during_capture_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None}


def extrapolate(per_moe_s, dense_s, rest_s, tokens_per_batch, moe_gb, dense_gb, other_gb, int4_moe_gb, gpu_gb):
    """61 layers (1 dense + 60 MoE) as one device_map replica: the GPUs run one after another."""
    moe = K25_LAYERS - K25_DENSE
    batch_s = rest_s + dense_s + moe * per_moe_s
    tok_s = tokens_per_batch / batch_s
    weights_gb = other_gb + dense_gb + moe * moe_gb
    int4_gb = other_gb + dense_gb + moe * int4_moe_gb
    usable = 0.9 * gpu_gb  # activations, CUDA context, the allocator's slack
    return {"layers": K25_LAYERS, "moe_layers": moe, "batch_seconds": round(batch_s, 3),
            "tokens_per_s": round(tok_s, 1), "hours_for_150M_tokens": round(150e6 / tok_s / 3600, 1),
            "weights_gb_as_loaded": round(weights_gb, 1), "gpus_needed_as_loaded": math.ceil(weights_gb / usable),
            "fits_8_gpus_as_loaded": weights_gb <= 8 * usable,
            "weights_gb_if_experts_stayed_int4": round(int4_gb, 1),
            "gpus_needed_if_experts_stayed_int4": math.ceil(int4_gb / usable)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3, help="decoder layers: layer 0 dense, the rest MoE")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens-per-batch", type=lambda v: [int(x) for x in v.split(",")], default=[8192],
                    help="padded tokens per forward; a comma list measures each (one load)")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temp dir, deleted)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (a smoke run of the same code)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        args.seq_len, args.tokens_per_batch = min(args.seq_len, 64), [min(n, 256) for n in args.tokens_per_batch]
        args.experts = min(args.experts, 8)
    cfg = k25_shaped_config(SimpleNamespace(tiny=args.tiny, layers=args.layers, experts=args.experts))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-release-"))
    ckpt = root / "k25-release"
    try:  # the checkpoint is tens of GB: a temp one goes whatever happens
        t0 = time.perf_counter()
        stored = write_release_checkpoint(cfg, ckpt, device)
        write_s = time.perf_counter() - t0
        torch.cuda.empty_cache() if cuda else None
        t0 = time.perf_counter()
        model, text = target_io.load_target(ckpt, "kimi_k25", "bfloat16", {"": 0} if cuda else None)
        load_s = time.perf_counter() - t0
        layers = target_io.decoder_layers(model)
        weights_alloc = torch.cuda.memory_allocated() if cuda else 0
        L, V = len(layers), cfg.vocab_size
        hf_indices = [1, max(1, L // 2), L]  # the hook cost is per token: which layers does not matter
        moe_ids = [i for i in range(L) if i >= cfg.first_k_dense_replace]
        gb = 1e9
        moe_gb = mean([module_bytes(layers[i]) for i in moe_ids]) / gb
        dense_gb = module_bytes(layers[0]) / gb
        other_gb = (module_bytes(model) - sum(module_bytes(x) for x in layers)) / gb  # embed, norm, head, vision stub
        int4_moe_gb = mean([stored[f"layer-{i:03d}"] for i in moe_ids]) / gb
        ckpt_gb = sum(stored.values()) / gb
        gpu_gb = torch.cuda.get_device_properties(0).total_memory / gb if cuda else H200_GB
        timer = LayerTimer(layers, cuda)
        runs = [time_capture(model, layers, timer, cfg, hf_indices, n, args, cuda, moe_ids) for n in args.tokens_per_batch]
        for r in runs:
            r["extrapolation_61_layers_8_gpus_device_map"] = extrapolate(
                r["seconds_per_batch"]["moe_layer"], r["seconds_per_batch"]["dense_layer"],
                r["seconds_per_batch"]["embed_norm_head_argmax_casts"], r["tokens_per_batch"], moe_gb, dense_gb,
                other_gb, int4_moe_gb, gpu_gb)
        report = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                         "compressed_tensors": __import__("compressed_tensors").__version__},
            "model": {"hidden": cfg.hidden_size, "layers": L, "routed_experts": cfg.n_routed_experts,
                      "active_experts": cfg.num_experts_per_tok, "moe_intermediate": cfg.moe_intermediate_size,
                      "vocab": V, "experts_implementation": getattr(model.config.get_text_config(), "_experts_implementation",
                                                                    None)},
            "checkpoint": {"gb_on_disk": round(ckpt_gb, 2), "int4_gb_per_moe_layer": round(int4_moe_gb, 3),
                           "write_seconds": round(write_s, 1), "load_seconds": round(load_s, 1),
                           "load_gb_per_s": round(ckpt_gb / load_s, 2)},
            "expert_dtype_after_load": str(layers[moe_ids[0]].mlp.experts.gate_up_proj.dtype) if moe_ids else None,
            "gpu_gb_per_moe_layer": round(moe_gb, 3), "gpu_gb_dense_layer": round(dense_gb, 3),
            "gpu_gb_embed_head_other": round(other_gb, 3),
            "gpu_weights_allocated_gb": round(weights_alloc / gb, 2),
            "runs": runs,
        }
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
