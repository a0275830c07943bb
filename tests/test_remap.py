"""lm_head remap between draft vocabularies: shared tokens keep their logits bit for bit; the
naive "overwrite d2t only" fix fails the same check; the new-row rules."""
import pytest
import torch

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.remap import remap_lm_head, shared_token_positions
from eagle3.drafter.vocab_map import d2t_from_ids, t2d_from_ids

V, H, N = 300, 16, 40


def vocabs(seed=0, overlap=25):
    """Old and new draft vocabs (sorted target ids) sharing `overlap` tokens, in shuffled positions."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(V, generator=g)
    shared, only_old, only_new = perm[:overlap], perm[overlap:N], perm[N:2 * N - overlap]
    return torch.sort(torch.cat([shared, only_old])).values, torch.sort(torch.cat([shared, only_new])).values


def drafter(ids, seed):
    cfg = DrafterConfig(hidden_size=H, intermediate_size=24, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=8, vocab_size=V, draft_vocab_size=N, target_hidden_size=H, torch_dtype="float32")
    torch.manual_seed(seed)
    m = Eagle3Drafter(cfg)
    m.set_vocab_mapping(d2t_from_ids(ids), t2d_from_ids(ids, V))
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 2.0)
    return m


def target_logits(m, prenorm):
    """Logits indexed by *target* token id (-inf for tokens outside the draft vocab)."""
    lg = m.logits(prenorm)  # [B, T, N]
    out = torch.full(lg.shape[:-1] + (V,), float("-inf"))
    out[..., m.draft_ids_to_target(torch.arange(N))] = lg
    return out


def shared_logits_unchanged(old, new, shared_ids, prenorm):
    a, b = target_logits(old, prenorm), target_logits(new, prenorm)
    return torch.equal(a[..., shared_ids], b[..., shared_ids])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_tokens_keep_their_logits_bit_for_bit(seed):
    old_ids, new_ids = vocabs(seed)
    old = drafter(old_ids, seed)
    shared = old_ids[torch.isin(old_ids, new_ids)]
    assert shared.numel() == 25
    new = drafter(new_ids, seed)
    new.load_state_dict({k: v for k, v in old.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")},
                        strict=False)
    w, stats = remap_lm_head(old.lm_head.weight.detach(), old_ids, new_ids, "mean")
    with torch.no_grad():
        new.lm_head.weight.copy_(w)
    prenorm = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(seed))
    assert shared_logits_unchanged(old, new, shared, prenorm)
    assert (stats["n_shared"], stats["n_fresh"], stats["n_dropped"]) == (25, 15, 15)

    # The known bug: install the new d2t/t2d but leave the rows where they were.
    naive = drafter(new_ids, seed)
    naive.load_state_dict({k: v for k, v in old.state_dict().items() if k not in ("d2t", "t2d")}, strict=False)
    assert not shared_logits_unchanged(old, naive, shared, prenorm)


def test_new_row_rules():
    old_ids = torch.tensor([3, 5, 9, 12])
    new_ids = torch.tensor([1, 5, 9, 20, 30])
    old_w = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0], [1.0, 1.0]])  # norms 1, 2, 5, sqrt2
    target = torch.tensor([[9.0, 9.0], [7.0, 7.0], [8.0, 8.0], [0.0, 6.0], [8.0, 0.0]])
    w, st = remap_lm_head(old_w, old_ids, new_ids, "zeros")
    assert torch.equal(w[1], old_w[1]) and torch.equal(w[2], old_w[2])
    assert torch.equal(w[[0, 3, 4]], torch.zeros(3, 2)) and st["n_fresh"] == 3 and st["n_dropped"] == 2
    w, _ = remap_lm_head(old_w, old_ids, new_ids, "mean")
    assert torch.allclose(w[[0, 3, 4]], torch.tensor([[1.25, 1.75]]).expand(3, 2))
    w, st = remap_lm_head(old_w, old_ids, new_ids, "target_lm_head", target_lm_head_rows=target)
    old_mean = (1 + 2 + 5 + 2 ** 0.5) / 4
    fresh_mean = (9 * 2 ** 0.5 + 6 + 8) / 3
    assert st["target_row_scale"] == pytest.approx(old_mean / fresh_mean)
    assert torch.allclose(w[[0, 3, 4]], target[[0, 3, 4]] * old_mean / fresh_mean)
    assert w[[0, 3, 4]].norm(dim=1).mean() == pytest.approx(old_mean)  # matched to the old rows' scale
    assert torch.equal(w[1], old_w[1])  # the target row of a shared token is NOT used


def test_shared_positions_unsorted_ids():
    new_pos, old_pos = shared_token_positions(torch.tensor([7, 2, 9]), torch.tensor([9, 4, 7]))
    assert new_pos.tolist() == [0, 2] and old_pos.tolist() == [2, 0]


def test_bad_inputs_are_named():
    w = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="target_lm_head_rows"):
        remap_lm_head(w, torch.tensor([0, 1, 2]), torch.tensor([0, 5]), "target_lm_head")
    with pytest.raises(ValueError, match="twice"):
        remap_lm_head(w, torch.tensor([0, 1, 1]), torch.tensor([0, 5]), "zeros")
    with pytest.raises(ValueError, match="disagree"):
        remap_lm_head(w, torch.tensor([0, 1]), torch.tensor([0, 5]), "zeros")
    with pytest.raises(ValueError, match="new_row_init"):
        remap_lm_head(w, torch.tensor([0, 1, 2]), torch.tensor([0, 5]), "random")
