"""Weight gradients of the TTT unroll summed in fp32 inside the GEMMs, not by autograd in bf16.

Every TTT step uses the same drafter weights, so each weight's gradient is a sum over the 7 steps.
Left to autograd, each step's weight-gradient GEMM writes a bf16 tensor, autograd adds the steps'
tensors in bf16 (six adds over ~0.9 G elements at Kimi-K2 size: 13.6 ms on an H200 at T=8192, each
add rounding to bf16), then the backward of the fp32 -> bf16 weight cast converts the sum to fp32.
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
and a sum may be filled in the forward pass with a deferred upstream factor (eagle3/fused_ce.py:
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


def stack_groups(use_rows: list[int], stack_rows: int, sum_elements: int = 0,
                 copied_cols: int = 0) -> list[tuple[int, int]]:
    """How the uses of one weight (rows of each, in arrival order) are gathered: consecutive uses while
    their rows fit in `stack_rows`, as (uses, rows) per group. Pure. A group of one use is not stacked
    (it goes straight into the sum). A group is kept only where it saves memory traffic: it spares
    (uses - 1) fp32 read-modify-writes of the sum (8 bytes x sum_elements each) and costs a copy of
    `copied_cols` columns per row of the operands its producers do not write in place (4 bytes each,
    read + write of bf16); a group that does not pay is split back into single uses."""
    groups: list[tuple[int, int]] = []
    n = rows = 0
    for r in use_rows:
        if n and rows + r > stack_rows:
            groups.append((n, rows))
            n = rows = 0
        n, rows = n + 1, rows + r
    if n:
        groups.append((n, rows))
    out: list[tuple[int, int]] = []
    at = 0
    for n, rows in groups:
        if n > 1 and (n - 1) * sum_elements * 2 < rows * copied_cols:
            out += [(1, r) for r in use_rows[at:at + n]]
        else:
            out.append((n, rows))
        at += n
    return out


class _Stack:
    """dY rows and X rows of consecutive uses of one weight, side by side in two buffers, for one
    GEMM with K = their total rows: one fp32 read-modify-write of the sum for the whole group
    instead of one per use (at Kimi-K2 size ~2 GB of memory traffic per use of gate/up)."""

    def __init__(self, groups: list[tuple[int, int]], out_features: int, in_features: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.groups = list(groups)
        self.shape = (out_features, in_features)
        self.dtype, self.device = dtype, device
        self.dy: Optional[torch.Tensor] = None
        self.x: Optional[torch.Tensor] = None
        self.filled = 0  # rows of the current group in the buffers
        self.arrived = 0  # uses of the current group so far (stacked or not)

    def views(self, rows: int, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Where the next use's dY [rows, out] and X [rows, in] go (None: it is not stacked)."""
        if not self.groups or self.groups[0][0] < 2 or dtype != self.dtype:
            return None
        capacity = self.groups[0][1]
        if self.filled + rows > capacity:
            return None
        if self.dy is None:
            self.dy = torch.empty(capacity, self.shape[0], dtype=self.dtype, device=self.device)
            self.x = torch.empty(capacity, self.shape[1], dtype=self.dtype, device=self.device)
        return self.dy[self.filled:self.filled + rows], self.x[self.filled:self.filled + rows]

    def arrive(self, stacked_rows: int) -> bool:
        """Count one use (its rows now in the buffers, or 0); True when its group is complete."""
        self.filled += stacked_rows
        self.arrived += 1
        return bool(self.groups) and self.arrived == self.groups[0][0]

    def drain(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The filled rows (dY, X) of the current group, which is then done; None if it holds none."""
        out = None if not self.filled else (self.dy[:self.filled], self.x[:self.filled])
        self.dy = self.x = None
        self.filled = self.arrived = 0
        if self.groups:
            self.groups.pop(0)
        return out


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class WeightGrads:
    """The gradient sums of one unroll's shared weights, by name: fp32 (fp64 for fp64 compute).
    A weight declared with `stack` gathers its uses' dY / X rows and sums a group of uses with one GEMM."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.uses: dict[str, int] = {}
        self.upstream: dict[str, torch.Tensor] = {}  # deferred factor of sums filled in the forward
        self.stacks: dict[str, _Stack] = {}
        self.handed_over = False

    def stack(self, name: str, use_rows: list[int], stack_rows: int, out_features: int, in_features: int,
              dtype: torch.dtype, device: torch.device, copied_cols: int = 0) -> None:
        """`name` will get uses of these row counts, in this order: gather them in groups of at most
        `stack_rows` rows and sum each group with one GEMM, where that saves memory traffic
        (`stack_groups`; copied_cols: columns per row its producers do not write in place via `slot`).
        Uses that do not arrive as declared go straight into the sum (correct, just not stacked)."""
        groups = stack_groups(use_rows, stack_rows, out_features * in_features, copied_cols)
        if any(n > 1 for n, _ in groups):
            self.stacks[name] = _Stack(groups, out_features, in_features, dtype, device)

    def slot(self, name: str, rows: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Buffers the producer of the next use's dY [rows, out] / X [rows, in] may write into (then
        `add` copies nothing); (None, None) when `name` is not stacked or the group cannot take it."""
        st = self.stacks.get(name)
        views = None if st is None else st.views(rows, st.dtype)
        return (None, None) if views is None else views

    def add(self, name: str, dy: torch.Tensor, x: torch.Tensor) -> None:
        """sums[name] += dy^T x over the leading dims: dy [..., out], x [..., in] (compute dtype)."""
        if self.handed_over:
            raise RuntimeError(f"WeightGrads: '{name}' gets a gradient after the sums were handed to the "
                               "parameters (a second backward through one unroll is not supported)")
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        self.uses[name] = self.uses.get(name, 0) + 1
        st = self.stacks.get(name)
        views = None if st is None else st.views(dy2.shape[0], dy2.dtype)
        if views is None:
            self._accumulate(name, dy2, x2)
        else:
            for src, dst in ((dy2, views[0]), (x2, views[1])):
                if not _same_view(src, dst):
                    dst.copy_(src)
        if st is not None and st.arrive(0 if views is None else dy2.shape[0]):
            self._flush(name)

    def _accumulate(self, name: str, dy2: torch.Tensor, x2: torch.Tensor) -> None:
        acc_dtype = torch.promote_types(dy2.dtype, torch.float32)
        self.sums[name] = matmul_accumulate(self.sums.get(name), dy2.t(), x2, acc_dtype)

    def _flush(self, name: str) -> None:
        rows = self.stacks[name].drain()
        if rows is not None:
            self._accumulate(name, *rows)

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
        """The summed gradient of `name` (None if nothing was added), scaled by its upstream factor;
        a partly filled group is summed first."""
        if name in self.stacks:
            self._flush(name)
            del self.stacks[name]
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
