"""fp8 aux states in the hidden-state store: bytes per token, and what they do to the drafter.

On the mini world, from ONE prepared k25-mini dataset:
  1. capture the train + validation splits twice: aux in bf16 (the default) and aux_dtype=float8_e4m3fn;
  2. build the draft vocab once (it depends only on the dataset);
  3. train the same drafter on each store (+init=scratch, same seed, same steps, same data order);
  4. evaluate with the eval stage (teacher-forced accuracy per TTT step, SGLang-style accept-length
     replay at 2/1/3 and 3/1/4, the SpecForge-style chain estimate from conditional accuracy, and
     the real speculative loop on the live target):
       bf16-trained on the bf16 validation store   the baseline
       fp8-trained  on the bf16 validation store   what serving sees: SGLang feeds the drafter
                                                   exact bf16 aux states, never fp8 ones
       fp8-trained  on the fp8 validation store    what the eval stage reports on an fp8 capture
  5. bytes per token of each store (from the shard files: all columns, and aux + aux_scale alone),
     and the CPU cost of dequantising one Kimi-K2.5-width sequence on read.

  python benchmarks/bench_fp8_store.py                                   # runs/mini_world, prepares its own data
  python benchmarks/bench_fp8_store.py --mini-world /path/mini_world --prepare-dir /path/stages/k25_mini/prepare
Everything is written under --work (default: a new temp dir); runs/ is never touched. A missing
mini world is built there first (~8 min on 2 cores); preparing (regenerating 120 conversations
with k25-mini, the demo's cpu preset) takes ~3 min; the rest ~6 min.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle3.formats.fp8 import dequantise_rows, quantise_rows
from eagle3.formats.store import HiddenStateStore

FP8 = "float8_e4m3fn"
FORMATS = {"bf16": [], "fp8": [f"aux_dtype={FP8}"]}
# The demo's cpu preset (conf/demo_size/cpu.yaml), so the figures are comparable with the demo's table.
PREPARE = ["regenerate.backend=hf", "regenerate.max_new_tokens=64", "regenerate.max_conversations=120",
           "regenerate.batch_size=16", "max_records=120", "max_length=384", "validation_fraction=0.15"]
TRAIN = ["+init=scratch", "epochs=1000", "optim.lr=1e-3", "optim.warmup_steps=4", "val_every=20",
         "checkpoint_every=20", "data.max_tokens_per_batch=4096", "val_accept_sequences=4", "wandb.mode=disabled"]
EVALS = {  # name: (drafter trained on, validation store, run the real speculative loop)
    "bf16 drafter, bf16 val": ("bf16", "bf16", True),
    "fp8 drafter, bf16 val": ("fp8", "bf16", True),
    "fp8 drafter, fp8 val": ("fp8", "fp8", False),  # the real loop does not read the store: same as above
}
KNOBS = ("2/1/3", "3/1/4")


def run_stage(stage: str, overrides: list[str], log: list) -> Path:
    from pipeline.demo import StageLog

    sl = StageLog()
    out = sl.run(stage, stage, overrides)
    log.append((f"{stage} {' '.join(o for o in overrides if not o.startswith('paths.'))}", sl.rows[0][1]))
    return out


def shard_columns(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def store_bytes(capture_dir: Path) -> dict:
    """Bytes per token over both splits: whole shard files, and the aux columns alone."""
    total = aux = tokens = 0
    for split in ("train", "validation"):
        store = HiddenStateStore(capture_dir / split)
        for s in store.manifest["shards"]:
            cols = shard_columns(capture_dir / split / s["file"])
            total += s["bytes"]
            aux += cols["aux"] + cols.get("aux_scale", 0)
        tokens += store.num_tokens
    return {"tokens": tokens, "bytes_per_token": total / tokens, "aux_bytes_per_token": aux / tokens}


def aux_error(bf16_dir: Path, fp8_dir: Path) -> dict:
    """How far the fp8 store's aux states are from the bf16 store's, over the validation split:
    per (token, layer) row, max |err| / amax and ||err|| / ||x||."""
    a, b = HiddenStateStore(bf16_dir / "validation"), HiddenStateStore(fp8_dir / "validation")
    max_rel, l2 = [], []
    for i in range(len(a)):
        layers = len(a.hf_indices)
        x = a[i]["aux"].float().view(a.lengths[i], layers, -1)
        y = b[i]["aux"].float().view(x.shape)
        err = (x - y).abs()
        max_rel.append((err.amax(-1) / x.abs().amax(-1).clamp_min(1e-30)).flatten())
        l2.append((err.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).flatten())
    max_rel, l2 = torch.cat(max_rel), torch.cat(l2)
    return {"rows": max_rel.numel(), "max_over_rows_of_max_err_over_amax": float(max_rel.max()),
            "mean_rel_l2": float(l2.mean()), "max_rel_l2": float(l2.max())}


def read_seconds(capture_dir: Path) -> float:
    """Wall time to read every train sequence through HiddenStateStore (median of 3)."""
    store = HiddenStateStore(capture_dir / "train", verify="none")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for i in range(len(store)):
            store[i]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def dequant_k25_seconds(tokens: int = 2048, hidden: int = 7168) -> dict:
    """CPU time to dequantise one K2.5-width sequence (3 layers x 7168) to bf16, and to copy its bf16 aux."""
    x = torch.randn(tokens, 3, hidden).to(torch.bfloat16)
    codes, scale = quantise_rows(x)

    def best(fn):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)
    return {"tokens": tokens, "threads": torch.get_num_threads(),
            "fp8_dequant_s": best(lambda: dequantise_rows(codes, scale, torch.bfloat16)),
            "bf16_copy_s": best(lambda: x.clone())}


def eval_figures(report: dict) -> dict:
    acc = report["accuracy"]
    real = (report.get("real_loop") or {}).get("knobs") or {}
    return {"acc_step0": acc["step_accuracy"][0], "acc_mean": sum(acc["step_accuracy"]) / len(acc["step_accuracy"]),
            "positions": acc["positions"][0],
            **{f"sim {k}": report["accept"][k]["drafter"]["accept_length"] for k in KNOBS},
            **{f"cycles {k}": report["accept"][k]["drafter"]["cycles"] for k in KNOBS},
            **{f"chain_est {k}": acc["chain_estimate"][k] for k in KNOBS},
            **{f"real {k}": (real.get(k) or {}).get("real_accept_length", float("nan")) for k in KNOBS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mini-world", type=Path, default=None, help="default: <repo>/runs/mini_world (built if missing)")
    ap.add_argument("--prepare-dir", type=Path, default=None, help="a k25-mini prepare stage dir (default: prepare one)")
    ap.add_argument("--work", type=Path, default=None, help="paths.root of every stage run here (default: a temp dir)")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--eval-sequences", type=int, default=32, help="validation sequences evaluated (eval max_sequences)")
    ap.add_argument("--real-prompts", type=int, default=4, help="prompts of the real speculative loop")
    args = ap.parse_args()
    t_start = time.time()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-fp8-store-"))
    stages = work / "stages" / "k25_mini"
    log: list = []

    world = args.mini_world or Path(__file__).resolve().parents[1] / "runs" / "mini_world"
    if not (world / "k25-mini" / "config.json").is_file():
        print(f"[bench] no mini world at {world}: building one under {work}")
        world = run_stage("mini_world", [f"paths.root={work}"], log)
    paths = [f"paths.root={work}", f"paths.mini_world={world}", "target=k25_mini"]
    prep = args.prepare_dir or run_stage("prepare", paths + PREPARE, log)
    layers = json.loads((world / "k25-mini" / "config.json").read_text())["text_config"]["num_hidden_layers"]
    hf_indices = [2, layers // 2, layers - 3]  # SGLang's default capture (Kimi's h), as the demo uses

    captures, trains = {}, {}
    for fmt, extra in FORMATS.items():
        captures[fmt] = run_stage("capture", paths + [f"in_dir={prep}", f"out_dir={stages}/capture-{fmt}",
                                                      f"aux_hf_indices=[{','.join(map(str, hf_indices))}]",
                                                      "progress=false", *extra], log)
    vocab = run_stage("vocab", paths + [f"in_dir={prep}", f"out_dir={stages}/vocab"], log)
    for fmt in FORMATS:
        trains[fmt] = run_stage("train", paths + TRAIN + [f"max_steps={args.max_steps}", f"capture_dir={captures[fmt]}",
                                                          f"vocab_dir={vocab}", f"out_dir={stages}/train-{fmt}",
                                                          "progress=false"], log)
    evals = {}
    for name, (drafter, val, real) in EVALS.items():
        tag = f"{drafter}-on-{val}"
        out = run_stage("eval", paths + [f"drafter_dir={trains[drafter]}/final", f"train_dir={trains[drafter]}",
                                         f"capture_dir={captures[val]}", f"name={tag}", f"out_dir={stages}/eval-{tag}",
                                         f"max_sequences={args.eval_sequences}", f"real_loop.enabled={str(real).lower()}",
                                         f"real_loop.num_prompts={args.real_prompts}", "real_loop.max_new_tokens=32",
                                         "wandb.mode=disabled", "progress=false"], log)
        evals[name] = eval_figures(json.loads((out / "report.json").read_text()))

    sizes = {fmt: {**store_bytes(captures[fmt]), "read_train_s": read_seconds(captures[fmt])} for fmt in FORMATS}
    error = aux_error(captures["bf16"], captures["fp8"])
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "mini_world": str(world),
              "prepare_dir": str(prep), "work": str(work), "aux_hf_indices": hf_indices, "max_steps": args.max_steps,
              "stores": sizes, "aux_bytes_ratio": sizes["fp8"]["aux_bytes_per_token"] / sizes["bf16"]["aux_bytes_per_token"],
              "total_bytes_ratio": sizes["fp8"]["bytes_per_token"] / sizes["bf16"]["bytes_per_token"],
              "aux_error": error, "dequant_k25_width": dequant_k25_seconds(), "evals": evals, "stage_seconds": log,
              "total_seconds": time.time() - t_start}
    (work / "bench_fp8_store.json").write_text(json.dumps(result, indent=1) + "\n")
    print(render(result))
    print(f"\n[bench] figures in {work / 'bench_fp8_store.json'}")


def render(r: dict) -> str:
    s = r["stores"]
    lines = ["| store | tokens | bytes/token (all columns) | aux bytes/token (aux + aux_scale) | read train split (s) |",
             "|---|---|---|---|---|"]
    for fmt, v in s.items():
        lines.append(f"| {fmt} aux | {v['tokens']} | {v['bytes_per_token']:.1f} | {v['aux_bytes_per_token']:.1f} | "
                     f"{v['read_train_s']:.3f} |")
    lines.append(f"\nfp8 / bf16: aux bytes x{r['aux_bytes_ratio']:.3f}, all bytes x{r['total_bytes_ratio']:.3f}")
    e = r["aux_error"]
    lines.append(f"fp8 vs bf16 aux over {e['rows']} validation (token, layer) rows: max |err| / row amax "
                 f"{e['max_over_rows_of_max_err_over_amax']:.4f}, relative L2 error mean {e['mean_rel_l2']:.4f} "
                 f"(max {e['max_rel_l2']:.4f})\n")
    cols = ["acc_step0", "acc_mean"] + [f"{m} {k}" for m in ("sim", "chain_est", "real") for k in KNOBS]
    lines += ["| drafter / validation store | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, e in r["evals"].items():
        lines.append(f"| {name} | " + " | ".join(f"{e[c]:.4f}" for c in cols) + " |")
    base = r["evals"]["bf16 drafter, bf16 val"]
    for name, e in list(r["evals"].items())[1:]:
        rel = ", ".join(f"{m} {k} {100 * (e[f'{m} {k}'] / base[f'{m} {k}'] - 1):+.2f}%"
                        for m in ("sim", "chain_est", "real") for k in KNOBS)
        lines.append(f"\n{name} vs baseline: acc_step0 {100 * (e['acc_step0'] - base['acc_step0']):+.2f} pts; {rel}")
    d = r["dequant_k25_width"]
    lines.append(f"\nCPU dequantise of one {d['tokens']}-token K2.5-width aux sequence (3 x 7168) to bf16: "
                 f"{d['fp8_dequant_s'] * 1e3:.0f} ms ({d['threads']} threads; a bf16 copy: {d['bf16_copy_s'] * 1e3:.0f} ms)")
    lines.append(f"replayed cycles 2/1/3: {base['cycles 2/1/3']}, teacher-forced positions: {base['positions']}; "
                 f"total {r['total_seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
