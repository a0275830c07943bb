"""Weight gradients of the TTT unroll summed in fp32 inside the GEMMs, not by autograd in bf16.

Every TTT step uses the same drafter weights, so each weight's gradient is a sum over the 7 steps.
Left to autograd, each step's weight-gradient GEMM writes a bf16 tensor, autograd adds the steps'
tensors in bf16 (six adds over ~0.9 G elements at Kimi-K2 size, each rounding to bf16; their time:
BENCHMARKS.md, "Training step at Kimi-K2 drafter dimensions"), then the backward of the fp32 -> bf16 weight cast converts the sum to fp32.
Here one fp32 buffer per weight takes every step's `dY^T X` through a GEMM with beta = 1 (cuBLAS
reads the buffer and adds in fp32: no separate add kernel, no bf16 rounding of a step's gradient
or of the sum), and the buffers become the parameters' gradients through one autograd node
(`shared_weights`), so accelerate / DDP gradient hooks and `AccumulateGrad` see an ordinary gradient.

    grads = WeightGrads()
    w = shared_weights(grads, {"o": [(o_proj.weight, ALL, ALL)], ...}, torch.bfloat16)  # compute-dtype copies
    y = linear(grads, "o", x, w["o"])          # y = x @ W^T; backward adds dY^T x into grads' "o" sum
    ...                                          # (any number of uses of w["o"])
    loss.backward()                              # o_proj.weight.grad == the fp32 sum over all uses

How it orders itself: `linear` takes the compute-dtype copy as an input and returns no gradient
for it, so autograd runs `shared_weights`' backward only after every use's backward has run
(dependencies count edges, not defined gradients); that backward hands the sums to the parameters.
A weight may be built from pieces of parameters (row blocks, column slices: q/k/v's hidden half),
and a sum may be filled in the forward pass with a deferred upstream factor (eagle3/ttt/fused_ce.py:
`WeightGrads.add` in the forward, `set_upstream` in the backward).

Imports only torch (core code).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

ALL = slice(None)  # a whole dimension, in a `shared_weights` piece


def _fp32_out_gemm(a: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    """Whether a GEMM of these operands writes fp32 directly (`out_dtype=torch.float32`: CUDA only): CUDA,
    bf16/fp16 operands, an fp32 sum."""
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and acc_dtype == torch.float32


def matmul_accumulate(acc: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                      acc_dtype: torch.dtype) -> torch.Tensor:
    """acc + a @ b with acc in acc_dtype (acc None: a @ b, a new tensor). a [m, n], b [n, p] in the
    compute dtype. On CUDA with bf16/fp16 operands and an fp32 acc this is one GEMM with beta = 1
    writing acc in place (the products are exact in fp32, the sum is fp32); elsewhere (CPU tests,
    fp32/fp64 weights) a matmul in acc_dtype and an in-place add."""
    if acc is None:
        if _fp32_out_gemm(a, acc_dtype):
            return torch.mm(a, b, out_dtype=torch.float32)
        return (a.to(acc_dtype) @ b.to(acc_dtype)) if a.dtype != acc_dtype else a @ b
    if acc.dtype != acc_dtype or acc.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"matmul_accumulate: buffer {tuple(acc.shape)} {acc.dtype} does not take a "
                         f"{tuple(a.shape)} @ {tuple(b.shape)} product in {acc_dtype}")
    if _fp32_out_gemm(a, acc_dtype):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    return acc.add_(a.to(acc.dtype) @ b.to(acc.dtype))


class WeightGrads:
    """The gradient sums of one unroll's shared weights, by name: fp32 (fp64 for fp64 compute)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.uses: dict[str, int] = {}
        self.upstream: dict[str, torch.Tensor] = {}  # deferred factor of sums filled in the forward
        self.handed_over = False

    def _check_open(self, name: str) -> None:
        if self.handed_over:
            raise RuntimeError(f"WeightGrads: '{name}' gets a gradient after the sums were handed to the "
                               "parameters (a second backward through one unroll is not supported)")

    def add(self, name: str, dy: torch.Tensor, x: torch.Tensor) -> None:
        """sums[name] += dy^T x over the leading dims: dy [..., out], x [..., in] (compute dtype)."""
        self._check_open(name)
        self.sums[name] = matmul_accumulate(self.sums.get(name), *self._operands(dy, x))
        self.uses[name] = self.uses.get(name, 0) + 1

    @staticmethod
    def _operands(dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        return (dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]),
                torch.promote_types(dy.dtype, torch.float32))

    def product(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dy^T x over the leading dims in the sums' dtype (fp32 for bf16 operands), not added to any
        sum (for a gradient that needs the product before it is added: `add_product`)."""
        return matmul_accumulate(None, *self._operands(dy, x))

    def add_product(self, name: str, g: torch.Tensor) -> None:
        """sums[name] += g, a gradient made by `product` (then transformed)."""
        self._check_open(name)
        self.sums[name] = g if name not in self.sums else self.sums[name].add_(g)
        self.uses[name] = self.uses.get(name, 0) + 1

    def set_upstream(self, name: str, factor: torch.Tensor) -> None:
        """A sum filled in the forward (before the upstream gradient was known) is scaled by `factor`
        (0-dim) when handed over. Every use must see the same factor: the fast unroll's loss is one sum
        of its steps' losses, so each step's loss gets the same upstream gradient."""
        prev = self.upstream.get(name)
        if prev is not None and not prev.is_cuda and not torch.equal(prev, factor):  # checkable without a sync
            raise RuntimeError(f"WeightGrads: '{name}' is scaled by {float(prev)} and {float(factor)}; one "
                               "factor per weight is supported")
        self.upstream[name] = factor

    def take(self, name: str) -> Optional[torch.Tensor]:
        """The summed gradient of `name` (None if nothing was added), scaled by its upstream factor."""
        g = self.sums.get(name)
        if g is not None and name in self.upstream:
            g = g.to(torch.promote_types(g.dtype, torch.float32)) * self.upstream[name]
        return g


def _column_tiling(parts: list[tuple[slice, slice, torch.Tensor]], n_cols: int) -> bool:
    """Whether the pieces are whole-row column blocks covering 0..n_cols in order (a cat along dim 1)."""
    at = 0
    for rows, cols, _ in parts:
        start, stop, step = cols.indices(n_cols)
        if rows != ALL or step != 1 or start != at:
            return False
        at = stop
    return at == n_cols


def _assemble(parts: list[tuple[slice, slice, torch.Tensor]], shape: torch.Size,
              dtype: torch.dtype) -> Optional[torch.Tensor]:
    """One parameter's gradient from its pieces' gradients (None: no piece got one)."""
    if not parts:
        return None
    if len(parts) == 1 and parts[0][0] == ALL and parts[0][1] == ALL:
        return parts[0][2].to(dtype)  # the sum itself (or a row block of a shared buffer): no copy
    if len(shape) == 2 and _column_tiling(parts, shape[1]):
        return torch.cat([p.to(dtype) for _, _, p in parts], dim=1)  # one pass, no zero fill
    out = torch.zeros(shape, dtype=dtype, device=parts[0][2].device)
    for rows, cols, p in parts:
        out[rows, cols] += p.to(dtype)
    return out


def _cast_rows(pieces: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The row-concatenation of 2-D pieces in `dtype`, each piece read once and written once (a cast
    then a cat would write every piece twice)."""
    if len(pieces) == 1:
        return pieces[0].to(dtype)
    out = torch.empty(sum(p.shape[0] for p in pieces), pieces[0].shape[1], dtype=dtype, device=pieces[0].device)
    at = 0
    for p in pieces:
        out[at:at + p.shape[0]].copy_(p)
        at += p.shape[0]
    return out


class _SharedWeights(torch.autograd.Function):
    """params (fp32 masters) -> compute-dtype copies; backward: the WeightGrads sums as their gradients."""

    @staticmethod
    def forward(ctx, grads: WeightGrads, layout: tuple, dtype: torch.dtype, *params):
        ctx.grads, ctx.layout = grads, layout
        ctx.set_materialize_grads(False)  # a use that returns no gradient must not cost a zero tensor
        ctx.param_meta = [(p.shape, p.dtype) for p in params]
        return tuple(_cast_rows([params[i][rows, cols] for i, rows, cols in pieces], dtype) for _, pieces in layout)

    @staticmethod
    def backward(ctx, *out_grads):
        grads, layout = ctx.grads, ctx.layout
        grads.handed_over = True
        parts: list[list[tuple[slice, slice, torch.Tensor]]] = [[] for _ in ctx.param_meta]
        for (name, pieces), autograd_grad in zip(layout, out_grads):
            g = grads.take(name)
            if autograd_grad is not None:  # a use through plain autograd (no WeightGrads)
                g = autograd_grad.to(torch.promote_types(autograd_grad.dtype, torch.float32)) if g is None \
                    else g + autograd_grad.to(g.dtype)
            if g is None:
                continue
            start = 0
            for i, rows, cols in pieces:
                n = len(range(*rows.indices(ctx.param_meta[i][0][0])))
                parts[i].append((rows, cols, g[start:start + n]))
                start += n
        return (None, None, None, *(_assemble(p, shape, dtype) for p, (shape, dtype) in zip(parts, ctx.param_meta)))



def shared_weights(grads: WeightGrads, layout: dict[str, list[tuple[torch.Tensor, slice, slice]]],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Compute-dtype copies of the named weights, each the row-concatenation of parameter pieces
    (param, rows, cols), e.g. {"qkv_hidden": [(q.weight, ALL, slice(H, None)), (k.weight, ...), ...]}.
    Gradients of the copies go through `grads` (use them with `linear` / WeightGrads.add); the
    parameters' gradients are the sums, put back piece by piece."""
    params: list[torch.Tensor] = []
    index: dict[int, int] = {}
    spec = []
    for name, pieces in layout.items():
        idx = []
        for p, rows, cols in pieces:
            if id(p) not in index:
                index[id(p)] = len(params)
                params.append(p)
            idx.append((index[id(p)], rows, cols))
        spec.append((name, tuple(idx)))
    outs = _SharedWeights.apply(grads, tuple(spec), dtype, *params)
    return dict(zip(layout, outs))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grads: WeightGrads, name: str, x, w):
        ctx.grads, ctx.name = grads, name
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[2] else None
        ctx.grads.add(ctx.name, dy, x)
        return None, None, dx, None


def linear(grads: WeightGrads, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T (w a `shared_weights` copy); the weight gradient of this use is added to grads[name]."""
    return _Linear.apply(grads, name, x, w)
