"""The drafter forward against an independent step-by-step computation, TTT vs inference, the real
Kimi-K2.5 drafter shape on the meta device, and the config.json round trip."""
import math

import pytest
import torch

from export import spec as export_spec
from eagle3.drafter.model import DEFAULT_ROPE_THETA, DrafterConfig, Eagle3Drafter, rope_inv_freq, rope_settings
from eagle3.drafter.vocab_map import mapping_problems
from eagle3.drafter.attention import KVCache, TTTCache, ttt_position_ids


def tiny_cfg(**kw):
    base = dict(hidden_size=16, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=50, draft_vocab_size=20, target_hidden_size=12, aux_hf_indices=[2, 3, 5],
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, torch_dtype="float32")
    base.update(kw)
    return DrafterConfig(**base)


def randomized(cfg, seed=0):
    torch.manual_seed(seed)
    m = Eagle3Drafter(cfg).double()
    with torch.no_grad():  # norms away from 1 so a skipped norm weight would show
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1) if p.dim() == 1 else None
        m.embed_tokens.weight.normal_()
    return m


# ---- an independent reference, written from the SGLang description with plain matmuls ----
def ref_rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    """x [T, d] at integer positions pos [T]: rotate pairs (i, i + d/2) by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        for i in range(d // 2):
            ang = pos[t] * theta ** (-2 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[t, i], x[t, i + d // 2]
            out[t, i], out[t, i + d // 2] = a * c - b * s, b * c + a * s
    return out


def ref_step(W, cfg, tok, hid, pos, keys_seen):
    """One drafter step for one sequence. tok [T], hid [T,H], pos [T]; keys_seen(t) -> list of (step, s)
    key indices visible to query t. Returns pre-norm output [T,H] and this step's (k, v) per head."""
    H, h, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    emb = W["embed_tokens.weight"][tok]
    x = torch.cat([ref_rms(emb, W["midlayer.input_layernorm.weight"], eps),
                   ref_rms(hid, W["midlayer.hidden_norm.weight"], eps)], -1)
    q = x @ W["midlayer.self_attn.q_proj.weight"].T
    k = x @ W["midlayer.self_attn.k_proj.weight"].T
    v = x @ W["midlayer.self_attn.v_proj.weight"].T
    qs = [ref_rope(q[:, i * d:(i + 1) * d], pos, cfg.rope_theta) for i in range(h)]
    ks = [ref_rope(k[:, j * d:(j + 1) * d], pos, cfg.rope_theta) for j in range(hkv)]
    vs = [v[:, j * d:(j + 1) * d] for j in range(hkv)]
    return x, qs, ks, vs, hid


def ref_finish(W, cfg, hid, attn):
    h1 = hid + attn @ W["midlayer.self_attn.o_proj.weight"].T
    n = ref_rms(h1, W["midlayer.post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = (torch.nn.functional.silu(n @ W["midlayer.mlp.gate_proj.weight"].T) * (n @ W["midlayer.mlp.up_proj.weight"].T)
           ) @ W["midlayer.mlp.down_proj.weight"].T
    out = h1 + mlp
    logits = ref_rms(out, W["norm.weight"], cfg.rms_norm_eps) @ W["lm_head.weight"].T
    return out, logits


def ref_ttt_unroll(W, cfg, tokens, aux, steps):
    """Reference TTT unroll of one sequence: tokens [T+steps], aux [T,3Ht]. Step k, position t reads
    token tokens[t+k], position t+k, and attends step-0 keys s<=t plus its own keys of steps 1..k."""
    T = aux.shape[0]
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = h // hkv
    hid = aux @ W["fc.weight"].T
    K, V = [], []  # per step: list over kv heads of [T,d]
    outs, logits = [], []
    for k in range(steps):
        _, qs, ks, vs, _ = ref_step(W, cfg, tokens[k:k + T], hid, torch.arange(T) + k, None)
        K.append(ks)
        V.append(vs)
        attn = torch.zeros(T, h * d, dtype=hid.dtype)
        for i in range(h):
            j = i // g
            for t in range(T):
                kk = [K[0][j][s] for s in range(t + 1)] + [K[st][j][t] for st in range(1, k + 1)]
                vv = [V[0][j][s] for s in range(t + 1)] + [V[st][j][t] for st in range(1, k + 1)]
                sc = torch.stack([qs[i][t] @ key for key in kk]) / math.sqrt(d)
                p = torch.softmax(sc, 0)
                attn[t, i * d:(i + 1) * d] = sum(pi * vi for pi, vi in zip(p, vv))
        hid, lg = ref_finish(W, cfg, hid, attn)
        outs.append(hid)
        logits.append(lg)
    return outs, logits


def model_ttt_unroll(m, tokens, aux, steps, attention_mask=None):
    B, T = aux.shape[:2]
    pos0 = torch.arange(T).expand(B, T)
    cache = TTTCache(attention_mask)
    hid = m.project_aux(aux)
    outs, logits = [], []
    for k in range(steps):
        hid = m.step(tokens[:, k:k + T], hid, ttt_position_ids(pos0, k), cache)
        outs.append(hid)
        logits.append(m.logits(hid))
    return outs, logits


def test_forward_matches_independent_reference():
    cfg = tiny_cfg()
    m = randomized(cfg)
    W = {k: v.detach() for k, v in m.state_dict().items()}
    T, steps, B = 6, 3, 2
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (B, T + steps), generator=g)
    aux = torch.randn(B, T, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    outs, logits = model_ttt_unroll(m, tokens, aux, steps)
    for b in range(B):
        r_outs, r_logits = ref_ttt_unroll(W, cfg, tokens[b], aux[b], steps)
        for k in range(steps):
            torch.testing.assert_close(outs[k][b], r_outs[k], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(logits[k][b], r_logits[k], rtol=1e-9, atol=1e-9)
    assert logits[0].shape == (B, T, cfg.draft_vocab_size)


def test_ttt_step_k_equals_inference_chain():
    """Step k of the TTT unroll at position t == the k-th draft step of an inference chain rooted at t:
    KV cache holding the prefix 0..t (step 0), then one appended entry per draft step."""
    cfg = tiny_cfg()
    m = randomized(cfg, seed=1)
    T, steps = 7, 4
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, cfg.vocab_size, (1, T + steps), generator=g)
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    outs, _ = model_ttt_unroll(m, tokens, aux, steps)
    h0 = m.project_aux(aux)
    for t in (0, 3, T - 1):
        kv = KVCache()
        # draft "extend" over the prefix: in two chunks, as after two verify rounds
        a = m.step(tokens[:, :2], h0[:, :2], torch.arange(2)[None], kv) if t >= 2 else None
        lo = 2 if t >= 2 else 0
        prefix = m.step(tokens[:, lo:t + 1], h0[:, lo:t + 1], torch.arange(lo, t + 1)[None], kv)
        step0 = torch.cat([a, prefix], 1) if a is not None else prefix
        torch.testing.assert_close(step0, outs[0][:, :t + 1])
        hid = step0[:, -1:]
        for k in range(1, steps):
            hid = m.step(tokens[:, t + k:t + k + 1], hid, torch.tensor([[t + k]]), kv)
            torch.testing.assert_close(hid[:, 0], outs[k][:, t])
        assert kv.length == t + steps


def test_right_padded_batch_matches_unpadded():
    cfg = tiny_cfg()
    m = randomized(cfg, seed=2)
    T, steps, n = 6, 3, 4
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, T + steps), generator=g)
    aux = torch.randn(2, T, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True] * T, [True] * n + [False] * (T - n)])
    outs, _ = model_ttt_unroll(m, tokens, aux, steps, attention_mask=mask)
    short_tokens = torch.cat([tokens[1:, :n + steps]], 0)
    ref, _ = model_ttt_unroll(m, short_tokens, aux[1:, :n], steps)
    for k in range(steps):
        torch.testing.assert_close(outs[k][1:, :n], ref[k])


def test_kimi_k25_drafter_shape_on_meta():
    cfg = DrafterConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                        head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
                        aux_hf_indices=[2, 30, 58], rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=262144)
    with torch.device("meta"):
        m = Eagle3Drafter(cfg)
    H, I, V, N = 7168, 18432, 163840, 32000
    expected = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (64 * 128, 2 * H), "midlayer.self_attn.k_proj.weight": (64 * 128, 2 * H),
        "midlayer.self_attn.v_proj.weight": (64 * 128, 2 * H), "midlayer.self_attn.o_proj.weight": (H, 64 * 128),
        "midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (N, H), "d2t": (N,), "t2d": (V,),
    }
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert got == expected
    assert set(m.export_state_dict()) == set(expected) - {"embed_tokens.weight"}
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    want = (H * 3 * H + 3 * H + 3 * (8192 * 2 * H) + H * 8192 + 3 * I * H + H + N * H)
    assert trainable == want == 1_190_948_864  # ~1.19B trainable, embeddings excluded
    assert not m.embed_tokens.weight.requires_grad


def test_hf_config_round_trip_and_defaults():
    src = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
           "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 131072,
           "vocab_size": 163840, "draft_vocab_size": 32000, "num_hidden_layers": 1, "bos_token_id": 163584,
           "eos_token_id": 163585, "torch_dtype": "bfloat16", "some_vendor_key": 7,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True}}
    cfg = DrafterConfig.from_hf_dict(src)  # current SGLang: a first id other than 1 means h = id
    assert cfg.target_hidden_size == 7168 and cfg.aux_hf_indices == [2, 30, 58]
    assert DrafterConfig.from_hf_dict(src, id_rule="sglang_legacy").aux_hf_indices == [3, 31, 59]
    out = cfg.to_hf_dict()
    assert out["architectures"] == ["LlamaForCausalLMEagle3"] and out["num_hidden_layers"] == 1
    # written back in the form every SGLang version reads as h = [2, 30, 58]
    assert out["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}
    assert DrafterConfig.from_hf_dict(out, id_rule="sglang_legacy").aux_hf_indices == [2, 30, 58]
    assert cfg.unknown_keys == ["some_vendor_key"] and "some_vendor_key" not in out  # reported, never carried
    assert out["draft_vocab_size"] == 32000 and out["model_type"] == "llama"
    assert DrafterConfig.from_hf_dict(out) == cfg
    bare = DrafterConfig.from_hf_dict({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                       "vocab_size": 100})
    assert (bare.head_dim, bare.num_key_value_heads, bare.draft_vocab_size, bare.target_hidden_size) == (16, 4, 100, 64)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        DrafterConfig.from_hf_dict({**src, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="rope_scaling"):
        DrafterConfig.from_hf_dict({**src, "rope_scaling": {"rope_type": "yarn", "factor": 4}})


def test_one_parse_of_sizes_and_rope_for_the_drafter_and_the_export():
    """DrafterConfig and export_spec.DrafterShape read a config's sizes through one function (model.config_sizes):
    the same absent-key readings, the same error; the rope parser's default is SGLang's / transformers' 10000."""
    bare = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100}
    cfg, shape = DrafterConfig.from_hf_dict(bare), export_spec.DrafterShape.from_hf_dict(bare)
    assert {f: getattr(cfg, f) for f in vars(shape)} == vars(shape)
    assert (shape.head_dim, shape.num_key_value_heads, shape.draft_vocab_size, shape.target_hidden_size) == (16, 4, 100, 64)
    for parse in (DrafterConfig.from_hf_dict, export_spec.DrafterShape.from_hf_dict):
        with pytest.raises(ValueError, match=r"lacks \['vocab_size'\]"):
            parse({**bare, "vocab_size": None})
    # rope: no theta in either spelling -> 10000 (what training used); the export's check asks for it explicitly
    assert cfg.rope_theta == DEFAULT_ROPE_THETA == 10000.0 and rope_settings({}) == (10000.0, None)
    assert rope_settings({}, default_theta=None) == (None, None)
    assert rope_settings({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}) == (5e5, None)
    theta, scaling = rope_settings({"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}})
    assert theta == 5e5 and scaling == {"rope_type": "linear", "factor": 2.0}
    assert DrafterConfig.from_hf_dict({**bare, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear",
                                                                   "factor": 2.0}}).rope_scaling == scaling


def test_llama3_rope_scaling_frequencies():
    cfg = tiny_cfg(head_dim=64, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    inv = rope_inv_freq(cfg)
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    wavelen = 2 * math.pi / base
    assert torch.allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high frequencies untouched
    assert torch.allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8)  # low frequencies divided by factor
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and ((inv[mid] < base[mid]) & (inv[mid] > base[mid] / 8)).all()
    lin = rope_inv_freq(tiny_cfg(rope_scaling={"type": "linear", "factor": 2.0}))
    assert torch.allclose(lin, rope_inv_freq(tiny_cfg()) / 2)


def test_vocab_mapping_and_draft_ids_to_target():
    cfg = tiny_cfg()
    m = Eagle3Drafter(cfg)
    target_ids = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    d2t = target_ids - torch.arange(cfg.draft_vocab_size)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    m.set_vocab_mapping(d2t, t2d)
    assert torch.equal(m.draft_ids_to_target(torch.arange(cfg.draft_vocab_size)), target_ids)
    bad = t2d.clone()
    bad[target_ids[0]] = False
    assert mapping_problems(d2t, bad, cfg.draft_vocab_size, cfg.vocab_size)
    with pytest.raises(ValueError, match="t2d marks"):
        m.set_vocab_mapping(d2t, bad)


def test_bf16_step_runs_and_is_close_to_fp32():
    cfg = tiny_cfg()
    m = randomized(cfg, seed=3).float()
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
    aux = torch.randn(2, 5, 3 * cfg.target_hidden_size, generator=g)
    ref, _ = model_ttt_unroll(m, tokens, aux, 3)
    mb = m.to(torch.bfloat16)
    got, _ = model_ttt_unroll(mb, tokens, aux.bfloat16(), 3)
    assert got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[2].float(), ref[2], rtol=0.05, atol=0.05)


def test_a_batch_without_loss_positions_gives_every_trainable_parameter_a_zero_gradient():
    """DDP reduces every parameter's gradient on every rank: a rank whose micro-batch has no valid position
    (all prompt, or targets outside the draft vocab) must still produce one, zero, for lm_head and the norm."""
    from eagle3.ttt.unroll import ttt_unroll

    cfg = tiny_cfg()
    m = randomized(cfg).float()
    B, T = 2, 6
    out = ttt_unroll(m, torch.randn(B, T, 3 * cfg.target_hidden_size), torch.randint(0, cfg.vocab_size, (B, T)),
                     torch.randn(B, T, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (B, T)),
                     torch.zeros(B, T, dtype=torch.bool), torch.randn(cfg.draft_vocab_size, cfg.hidden_size), 3)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and float(out.count.sum()) == 0
    trainable = {n: p for n, p in m.named_parameters() if p.requires_grad}
    assert {n for n, p in trainable.items() if p.grad is None} == set()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in trainable.values())
