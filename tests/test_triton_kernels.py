"""eagle3/ttt/triton_kernels.py: the Triton kernels give the eager functions' results (eagle3/ttt/fast_kernels.py:
diagonal_merge_forward / _backward, soft_ce_chunk), on CUDA (skipped elsewhere: CI has no GPU; run on
the device, BENCHMARKS.md). Without a GPU, `usable` must refuse and the compiled path is used."""
import pytest
import torch

from eagle3.ttt import triton_kernels
from eagle3.ttt.fast_kernels import diagonal_merge_backward, diagonal_merge_forward, soft_ce_chunk


def test_usable_refuses_cpu_and_odd_head_dims():
    assert not triton_kernels.usable(torch.zeros(1, 2, 3, 128), head_dim=128)
    assert not triton_kernels.usable(torch.zeros(4, 8))
    if torch.cuda.is_available():
        assert not triton_kernels.usable(torch.zeros(1, 2, 3, 96, device="cuda"), head_dim=96)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def _case(S, T, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, h, d = 2, 3, 128
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    q, o0 = r(B, T, h, d), r(B, T, h, d)
    lse0 = torch.randn(B, h, T + 5, generator=g, device="cuda")[..., :T].transpose(1, 2)  # a strided view, as used
    buf_k, buf_v = r(6, B, T, h, d), r(6, B, T, h, d)
    return q, o0, lse0, buf_k[:S], buf_v[:S]


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("S,T", [(1, 5), (3, 37), (6, 64)])  # rows = 2*T*3: not a multiple of the 32-row block
def test_triton_merge_matches_the_eager_functions(S, T, dtype, tol):
    pytest.importorskip("triton")
    q, o0, lse0, keys, values = _case(S, T, dtype)
    scale = 128 ** -0.5
    out, lse = triton_kernels.merge_forward(q, o0, lse0, keys, values, scale)
    want_out, want_lse = diagonal_merge_forward(q, o0, lse0, keys, values, scale)
    assert out.dtype == want_out.dtype and lse.dtype == want_lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    g = torch.Generator(device="cuda").manual_seed(9)
    dout = torch.randn(q.shape, generator=g, device="cuda").to(dtype)
    dq0 = torch.randn(q.shape, generator=g, device="cuda").to(dtype)
    got = triton_kernels.merge_backward(dout, q, out, lse, dq0, keys, values, scale)
    want = diagonal_merge_backward(dout, q, out, lse, dq0, keys, values, scale)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@cuda
def test_triton_merge_rejects_keys_that_do_not_fit():
    pytest.importorskip("triton")
    q, o0, lse0, keys, values = _case(2, 8, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        triton_kernels.merge_forward(q, o0, lse0, keys[:, :, :4], values[:, :, :4], 0.1)


@cuda
@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-5, 1e-6), (torch.bfloat16, 1e-2, 1e-4)])
@pytest.mark.parametrize("n,V", [(1, 7), (37, 5000), (64, 32000)])  # V not a multiple of the 4096-column block
def test_triton_soft_ce_matches_the_eager_chunk(n, V, dtype, rtol, atol):
    pytest.importorskip("triton")
    g = torch.Generator(device="cuda").manual_seed(n + V)
    logits = (3 * torch.randn(n, V, generator=g, device="cuda")).to(dtype)
    teacher = torch.softmax(2 * torch.randn(n + 5, V, generator=g, device="cuda"), dim=-1)
    rows = torch.randint(0, n + 5, (n,), generator=g, device="cuda")
    scale = torch.tensor(0.37, device="cuda")
    loss, grad, top = triton_kernels.soft_ce_chunk(logits, teacher, rows, scale)
    want_loss, want_grad, want_top = soft_ce_chunk(logits, teacher, rows, scale)
    assert loss.dtype == want_loss.dtype and grad.dtype == want_grad.dtype == dtype and top.dtype == torch.long
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, want_grad, rtol=rtol, atol=atol)
    assert torch.equal(top, want_top)


@cuda
def test_triton_soft_ce_rejects_rows_that_do_not_fit():
    pytest.importorskip("triton")
    logits = torch.zeros(4, 10, device="cuda")
    with pytest.raises(ValueError, match="do not fit"):
        triton_kernels.soft_ce_chunk(logits, torch.zeros(3, 9, device="cuda"), torch.zeros(4, dtype=torch.long,
                                     device="cuda"), torch.tensor(1.0, device="cuda"))
