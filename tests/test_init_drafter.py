"""The training drafter: from an older drafter (compatibility first, lm_head remap, target
embeddings, max_position from the target) and from scratch, on tiny real targets of both layouts."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.target_model import target_io
from eagle3.drafter.drafter_io import CompatibilityError, save_drafter_dir
from eagle3.drafter.initial import build_training_drafter, scratch_config
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.attention import TTTCache
from eagle3.drafter.vocab_map import d2t_from_ids, t2d_from_ids

TEXT = dict(vocab_size=80, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=6,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=512, num_mtp_layers=0,
            tie_word_embeddings=False, rope_theta=50000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
N = 24


def build_target(out_dir, layout):
    import transformers

    torch.manual_seed(0)
    if layout == "causal_lm":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TEXT))
    else:
        cfg = transformers.Kimi_K25Config(
            text_config=dict(TEXT), tie_word_embeddings=False, projection_hidden_size=16,
            vision_config=dict(num_hidden_layers=1, hidden_size=16, intermediate_size=16, num_attention_heads=2))
        model = transformers.Kimi_K25ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    if layout == "kimi_k25":  # the released checkpoint's names (transformers writes `blocks`)
        f = out_dir / "model.safetensors"
        sd = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in load_file(f).items()}
        save_file(sd, f, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_targets")
    return {layout: build_target(root / layout, layout) for layout in ("causal_lm", "kimi_k25")}


def vocab_ids(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(80, generator=g)[:N]).values


def old_drafter_dir(tmp_path, **cfg_kw):
    """An 'AQ-MedAI'-style drafter for the target: its own vocab, max_position 128 (< target's 512)."""
    kw = dict(hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
              vocab_size=80, draft_vocab_size=N, target_hidden_size=16, aux_hf_indices=[2, 3, 5],
              max_position_embeddings=128, rope_theta=1e6, torch_dtype="bfloat16")
    kw.update(cfg_kw)
    cfg = DrafterConfig(**kw)
    torch.manual_seed(1)
    m = Eagle3Drafter(cfg)
    ids = vocab_ids(1)[: cfg.draft_vocab_size] if cfg.draft_vocab_size <= N else torch.arange(cfg.draft_vocab_size)
    m.set_vocab_mapping(d2t_from_ids(ids), t2d_from_ids(ids, cfg.vocab_size))
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
    return save_drafter_dir(m, tmp_path / "old", dtype="float32"), m, ids


@pytest.mark.parametrize("layout", ["causal_lm", "kimi_k25"])
def test_from_old_drafter(targets, tmp_path, layout):
    d, old, old_ids = old_drafter_dir(tmp_path)
    new_ids = vocab_ids(2)
    model, report = build_training_drafter("aqmedai_k2", d, targets[layout], layout, new_ids, [2, 3, 5])
    embed = target_io.load_embed_tokens(targets[layout], layout)
    assert torch.equal(model.embed_tokens.weight, embed) and not model.embed_tokens.weight.requires_grad
    assert model.config.max_position_embeddings == 512 and report["max_position_embeddings"]["old"] == 128
    assert torch.equal(model.draft_ids_to_target(torch.arange(N)), new_ids) and int(model.t2d.sum()) == N
    for k, v in old.state_dict().items():
        if k not in ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight"):
            assert torch.equal(model.state_dict()[k], v), k
    # Same inputs through both drafters (old with the target's embeddings): identical pre-norm
    # outputs, and every token in both vocabs gets exactly its old logit.
    old.set_embeddings(embed)
    g = torch.Generator().manual_seed(3)
    aux, ids = torch.randn(1, 6, 48, generator=g), torch.randint(0, 80, (1, 6), generator=g)
    pos = torch.arange(6)[None]
    h_old = old.step(ids, old.project_aux(aux), pos, TTTCache())
    h_new = model.step(ids, model.project_aux(aux), pos, TTTCache())
    assert torch.equal(h_old, h_new)
    lo, ln = old.logits(h_old), model.logits(h_new)
    shared = [t for t in new_ids.tolist() if t in old_ids.tolist()]
    assert shared and report["lm_head_remap"]["n_shared"] == len(shared)
    for t in shared:
        assert torch.equal(lo[..., old_ids.tolist().index(t)], ln[..., new_ids.tolist().index(t)])
    # New tokens: the target's lm_head rows, one common scale.
    fresh = [i for i, t in enumerate(new_ids.tolist()) if t not in old_ids.tolist()]
    rows = target_io.load_lm_head_rows(targets[layout], layout, new_ids[fresh])
    scale = report["lm_head_remap"]["target_row_scale"]
    torch.testing.assert_close(model.lm_head.weight[fresh], rows * scale)


def test_old_drafter_incompatible_with_target_stops_first(targets, tmp_path):
    d, _, _ = old_drafter_dir(tmp_path, vocab_size=90, target_hidden_size=12)
    with pytest.raises(CompatibilityError) as e:
        build_training_drafter("aqmedai_k2", d, targets["causal_lm"], "causal_lm", vocab_ids(2), [2, 3, 5])
    assert "vocab_size" in str(e.value) and "target_hidden_size" in str(e.value)
    d2, _, _ = old_drafter_dir(tmp_path / "b")
    with pytest.raises(CompatibilityError, match=r"the store holds h = \[3, 4, 5\]"):
        build_training_drafter("aqmedai_k2", d2, targets["causal_lm"], "causal_lm", vocab_ids(2), [3, 4, 5])
    # the rule decides: ids [1, 2, 4] mean h = [2, 3, 5] for SGLang but h = [1, 2, 4] for vLLM
    with pytest.raises(CompatibilityError, match=r"drafter reads hidden states h = \[1, 2, 4\]"):
        build_training_drafter("aqmedai_k2", d2, targets["causal_lm"], "causal_lm", vocab_ids(2), [2, 3, 5],
                               aux_id_rule="vllm")


@pytest.mark.parametrize("rule", ["mean", "zeros"])
def test_other_new_row_rules(targets, tmp_path, rule):
    d, old, old_ids = old_drafter_dir(tmp_path)
    new_ids = vocab_ids(2)
    model, report = build_training_drafter("aqmedai_k2", d, targets["causal_lm"], "causal_lm", new_ids, None, rule)
    assert report["lm_head_remap"]["rule"] == rule and model.config.aux_hf_indices == [2, 3, 5]
    fresh = [i for i, t in enumerate(new_ids.tolist()) if t not in old_ids.tolist()]
    want = old.lm_head.weight.mean(0) if rule == "mean" else torch.zeros(16)
    torch.testing.assert_close(model.lm_head.weight[fresh], want.expand(len(fresh), 16))


@pytest.mark.parametrize("layout", ["causal_lm", "kimi_k25"])
def test_scratch(targets, layout):
    new_ids = vocab_ids(4)
    model, report = build_training_drafter("scratch", None, targets[layout], layout, new_ids, [2, 3, 5])
    c = model.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (16, 2, 2, 8, 32)
    assert (c.vocab_size, c.draft_vocab_size, c.max_position_embeddings, c.rope_theta) == (80, N, 512, 50000.0)
    assert c.rope_scaling is None and any("yarn" in n for n in report["config_notes"])
    assert torch.equal(model.embed_tokens.weight, target_io.load_embed_tokens(targets[layout], layout))
    assert torch.equal(model.lm_head.weight, target_io.load_lm_head_rows(targets[layout], layout, new_ids))
    assert torch.equal(model.draft_ids_to_target(torch.arange(N)), new_ids)
    assert report["trainable_parameters"] == sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    assert 0.01 < float(model.fc.weight.detach().std()) < 0.03  # N(0, 0.02) init
    again, _ = build_training_drafter("scratch", None, targets[layout], layout, new_ids, [2, 3, 5])
    assert torch.equal(again.fc.weight, model.fc.weight)  # deterministic


def test_scratch_config_for_kimi_k25_shape():
    text = json.loads(json.dumps(dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                                      num_attention_heads=64, num_key_value_heads=64, qk_rope_head_dim=64,
                                      qk_nope_head_dim=128, v_head_dim=128, head_dim=64, vocab_size=163840,
                                      num_hidden_layers=61, max_position_embeddings=262144, rms_norm_eps=1e-6,
                                      rope_theta=50000.0, bos_token_id=163584, eos_token_id=163585)))
    cfg, _ = scratch_config(text, 32000, [2, 30, 58])
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.intermediate_size, cfg.max_position_embeddings) == (128, 64, 18432, 262144)
    out = cfg.to_hf_dict()
    # h [2, 30, 58] (Kimi's layers 2/30/58) is written as ids [1, 29, 57]: h in every SGLang version
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57] and out["bos_token_id"] == 163584


def test_bad_vocab_ids_rejected(targets):
    with pytest.raises(ValueError):
        build_training_drafter("scratch", None, targets["causal_lm"], "causal_lm", torch.tensor([5, 3, 9]), [2, 3, 5])
    with pytest.raises(ValueError, match="init"):
        build_training_drafter("medusa", None, targets["causal_lm"], "causal_lm", vocab_ids(2), [2, 3, 5])
