"""What is alive on the GPU at the peak of one training step, by where it was allocated.

Records the CUDA caching allocator's history over one fast step (after a warm-up step) at T tokens,
replays it to find the moment of peak allocation, and groups the blocks alive then by the first
frame in this repo's code that allocated them (file:line function), largest first. Also prints
the peak against the step's phases (forward / backward / optimizer).

    python benchmarks/probe_step_memory.py --seq-len 8192

Imports only torch and eagle3 core modules (CUDA only).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from bench_train_step import K2, build, make_batch

REPO = str(Path(__file__).resolve().parents[1])


def where(frames: list[dict]) -> str:
    """The innermost frame in this repo's code (not this probe), else the innermost Python frame."""
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(REPO) and "probe_step_memory" not in name:
            return f"{name[len(REPO) + 1:]}:{f.get('line')} {f.get('name')}"
    return next((f"{f.get('filename', '?').split('/')[-1]}:{f.get('line')} {f.get('name')}" for f in frames
                 if f.get("filename", "").endswith(".py")), "?")


def live_at_peak(trace: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """Replay allocator events: (peak bytes, index of the peak event, the blocks alive then by address). Pure."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_i, peak_live = -1, {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, peak_i, peak_live = cur, i, dict(live)
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    return peak, peak_i, peak_live


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    objective, rows, draft_ids = build(K2, 7, device, bf16=True)
    objective.compile = True
    params = [q for q in objective.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.95), fused=True)
    batch = make_batch(K2, 1, args.seq_len, draft_ids, device)
    amp = torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    marks = {}

    def step(record: bool):
        with amp:
            out = objective(batch, rows)
        if record:
            marks["forward_end"] = torch.cuda.memory_allocated()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)  # (bench_train_step.train_step, with a mark after the forward)

    step(False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    step(True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, peak_i, live = live_at_peak(trace)
    print(f"T={args.seq_len}: allocated before the step {base / 2**30:.2f} GiB (weights, optimizer state, batch); "
          f"after the forward {marks['forward_end'] / 2**30:.2f} GiB; peak {torch.cuda.max_memory_allocated() / 2**30:.2f} "
          f"GiB (this step's own allocations at the peak: {peak / 2**30:.2f} GiB, event {peak_i} of {len(trace)})")
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        g = groups[where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    per_token = 1 / args.seq_len / 1024
    print(f"{'GiB':>7} {'KiB/token':>10} {'blocks':>6}  allocated at")
    for name, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{size / 2**30:7.2f} {size * per_token:10.1f} {n:6d}  {name}")


if __name__ == "__main__":
    main()
