"""Throughput of the eval stage's accept-length replay (eagle3/replay/evaluate.py:simulate_accept_length).

A random drafter of the given shape over a random greedy-consistent store (sequences whose next
token is the stored argmax, so every assistant position is replayed). Prints replayed tokens/s per
knob setting and the time of the teacher-forced accuracy pass.

    python benchmarks/bench_eval_replay.py                          # mini-world shape, CPU
    python benchmarks/bench_eval_replay.py --preset k2 --device cuda --tokens 1000000
"""
import argparse
import tempfile
import time
from pathlib import Path

import torch

from eagle3.engines.serve_launch import SpecKnobs
from eagle3.config.dtypes import torch_dtype
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.formats.store import HiddenStateStore, HiddenStateWriter
from eagle3.replay.evaluate import simulate_accept_length, teacher_forced_accuracy

PRESETS = {  # hidden, intermediate, heads, kv heads, head_dim, vocab, draft vocab
    "mini": (128, 384, 4, 4, 32, 8192, 4096),
    "k2": (7168, 18432, 64, 64, 128, 163840, 32000),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--knobs", default="2/1/3,3/1/4,3/2/6")
    ap.add_argument("--accuracy", action="store_true", help="also time the teacher-forced accuracy pass (TTT 7)")
    ap.add_argument("--disk", action="store_true", help="write and read a real store (default: in-memory)")
    args = ap.parse_args()
    H, I, h, hkv, d, V, DV = PRESETS[args.preset]
    dt = torch_dtype(args.dtype)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=I, num_attention_heads=h, num_key_value_heads=hkv,
                        head_dim=d, vocab_size=V, draft_vocab_size=DV, target_hidden_size=H, aux_hf_indices=[1, 2, 3])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    model = model.to(dt).to_empty(device=args.device)
    model.init_weights()
    model.d2t.zero_()
    model.t2d.zero_()
    model.t2d[:DV] = True
    model.embed_tokens.weight.data.normal_(0, 0.02)
    model.eval()
    n_seq = max(1, args.tokens // args.seq_len)
    if args.disk:
        with tempfile.TemporaryDirectory() as tmp:
            w = HiddenStateWriter(Path(tmp) / "val", hidden_size=H, target_hidden_size=H,
                                  hf_indices=[1, 2, 3], dtype="bfloat16", shard_tokens=1 << 16)
            for i in range(n_seq):
                s = FakeStore.make(i, args.seq_len, H, V)
                w.add(f"s{i}", s["input_ids"], s["loss_mask"], s["aux"], torch.zeros(args.seq_len, H), s["target_argmax"])
            w.finish()
            run(args, model, HiddenStateStore(Path(tmp) / "val"), n_seq)
    else:
        run(args, model, FakeStore(n_seq, args.seq_len, H, V, args.device), n_seq)


class FakeStore:
    """In-memory stand-in for HiddenStateStore: random greedy-consistent sequences made on demand
    (a 1M-token store at K2 width would be 43 GB of aux states)."""

    def __init__(self, n, T, H, V, device):
        self.n, self.T, self.H, self.V, self.device = n, T, H, V, device

    @staticmethod
    def make(i, T, H, V, device="cpu"):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, V, (T,), generator=g)
        mask = torch.ones(T, dtype=torch.bool)
        mask[: T // 8] = False
        gd = torch.Generator(device=device).manual_seed(i)  # made where it is used: CPU-side randn would dominate
        aux = torch.randn(T, 3 * H, generator=gd, device=device, dtype=torch.bfloat16)
        return {"id": f"s{i}", "input_ids": ids, "loss_mask": mask, "aux": aux, "last": None,
                "target_argmax": torch.cat([ids[1:], ids[:1]])}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i, self.T, self.H, self.V, self.device)


def run(args, model, store, n_seq):
    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    print(f"{args.preset} drafter on {args.device} ({args.dtype}), {n_seq} sequences x {args.seq_len} tokens")
    for label in args.knobs.split(","):
        k = SpecKnobs(*map(int, label.split("/")))
        sync()
        t0 = time.perf_counter()
        res = simulate_accept_length(model, store, [k], progress=False)[k.label]["drafter"]
        sync()
        dt_s = time.perf_counter() - t0
        print(f"  replay {k.label} (+ n-gram): {res.tokens} tokens in {res.cycles} cycles, {dt_s:.2f} s "
              f"-> {res.tokens / dt_s:,.0f} tokens/s, {1000 * dt_s / max(res.cycles, 1):.3f} ms/cycle")
    if args.accuracy:
        sync()
        t0 = time.perf_counter()
        teacher_forced_accuracy(model, store, 7, progress=False)
        sync()
        print(f"  teacher-forced accuracy (TTT 7): {time.perf_counter() - t0:.2f} s")

if __name__ == "__main__":
    main()
