"""The fast TTT training path against independent references, CPU only, eager only (no
torch.compile: Inductor takes minutes on CPU).

- eagle3/ttt/ttt_flash.py (flash causal block + log-sum-exp diagonal merge) vs the explicit TTTCache,
  outputs and gradients in float64;
- eagle3/ttt/fused_ce.py (chunked linear + soft CE) vs logits @ soft_cross_entropy_rows and a float64
  log_softmax written here;
- eagle3/ttt/fast_kernels.py eager pieces vs RMSNorm / a hand-built softmax over [block 0 | diagonal];
- eagle3/ttt/fast_unroll.py vs eagle3/ttt/unroll.ttt_unroll: loss, per-step counts and every gradient;
- eagle3/ttt/loss.teacher_logits leaves the TF32 switch as it found it.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from eagle3.ttt import attention_check
from eagle3.ttt import ttt_flash
from eagle3.ttt import loss as loss_module
from eagle3.ttt.fast_kernels import diagonal_merge_backward, diagonal_merge_forward, rms_norm
from eagle3.ttt.fast_unroll import ttt_unroll_fast
from eagle3.ttt.fused_ce import linear_soft_cross_entropy
from eagle3.ttt.loss import soft_cross_entropy_rows, teacher_logits
from eagle3.drafter.model import RMSNorm
from eagle3.drafter.attention import TTTCache
from eagle3.config.schema.train import ATTENTION_KERNELS as SCHEMA_ATTENTION_KERNELS
from eagle3.ttt.ttt_flash import (ATTENTION_KERNELS, DiagonalKeys, causal_attention, causal_plus_diagonal_attention,
                                  choose_attention_kernel)
from eagle3.ttt.unroll import TTTObjective, step_position_counts, ttt_unroll
from eagle3.drafter.vocab_map import ids_from_d2t
from tests.fixtures.unroll_batch import DV, H, tiny_batch, tiny_drafter

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# helpers


def randn(*shape, g, dtype=F64, requires_grad=False):
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def leaf_qkv(B, T, h, d, g, layout):
    """One step's q, k, v as leaves, returned as sequence-major [B,T,h,d] tensors in a given memory
    layout, plus the leaves themselves (for torch.autograd.grad)."""
    if layout == "contiguous":
        leaves = [randn(B, T, h, d, g=g, requires_grad=True) for _ in range(3)]
        return leaves, leaves
    if layout == "head_major":  # stored [B,h,T,d], seen through a transpose
        leaves = [randn(B, h, T, d, g=g, requires_grad=True) for _ in range(3)]
        return leaves, [x.transpose(1, 2) for x in leaves]
    if layout == "packed":  # slices of one [B,T,3h+1,d] tensor, as q/k/v views of a fused projection
        packed = randn(B, T, 3 * h + 1, d, g=g, requires_grad=True)
        return [packed], [packed[:, :, 1 + i * h:1 + (i + 1) * h] for i in range(3)]
    raise AssertionError(layout)


def fast_ttt_attention(qkvs, scale):
    """Steps 0..K-1 through the fast path ([B,T,h,d] in and out): step 0 one causal_attention call
    (as ttt_unroll_fast does), later steps causal_plus_diagonal_attention."""
    (q0, k0, v0), rest = qkvs[0], qkvs[1:]
    outs = [causal_attention(q0, k0, v0, scale)]
    diagonal = DiagonalKeys(len(rest), q0)
    for q, k, v in rest:
        diagonal.append(k, v)
        outs.append(causal_plus_diagonal_attention(q, k0, v0, diagonal, scale))
    return outs


def explicit_ttt_attention(qkvs):
    """The same steps through eagle3.drafter.attention.TTTCache(impl="explicit"), which takes [B,h,T,d]."""
    cache = TTTCache(impl="explicit")
    return [cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
            for q, k, v in qkvs]


def block0_and_diagonal_scores(q, k0, keys, scale):
    """Scores of TTT attention built by hand, float64: causal block 0 [B,T,h,T] (-inf above the
    diagonal) and the diagonal columns [B,T,h,S] (query t against step j's key at t)."""
    T = q.shape[1]
    s0 = torch.einsum("bthd,bshd->bths", q, k0) * scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, :, None, :]
    s0 = s0.masked_fill(~causal, float("-inf"))
    sd = torch.einsum("bthd,jbthd->bthj", q, keys) * scale
    return s0, sd


def relative_max_error(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def linear_soft_ce_float64(x, weight, teacher_probs, rows):
    """sum_n -sum_v p[rows[n], v] log softmax(x[n] @ W^T)_v, every op in float64."""
    logits = x.to(F64) @ weight.to(F64).t()
    return -(teacher_probs[rows].to(F64) * torch.log_softmax(logits, dim=-1)).sum()


def unroll_args(model, batch, rows):
    return (model, batch["aux"], batch["input_ids"], batch["last"], batch["target_argmax"], batch["loss_mask"], rows)


def loss_and_grads(unroll, args, K, **kwargs):
    model = args[0]
    model.zero_grad(set_to_none=True)
    out = unroll(*args, K, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert model.embed_tokens.weight.grad is None  # frozen target embeddings stay untouched
    model.zero_grad(set_to_none=True)
    return out, grads


# --------------------------------------------------------------------------------------------
# eagle3/ttt/ttt_flash.py


@pytest.mark.parametrize("layout", ["contiguous", "head_major", "packed"])
@pytest.mark.parametrize("T,steps,h", [(1, 4, 2), (9, 5, 3), (37, 7, 2)])
def test_causal_plus_diagonal_matches_explicit_cache_outputs_and_grads(T, steps, h, layout):
    """T=37 crosses the CPU flash kernel's 32-query block; every step's output and the gradient of
    q, k0, v0 and every diagonal k/v agree with the explicit T x T softmax to float64 precision."""
    g = torch.Generator().manual_seed(T * 10 + steps)
    B, d = 2, 8
    leaves, qkvs = [], []
    for _ in range(steps):
        step_leaves, step_qkv = leaf_qkv(B, T, h, d, g, layout)
        leaves += step_leaves
        qkvs.append(step_qkv)
    weights = [randn(B, T, h, d, g=g) for _ in range(steps)]  # a random upstream gradient per step

    fast = fast_ttt_attention(qkvs, 1.0 / math.sqrt(d))
    ref = explicit_ttt_attention(qkvs)
    for k, (got, want) in enumerate(zip(fast, ref)):
        assert got.shape == (B, T, h, d) and got.dtype == F64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"step {k} output")

    fast_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(fast, weights)), leaves)
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, weights)), leaves)
    for i, (got, want) in enumerate(zip(fast_grads, ref_grads)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"gradient of leaf {i}")
    # The comparison is not vacuous: every gradient is far from zero, except step 0's query at T = 1
    # (one key: its gradient is zero in exact arithmetic, and a CPU's exp leaves 0 or ~1e-17 there).
    zero = [i for i, want in enumerate(ref_grads) if want.abs().max() < 1e-6]
    assert zero == ([0] if T == 1 and layout != "packed" else [])


@pytest.mark.parametrize("layout", ["contiguous", "head_major"])
def test_causal_attention_matches_sdpa_outputs_and_grads(layout):
    g = torch.Generator().manual_seed(3)
    leaves, (q, k, v) = leaf_qkv(2, 9, 3, 4, g, layout)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    got = causal_attention(q, k, v, 0.4)
    want = t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, scale=0.4))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = randn(*got.shape, g=g)
    for a, b in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="v "):
        causal_attention(q, k, randn(2, 8, 3, 4, g=g), 0.4)


@pytest.mark.parametrize("choice,device,cap,cudnn,want", [
    ("auto", "cuda", (9, 0), 91900, "cudnn"),   # Hopper: cuDNN
    ("auto", "cuda", (10, 0), 90800, "cudnn"),  # Blackwell
    ("auto", "cuda", (8, 0), 91900, "flash"),   # Ampere: flash
    ("auto", "cuda", (9, 0), 8907, "flash"),    # cuDNN 8: flash
    ("auto", "cuda", (9, 0), None, "flash"),    # no cuDNN
    ("auto", "cpu", None, None, "flash"),
    ("flash", "cuda", (9, 0), 91900, "flash"),
    ("cudnn", "cuda", (8, 0), 90100, "cudnn"),  # asked for explicitly: honoured where cuDNN 9 exists
])
def test_attention_kernel_choice(choice, device, cap, cudnn, want):
    assert choose_attention_kernel(choice, device, cap, cudnn) == want


def test_attention_kernel_auto_keeps_flash_for_head_dims_not_checked_on_cudnn():
    assert choose_attention_kernel("auto", "cuda", (9, 0), 91900, head_dim=64) == "flash"
    assert choose_attention_kernel("cudnn", "cuda", (9, 0), 91900, head_dim=64) == "cudnn"


def test_attention_kernel_choice_rejects_unknown_names_and_cudnn_without_cuda():
    with pytest.raises(ValueError, match="expected one of"):
        choose_attention_kernel("fa3", "cuda", (9, 0), 91900)
    with pytest.raises(ValueError, match="cuDNN 9"):
        choose_attention_kernel("cudnn", "cpu", None, None)
    with pytest.raises(ValueError, match="cuDNN 9"):
        choose_attention_kernel("cudnn", "cuda", (9, 0), 8907)
    assert SCHEMA_ATTENTION_KERNELS == ATTENTION_KERNELS  # the config schema keeps its own torch-free copy


def test_causal_plus_diagonal_rejects_mismatched_shapes():
    g = torch.Generator().manual_seed(0)
    q = randn(1, 5, 2, 4, g=g)
    diagonal = DiagonalKeys(2, q)
    diagonal.append(randn(1, 5, 2, 4, g=g), randn(1, 5, 2, 4, g=g))
    with pytest.raises(ValueError, match="k0"):
        causal_plus_diagonal_attention(q, randn(1, 5, 1, 4, g=g), q, diagonal, 0.5)
    with pytest.raises(ValueError, match="v0"):
        causal_plus_diagonal_attention(q, q, randn(1, 6, 2, 4, g=g), diagonal, 0.5)
    other = DiagonalKeys(2, randn(1, 5, 2, 8, g=g))
    other.append(randn(1, 5, 2, 8, g=g), randn(1, 5, 2, 8, g=g))
    with pytest.raises(ValueError, match="diagonal keys"):
        causal_plus_diagonal_attention(q, q, q, other, 0.5)


def test_causal_plus_diagonal_needs_a_diagonal_key():
    q = torch.randn(1, 5, 2, 4, dtype=F64)
    with pytest.raises(ValueError, match="no diagonal keys"):
        causal_plus_diagonal_attention(q, q, q, DiagonalKeys(3, q), 0.5)


def test_diagonal_keys_reject_a_step_past_max_steps():
    q = torch.randn(1, 5, 2, 4, dtype=F64)
    diagonal = DiagonalKeys(2, q)
    diagonal.append(q, q)
    diagonal.append(q, q)
    assert diagonal.n == 2
    with pytest.raises(ValueError, match="holds 2 steps"):
        diagonal.append(q, q)
    assert diagonal.n == 2 and len(diagonal.inputs) == 4  # the failed append left nothing behind


# --------------------------------------------------------------------------------------------
# eagle3/ttt/fused_ce.py


def ce_case(N, Hx=6, V=11, M=5, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = randn(N, Hx, g=g, dtype=dtype, requires_grad=True)
    weight = randn(V, Hx, g=g, dtype=dtype, requires_grad=True)
    teacher = torch.softmax(randn(M, V, g=g, dtype=torch.float32) * 2, dim=-1)  # fp32 [M, V]
    rows = torch.randint(0, M, (N,), generator=g)  # repeated and out-of-order teacher rows
    return x, weight, teacher, rows


@pytest.mark.parametrize("chunk_rows", [1, 4, 10, 64])  # 4 does not divide N=10; 64 > N
def test_linear_soft_ce_matches_soft_cross_entropy_rows(chunk_rows):
    x, weight, teacher, rows = ce_case(N=10)
    loss, top = linear_soft_cross_entropy(x, weight, teacher, rows, chunk_rows)
    assert loss.dtype == F64 and loss.shape == () and top.dtype == torch.long
    dx, dw = torch.autograd.grad(loss, (x, weight))

    exact = linear_soft_ce_float64(x, weight, teacher, rows)  # float64 throughout: tight
    ex_dx, ex_dw = torch.autograd.grad(exact, (x, weight))
    torch.testing.assert_close(loss, exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ex_dx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, ex_dw, rtol=1e-12, atol=1e-12)

    # the repository's soft CE (it runs the log-softmax in fp32)
    ref = soft_cross_entropy_rows(x @ weight.t(), teacher[rows])
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, weight))
    torch.testing.assert_close(loss.float(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx.to(F64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, ref_dw.to(F64), rtol=1e-5, atol=1e-5)
    assert torch.equal(top, (x @ weight.t()).argmax(dim=-1))


def test_linear_soft_ce_float32_matches_soft_cross_entropy_rows():
    x, weight, teacher, rows = ce_case(N=13, V=17, seed=3, dtype=torch.float32)
    loss, top = linear_soft_cross_entropy(x, weight, teacher, rows, 5)
    assert loss.dtype == torch.float32
    dx, dw = torch.autograd.grad(loss, (x, weight))
    ref = soft_cross_entropy_rows(x @ weight.t(), teacher[rows])
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, weight))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-6)
    assert torch.equal(top, (x @ weight.t()).argmax(dim=-1))


def test_linear_soft_ce_scales_gradients_by_the_upstream_gradient():
    x, weight, teacher, rows = ce_case(N=7, seed=1)
    loss, _ = linear_soft_cross_entropy(x, weight, teacher, rows, 3)
    (3 * loss).backward()
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (3 * linear_soft_ce_float64(x2, w2, teacher, rows)).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-12, atol=1e-12)


def test_linear_soft_ce_of_no_rows_is_zero_with_zero_gradients():
    x, weight, teacher, rows = ce_case(N=0)
    loss, top = linear_soft_cross_entropy(x, weight, teacher, rows, 4)
    assert loss.item() == 0.0 and top.shape == (0,)
    loss.backward()
    assert x.grad.shape == (0, 6)
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_linear_soft_ce_without_gradients_gives_the_same_loss():
    """Validation: no input needs a gradient (plain tensors), or grad mode is off."""
    x, weight, teacher, rows = ce_case(N=9, seed=2)
    exact = linear_soft_ce_float64(x, weight, teacher, rows)
    plain, top = linear_soft_cross_entropy(x.detach(), weight.detach(), teacher, rows, 4)
    assert not plain.requires_grad
    torch.testing.assert_close(plain, exact.detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(top, (x @ weight.t()).argmax(dim=-1))
    with torch.no_grad():
        no_grad, _ = linear_soft_cross_entropy(x, weight, teacher, rows, 4)
    torch.testing.assert_close(no_grad, exact.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", ["x not 2-D", "hidden sizes differ", "teacher vocab differs", "rows do not fit x",
                                 "dtypes differ", "chunk_rows 0"])
def test_linear_soft_ce_rejects_bad_shapes_and_dtypes(bad):
    x, weight, teacher, rows = ce_case(N=4)
    args = {
        "x not 2-D": (x[0], weight, teacher, rows[:1], 4),
        "hidden sizes differ": (x[:, :5], weight, teacher, rows, 4),
        "teacher vocab differs": (x, weight, teacher[:, :10], rows, 4),
        "rows do not fit x": (x, weight, teacher, rows[:3], 4),
        "dtypes differ": (x.float(), weight, teacher, rows, 4),
        "chunk_rows 0": (x, weight, teacher, rows, 0),
    }[bad]
    with pytest.raises(ValueError):
        linear_soft_cross_entropy(*args)


# --------------------------------------------------------------------------------------------
# eagle3/ttt/fast_kernels.py (eager)


@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype", [
    (torch.float32, torch.float32, torch.float32), (torch.float32, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float32)])
def test_rms_norm_is_the_model_rmsnorm_then_a_cast(x_dtype, w_dtype, out_dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(24, g=g, dtype=torch.float32))
    norm = norm.to(w_dtype)
    x = randn(3, 5, 24, g=g, dtype=torch.float32).mul(4).to(x_dtype)
    got = rms_norm(x, norm.weight, norm.eps, out_dtype)
    want = norm(x).to(out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, want)


def merge_case(seed=0, B=2, T=5, h=3, d=4, S=3):
    g = torch.Generator().manual_seed(seed)
    q = randn(B, T, h, d, g=g)
    k0, v0 = randn(B, T, h, d, g=g), randn(B, T, h, d, g=g)
    keys, values = randn(S, B, T, h, d, g=g), randn(S, B, T, h, d, g=g)
    return q, k0, v0, keys, values, 1.0 / math.sqrt(d)


def direct_attention(q_block0, q_diag, k0, v0, keys, values, scale):
    """One softmax over [block-0 scores | diagonal scores] built by hand (float64): returns out
    [B,T,h,d] and the row log-sum-exp [B,T,h]. Separate queries for the two score sets, so that
    autograd gives block 0's and the diagonal's shares of dq apart."""
    s0, _ = block0_and_diagonal_scores(q_block0, k0, keys, scale)
    _, sd = block0_and_diagonal_scores(q_diag, k0, keys, scale)
    scores = torch.cat([s0, sd], dim=-1)                                     # [B,T,h,T+S]
    p = torch.softmax(scores, dim=-1)
    T = q_block0.shape[1]
    out = torch.einsum("bths,bshd->bthd", p[..., :T], v0) + torch.einsum("bthj,jbthd->bthd", p[..., T:], values)
    return out, torch.logsumexp(scores, dim=-1)


def test_diagonal_merge_forward_is_one_softmax_over_both_blocks():
    q, k0, v0, keys, values, scale = merge_case()
    s0, _ = block0_and_diagonal_scores(q, k0, keys, scale)
    o0 = torch.einsum("bths,bshd->bthd", torch.softmax(s0, dim=-1), v0)       # block 0 alone
    lse0 = torch.logsumexp(s0, dim=-1)
    out, lse = diagonal_merge_forward(q, o0, lse0, keys, values, scale)
    want_out, want_lse = direct_attention(q, q, k0, v0, keys, values, scale)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_diagonal_merge_backward_matches_autograd_of_the_direct_softmax():
    q, k0, v0, keys, values, scale = merge_case(seed=1)
    q_block0, q_diag = q.clone().requires_grad_(), q.clone().requires_grad_()
    keys_l, values_l = keys.clone().requires_grad_(), values.clone().requires_grad_()
    out, lse = direct_attention(q_block0, q_diag, k0, v0, keys_l, values_l, scale)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    dq_block0, dq_diag, dkeys_want, dvalues_want = torch.autograd.grad(out, (q_block0, q_diag, keys_l, values_l),
                                                                       dout)
    dq, dkeys, dvalues = diagonal_merge_backward(dout, q, out.detach(), lse.detach(), dq_block0, keys, values, scale)
    torch.testing.assert_close(dq, dq_block0 + dq_diag, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkeys, dkeys_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dvalues, dvalues_want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# eagle3/ttt/fast_unroll.py


def unroll_case(T=24, seed=1):
    model = tiny_drafter()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query heads
    batch, _ = tiny_batch(T=T, seed=seed, in_vocab=ids_from_d2t(model.d2t))
    rows = torch.randn(DV, H, generator=torch.Generator().manual_seed(seed + 10))
    return model, batch, rows


@pytest.mark.parametrize("K,options", [(1, "defaults"), (7, "defaults"), (7, "positions+denominators")])
def test_fast_unroll_matches_reference_unroll(K, options):
    model, batch, rows = unroll_case()
    args = unroll_args(model, batch, rows)
    kwargs = {}
    if options == "positions+denominators":
        B, T = batch["input_ids"].shape
        counts = step_position_counts(batch["loss_mask"], batch["target_argmax"], model.t2d, K)
        # Uneven gaps: rope is relative, so a constant offset per row would not change anything.
        gaps = torch.randint(1, 4, (B, T), generator=torch.Generator().manual_seed(7))
        kwargs = {"position_ids": gaps.cumsum(dim=1) + torch.tensor([[3], [11]]),
                  "step_denominators": 2 * counts + torch.arange(K, dtype=torch.float32)}
    ref, ref_grads = loss_and_grads(ttt_unroll, args, K, **kwargs)
    fast, fast_grads = loss_and_grads(ttt_unroll_fast, args, K, **kwargs)

    assert (ref.count > 0).all()  # every step has valid positions
    assert fast.count.tolist() == ref.count.tolist()
    assert fast.correct.tolist() == ref.correct.tolist()
    assert fast.loss.dtype == torch.float32
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-5)
    assert fast_grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        assert want.abs().max() > 1e-4, name  # every parameter takes part (its largest entry is ~1e-2 or more)
        assert relative_max_error(fast_grads[name], want) < 1e-5, name


def test_fast_unroll_with_trainable_embeddings_matches_reference():
    """The embeddings are frozen in training, so q/k/v's embedding half skips its input-gradient GEMM
    (input_layernorm's weight gradient comes from the weight-gradient product). Made trainable, the
    embeddings get their gradient through the other branch, and every gradient still matches."""
    model, batch, rows = unroll_case()
    model.embed_tokens.weight.requires_grad_(True)
    args = unroll_args(model, batch, rows)
    grads = {}
    for name, unroll in (("ref", ttt_unroll), ("fast", ttt_unroll_fast)):
        model.zero_grad(set_to_none=True)
        unroll(*args, 7).loss.backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads["ref"]["embed_tokens.weight"].abs().max() > 1e-4
    for name, want in grads["ref"].items():
        assert relative_max_error(grads["fast"][name], want) < 1e-5, name


def test_norm_weight_grads_matches_autograd():
    """fast_kernels.norm_weight_grads: from dy^T normalise(x), the gradients of w and of the norm weight
    of y = rms_norm(x, weight) @ w^T, as autograd gives them (x without a gradient)."""
    from eagle3.ttt.fast_kernels import norm_weight_grads

    g = torch.Generator().manual_seed(3)
    x, dy = randn(9, 6, g=g), randn(9, 5, g=g)
    w, weight = randn(5, 6, g=g, requires_grad=True), (1 + randn(6, g=g)).requires_grad_(True)
    (rms_norm(x, weight, 1e-6, F64) @ w.t()).backward(dy)
    n = rms_norm(x, torch.ones(6, dtype=F64), 1e-6, F64)
    d_w, d_weight = norm_weight_grads(dy.t() @ n, w.detach(), weight.detach())
    torch.testing.assert_close(d_w, w.grad)
    torch.testing.assert_close(d_weight, weight.grad)


def test_fast_unroll_with_more_steps_than_positions_matches_reference():
    """T=5, 7 steps: the later steps have no valid position (empty loss rows)."""
    model, batch, rows = unroll_case(T=5, seed=2)
    args = unroll_args(model, batch, rows)
    ref, ref_grads = loss_and_grads(ttt_unroll, args, 7)
    fast, fast_grads = loss_and_grads(ttt_unroll_fast, args, 7)
    assert ref.count[-1] == 0
    assert fast.count.tolist() == ref.count.tolist()
    assert fast.correct.tolist() == ref.correct.tolist()
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for name, want in ref_grads.items():
        assert relative_max_error(fast_grads[name], want) < 1e-5, name


def test_fast_unroll_without_grad_mode_gives_the_same_loss_and_no_gradients():
    """Validation runs the fast unroll under no_grad: same loss / accuracy, no weight-gradient sums, no .grad."""
    model, batch, rows = unroll_case()
    args = unroll_args(model, batch, rows)
    with_grad, _ = loss_and_grads(ttt_unroll_fast, args, 7)
    with torch.no_grad():
        plain = ttt_unroll_fast(*args, 7)
    assert not plain.loss.requires_grad
    torch.testing.assert_close(plain.loss, with_grad.loss.detach(), rtol=1e-6, atol=1e-7)
    assert plain.correct.tolist() == with_grad.correct.tolist()
    assert all(p.grad is None for p in model.parameters())


def test_fast_unroll_gradients_accumulate_over_two_batches_like_the_reference():
    """Two unrolls before one optimizer step (gradient accumulation): each hands its fp32 sums to the
    parameters, which add them, as autograd's own gradients would be."""
    model, batch, rows = unroll_case()
    args = unroll_args(model, batch, rows)
    for unroll in (ttt_unroll, ttt_unroll_fast):
        model.zero_grad(set_to_none=True)
        for scale in (1.0, 0.5):
            (scale * unroll(*args, 7).loss).backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        if unroll is ttt_unroll:
            want = got
    model.zero_grad(set_to_none=True)
    for name, g in want.items():
        assert relative_max_error(got[name], g) < 1e-5, name


def test_compiled_pieces_mark_exactly_the_sizes_that_vary(monkeypatch):
    """fast_kernels.VARYING_DIMS: across two batches of different lengths and the 7 steps, every
    (argument, dim) it marks takes more than one size, and every other dim of every tensor
    argument keeps one size (H, heads, head_dim, V, B ... stay compile-time constants)."""
    from eagle3.ttt import fast_kernels

    seen = {name: [] for name in fast_kernels._FUNCTIONS}

    def recording(name, fn):
        def call(*args):
            seen[name].append([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args])
            return fn(*args)
        return call

    monkeypatch.setattr(fast_kernels, "_FUNCTIONS", {n: recording(n, f) for n, f in fast_kernels._FUNCTIONS.items()})
    monkeypatch.setattr(fast_kernels, "_COMPILED", {})
    monkeypatch.setattr(fast_kernels.torch, "compile", lambda fn, dynamic=None: fn)  # no Inductor on CPU tests
    monkeypatch.setattr(fast_kernels.torch._dynamo, "maybe_mark_dynamic", lambda t, d: None)
    for T in (24, 12):
        model, batch, rows = unroll_case(T=T)
        out = ttt_unroll_fast(*unroll_args(model, batch, rows), 7, compiled=True)
        out.loss.backward()
    for name, calls in seen.items():
        assert len(calls) >= 2, name
        marked = set(fast_kernels.VARYING_DIMS[name])
        for arg, shape in enumerate(calls[0]):
            if shape is None:
                assert not any(a == arg for a, _ in marked), (name, arg)
                continue
            for dim in range(len(shape)):
                sizes = {c[arg][dim] for c in calls}
                assert (len(sizes) > 1) == ((arg, dim) in marked), (name, arg, dim, sizes)


def test_fast_unroll_rejects_an_attention_mask():
    model, batch, rows = unroll_case(T=8)
    with pytest.raises(ValueError, match="attention_mask"):
        ttt_unroll_fast(*unroll_args(model, batch, rows), 3,
                        attention_mask=torch.ones_like(batch["loss_mask"]))


@pytest.mark.parametrize("unroll", [ttt_unroll, ttt_unroll_fast])
def test_both_unrolls_refuse_aux_of_another_width(unroll):
    model, batch, rows = unroll_case(T=8)
    args = list(unroll_args(model, batch, rows))
    args[1] = torch.cat([args[1], args[1][..., :1]], dim=-1)  # one column too many: another target's states
    with pytest.raises(ValueError, match=r"aux width \d+ != fc input"):
        unroll(*args, 3)


def test_fast_unroll_names_a_cudnn_kernel_it_cannot_use():
    model, batch, rows = unroll_case(T=8)
    with pytest.raises(ValueError, match="cudnn"):
        ttt_unroll_fast(*unroll_args(model, batch, rows), 3, attention_kernel="cudnn")
    out = TTTObjective(model, ttt_length=3, impl="fast", attention_kernel="flash")(batch, rows)
    assert torch.isfinite(out.loss)


def test_objective_fast_and_reference_give_the_same_loss():
    model, batch, rows = unroll_case()
    fast = TTTObjective(model, ttt_length=4, impl="fast")(batch, rows)
    ref = TTTObjective(model, ttt_length=4, impl="reference")(batch, rows)
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert fast.count.tolist() == ref.count.tolist()


def test_objective_auto_is_reference_on_cpu_and_unknown_impls_raise():
    model, batch, _ = unroll_case(T=8)
    assert TTTObjective(model, impl="auto").resolved_impl(batch) == "reference"
    assert TTTObjective(model, impl="fast").resolved_impl(batch) == "fast"
    with pytest.raises(ValueError, match="impl"):
        TTTObjective(model, impl="flash")


# --------------------------------------------------------------------------------------------
# eagle3/ttt/loss.py


@pytest.mark.parametrize("before", [True, False])
def test_teacher_logits_restores_the_tf32_switch_and_returns_fp32(before):
    g = torch.Generator().manual_seed(0)
    last, head = randn(3, 8, g=g, dtype=torch.bfloat16), randn(5, 8, g=g, dtype=torch.bfloat16)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = before
        out = teacher_logits(last, head)
        assert torch.backends.cuda.matmul.allow_tf32 is before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, last.double() @ head.double().t(), rtol=0, atol=1e-5, check_dtype=False)


@pytest.mark.parametrize("before", [True, False])
def test_tf32_context_restores_the_switch_even_on_an_error(before):
    """The context teacher_logits uses on CUDA (bf16 inputs): TF32 on inside, as before after."""
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = before
        with pytest.raises(RuntimeError, match="inside"):
            with loss_module._tf32_matmul(True):
                assert torch.backends.cuda.matmul.allow_tf32 is True
                raise RuntimeError("inside")
        assert torch.backends.cuda.matmul.allow_tf32 is before
        with loss_module._tf32_matmul(False):
            assert torch.backends.cuda.matmul.allow_tf32 is before
        assert torch.backends.cuda.matmul.allow_tf32 is before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# --------------------------------------------------------------------------------------------
# eagle3/ttt/attention_check.py


def test_kernel_disagreement_of_a_kernel_with_itself_is_zero():
    worst = attention_check.kernel_disagreement("flash", "flash", torch.device("cpu"), F64, 8, heads=2, T=12, steps=3)
    assert worst < 1e-12  # (float64: the same computation twice; not "== 0", which a CPU's math need not give)


def test_kernel_disagreement_sees_a_backward_that_gets_dq_wrong(monkeypatch):
    # "cudnn" on CPU runs the CPU flash kernel; break its backward's dq the way cuDNN once did
    real = ttt_flash._causal_backward

    def broken(*args):
        dq, dk, dv = real(*args)
        return (dq * 1.5, dk, dv) if args[-1] == "cudnn" else (dq, dk, dv)
    monkeypatch.setattr(ttt_flash, "_causal_backward", broken)
    worst = attention_check.kernel_disagreement("flash", "cudnn", torch.device("cpu"), F64, 8, heads=2, T=12)
    assert worst > attention_check.TOLERANCE
    with torch.no_grad():  # callable from validation's no_grad too
        again = attention_check.kernel_disagreement("flash", "cudnn", torch.device("cpu"), F64, 8, heads=2, T=12)
        assert again == pytest.approx(worst, rel=1e-9)


@pytest.mark.parametrize("worst,choice,want", [(3e-3, "auto", "cudnn"), (3e-3, "cudnn", "cudnn"),
                                               (0.5, "auto", "flash"), (0.5, "cudnn", "error")])
def test_checked_attention_kernel_uses_cudnn_only_when_it_matched_flash(monkeypatch, worst, choice, want):
    monkeypatch.setattr(attention_check, "resolve_attention_kernel", lambda c, dev, hd: "cudnn")
    monkeypatch.setattr(attention_check, "_cudnn_disagreement", lambda dev, dt, hd: worst)
    dev = torch.device("cpu")
    if want == "error":
        with pytest.raises(RuntimeError, match="differs from flash"):
            attention_check.checked_attention_kernel(choice, dev, torch.bfloat16, 128)
    elif want == "flash":
        with pytest.warns(RuntimeWarning, match="using flash"):
            assert attention_check.checked_attention_kernel(choice, dev, torch.bfloat16, 128) == "flash"
    else:
        assert attention_check.checked_attention_kernel(choice, dev, torch.bfloat16, 128) == want
    # fp32 never reaches the kernel: no check, no warning
    assert attention_check.checked_attention_kernel(choice, dev, torch.float32, 128) == "cudnn"


def test_checked_attention_kernel_falls_back_when_the_check_itself_fails(monkeypatch):
    def fails(dev, dt, hd):
        raise RuntimeError("cuDNN Frontend error: no valid execution plans")
    monkeypatch.setattr(attention_check, "resolve_attention_kernel", lambda c, dev, hd: "cudnn")
    monkeypatch.setattr(attention_check, "_cudnn_disagreement", fails)
    with pytest.warns(RuntimeWarning, match="no valid execution plans"):
        assert attention_check.checked_attention_kernel("auto", torch.device("cpu"), torch.bfloat16, 64) == "flash"
