"""eagle3/triton_merge.py: the diagonal merge's Triton kernels give the eager functions' results
(eagle3/fast_kernels.diagonal_merge_forward / _backward), on CUDA (skipped elsewhere: CI has no GPU;
run on the device, BENCHMARKS.md). Without a GPU, `usable` must refuse and the compiled path is used."""
import pytest
import torch

from eagle3 import triton_merge
from eagle3.fast_kernels import diagonal_merge_backward, diagonal_merge_forward


def test_usable_refuses_cpu_and_odd_head_dims():
    assert not triton_merge.usable(torch.zeros(1, 2, 3, 128))
    if torch.cuda.is_available():
        assert not triton_merge.usable(torch.zeros(1, 2, 3, 96, device="cuda"))


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
    out, lse = triton_merge.merge_forward(q, o0, lse0, keys, values, scale)
    want_out, want_lse = diagonal_merge_forward(q, o0, lse0, keys, values, scale)
    assert out.dtype == want_out.dtype and lse.dtype == want_lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    g = torch.Generator(device="cuda").manual_seed(9)
    dout = torch.randn(q.shape, generator=g, device="cuda").to(dtype)
    dq0 = torch.randn(q.shape, generator=g, device="cuda").to(dtype)
    got = triton_merge.merge_backward(dout, q, out, lse, dq0, keys, values, scale)
    want = diagonal_merge_backward(dout, q, out, lse, dq0, keys, values, scale)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@cuda
def test_triton_merge_rejects_keys_that_do_not_fit():
    pytest.importorskip("triton")
    q, o0, lse0, keys, values = _case(2, 8, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        triton_merge.merge_forward(q, o0, lse0, keys[:, :, :4], values[:, :, :4], 0.1)
