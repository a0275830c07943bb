"""The compute floor of one fast training step: its matmuls and its causal attention, replayed back to back.

`eagle3/ttt/fast_unroll.ttt_unroll_fast` at given dimensions runs a fixed list of GEMMs (the forward's
projections, the fused CE's three products per chunk, each step's input- and weight-gradient products,
the weight gradients accumulated in fp32 with beta = 1) and 7 causal attention calls forward and
backward. `step_ops` lists them in order with the operand layouts the step uses (x @ W^T forward, dy @ W input
gradients, dy^T x weight gradients) and marks where the attention runs; `time_floor` runs that list as a
sustained sequence of whole steps on random operands: nothing else (no norms, rope, SwiGLU, merges,
soft CE, adds, copies, optimizer). Its tokens/s is what the step would reach if every memory-bound
kernel took no time, so `floor / anchor` is the highest ratio this step's math can give on that card
(bench_train_step.py --floor prints it beside the measured ratio, in the same run).

tests/test_step_floor.py checks the list against the real unroll: the (m, k, n) of every mm / addmm /
addmm_ dispatched while `ttt_unroll_fast` runs forward and backward equal this list's, as a multiset.

Imports only torch and this repository's core code.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from eagle3.ttt.ttt_flash import causal_attention
from eagle3.ttt.wgrad import matmul_accumulate

# how a GEMM's operands are laid out, as the fast step calls it (out [m, n]):
#   "linear": x [m, k] @ W[n, k]^T (F.linear);  "dgrad": dy [m, k] @ W [k, n];
#   "wgrad": dy[k, m]^T @ x [k, n] added into an fp32 sum (beta = 1);  "product": the same, a new fp32 tensor
KINDS = ("linear", "dgrad", "wgrad", "product")


@dataclass(frozen=True)
class Gemm:
    name: str   # the weight it belongs to (the WeightGrads sum of a "wgrad")
    kind: str   # one of KINDS
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


ATTENTION_FORWARD, ATTENTION_BACKWARD = "attention forward", "attention backward"  # markers in step_ops


def step_ops(dims: dict, T: int, ttt: int, step_rows: list[int], teacher_rows: int,
             ce_chunk_rows: int = 8192, batch: int = 1) -> list:
    """The GEMMs of one `ttt_unroll_fast` forward + backward in the order they run, with a marker where
    each TTT step's causal attention runs (ATTENTION_FORWARD / ATTENTION_BACKWARD). dims as
    bench_train_step.K2 (hidden, heads, kv_heads, head_dim, intermediate, draft_vocab); step_rows: the loss
    rows of each TTT step (N_k), teacher_rows: the teacher rows (M), both from eagle3.ttt.loss.all_loss_positions."""
    if len(step_rows) != ttt:
        raise ValueError(f"step_ops: {len(step_rows)} step row counts for {ttt} TTT steps")
    H, I, V = dims["hidden"], dims["intermediate"], dims["draft_vocab"]
    q, kv = dims["heads"] * dims["head_dim"], dims["kv_heads"] * dims["head_dim"]
    qkv, BT, strip = q + 2 * kv, batch * T, batch * (T + ttt - 1)
    fwd = [Gemm("fc", "linear", BT, 3 * H, H),             # aux -> hidden (the aux states take no gradient)
           Gemm("qkv_embed", "linear", strip, H, qkv)]    # the embedding half, once for every step
    if teacher_rows:
        fwd.append(Gemm("teacher", "linear", teacher_rows, H, V))  # the target head's draft-vocab rows (frozen)
    backs = []
    for k in range(ttt):
        fwd += [Gemm("qkv_hidden", "linear", BT, H, qkv), ATTENTION_FORWARD, Gemm("o", "linear", BT, q, H),
                Gemm("gate_up", "linear", BT, H, 2 * I), Gemm("down", "linear", BT, I, H)]
        for start in range(0, step_rows[k], ce_chunk_rows):  # the fused CE: logits, dx, dW per chunk, in the forward
            n = min(ce_chunk_rows, step_rows[k] - start)
            fwd += [Gemm("lm_head", "linear", n, H, V), Gemm("lm_head", "dgrad", n, V, H), Gemm("lm_head", "wgrad", V, n, H)]
        back = []
        for name, d_in, d_out in (("down", I, H), ("gate_up", H, 2 * I), ("o", q, H), ("qkv_hidden", H, qkv)):
            back += [Gemm(name, "wgrad", d_out, BT, d_in), Gemm(name, "dgrad", BT, d_out, d_in)]
            if name == "o":
                back.append(ATTENTION_BACKWARD)
        backs.append(back)
    tail = [Gemm("qkv_embed", "product", qkv, strip, H),  # no input gradient: the embeddings are frozen
            Gemm("fc", "wgrad", H, BT, 3 * H)]
    return fwd + [op for back in reversed(backs) for op in back] + tail


def step_gemms(dims: dict, T: int, ttt: int, step_rows: list[int], teacher_rows: int,
               ce_chunk_rows: int = 8192, batch: int = 1) -> list[Gemm]:
    """`step_ops` without the attention markers."""
    return [op for op in step_ops(dims, T, ttt, step_rows, teacher_rows, ce_chunk_rows, batch) if isinstance(op, Gemm)]


def attention_flops(dims: dict, T: int, ttt: int, batch: int = 1) -> int:
    """The causal attention's matmul FLOPs of one step: ttt calls, forward (2 products) and backward (5),
    each over the T (T + 1) / 2 causal score entries per head."""
    h, d = dims["heads"], dims["head_dim"]
    return batch * ttt * 7 * 2 * h * d * (T * (T + 1) // 2)


class _Operands:
    """Random operands for every GEMM shape, made once; an fp32 sum per weight for the "wgrad" GEMMs."""

    def __init__(self, gemms: list[Gemm], device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.device, self.dtype = device, dtype
        self.mats: dict[tuple[int, int], torch.Tensor] = {}
        self.sums: dict[str, torch.Tensor] = {}
        for gm in gemms:
            if gm.kind == "wgrad" and gm.name not in self.sums:
                self.sums[gm.name] = torch.zeros(gm.m, gm.n, device=device, dtype=torch.promote_types(dtype, torch.float32))

    def mat(self, rows: int, cols: int) -> torch.Tensor:
        key = (rows, cols)
        if key not in self.mats:
            self.mats[key] = (torch.randn(rows, cols, generator=self.g, device=self.device) * 0.05).to(self.dtype)
        return self.mats[key]

    def run(self, gm: Gemm) -> None:
        acc = torch.promote_types(self.dtype, torch.float32)
        if gm.kind == "linear":
            torch.nn.functional.linear(self.mat(gm.m, gm.k), self.mat(gm.n, gm.k))
        elif gm.kind == "dgrad":
            self.mat(gm.m, gm.k) @ self.mat(gm.k, gm.n)
        elif gm.kind == "wgrad":
            matmul_accumulate(self.sums[gm.name], self.mat(gm.k, gm.m).t(), self.mat(gm.k, gm.n), acc)
        elif gm.kind == "product":
            matmul_accumulate(None, self.mat(gm.k, gm.m).t(), self.mat(gm.k, gm.n), acc)
        else:
            raise ValueError(f"unknown GEMM kind {gm.kind!r} (want one of {KINDS})")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_floor(dims: dict, T: int, ttt: int, step_rows: list[int], teacher_rows: int, device: torch.device,
               dtype: torch.dtype, attention_kernel: str, iters: int = 5, warmup: int = 2, batch: int = 1,
               ce_chunk_rows: int = 8192) -> dict:
    """Median seconds per step of the floor (`step_ops` in order: GEMMs with the causal attention where the
    step runs it), of the GEMMs alone and of the attention alone, each over `iters` whole steps back to back
    after `warmup`; with their TFLOP/s."""
    ops_list = step_ops(dims, T, ttt, step_rows, teacher_rows, ce_chunk_rows, batch)
    gemms = [op for op in ops_list if isinstance(op, Gemm)]
    ops = _Operands(gemms, device, dtype)
    h, d = dims["heads"], dims["head_dim"]
    g = torch.Generator(device=device).manual_seed(1)
    qkv = [(torch.randn(batch, T, h, d, generator=g, device=device) * 0.5).to(dtype).requires_grad_() for _ in range(3)]
    dout = torch.randn(batch, T, h, d, generator=g, device=device).to(dtype)
    scale = d ** -0.5

    def whole(with_gemms: bool, with_attention: bool) -> None:
        outs = []
        for op in ops_list:
            if op == ATTENTION_FORWARD:
                if with_attention:
                    outs.append(causal_attention(*qkv, scale, attention_kernel))
            elif op == ATTENTION_BACKWARD:
                if with_attention:
                    outs.pop().backward(dout)
                    for t in qkv:
                        t.grad = None
            elif with_gemms:
                ops.run(op)

    def timed(with_gemms: bool, with_attention: bool) -> float:
        times = []
        for i in range(warmup + iters):
            _sync(device)
            t0 = time.perf_counter()
            whole(with_gemms, with_attention)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    gemm_flops = sum(gm.flops for gm in gemms)
    attn_flops = attention_flops(dims, T, ttt, batch)
    step_s, gemm_s, attn_s = timed(True, True), timed(True, False), timed(False, True)
    return {"step_s": round(step_s, 5), "gemm_s": round(gemm_s, 5), "attention_s": round(attn_s, 5),
            "gemm_tflops": round(gemm_flops / gemm_s / 1e12, 1), "attention_tflops": round(attn_flops / attn_s / 1e12, 1),
            "gemm_tflop": round(gemm_flops / 1e12, 3), "attention_tflop": round(attn_flops / 1e12, 3),
            "tokens_per_s": round(batch * T / step_s, 1), "n_gemms": len(gemms)}
