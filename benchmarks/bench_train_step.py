"""Time one TTT training step of the drafter, the way train/stage.py runs it (without accelerate):
the real objective (eagle3.ttt.unroll.TTTObjective: TTT unroll, fp32 teacher from the draft-vocab rows
of the target head, soft CE, 0.8^k weights), fp32 master weights under bf16 autocast on CUDA,
frozen bf16 target embeddings, AdamW (fused on CUDA), grad clipping at 0.5 (folded into the fused
AdamW step as the trainer does it: train/distributed.clip_gradients).

Defaults are the Kimi-K2 / K2.5 drafter (issue 9): hidden 7168, 64 x 128 heads (64 KV heads),
MLP 18432, draft vocab 32000, target vocab 163840, TTT 7, batch 1, random weights and inputs
already on the device. Each step runs as train/trainer.py runs it (one host sync between backward
and optimizer, none between forward and backward; phases split by CUDA events): forward+loss,
backward (+ clip), optimizer. Reports tokens/s, model TFLOP/s by issue 9's formula
(6 x 1.0368e9 x T x 7 for the trainable matmuls + 344,064 x T^2 for attention, scaled to the
chosen dims) and peak allocated / reserved memory.

    python benchmarks/bench_train_step.py                          # H200: K2 dims, T = 2048..16384
    python benchmarks/bench_train_step.py --tiny --seq-lens 64,128 # CPU smoke run
    python benchmarks/bench_train_step.py --impls fast --seq-lens 4096,8192 --store-seq-lens 4096@0.65 --anchor
        # + SpecForge 0.2.0's own step (bench_specforge_anchor.py) at every (T, loss share) timed, in the same
        # process right after this project's, and the tokens/s ratios per (T, share) (issue 22)
    ... --floor   # + the step's compute floor at each (T, share): its GEMMs and causal attention alone,
                  # replayed back to back (step_floor.py), and floor / SpecForge: the highest ratio its math allows

Imports only torch, eagle3 core modules and train/distributed.py (runs on the GPU image without hydra/wandb/accelerate).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_specforge_anchor (--anchor), step_floor (--floor)

import torch

from eagle3.ttt.loss import all_loss_positions
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.ttt.ttt_flash import resolve_attention_kernel
from eagle3.ttt.unroll import TTTObjective
from eagle3.ttt import triton_kernels
from train.distributed import clip_gradients, optimizer_step
from train.optim import adamw

K2 = dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, draft_vocab=32000, vocab=163840)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=256, vocab=1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small dims for a CPU smoke run")
    for k in K2:
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    p.add_argument("--seq-lens", default="2048,4096,8192,16384", help="comma-separated T values")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--mask-frac", type=float, default=1.0,
                   help="share of loss positions (assistant tokens); 1.0 = all, comparable with full-vocab trainers")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-autocast", action="store_true", help="fp32 compute on CUDA too")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="for the MFU column (H200 bf16 dense)")
    p.add_argument("--impls", default="fast,reference",
                   help="objective implementations to time, comma-separated (eagle3.ttt.unroll.TTTObjective impl); "
                        "fast-flash / fast-cudnn = the fast path with that attention kernel (fast = --attention-kernel)")
    p.add_argument("--attention-kernel", default="auto", help="the fast path's attention kernel: auto | flash | cudnn")
    p.add_argument("--compile", action="store_true", help="fast path with torch.compile'd memory-bound pieces")
    p.add_argument("--check-seq-len", type=int, default=1024,
                   help="T of the fast-vs-reference loss/gradient check (0 = skip)")
    p.add_argument("--profile-seq-len", type=int, default=0, help="profile one fast step at this T (0 = no)")
    p.add_argument("--profile-shapes", action="store_true", help="the profile also lists aten ops by input shape")
    p.add_argument("--store-seq-lens", default="",
                   help="also time the fast step fed from a real hidden-state store at these T (comma-separated): "
                        "a reader thread into pinned memory + side-stream prefetch, as train/stage.py runs it; "
                        "T@share (e.g. 4096@0.65) sets that store's loss share (default --mask-frac) and adds an "
                        "in-memory fast row at the same share")
    p.add_argument("--store-steps", type=int, default=8, help="timed steps per store-fed T (after 2 warm-up steps)")
    p.add_argument("--store-dir", default=None, help="where to write the benchmark store (default: a temp dir)")
    p.add_argument("--anchor", action="store_true",
                   help="then time SpecForge 0.2.0's own training step (benchmarks/bench_specforge_anchor.py) at "
                        "every (T, loss share) of the fast rows, in this process, and print the ratios")
    p.add_argument("--anchor-attention", default="flex_attention",
                   help="SpecForge's training.attention_backend (its default flex_attention; sdpa | fa)")
    p.add_argument("--anchor-compact-teacher", action="store_true",
                   help="SpecForge's training.compact_teacher (default off: full-vocab teacher logits)")
    p.add_argument("--anchor-no-fsdp", action="store_true",
                   help="skip SpecForge's FSDP wrap (its trainer wraps even on one GPU)")
    p.add_argument("--anchor-max-seq-len", type=int, default=None,
                   help="run the anchor only up to this T (longer rows are reported without an anchor)")
    p.add_argument("--floor", action="store_true",
                   help="also time the step's compute floor at every (T, share) of the fast rows: its GEMMs and "
                        "causal attention alone, replayed back to back (benchmarks/step_floor.py)")
    p.add_argument("--memory-cap-gb", type=float, default=None,
                   help="cap this process's GPU memory at this many GB (1e9 bytes; e.g. 96 for an RTX PRO 6000): "
                        "a step that needs more fails with out-of-memory instead of using the H200's 141 GB")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the in-memory rows (every impl x T) this many times, alternating impls (A/B on a "
                        "noisy machine: compare within a round)")
    p.add_argument("--anchor-rounds", type=int, default=1,
                   help="time the anchor at each (T, share) this many times (each --warmup + --iters steps); the "
                        "ratios then take the median over rounds of both tools' tokens/s")
    p.add_argument("--optimizer", default="auto", choices=("auto", "torch-fused"),
                   help="auto: the trainer's choice (train/optim.adamw: the Triton AdamW on CUDA); torch-fused: "
                        "torch's fused AdamW (the A/B of the optimizer kernel)")
    p.add_argument("--triton-kernels", default="on", choices=("on", "off"),
                   help="off: the fast path's hand-written Triton kernels (eagle3/ttt/triton_kernels.py: diagonal merge, "
                        "soft CE) refuse every call and the compiled functions run (the A/B of those kernels)")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    dims = dict(TINY if args.tiny else K2)
    for k in dims:
        if getattr(args, k) is not None:
            dims[k] = getattr(args, k)
    args.dims = dims
    args.seq_lens = [int(x) for x in args.seq_lens.split(",") if x]
    args.stores = [parse_store_entry(x, args.mask_frac) for x in args.store_seq_lens.split(",") if x]
    return args


def parse_store_entry(entry: str, default_share: float) -> tuple[int, float]:
    """'4096' or '4096@0.65' -> (T, loss share)."""
    T, _, share = entry.partition("@")
    try:
        T, share = int(T), float(share) if share else default_share
    except ValueError:
        raise SystemExit(f"--store-seq-lens entry {entry!r}: want T or T@share (e.g. 4096@0.65)") from None
    if T <= 0 or not 0.0 < share <= 1.0:
        raise SystemExit(f"--store-seq-lens entry {entry!r}: T must be > 0 and the share in (0, 1]")
    return T, share


def build(dims: dict, ttt: int, device: torch.device, bf16: bool):
    cfg = DrafterConfig(hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                        head_dim=dims["head_dim"], vocab_size=dims["vocab"], draft_vocab_size=dims["draft_vocab"],
                        target_hidden_size=dims["hidden"], aux_hf_indices=[2, 30, 58], rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = Eagle3Drafter(cfg)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.sort(torch.randperm(dims["vocab"], generator=g)[: dims["draft_vocab"]]).values
    t2d = torch.zeros(dims["vocab"], dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab_mapping((ids - torch.arange(ids.numel())).to(device), t2d.to(device))
    if bf16:
        drafter.embed_tokens.to(torch.bfloat16)  # frozen, as train/stage.py keeps it under bf16
    store_dtype = torch.bfloat16
    rows = (torch.randn(dims["draft_vocab"], dims["hidden"], device=device) * 0.02).to(store_dtype)
    return TTTObjective(drafter, ttt_length=ttt), rows, ids.to(device)


def make_batch(dims: dict, B: int, T: int, draft_ids: torch.Tensor, device, dtype=torch.bfloat16,
               mask_frac: float = 1.0) -> dict:
    H = dims["hidden"]
    g = torch.Generator(device="cpu").manual_seed(T)
    pick = draft_ids.cpu()[torch.randint(0, draft_ids.numel(), (B, T), generator=g)]
    # a prompt then the assistant reply: the first (1 - mask_frac) of each row is out of the loss
    loss_mask = torch.arange(T)[None].expand(B, T) >= int(round(T * (1 - mask_frac)))
    return {
        "input_ids": torch.randint(0, dims["vocab"], (B, T), generator=g).to(device),
        "loss_mask": loss_mask.to(device),
        "target_argmax": pick.to(device),  # in the draft vocab: every position counts (worst case)
        "aux": torch.randn(B, T, 3 * H, generator=g).to(device, dtype),
        "last": torch.randn(B, T, H, generator=g).to(device, dtype),
    }


def step_flops(dims: dict, T: int, ttt: int, B: int) -> float:
    """Issue 9's count, generalised: 6 x (matrix params touched per TTT step) x tokens x steps
    + attention; fc runs once per sequence (step 0)."""
    H, h, hkv, d, I, DV = (dims[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "draft_vocab"))
    per_step = 2 * H * h * d + 2 * 2 * H * hkv * d + h * d * H + 3 * H * I + H * DV
    attn = 344064 * (h * d) / 8192 * T ** 2  # 344,064 x T^2 at 64 x 128 heads, scaled by h*d
    return B * (6 * per_step * T * ttt + 6 * 3 * H * H * T + attn)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(objective, rows, batch, optimizer, params, amp) -> torch.Tensor:
    """One training step as the trainer's (forward + loss, backward, clip at 0.5, optimizer), no syncs; the loss."""
    with amp:
        out = objective(batch, rows)
    out.loss.backward()
    clip_gradients(None, optimizer, params, 0.5, fsdp=False)
    optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return out.loss.detach()


def bench_one(objective, rows, batch, optimizer, params, device, autocast: bool, iters: int, warmup: int) -> dict:
    """Median phase and step times of `iters` steps after `warmup`, each step as train/trainer.py runs it:
    forward + loss, backward, clip, one host sync (the trainer's non-finite check), optimizer; the
    device is synchronised before and after each step only. Forward and backward are split by CUDA
    events (no sync between them); on CPU by the wall clock."""
    phases = {"forward_loss": [], "backward": [], "optimizer": [], "step": []}
    amp = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    cuda = device.type == "cuda"
    for i in range(warmup + iters):
        sync(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        t0 = time.perf_counter()
        if cuda:
            events[0].record()
        with amp:
            out = objective(batch, rows)
        loss = out.loss
        t1 = time.perf_counter()
        if cuda:
            events[1].record()
        loss.backward()
        clip_gradients(None, optimizer, params, 0.5, fsdp=False)
        if cuda:
            events[2].record()
        if not torch.isfinite(loss):  # the host sync the trainer makes here
            raise RuntimeError(f"non-finite loss {float(loss)} in the benchmark step")
        t2 = time.perf_counter()
        optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        if cuda:
            fwd, bwd = events[0].elapsed_time(events[1]) / 1e3, events[1].elapsed_time(events[2]) / 1e3
        else:
            fwd, bwd = t1 - t0, t2 - t1
        if i >= warmup:
            for k, v in (("forward_loss", fwd), ("backward", bwd), ("optimizer", t3 - t2), ("step", t3 - t0)):
                phases[k].append(v)
    return {k: statistics.median(v) for k, v in phases.items()} | {"loss": float(loss.detach())}


def grad_check(objective, rows, batch, params, amp) -> dict:
    """Fast vs reference on one batch, each against an fp32 run of the reference (the truth):
    relative difference of the loss and of every gradient (L2 norm of the difference over the
    truth's L2 norm). Under bf16 both paths carry rounding noise; the fast path passes when its
    error is within 1.5x the reference's own (or 1e-3 absolute)."""
    runs = {}
    for name, impl, ctx in (("truth", "reference", torch.autocast("cuda", enabled=False)),
                            ("reference", "reference", amp), ("fast", "fast", amp)):
        objective.impl = impl
        for p in params:
            p.grad = None
        with ctx:
            out = objective(batch, rows)
        out.loss.backward()
        runs[name] = (float(out.loss.detach()), out.step_acc.tolist(), [p.grad.detach().float().clone() for p in params])
    for p in params:
        p.grad = None
    names = [n for n, p in objective.named_parameters() if p.requires_grad]
    loss_t, _, g_t = runs["truth"]

    def errors(name):
        loss, acc, g = runs[name]
        return {"loss": loss, "loss_rel_err": abs(loss - loss_t) / abs(loss_t), "acc": acc,
                "grad_rel_err": {n: float((a - b).norm() / b.norm().clamp(min=1e-30)) for n, a, b in zip(names, g, g_t)}}

    ref, fast = errors("reference"), errors("fast")
    worse = {n: (fast["grad_rel_err"][n], ref["grad_rel_err"][n]) for n in names
             if not fast["grad_rel_err"][n] <= max(1.5 * ref["grad_rel_err"][n], 1e-3)}
    return {"truth_loss": loss_t, "reference": ref, "fast": fast, "worse_than_reference": worse}


KERNEL_KINDS = (  # (category, substrings of a CUDA kernel's name), first match wins
    ("attention", ("cudnn", "flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
    ("compiled (triton)", ("triton",)),
    ("copy / fill", ("memcpy", "memset", "copy", "fill", "cat", "index")),
    ("reduction", ("reduce",)),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def is_range(name: str) -> bool:
    """Whether a profiler row with device time is a range over kernels, not a kernel: "## Call CompiledFxGraph"
    and the like, and torch's optimizer ranges ("Optimizer.step#TritonAdamW.step"); counted, they would count
    their kernels twice."""
    return name.startswith(("## ", "Optimizer."))


def kernel_table(prof, top: int) -> str:
    """CUDA kernels of a profile: per category, then the `top` kernels by total time (ms)."""
    rows = [(e.key, e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
            if e.self_device_time_total > 0 and e.device_type.name == "CUDA" and not is_range(e.key)]
    total = sum(r[2] for r in rows)
    kinds: dict[str, float] = {}
    for name, _, ms in rows:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    lines = [f"GPU kernel time {total:.1f} ms"]
    lines += [f"  {k:22s} {v:8.1f} ms  {v / total:6.1%}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines.append(f"  {'ms':>8} {'calls':>6}  kernel (top {top})")
    for name, count, ms in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"  {ms:8.2f} {count:6d}  [{kernel_kind(name)}] {name[:150]}")
    return "\n".join(lines)


def profile_step(objective, rows, batch, amp, top: int = 60, shapes: bool = False) -> str:
    """Kernel time of one fast step: the forward (with the loss) alone, then forward + backward;
    shapes: also the aten ops of the full step by input shape (where the eager kernels come from)."""
    from torch.profiler import ProfilerActivity, profile

    objective.impl = "fast"
    parts = []
    for label, backward in (("forward + loss", False), ("forward + loss + backward", True)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) as prof:
            with amp:
                out = objective(batch, rows)
            if backward:
                out.loss.backward()
            torch.cuda.synchronize()
        del out
        for p in objective.parameters():
            p.grad = None
        parts.append(f"== profile: {label} ==\n" + kernel_table(prof, top if backward else top // 2))
        if shapes and backward:
            parts.append(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=40, max_shapes_column_width=110))
    return "\n".join(parts)


def write_store(out_dir: Path, dims: dict, T: int, n: int, draft_ids: torch.Tensor, mask_frac: float = 1.0) -> Path:
    """A real hidden-state store (eagle3.formats.store) of n random sequences of T tokens at these dims, the last
    `mask_frac` of each in the loss (a prompt, then the assistant reply)."""
    from eagle3.formats.store import HiddenStateWriter

    writer = HiddenStateWriter(out_dir, hidden_size=dims["hidden"], target_hidden_size=dims["hidden"],
                               hf_indices=[2, 30, 58], shard_tokens=4 * T)
    for i in range(n):
        b = make_batch(dims, 1, T + i, draft_ids, "cpu", mask_frac=mask_frac)
        b = {k: v[0, :T] for k, v in b.items()}
        writer.add(f"seq-{i}", b["input_ids"], b["loss_mask"], b["aux"], b["last"], b["target_argmax"],
                   check_finite=False)
    writer.finish()
    return out_dir


def bench_from_store(objective, rows, optimizer, params, device, amp, store_dir: Path, T: int, steps: int) -> dict:
    """Steps fed by the training loop's own data path: train.batches.make_loader (on a GPU: a reader
    thread collating straight into pinned memory) -> train.prefetch.DevicePrefetcher (host-to-device
    copy on a side stream). Also times the loader alone (batches/s it can deliver)."""
    from eagle3.formats.store import HiddenStateStore
    from train.batches import BatchStream, make_loader
    from train.prefetch import DevicePrefetcher

    store = HiddenStateStore(store_dir, verify="size")
    stream = BatchStream(store.lengths, max_tokens=T, max_length=T, seed=0)
    pin = device.type == "cuda"
    workers = 4 if pin else 0  # CPU: no worker processes (the GPU path reads in a thread)
    alone = iter(make_loader(store, stream, 0, T, num_workers=workers, pin_memory=pin))
    next(alone)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(alone)
    loader_alone = steps / (time.perf_counter() - t0)
    if hasattr(alone, "close"):
        alone.close()
    loader = DevicePrefetcher(iter(make_loader(store, stream, 0, T, num_workers=workers, pin_memory=pin)), device)
    objective.impl = "fast"
    times, waits = [], []
    for i in range(steps + 2):
        sync(device)
        t0 = time.perf_counter()
        host, batch = next(loader)
        t1 = time.perf_counter()
        train_step(objective, rows, batch, optimizer, params, amp)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
            waits.append(t1 - t0)
    step = statistics.median(times)
    return {"T": T, "step_s": round(step, 5), "tokens_per_s": round(T / step, 1),
            "loader_wait_s": round(statistics.median(waits), 5), "loader_alone_batches_per_s": round(loader_alone, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if device.type == "cuda" else None}


def use_impl(objective, name: str, default_kernel: str) -> None:
    """Point the objective at impl `name`: fast | reference | fast-<attention kernel>."""
    impl, _, kernel_name = name.partition("-")
    objective.impl = impl
    objective.attention_kernel = kernel_name or default_kernel


def time_row(ctx: dict, impl: str, T: int, share: float) -> dict:
    """This project's step (impl) on an in-memory batch of T tokens with `share` of them in the loss."""
    args, device = ctx["args"], ctx["device"]
    batch = make_batch(args.dims, args.batch, T, ctx["draft_ids"], device, mask_frac=share)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        r = bench_one(ctx["objective"], ctx["rows"], batch, ctx["optimizer"], ctx["params"], device, ctx["autocast"],
                      args.iters, args.warmup)
    except torch.cuda.OutOfMemoryError:
        ctx["optimizer"].zero_grad(set_to_none=True)
        print(f"{impl:>10} {T:>6} {share:>5} OOM", flush=True)
        return {"impl": impl, "T": T, "share": share, "oom": True}
    tokens = args.batch * T
    tflops = step_flops(args.dims, T, args.ttt, args.batch) / r["step"] / 1e12
    row = {"impl": impl, "T": T, "share": share, **{f"{k}_s": round(v, 5) for k, v in r.items() if k != "loss"},
           "loss": r["loss"], "tokens_per_s": round(tokens / r["step"], 1), "model_tflops": round(tflops, 2),
           "mfu": round(tflops / args.peak_tflops, 4) if device.type == "cuda" else None}
    if device.type == "cuda":
        row["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
    print(f"{impl:>10} {T:>6} {share:>5} {r['step']:>8.4f} {r['forward_loss']:>9.4f} {r['backward']:>8.4f} "
          f"{r['optimizer']:>8.4f} {row['tokens_per_s']:>9.0f} {tflops:>8.1f} {mfu:>6} "
          f"{row.get('peak_alloc_gib', '-'):>10} {row.get('peak_reserved_gib', '-'):>9}", flush=True)
    return row


def find_row(results: list[dict], impl: str, T: int, share: float) -> dict | None:
    return next((r for r in results if r.get("impl") == impl and r["T"] == T and r.get("share") == share
                 and "tokens_per_s" in r), None)


def rounds_tokens_per_s(results: list[dict], impl: str, T: int, share: float) -> list[float]:
    """The tokens/s of every timed row (round) of impl at (T, share), in order."""
    return [r["tokens_per_s"] for r in results if r.get("impl") == impl and r["T"] == T and r.get("share") == share
            and "tokens_per_s" in r]


def median_tokens_per_s(results: list[dict], impl: str, T: int, share: float) -> float | None:
    """The median tokens/s over the timed rows (rounds) of impl at (T, share); None where none ran."""
    got = rounds_tokens_per_s(results, impl, T, share)
    return statistics.median(got) if got else None


def fast_vs_reference(results: list[dict], seq_lens: list[int], share: float) -> dict[int, float]:
    """fast / reference tokens/s per T where both ran, each the median over the rounds (as the anchor ratios)."""
    out = {}
    for T in seq_lens:
        fast, ref = (median_tokens_per_s(results, impl, T, share) for impl in ("fast", "reference"))
        if fast and ref:
            out[T] = round(fast / ref, 3)
    return out


def anchor_pairs(results: list[dict], max_seq_len: int | None = None) -> list[tuple[int, float]]:
    """The (T, loss share) pairs the anchor must run at: every timed fast row (up to max_seq_len), in
    order, once each."""
    pairs = []
    for r in results:
        if r.get("impl") in ("fast", "fast-from-store") and "tokens_per_s" in r and (r["T"], r["share"]) not in pairs \
                and (max_seq_len is None or r["T"] <= max_seq_len):
            pairs.append((r["T"], r["share"]))
    return pairs


def anchor_summary(results: list[dict]) -> list[dict]:
    """Per (T, share): this project's fast step in memory and fed from the store, SpecForge's own step,
    and the tokens/s ratios (the same-run figures every speed claim quotes); each the median over the
    rounds that ran (--rounds, --anchor-rounds), with the rounds' spread."""
    out = []
    for T, share in anchor_pairs(results):  # every fast row; the anchor columns stay empty where it did not run
        mem, store, sf, floor = (median_tokens_per_s(results, impl, T, share)
                                 for impl in ("fast", "fast-from-store", "specforge", "floor"))
        row = {"T": T, "share": share, "fast_tokens_per_s": mem, "store_tokens_per_s": store, "anchor_tokens_per_s": sf,
               "floor_tokens_per_s": floor}
        for k, ours, base in (("fast_vs_anchor", mem, sf), ("store_vs_anchor", store, sf),
                              ("floor_vs_anchor", floor, sf), ("fast_vs_floor", mem, floor)):
            row[k] = round(ours / base, 3) if ours and base else None
        row["anchor_rounds"] = rounds_tokens_per_s(results, "specforge", T, share)
        out.append(row)
    return out


def time_floor_row(ctx: dict, T: int, share: float) -> dict:
    """The compute floor of the fast step on the batch `time_row` gets at (T, share): its GEMMs and causal
    attention replayed alone (step_floor.time_floor), with the same loss rows per TTT step."""
    import step_floor

    args, device = ctx["args"], ctx["device"]
    batch = make_batch(args.dims, args.batch, T, ctx["draft_ids"], device, mask_frac=share)
    counts = all_loss_positions(batch["loss_mask"], batch["target_argmax"], ctx["objective"].drafter.t2d,
                                args.ttt).sum(dim=(1, 2)).tolist()
    del batch
    kernel_name = resolve_attention_kernel(args.attention_kernel, device, args.dims["head_dim"])
    dtype = torch.bfloat16 if ctx["autocast"] else torch.float32
    r = step_floor.time_floor(args.dims, T, args.ttt, counts[1:], counts[0], device, dtype, kernel_name,
                              iters=args.iters, warmup=args.warmup, batch=args.batch)
    print(f"{'floor':>10} {T:>6} {share:>5} {r['step_s']:>8.4f}  (GEMMs alone {r['gemm_s']:.4f} s, "
          f"{r['gemm_tflop']:.1f} TFLOP at {r['gemm_tflops']:.0f} TFLOP/s; attention alone {r['attention_s']:.4f} s, "
          f"{r['attention_tflop']:.1f} TFLOP at {r['attention_tflops']:.0f} TFLOP/s) {r['tokens_per_s']:>9.0f} tok/s",
          flush=True)
    return {"impl": "floor", "T": T, "share": share, **r}


def free_objective(ctx: dict) -> None:
    """Drop this project's drafter, optimizer state and compiled graphs before the anchor builds its own."""
    import gc

    for k in ("objective", "optimizer", "params", "rows"):
        ctx.pop(k, None)
    torch._dynamo.reset()
    gc.collect()
    if ctx["device"].type == "cuda":
        torch.cuda.empty_cache()


def run_anchor(ctx: dict, pairs: list[tuple[int, float]]) -> list[dict]:
    """SpecForge 0.2.0's own step at each (T, share), on the batch this project's step got. A setting that
    fails to build or step is reported in one line and the next falls back (FSDP wrap -> none; flex
    attention -> sdpa), so one broken piece costs a row's label, not the run."""
    import bench_specforge_anchor as sfa

    args, device = ctx["args"], ctx["device"]
    why = sfa.unavailable(device)
    if why:
        print(f"anchor skipped: {why}", flush=True)
        return [{"impl": "specforge", "T": T, "share": share, "skipped": why} for T, share in pairs]
    want = dict(attention_backend=args.anchor_attention, compact_teacher=args.anchor_compact_teacher,
                fsdp=not args.anchor_no_fsdp)
    tries = [want, dict(want, fsdp=False), dict(want, fsdp=False, attention_backend="sdpa")]
    tries = [t for i, t in enumerate(tries) if t not in tries[:i]]
    for settings in tries:
        rows, sf = [], None
        try:
            sf = sfa.SpecForgeStep(args.dims, args.ttt, device, ctx["draft_ids"],
                                   max_len=max(T for T, _ in pairs) + args.ttt + 64, **settings)
            print(f"SpecForge 0.2.0 anchor: {settings}, trainable params {sf.trainable / 1e6:.1f}M", flush=True)
            for rnd, (T, share) in ((rnd, pair) for rnd in range(args.anchor_rounds) for pair in pairs):
                batch = make_batch(args.dims, args.batch, T, ctx["draft_ids"], device, mask_frac=share)
                try:
                    r = sfa.time_steps(sf, batch, args.iters, args.warmup)
                except torch.cuda.OutOfMemoryError:
                    print(f" specforge {T:>6} {share:>5} OOM", flush=True)
                    rows.append({"impl": "specforge", "T": T, "share": share, "oom": True, **settings})
                    continue
                finally:
                    del batch
                rows.append({"impl": "specforge", "T": T, "share": share, **r, **settings, "round": rnd})
                print(f" specforge {T:>6} {share:>5} {r['step_s']:>8.4f} {'':>9} {'':>8} {'':>8} {r['tokens_per_s']:>9.0f} "
                      f"{'':>8} {'':>6} {r.get('peak_alloc_gib', '-'):>10} {r.get('peak_reserved_gib', '-'):>9}  "
                      f"loss {r['loss']:.4f}", flush=True)
            return rows
        except Exception as e:  # noqa: BLE001 - a SpecForge failure: say it, fall back to the next setting
            print(f"anchor with {settings} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  flush=True)
        finally:
            if sf is not None:
                sf.close()
            elif torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # the group a failed build made
            del sf
            free_objective({"device": device})
    why = "every SpecForge setting failed (above)"
    return [{"impl": "specforge", "T": T, "share": share, "skipped": why} for T, share in pairs]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    autocast = device.type == "cuda" and not args.no_autocast
    amp = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    if args.memory_cap_gb and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 1e9 / total),
                                                  device.index if device.index is not None else torch.cuda.current_device())
        print(f"GPU memory capped at {args.memory_cap_gb:g} GB ({args.memory_cap_gb * 1e9 / 2**30:.1f} GiB) of "
              f"{total / 2**30:.1f} GiB", flush=True)
    objective, rows, draft_ids = build(args.dims, args.ttt, device, bf16=autocast)
    objective.compile = args.compile
    objective.attention_kernel = args.attention_kernel
    params = [p for p in objective.parameters() if p.requires_grad]
    triton_kernels.set_enabled(args.triton_kernels == "on")
    fused = device.type == "cuda"
    if args.optimizer == "torch-fused" and fused:
        optimizer = torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.95), fused=True)
    else:  # the trainer's AdamW (train/distributed.make_optimizer), weight decay as torch's default
        optimizer = adamw(params, lr=5e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=None, device=device)
    n_train = sum(p.numel() for p in params)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, autocast bf16: {autocast}, compile: {args.compile}, dims {args.dims}, TTT {args.ttt}, batch {args.batch}, "
          f"loss share {args.mask_frac}, trainable params {n_train / 1e6:.1f}M, attention kernel {args.attention_kernel} "
          f"-> {resolve_attention_kernel(args.attention_kernel, device, args.dims['head_dim'])}", flush=True)
    check, failure = None, None
    if args.check_seq_len:
        batch = make_batch(args.dims, args.batch, args.check_seq_len, draft_ids, device, mask_frac=args.mask_frac)
        check = grad_check(objective, rows, batch, params, amp)
        ref, fast = check["reference"], check["fast"]
        print(f"check at T={args.check_seq_len} against fp32: loss {check['truth_loss']:.6f}; rel error reference "
              f"{ref['loss_rel_err']:.2e} / fast {fast['loss_rel_err']:.2e}; worst gradient rel error reference "
              f"{max(ref['grad_rel_err'].values()):.2e} / fast {max(fast['grad_rel_err'].values()):.2e}", flush=True)
        for n in ref["grad_rel_err"]:
            print(f"  {n:55s} reference {ref['grad_rel_err'][n]:.3e}  fast {fast['grad_rel_err'][n]:.3e}")
        if check["worse_than_reference"] or not fast["loss_rel_err"] <= max(1.5 * ref["loss_rel_err"], 1e-4):
            failure = (f"fast path less accurate than the reference: {check['worse_than_reference']}, loss "
                             f"{fast['loss_rel_err']:.2e} vs {ref['loss_rel_err']:.2e}")
        del batch
    if args.profile_seq_len and device.type == "cuda":
        batch = make_batch(args.dims, args.batch, args.profile_seq_len, draft_ids, device, mask_frac=args.mask_frac)
        with amp:  # warm-up
            objective.impl = "fast"
            objective(batch, rows).loss.backward()
        print(profile_step(objective, rows, batch, amp, shapes=args.profile_shapes), flush=True)
        del batch
    ctx = dict(args=args, device=device, autocast=autocast, objective=objective, rows=rows, draft_ids=draft_ids,
               optimizer=optimizer, params=params)
    del objective, rows, optimizer, params  # ctx holds them (free_objective drops them before the anchor)
    results = []
    print(f"{'impl':>10} {'T':>6} {'share':>5} {'step s':>8} {'fwd+loss':>9} {'bwd':>8} {'optim':>8} {'tok/s':>9} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'alloc GiB':>10} {'resv GiB':>9}")
    for rnd in range(args.rounds):
        for impl in [x for x in args.impls.split(",") if x]:
            use_impl(ctx["objective"], impl, args.attention_kernel)
            for T in args.seq_lens:
                results.append(dict(time_row(ctx, impl, T, args.mask_frac), round=rnd))
    speedups = fast_vs_reference(results, args.seq_lens, args.mask_frac)
    if speedups:
        print("fast / reference tokens/s: " + ", ".join(f"T={T}: {v:.2f}x" for T, v in speedups.items()))
    use_impl(ctx["objective"], "fast", args.attention_kernel)
    store_rows = []
    for T, share in args.stores:
        import tempfile

        if not find_row(results, "fast", T, share):  # the in-memory figure at the same share, to compare with
            results.append(time_row(ctx, "fast", T, share))
        root = Path(args.store_dir or tempfile.mkdtemp(prefix="bench-store-"))
        t0 = time.perf_counter()
        store_dir = write_store(root / (f"T{T}" if share == 1.0 else f"T{T}-share{share}"), args.dims, T,
                                2 * args.store_steps + 4, draft_ids, mask_frac=share)
        written = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row = bench_from_store(ctx["objective"], ctx["rows"], ctx["optimizer"], ctx["params"], device, amp,
                               store_dir, T, args.store_steps)
        row["share"] = share
        mem = find_row(results, "fast", T, share)
        row["vs_in_memory"] = round(row["tokens_per_s"] / mem["tokens_per_s"], 3) if mem else None
        row["store_write_s"] = round(written, 1)
        store_rows.append(row)
        print(f"from the store (written in {written:.1f} s): T={T} share {share} step {row['step_s']:.4f} s, "
              f"{row['tokens_per_s']:.0f} tok/s, {row['vs_in_memory']}x the in-memory figure, waiting for data "
              f"{row['loader_wait_s']:.4f} s/step, loader alone {row['loader_alone_batches_per_s']} batches/s, "
              f"peak reserved {row['peak_reserved_gib']} GiB", flush=True)
    results += [dict(r, impl="fast-from-store") for r in store_rows]
    if args.floor:
        results += [time_floor_row(ctx, T, share) for T, share in anchor_pairs(results)]
    summary = None
    if args.anchor or args.floor:
        if args.anchor:
            pairs = anchor_pairs(results, args.anchor_max_seq_len)
            free_objective(ctx)
            results += run_anchor(ctx, pairs)
        summary = anchor_summary(results)
        print(f"same run, tokens/s: {'T':>6} {'share':>5} {'fast':>9} {'from store':>10} {'SpecForge':>9} "
              f"{'fast/SF':>8} {'store/SF':>8} {'floor':>9} {'floor/SF':>8} {'fast/floor':>10}")
        for s in summary:
            cells = [f"{s[k]:.0f}" if s[k] else "-" for k in ("fast_tokens_per_s", "store_tokens_per_s",
                                                              "anchor_tokens_per_s", "floor_tokens_per_s")]
            ratios = [f"{s[k]:.2f}x" if s[k] else "-" for k in ("fast_vs_anchor", "store_vs_anchor", "floor_vs_anchor")]
            of_floor = f"{s['fast_vs_floor']:.1%}" if s["fast_vs_floor"] else "-"
            spread = (f"  (anchor rounds {', '.join(f'{x:.0f}' for x in s['anchor_rounds'])})"
                      if len(s["anchor_rounds"]) > 1 else "")
            print(f"{'':>19} {s['T']:>6} {s['share']:>5} {cells[0]:>9} {cells[1]:>10} {cells[2]:>9} {ratios[0]:>8} "
                  f"{ratios[1]:>8} {cells[3]:>9} {ratios[2]:>8} {of_floor:>10}{spread}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"dims": args.dims, "ttt": args.ttt, "batch": args.batch,
                                               "mask_frac": args.mask_frac, "device": str(device), "check": check,
                                               "speedups": speedups, "results": results, "anchor": summary},
                                              indent=2))
    if failure:
        raise SystemExit(failure)
    return results


if __name__ == "__main__":
    main()
