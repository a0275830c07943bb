"""TTT attention: the efficient cache path equals naive full-mask attention; KVCache behaviour."""
import math

import pytest
import torch

from eagle3.drafter.attention import KVCache, TTTCache, repeat_kv, ttt_attention_mask, ttt_position_ids


def test_mask_small_case_by_hand():
    m = ttt_attention_mask(3, 2)
    expected = torch.tensor([
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert m.dtype == torch.bool and torch.equal(m, expected)
    assert torch.equal(ttt_attention_mask(4, 0), torch.ones(4, 4, dtype=torch.bool).tril())


def test_position_ids_shift_by_step():
    pos = torch.arange(5)[None]
    assert torch.equal(ttt_position_ids(pos, 3), pos + 3)


def naive_attention(q, keys, values, mask):
    """q [B,h,T,d]; keys/values: per-step lists of [B,hkv,T,d]; mask bool [T, T*(k+1)] (or [B,1,T,T*(k+1)])."""
    h, hkv = q.shape[1], keys[0].shape[1]
    K = torch.cat(keys, dim=2).repeat_interleave(h // hkv, dim=1)  # [B,h,T*(k+1),d]
    V = torch.cat(values, dim=2).repeat_interleave(h // hkv, dim=1)
    s = q @ K.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ V


@pytest.mark.parametrize("impl", ["explicit", "sdpa_mask"])
@pytest.mark.parametrize("T,steps,h,hkv", [(1, 3, 2, 2), (5, 4, 4, 2), (9, 7, 3, 1), (16, 2, 2, 2)])
def test_efficient_equals_naive(T, steps, h, hkv, impl):
    g = torch.Generator().manual_seed(T * 100 + steps)
    B, d = 2, 8
    cache = TTTCache(impl=impl)
    keys, values = [], []
    for k in range(steps):
        q = torch.randn(B, h, T, d, generator=g, dtype=torch.float64)
        kk = torch.randn(B, hkv, T, d, generator=g, dtype=torch.float64)
        vv = torch.randn(B, hkv, T, d, generator=g, dtype=torch.float64)
        keys.append(kk)
        values.append(vv)
        got = cache.attend(q, kk, vv)
        want = naive_attention(q, keys, values, ttt_attention_mask(T, k))
        assert cache.num_steps == k + 1
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["explicit", "sdpa_mask"])
def test_gradients_match_naive(impl):
    g = torch.Generator().manual_seed(0)
    B, h, T, d = 1, 2, 6, 4
    qs = [torch.randn(B, h, T, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    ks = [torch.randn(B, h, T, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    vs = [torch.randn(B, h, T, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    cache = TTTCache(impl=impl)
    eff = sum((cache.attend(qs[k], ks[k], vs[k]) * (k + 1)).sum() for k in range(3))
    naive = sum((naive_attention(qs[k], ks[: k + 1], vs[: k + 1], ttt_attention_mask(T, k)) * (k + 1)).sum()
                for k in range(3))
    ge = torch.autograd.grad(eff, qs + ks + vs)
    gn = torch.autograd.grad(naive, qs + ks + vs)
    for a, b in zip(ge, gn):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("impl", ["explicit", "sdpa_mask"])
def test_right_padding_leaves_real_positions_unchanged(impl):
    """A batch with a right-padded row gives that row's real positions the unpadded result."""
    g = torch.Generator().manual_seed(1)
    h, d, T, n_real = 2, 4, 7, 4
    mask = torch.tensor([[True] * T, [True] * n_real + [False] * (T - n_real)])
    full, short = TTTCache(attention_mask=mask, impl=impl), TTTCache(impl=impl)
    for k in range(3):
        q = torch.randn(2, h, T, d, generator=g, dtype=torch.float64)
        kk = torch.randn(2, h, T, d, generator=g, dtype=torch.float64)
        vv = torch.randn(2, h, T, d, generator=g, dtype=torch.float64)
        out = full.attend(q, kk, vv)
        ref = short.attend(q[1:, :, :n_real], kk[1:, :, :n_real], vv[1:, :, :n_real])
        torch.testing.assert_close(out[1:, :, :n_real], ref)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("impl", ["explicit", "sdpa_mask"])
def test_left_padding_masks_padded_keys(impl):
    g = torch.Generator().manual_seed(2)
    h, d, T, pad = 2, 4, 6, 2
    mask = torch.tensor([[False] * pad + [True] * (T - pad)])
    padded, plain = TTTCache(attention_mask=mask, impl=impl), TTTCache(impl=impl)
    for k in range(3):
        q = torch.randn(1, h, T, d, generator=g, dtype=torch.float64)
        kk = torch.randn(1, h, T, d, generator=g, dtype=torch.float64)
        vv = torch.randn(1, h, T, d, generator=g, dtype=torch.float64)
        out = padded.attend(q, kk, vv)
        ref = plain.attend(q[:, :, pad:], kk[:, :, pad:], vv[:, :, pad:])
        torch.testing.assert_close(out[:, :, pad:], ref)


def test_kv_cache_incremental_equals_full_causal():
    g = torch.Generator().manual_seed(3)
    B, h, hkv, T, d = 2, 4, 2, 7, 8
    q = torch.randn(B, h, T, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, hkv, T, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, hkv, T, d, generator=g, dtype=torch.float64)
    full = naive_attention(q, [k], [v], ttt_attention_mask(T, 0))
    cache = KVCache()
    parts = [cache.attend(q[:, :, :3], k[:, :, :3], v[:, :, :3])]
    for t in range(3, T):
        parts.append(cache.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]))
    torch.testing.assert_close(torch.cat(parts, dim=2), full)
    assert cache.length == T


def test_kv_cache_truncate_and_keep():
    g = torch.Generator().manual_seed(4)
    B, h, d = 1, 2, 4
    k = torch.randn(B, h, 6, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, h, 6, d, generator=g, dtype=torch.float64)
    q = torch.randn(B, h, 1, d, generator=g, dtype=torch.float64)
    cache = KVCache()
    cache.attend(torch.zeros(B, h, 6, d, dtype=torch.float64), k, v)
    cache.truncate(4)  # drop two rejected drafts
    assert cache.length == 4
    out = cache.attend(q, k[:, :, 5:6], v[:, :, 5:6])
    ref = naive_attention(q, [torch.cat([k[:, :, :4], k[:, :, 5:6]], 2)], [torch.cat([v[:, :, :4], v[:, :, 5:6]], 2)],
                          torch.ones(1, 5, dtype=torch.bool))
    torch.testing.assert_close(out, ref)
    cache.keep(torch.tensor([0, 2, 4]))
    assert torch.equal(cache.k[:, :, 1], k[:, :, 2]) and torch.equal(cache.k[:, :, 2], k[:, :, 5])
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(9)
    with pytest.raises(ValueError, match="outside"):
        cache.keep(torch.tensor([3]))


def test_unknown_impl_rejected():
    with pytest.raises(ValueError, match="impl"):
        TTTCache(impl="flash")


def test_ttt_step_shape_mismatch_is_an_error():
    cache = TTTCache()
    cache.attend(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="step 1"):
        cache.attend(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))


def test_repeat_kv_gives_each_query_head_its_group_key():
    x = torch.randn(2, 3, 5, 4)                                    # [B, h_kv, L, d]
    assert torch.equal(repeat_kv(x, 6), x.repeat_interleave(2, dim=1))  # query head i reads KV head i // 2
    assert repeat_kv(x, 3) is x                                    # h_kv == h: no copy
