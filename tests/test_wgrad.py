"""eagle3/ttt/wgrad.py: weight gradients summed in fp32 over a batch's uses, handed to the parameters
through one autograd node; and the fast unroll's SwiGLU recompute (eagle3/ttt/fast_unroll._SwiGLUDown)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3.ttt.fast_unroll import _SwiGLUDown
from eagle3.ttt.fused_ce import scaled_linear_soft_cross_entropy
from eagle3.ttt.wgrad import ALL, WeightGrads, linear, matmul_accumulate, shared_weights


def _params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(6, 10, generator=g, dtype=dtype, requires_grad=True)   # [out, 2H], H = 5
    k = torch.randn(4, 10, generator=g, dtype=dtype, requires_grad=True)
    o = torch.randn(5, 6, generator=g, dtype=dtype, requires_grad=True)
    return q, k, o


def test_matmul_accumulate_adds_products_in_the_buffer_dtype():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 7, generator=g), torch.randn(7, 4, generator=g)
    acc = matmul_accumulate(None, a, b, torch.float64)
    assert acc.dtype == torch.float64
    again = matmul_accumulate(acc, 2 * a, b, torch.float64)
    assert again is acc  # in place
    torch.testing.assert_close(acc, 3 * (a.double() @ b.double()))
    with pytest.raises(ValueError, match="does not take"):
        matmul_accumulate(acc, a, b[:, :3], torch.float64)


def test_shared_weights_hand_the_summed_gradients_of_every_use_to_their_pieces():
    """Slices of parameters concatenated, used three times each through `linear` (and once through
    plain autograd): the parameters' gradients equal plain autograd's over the same computation."""
    H = 5
    q, k, o = _params()
    x = torch.randn(2, 3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def forward(wq_e, wq_h, wo, lin):
        h = x
        total = 0
        for _ in range(3):
            y = lin("qk_hidden", torch.tanh(h), wq_h)                   # [2,3,10]
            h = h + lin("o", y[..., :6], wo)                          # [2,3,5]
            total = total + (h ** 2).sum()
        return total + (F.linear(x, wq_e) ** 2).sum()                 # the embed half through autograd

    plain = forward(torch.cat([q[:, :H], k[:, :H]]), torch.cat([q[:, H:], k[:, H:]]), o,
                    lambda name, a, w: F.linear(a, w))
    want = torch.autograd.grad(plain, (q, k, o))
    grads = WeightGrads()
    w = shared_weights(grads, {"qk_embed": [(q, ALL, slice(None, H)), (k, ALL, slice(None, H))],
                               "qk_hidden": [(q, ALL, slice(H, None)), (k, ALL, slice(H, None))],
                               "o": [(o, ALL, ALL)]}, torch.float64)
    out = forward(w["qk_embed"], w["qk_hidden"], w["o"], lambda name, a, wt: linear(grads, name, a, wt))
    torch.testing.assert_close(out, plain)
    got = torch.autograd.grad(out, (q, k, o))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert grads.uses == {"qk_hidden": 3, "o": 3}


def test_a_second_backward_through_the_same_sums_is_refused():
    q, k, o = _params()
    grads = WeightGrads()
    w = shared_weights(grads, {"o": [(o, ALL, ALL)]}, torch.float64)
    y = linear(grads, "o", torch.ones(2, 6, dtype=torch.float64), w["o"]).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.backward()


def test_swiglu_down_recomputes_the_product_and_matches_autograd():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    down = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    gate, up = gu.chunk(2, dim=-1)
    want = torch.autograd.grad(F.linear(F.silu(gate) * up, down), (gu, down), dy)
    grads = WeightGrads()
    w = shared_weights(grads, {"down": [(down, ALL, ALL)]}, torch.float64)
    got = torch.autograd.grad(_SwiGLUDown.apply(grads, False, gu, w["down"]), (gu, down), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_scaled_soft_ce_through_weight_grads_scales_by_the_upstream_gradient():
    """The lm_head sum is filled in the forward and scaled when handed over: 3 * (s1 CE1 + s2 CE2)
    gives the same weight gradient as plain autograd of the same expression."""
    g = torch.Generator().manual_seed(4)
    W = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(n, 5, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 3)]
    teacher = torch.softmax(torch.randn(7, 6, generator=g, dtype=torch.float64), -1)
    rows = [torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5])]
    scales = [torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64)]

    def plain_ce(x, r):
        logp = torch.log_softmax(x @ W.t(), -1)
        return -(teacher[r] * logp).sum()

    plain = 3 * sum(s * plain_ce(x, r) for x, r, s in zip(xs, rows, scales))
    want = torch.autograd.grad(plain, (W, *xs))
    grads = WeightGrads()
    w = shared_weights(grads, {"lm_head": [(W, ALL, ALL)]}, torch.float64)
    parts = [scaled_linear_soft_cross_entropy(x, w["lm_head"], teacher, r, s, 2, False, grads)
             for x, r, s in zip(xs, rows, scales)]
    for (sc, raw, _), x, r, s in zip(parts, xs, rows, scales):
        torch.testing.assert_close(raw, plain_ce(x, r).detach())
        torch.testing.assert_close(sc.detach(), s * raw)
    got = torch.autograd.grad(3 * (parts[0][0] + parts[1][0]), (W, *xs))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_one_weight_scaled_by_two_upstream_factors_is_refused():
    grads = WeightGrads()
    grads.set_upstream("lm_head", torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="one factor per weight"):
        grads.set_upstream("lm_head", torch.tensor(2.0))


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.float32)])
def test_rms_norm_backward_is_autograd_of_rms_norm(x_dtype, w_dtype):
    from eagle3.ttt.fast_kernels import rms_norm, rms_norm_backward
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, generator=g).to(x_dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(16, generator=g)).to(w_dtype).requires_grad_()
    d_out = torch.randn(2, 3, 16, generator=g).to(x_dtype)
    want = torch.autograd.grad(rms_norm(x, w, 1e-6, x_dtype), (x, w), d_out)
    got = rms_norm_backward(x.detach(), w.detach(), 1e-6, d_out)
    assert got[0].dtype == x_dtype and got[1].dtype == w_dtype
    tol = dict(rtol=1e-10, atol=1e-12) if x_dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_norm_linear_recomputes_the_norm_and_matches_autograd():
    from eagle3.ttt.fast_kernels import rms_norm
    from eagle3.ttt.fast_unroll import _NormLinear
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    nw = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(F.linear(rms_norm(x, nw, 1e-6, torch.float64), W), (x, nw, W), dy)
    grads = WeightGrads()
    w = shared_weights(grads, {"w": [(W, ALL, ALL)]}, torch.float64)
    got = torch.autograd.grad(_NormLinear.apply(grads, "w", False, 1e-6, x, nw, w["w"]), (x, nw, W), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_diagonal_keys_release_only_tensors_that_own_their_storage():
    from eagle3.ttt.ttt_flash import DiagonalKeys
    q = torch.randn(1, 4, 2, 3)
    keys = DiagonalKeys(2, q)
    k, v = torch.randn(1, 4, 2, 3), torch.randn(1, 4, 2, 3)
    keys.append(k, v, release=True)
    assert k.untyped_storage().nbytes() == 0 and v.untyped_storage().nbytes() == 0
    big = torch.randn(2, 1, 4, 2, 3)
    k2, v2 = big[0], big[1]  # views of one storage: kept
    keys.append(k2, v2, release=True)
    assert big.untyped_storage().nbytes() > 0
    torch.testing.assert_close(keys.keys[1], big[0])


def test_pieces_that_are_row_blocks_are_put_back_in_place():
    """A copy made of a parameter's row blocks in another order (neither whole nor column slices): each
    block's gradient lands on its own rows."""
    q, _, _ = _params()
    x = torch.randn(4, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    plain = (F.linear(x, torch.cat([q[3:], q[:3]])) ** 2).sum()
    want = torch.autograd.grad(plain, q)[0]
    grads = WeightGrads()
    w = shared_weights(grads, {"swapped": [(q, slice(3, None), ALL), (q, slice(None, 3), ALL)]}, torch.float64)
    got = torch.autograd.grad((linear(grads, "swapped", x, w["swapped"]) ** 2).sum(), q)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
