"""eagle3.target_model.target_io: text config, single tensors from the checkpoint, and the
aux-state hooks on both layouts (Kimi-K2.5 wrapper and a plain DeepSeek-V3 causal LM)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.target_model import target_io
from eagle3.target_model.target_io import (AuxHiddenCapture, TargetError, argmax_from_last, decoder_layers, final_norm,
                                           load_checkpoint_tensor, load_embed_tokens, load_lm_head_rows, load_target,
                                           read_text_config, text_model)

from tests.fixtures.tiny import TINY_TARGET_HIDDEN as H, TINY_TARGET_LAYERS as L, TINY_VOCAB as V


@pytest.fixture(scope="module")
def tiny_targets(tiny_k25_target, tiny_k2_target):
    """conftest's tiny targets: one random DeepSeek-V3 text model, in the Kimi-K2.5 layout and as a
    plain causal LM (8 layers, hidden 64, vocab 512, untied lm_head)."""
    return {"kimi_k25": tiny_k25_target, "causal_lm": tiny_k2_target}


def test_read_text_config_both_layouts(tiny_targets, tmp_path):
    for layout in ("kimi_k25", "causal_lm"):
        cfg = read_text_config(tiny_targets[layout], layout)
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (H, L, V)
        assert cfg["max_position_embeddings"] > 0
    with pytest.raises(TargetError, match="text_config"):
        read_text_config(tiny_targets["causal_lm"], "kimi_k25")
    with pytest.raises(TargetError, match="use layout kimi_k25"):
        read_text_config(tiny_targets["kimi_k25"], "causal_lm")
    with pytest.raises(TargetError, match="no config.json"):
        read_text_config(tmp_path / "nope", "causal_lm")


def test_checkpoint_tensors_match_the_loaded_model(tiny_targets):
    for layout in ("kimi_k25", "causal_lm"):
        model, _ = load_target(tiny_targets[layout], layout, dtype="float32")
        embed = load_embed_tokens(tiny_targets[layout], layout)
        assert torch.equal(embed, text_model(model).embed_tokens.weight)
        head = target_io.lm_head(model).weight
        assert not torch.equal(head, embed)  # not tied (Kimi does not tie)
        rows = torch.tensor([V - 1, 3, 40, 3, 0])
        assert torch.equal(load_lm_head_rows(tiny_targets[layout], layout, rows, block_rows=7), head[rows])
        assert torch.equal(load_lm_head_rows(tiny_targets[layout], layout, None), head)
        with pytest.raises(TargetError, match="out of range"):
            load_lm_head_rows(tiny_targets[layout], layout, torch.tensor([V]))


def test_sharded_checkpoint_via_index(tiny_targets, tmp_path):
    sd = load_file(tiny_targets["kimi_k25"] / "model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, tmp_path / fname)
        weight_map.update({k: fname for k in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((tiny_targets["kimi_k25"] / "config.json").read_text())
    assert torch.equal(load_embed_tokens(tmp_path, "kimi_k25"), sd["language_model.model.embed_tokens.weight"])
    assert torch.equal(load_checkpoint_tensor(tmp_path, ["x.weight", "language_model.lm_head.weight"]),
                       sd["language_model.lm_head.weight"])
    with pytest.raises(TargetError, match="none of"):
        load_checkpoint_tensor(tmp_path, ["model.nothing.weight"])


@pytest.mark.parametrize("layout", ["kimi_k25", "causal_lm"])
def test_hooks_capture_hf_hidden_states_h(tiny_targets, layout):
    model, text_cfg = load_target(tiny_targets[layout], layout, dtype="float32")
    assert len(decoder_layers(model)) == text_cfg["num_hidden_layers"] == L
    hf = [1, 4, L - 1]  # h: HF output_hidden_states index = the output of decoder layer h - 1
    # (h = L would be the last layer's raw output, while HF's hidden_states[L] is post-norm)
    input_ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=input_ids, output_hidden_states=True)
        with AuxHiddenCapture(model, hf) as cap:
            text_model(model)(input_ids=input_ids)
            aux, last = cap.aux, cap.last
    hs = ref.hidden_states
    assert len(hs) == L + 1
    for k, h in enumerate(hf):
        torch.testing.assert_close(aux[k], hs[h], rtol=0, atol=0)
        assert not torch.allclose(aux[k], hs[h - 1], atol=1e-3)  # off-by-one would be caught
    # the post-norm state lm_head consumes: lm_head(last) reproduces the model's logits
    torch.testing.assert_close(target_io.lm_head(model)(last), ref.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax_from_last(model, last, chunk_tokens=5), ref.logits.argmax(-1))
    assert cap.aux_concat().shape == (2, 11, 3 * H)
    assert final_norm(model)._forward_hooks == {}  # hooks removed on exit
    for bad in ([L + 1], [0]):  # past the last layer; the embeddings (no decoder layer outputs them)
        with pytest.raises(TargetError, match="not decoder-layer outputs"):
            AuxHiddenCapture(model, bad)


def test_load_target_errors(tmp_path, tiny_targets):
    with pytest.raises(TargetError, match="no config.json"):
        load_target(tmp_path / "missing", "causal_lm", dtype="float32")
    (tmp_path / "config.json").write_text((tiny_targets["causal_lm"] / "config.json").read_text())
    with pytest.raises(TargetError, match="no model.safetensors"):
        load_target(tmp_path, "causal_lm", dtype="float32")


def test_a_missing_tokenizer_fails_at_once_without_asking_the_hub(tmp_path, monkeypatch, tiny_tokenizer):
    """Nothing downloads at run time: a path that is not there is an error naming it, not a Hub lookup (the Hub
    client retries for ~45 s before it gives up, which made a mistyped path look like a hang)."""
    import socket
    import time
    from types import SimpleNamespace

    def no_network(*args, **kwargs):
        raise OSError("no network in this test")

    backoff = []  # the Hub client sleeps between the retries of a file lookup
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(time, "sleep", backoff.append)
    missing = SimpleNamespace(tokenizer="no-such-org/no-such-tokenizer", trust_remote_code=False)
    with pytest.raises(TargetError, match=r"target\.tokenizer=no-such-org/no-such-tokenizer .*nothing is downloaded"):
        target_io.load_tokenizer(missing)
    assert backoff == []
    there = SimpleNamespace(tokenizer=str(tiny_tokenizer), trust_remote_code=False)
    assert target_io.load_tokenizer(there).convert_tokens_to_ids("<|im_end|>") == 505  # a directory still loads
