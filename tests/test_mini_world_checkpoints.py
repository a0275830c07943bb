"""Tiny checkpoint builders and the shared fixtures: loadable, faithful names, same logits."""
import json

import torch
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from data.mini_world.checkpoints import checkpoint_weight_names, deepseek_v3_config
from data.mini_world.tokenizer import SPECIAL_TOKENS


def test_deepseek_v3_config_has_kimi_structure():
    cfg = deepseek_v3_config(hidden_size=32)
    assert cfg.hidden_size == 32 and cfg.num_mtp_layers == 0 and cfg.first_k_dense_replace == 1
    assert cfg.tie_word_embeddings is False and cfg.q_lora_rank and cfg.kv_lora_rank  # MLA
    assert cfg.n_routed_experts > cfg.num_experts_per_tok >= 1 and cfg.n_shared_experts == 1
    assert deepseek_v3_config(num_mtp_layers=0).num_nextn_predict_layers == 0


def test_tiny_tokenizer_specials_and_template(tiny_tokenizer):
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    assert len(tok) == 512
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(512 - len(SPECIAL_TOKENS), 512))  # at the top, like Kimi's
    cfg = json.loads((tiny_tokenizer / "tokenizer_config.json").read_text())
    assert "<|im_middle|>" in cfg["chat_template"]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>Hi there<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>")
    gen = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True)
    assert gen == "<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>assistant<|im_middle|>"
    # list-of-parts content (multimodal style) renders its text parts
    parts = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "ab"}]}], tokenize=False)
    assert "<|im_middle|>ab<|im_end|>" in parts
    enc = tok(text)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_middle|>") in enc and tok.decode(enc) == text
    s = "naïve 中文 code: def f(x):\n    return x"
    assert tok.decode(tok(s)["input_ids"]) == s  # byte level: lossless on any text


def test_tiny_k2_target_loads(tiny_k2_target, tiny_text_model):
    m = DeepseekV3ForCausalLM.from_pretrained(str(tiny_k2_target))
    assert m.config.num_hidden_layers == 8 and len({2, 8 // 2, 8 - 3}) == 3
    assert m.config.vocab_size == 512 and m.config.hidden_size == 64
    names = checkpoint_weight_names(tiny_k2_target)
    assert "model.layers.7.mlp.experts.0.gate_proj.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace=1: layer 0 dense
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(m(ids).logits, tiny_text_model(ids).logits, atol=1e-5)
    assert AutoTokenizer.from_pretrained(str(tiny_k2_target)).chat_template


def test_kimi_k25_layout_names_and_logits(tiny_k25_target, tiny_text_model):
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    cfg = json.loads((tiny_k25_target / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["text_config"]["model_type"] == "deepseek_v3"
    assert cfg["tie_word_embeddings"] is False and cfg["text_config"]["tie_word_embeddings"] is False
    assert cfg["text_config"]["num_nextn_predict_layers"] == 0
    names = checkpoint_weight_names(tiny_k25_target)
    for n in ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
              "language_model.lm_head.weight", "language_model.model.layers.7.self_attn.kv_b_proj.weight",
              "language_model.model.layers.3.mlp.experts.1.down_proj.weight",
              "vision_tower.patch_embed.proj.weight", "mm_projector.pre_norm.weight"):
        assert n in names, n
    assert not [n for n in names if ".blocks." in n and n.startswith("language_model")]
    assert not [n for n in names if n.startswith("model.")]

    m, info = Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_k25_target), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # untied: lm_head is its own tensor, equal to the text model's lm_head, not the embeddings
    assert m.lm_head.weight.data_ptr() != m.model.language_model.embed_tokens.weight.data_ptr()
    assert torch.equal(m.lm_head.weight, tiny_text_model.lm_head.weight)
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m.eval()(input_ids=ids).logits
        want = tiny_text_model(ids).logits
    assert got.shape == (2, 11, 512)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_train_tokenizer_is_deterministic_and_checks_size(tmp_path, tiny_sharegpt_records):
    import pytest

    from data.mini_world.checkpoints import train_tokenizer

    texts = [t["value"][:500] for r in tiny_sharegpt_records[:30] for t in r["conversations"]]
    train_tokenizer(texts, 420, tmp_path / "a")
    train_tokenizer(texts, 420, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(texts, 200, tmp_path / "c")
    # too little text for the asked size: padded with unused ids, specials still at the top
    tok = train_tokenizer(["ab ab ab"], 300, tmp_path / "d")
    assert len(tok) == 300 and tok.convert_tokens_to_ids("</think>") == 299
