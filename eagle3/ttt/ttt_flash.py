"""TTT attention without a T x T score matrix: a fused causal kernel plus a log-sum-exp merge.

At TTT step k (eagle3/drafter/attention.py) query t attends to the step-0 keys 0..t (causal) and to its own
position's keys of steps 1..k (one key per step). The softmax over those T + k columns splits into
  * block 0: causal attention over the step-0 keys, done by a flash kernel that returns its
    output o0 [B,h,T,d] and log-sum-exp lse0 [B,h,T] (natural log, fp32), and
  * the diagonal: k per-position dot products s_j = q_t . k_j,t * scale [B,h,T],
merged exactly:  lse = logsumexp(lse0, s_1..s_k),  out = e^(lse0-lse) o0 + sum_j e^(s_j-lse) v_j
(eagle3/ttt/fast_kernels.py: diagonal_merge_forward / diagonal_merge_backward).

Backward (the trick ring attention uses): the gradient of block 0's share of a softmax it shares
with other columns is what the flash backward computes when given the *merged* output and the
*merged* lse instead of its own: it rebuilds P = exp(S - lse) (block 0's share of the global
softmax) and D = rowsum(dout * out) (the global row term), so dS = P (dP - D) is exact. The
diagonal terms' gradients are elementwise: p_j = e^(s_j - lse), dv_j = p_j dout,
ds_j = p_j (dout . v_j - D), dq += ds_j k_j scale, dk_j = ds_j q scale.

Kernels for block 0 (`resolve_attention_kernel`): on CUDA (bf16/fp16) "cudnn" =
`aten._scaled_dot_product_cudnn_attention` (the default on Hopper and newer at head_dim 128, where it is the faster of
the two: BENCHMARKS.md, "Training step at Kimi-K2 drafter dimensions", the attention kernels alone) or
"flash" = `aten._scaled_dot_product_flash_attention`, each with its own backward, which both accept
the merged out / lse; on CPU (any float dtype, used by the tests) the CPU flash kernel. The merge
math is in fp32 (fp64 stays fp64). Imports only torch (core code).
"""
from __future__ import annotations

import torch

from eagle3.ttt import triton_kernels
from eagle3.config.choices import ATTENTION_KERNELS  # the train config's attention_kernel choices
from eagle3.ttt.fast_kernels import kernel


def flash_supported(q: torch.Tensor) -> bool:
    """Whether this module's kernels take these queries (CUDA: fp16/bf16 only; CPU: any float)."""
    if q.is_cuda:
        return q.dtype in (torch.float16, torch.bfloat16)
    return q.device.type == "cpu" and q.is_floating_point()


def choose_attention_kernel(choice: str, device_type: str, capability: tuple[int, int] | None,
                            cudnn_version: int | None, head_dim: int = 128) -> str:
    """The block-0 kernel for a configured choice (auto | flash | cudnn) on a device: "flash" or
    "cudnn". auto = cuDNN on CUDA compute capability 9.0+ (Hopper and newer) with cuDNN 9+ for
    head_dim 128 (Kimi-K2's, the shape whose gradients were checked against flash on an H200),
    flash elsewhere (and always on CPU). Pure: the device facts are arguments."""
    if choice not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {choice!r}: expected one of {ATTENTION_KERNELS}")
    cudnn_ok = device_type == "cuda" and cudnn_version is not None and cudnn_version >= 90000
    if choice == "cudnn" and not cudnn_ok:
        raise ValueError(f"attention kernel 'cudnn' needs a CUDA device with cuDNN 9+ (device {device_type}, "
                         f"cuDNN {cudnn_version})")
    if choice == "auto":
        hopper = capability is not None and capability >= (9, 0)
        return "cudnn" if cudnn_ok and hopper and head_dim == 128 else "flash"
    return choice


def resolve_attention_kernel(choice: str, device: torch.device, head_dim: int = 128) -> str:
    """`choose_attention_kernel` for this process's `device`."""
    cuda = device.type == "cuda"
    cap = torch.cuda.get_device_capability(device) if cuda else None
    ver = torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None
    return choose_attention_kernel(choice, device.type, cap, ver, head_dim)


def _causal_forward(q, k, v, scale: float, kernel_name: str):
    """q/k/v [B,h,T,d] -> (out [B,h,T,d], lse fp32 [B,h,T...], state for the backward)."""
    if not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    if kernel_name == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return r[0], r[1].squeeze(-1), tuple(r[2:8])  # lse [B,h,T,1] -> [B,h,T]; cum_q, cum_k, max_q, max_k, seed, offset
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return r[0], r[1], tuple(r[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused


def _causal_backward(dout, q, k, v, out, lse, state: tuple, scale: float, kernel_name: str):
    """(dq, dk, dv) of causal block 0, given the merged out / lse (see the module docstring)."""
    if not q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale)
    cum_q, cum_k, max_q, max_k, a, b = state
    if kernel_name == "cudnn":  # a, b = philox seed / offset; no bias (None = an undefined tensor)
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dout, out = (t(y) for y in kernel_inputs("cudnn", t(dout), t(out)))  # the q/k/v layout (see kernel_inputs)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.contiguous().unsqueeze(-1), a, b, None, cum_q, cum_k, max_q, max_k, 0.0, True,
            scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, a, b, scale=scale)


def kernel_inputs(kernel_name: str, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The [B,T,h,d] tensors as the kernel needs them: for cuDNN every input of forward and
    backward (q, k, v, out, dout) a dense sequence-major tensor (a copy only where it is not one
    already), the one layout checked against flash on the H200 (benchmarks/probe_attention_kernels.py);
    flash takes any strides."""
    if kernel_name != "cudnn":
        return xs
    return tuple(x if x.is_contiguous() else x.contiguous() for x in xs)


class _Causal(torch.autograd.Function):
    """Plain causal attention (TTT step 0) through the chosen kernel. Tensors [B,T,h,d]."""

    @staticmethod
    def forward(ctx, scale: float, kernel_name: str, q, k, v):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        q, k, v = kernel_inputs(kernel_name, q, k, v)
        out, lse, state = _causal_forward(t(q), t(k), t(v), scale, kernel_name)
        ctx.scale, ctx.kernel_name, ctx.state = scale, kernel_name, state
        ctx.save_for_backward(q, k, v, t(out), lse)
        return t(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = _causal_backward(t(dout), t(q), t(k), t(v), t(out), lse, ctx.state, ctx.scale, ctx.kernel_name)
        return None, None, t(dq), t(dk), t(dv)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     kernel_name: str = "flash") -> torch.Tensor:
    """Causal attention, sequence-major: q, k, v [B,T,h,d] (k/v repeated to h heads) -> [B,T,h,d],
    through `kernel_name` ("flash" | "cudnn", see resolve_attention_kernel)."""
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"causal_attention: {name} {tuple(x.shape)} != queries {tuple(q.shape)}")
    if not flash_supported(q):
        raise ValueError(f"causal_attention: no flash kernel for {q.dtype} on {q.device}")
    return _Causal.apply(float(scale), kernel_name, q, k, v)


class DiagonalKeys:
    """The own-position keys/values of TTT steps 1..K-1, written into preallocated [K-1,B,T,h,d]
    buffers so that step k's merge reads slots [:k] as one tensor (no per-step stacking). A slot
    is written once and never again, so earlier steps' views stay valid for their backward."""

    def __init__(self, max_steps: int, like: torch.Tensor):
        self.keys = like.new_empty((max_steps,) + tuple(like.shape))
        self.values = like.new_empty((max_steps,) + tuple(like.shape))
        self.inputs: list[torch.Tensor] = []  # the autograd inputs: k_1, v_1, k_2, v_2, ...
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, release: bool = False) -> None:
        """Copy step n's keys/values into slot n. release: free k's and v's own storage afterwards (the
        tensors stay as autograd inputs, which is all the attention needs of them; only for tensors no
        backward reads, and only where a tensor owns its whole storage, so no other tensor loses data)."""
        if self.n >= self.keys.shape[0]:
            raise ValueError(f"DiagonalKeys holds {self.keys.shape[0]} steps; step {self.n + 1} does not fit")
        for name, x in (("key", k), ("value", v)):
            if x.shape != self.keys.shape[1:] or x.dtype != self.keys.dtype:
                raise ValueError(f"DiagonalKeys.append: {name} {tuple(x.shape)} {x.dtype} != the step-0 queries' "
                                 f"{tuple(self.keys.shape[1:])} {self.keys.dtype}")
        with torch.no_grad():
            self.keys[self.n].copy_(k)
            self.values[self.n].copy_(v)
        self.inputs += [k, v]
        self.n += 1
        if release:
            owned = [x for x in (k, v) if x.storage_offset() == 0
                     and x.untyped_storage().nbytes() == x.numel() * x.element_size()]
            if len({x.untyped_storage().data_ptr() for x in owned}) == len(owned):  # not one shared storage
                for x in owned:
                    x.untyped_storage().resize_(0)


def _merge_kernel(direction: str, compiled: bool, q: torch.Tensor):
    """The diagonal merge (forward | backward): on CUDA, when the fast path is compiled, the Triton
    kernels of eagle3/ttt/triton_kernels.py (keys/values read once); else fast_kernels' function, eager or
    compiled by Inductor."""
    if compiled and triton_kernels.usable(q, head_dim=q.shape[-1]):
        return triton_kernels.merge_forward if direction == "forward" else triton_kernels.merge_backward
    return kernel(f"diagonal_merge_{direction}", compiled)


class _CausalPlusDiagonal(torch.autograd.Function):
    """Tensors [B,T,h,d] (sequence-major). inputs: scale, compiled, block-0 kernel name, keys [S,...],
    values [S,...] (buffer views, read only), q, k0, v0, k_1, v_1, ..., k_S, v_S (for the gradients)."""

    @staticmethod
    def forward(ctx, scale: float, compiled: bool, kernel_name: str, keys, values, q, k0, v0, *diag):
        q, k0, v0 = kernel_inputs(kernel_name, q, k0, v0)
        o0, lse0, state = _causal_forward(q.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2), scale,
                                          kernel_name)
        T = q.shape[1]
        out, lse = _merge_kernel("forward", compiled, q)(q, o0.transpose(1, 2), lse0[..., :T].transpose(1, 2),
                                                         keys, values, scale)
        lse_full = lse0.clone()    # same shape as the kernel's lse (it may be padded past T)
        lse_full[..., :T] = lse.transpose(1, 2).to(lse_full.dtype)
        ctx.scale, ctx.compiled, ctx.state, ctx.kernel_name = scale, compiled, state, kernel_name
        ctx.keys, ctx.values = keys, values  # buffer views: slots [:S] are never written again
        ctx.save_for_backward(q, k0, v0, out, lse_full)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse_full = ctx.saved_tensors
        t = lambda x: x.transpose(1, 2)  # noqa: E731  [B,T,h,d] <-> [B,h,T,d] views
        dq0, dk0, dv0 = _causal_backward(t(dout), t(q), t(k0), t(v0), t(out), lse_full, ctx.state, ctx.scale,
                                         ctx.kernel_name)
        lse = lse_full[..., :q.shape[1]].transpose(1, 2)
        dq, dkeys, dvalues = _merge_kernel("backward", ctx.compiled, q)(dout, q, out, lse, t(dq0), ctx.keys,
                                                                        ctx.values, ctx.scale)
        diag = [g for pair in zip(dkeys.unbind(0), dvalues.unbind(0)) for g in pair]
        return (None, None, None, None, None, dq, t(dk0), t(dv0), *diag)


def causal_plus_diagonal_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diagonal: DiagonalKeys,
                                   scale: float, compiled: bool = False, kernel_name: str = "flash") -> torch.Tensor:
    """TTT attention of one step, sequence-major: q [B,T,h,d] against the step-0 keys/values
    k0, v0 [B,T,h,d] (causal) and the own-position keys/values of the later steps held by
    `diagonal` (all appended so far). Grouped-query callers repeat k/v to h heads first.
    Returns [B,T,h,d] in q's dtype. compiled: the merge math through torch.compile; kernel_name:
    block 0's kernel ("flash" | "cudnn", see resolve_attention_kernel)."""
    if diagonal.n == 0:
        raise ValueError("causal_plus_diagonal_attention: no diagonal keys (step 0 is plain causal attention)")
    for name, x in (("k0", k0), ("v0", v0), ("diagonal keys", diagonal.keys[0])):
        if x.shape != q.shape:
            raise ValueError(f"causal_plus_diagonal_attention: {name} {tuple(x.shape)} != queries {tuple(q.shape)}")
    if not flash_supported(q):
        raise ValueError(f"causal_plus_diagonal_attention: no flash kernel for {q.dtype} on {q.device}")
    n = diagonal.n
    return _CausalPlusDiagonal.apply(float(scale), bool(compiled), kernel_name, diagonal.keys[:n], diagonal.values[:n],
                                     q, k0, v0, *diagonal.inputs)
