"""Where a training step's wall time goes that is not GPU work: the GPU timeline of whole steps
run as train/trainer.py runs them (forward + loss, backward, clip, optimizer; no synchronisation
between the phases), from a torch.profiler trace.

Prints per step: wall time, GPU busy time (the union of kernel / copy intervals), idle time, and
the largest idle gaps, each with the kernel before and after it and the CPU ops that were running
when the next kernel was launched ("late launch": the CPU had not queued it yet; "queued": it
was queued before the gap, so the GPU waited on something else). Also kernel time by category
(bench_train_step.kernel_table).

    python benchmarks/probe_step_timeline.py --seq-len 4096 --trace /tmp/step.json.gz

Imports only torch and eagle3 core modules.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from bench_train_step import K2, TINY, build, kernel_table, make_batch, train_step
from train.optim import adamw  # (the trainer's optimizer: the Triton AdamW on CUDA)


def gpu_intervals(events: list[dict]) -> list[tuple[float, float, str, int]]:
    """(start, end, name, correlation) of every GPU kernel / memcpy / memset in a chrome trace, by start (us)."""
    out = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}).get("correlation", -1))
           for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out)


def idle_gaps(intervals: list[tuple[float, float, str, int]], start: float, end: float, min_us: float = 0.0):
    """Busy time (union of intervals inside [start, end]) and the gaps between them of at least min_us:
    (busy_us, [(gap_start, gap_us, previous interval, next interval)]). Pure."""
    busy, gaps, cursor, prev = 0.0, [], start, None
    for iv in intervals:
        s, e = max(iv[0], start), min(iv[1], end)
        if e <= s:
            continue
        if s > cursor and s - cursor >= min_us:
            gaps.append((cursor, s - cursor, prev, iv))
        if e > cursor:
            busy += e - max(s, cursor)
            cursor = e
        prev = iv
    if end > cursor and end - cursor >= min_us:
        gaps.append((cursor, end - cursor, prev, None))
    return busy, gaps


def launch_context(events: list[dict], correlation: int) -> tuple[float | None, list[str]]:
    """The CPU time the kernel with this correlation id was launched, and the CPU ops around that moment
    (innermost first)."""
    launch = next((e for e in events if e.get("cat") == "cuda_runtime"
                   and e.get("args", {}).get("correlation") == correlation), None)
    if launch is None:
        return None, []
    t, tid = launch["ts"], launch.get("tid")
    around = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
              and e.get("tid") == tid and e["ts"] <= t <= e["ts"] + e.get("dur", 0)]
    around.sort(key=lambda e: e.get("dur", 0))
    return t, [e["name"][:70] for e in around[:4]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--share", type=float, default=1.0, help="loss share of each sequence")
    p.add_argument("--steps", type=int, default=2, help="profiled steps (after 2 warm-up steps)")
    p.add_argument("--gaps", type=int, default=25, help="how many of the largest gaps to list")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run: no GPU timeline)")
    p.add_argument("--trace", default=None, help="also write the chrome trace here (.json.gz)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = TINY if args.tiny else K2
    objective, rows, draft_ids = build(dims, 7, device, bf16=device.type == "cuda")
    objective.compile = device.type == "cuda"
    params = [q for q in objective.parameters() if q.requires_grad]
    opt = adamw(params, lr=5e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=None, device=device)
    batch = make_batch(dims, 1, args.seq_len, draft_ids, device, mask_frac=args.share)
    amp = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with torch.profiler.record_function("## step"):
            return train_step(objective, rows, batch, opt, params, amp)

    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(kernel_table(prof, 40) if device.type == "cuda" else "(CPU: no GPU timeline)", flush=True)
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    if args.trace:
        with gzip.open(args.trace, "wt") as f:
            json.dump({"traceEvents": events}, f)
    # the steps' spans on the GPU timeline (the CPU ranges run ahead of the GPU work they queue)
    spans = [e for e in events if e.get("name") == "## step" and e.get("cat") == "gpu_user_annotation"] or \
        [e for e in events if e.get("name") == "## step" and e.get("cat") == "user_annotation"]
    steps = sorted(spans, key=lambda e: e["ts"])
    intervals = gpu_intervals(events)
    for i, s in enumerate(steps):
        start = s["ts"]
        end = steps[i + 1]["ts"] if i + 1 < len(steps) else max((iv[1] for iv in intervals), default=start)
        busy, gaps = idle_gaps(intervals, start, end, min_us=5.0)
        wall = end - start
        print(f"step {i}: wall {wall / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({busy / max(wall, 1):.1%}), idle "
              f"{(wall - busy) / 1e3:.1f} ms in {len(gaps)} gaps >= 5 us", flush=True)
        for g0, g, prev, nxt in sorted(gaps, key=lambda x: -x[1])[:args.gaps]:
            t_launch, ops = launch_context(events, nxt[3]) if nxt else (None, [])
            how = "" if t_launch is None else ("late launch" if t_launch > g0 else "queued")
            print(f"  {g / 1e3:7.2f} ms at +{(g0 - start) / 1e3:7.1f} ms  {how:11s} after [{prev[2][:50] if prev else '-'}] "
                  f"before [{nxt[2][:50] if nxt else '-'}]  cpu: {' < '.join(ops)}", flush=True)


if __name__ == "__main__":
    main()
