"""The speculators directory with the target's embedding (export.speculators_embed, issue 20 item 7).

An outside check found speculators 0.9.0's `Eagle3DraftModel.from_pretrained` keeping an all-zero embedding
for a directory that ships none; on this stack (transformers 5.24) it instead reads the embedding from the
verifier checkpoint the config names (the test below shows both variants end with the target's). Shipping it
makes the directory's drafter complete whatever the loader does. The validator accepts `embed_tokens.weight` there only on request and
only equal to the target's. Where speculators imports (pip install speculators==0.9.0 --no-deps plus
hs-connectors loguru pydantic-settings typer; not a CI dependency) both variants are loaded with its own
loader; elsewhere the checks run against this project's loader only.
"""
import json

import pytest
import torch
from safetensors.torch import save_file

from export import spec
from export.directory import export_tensors, validate_format_dir, write_format_dir
from export.formats import FORMATS
from export.format_speculators import load_speculators_dir
from export.serving import speculators_embed_note
from tests.fixtures.specforge_drafter import SF_CONFIG, H, V, tiny_weights

HF = [2, 3, 4]
KW = dict(vocab_size=V, max_position_embeddings=64, hf_indices=HF, dtype="float32", rope=(10000.0, None))


def speculators_dir(tmp_path, embed=None, verifier="/t", name="sp"):
    sg = spec.sglang_config(SF_CONFIG, vocab_size=V, max_position_embeddings=64, hf_indices=HF, dtype="float32")
    cfg = spec.speculators_config(sg, hf_indices=HF, verifier_path=str(verifier),
                                  verifier_architectures=["LlamaForCausalLM"], speculative_tokens=2)
    tensors = export_tensors(tiny_weights(), "speculators", torch.float32)
    if embed is not None:
        tensors[spec.EMBED] = embed
    d = tmp_path / name
    write_format_dir(d, cfg, tensors, "speculators")
    return d


def target_embed(seed=3):
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed))


def test_validator_accepts_the_targets_embedding_only_on_request(tmp_path):
    embed = target_embed()
    with_embed = speculators_dir(tmp_path, embed, name="with")
    assert validate_format_dir(with_embed, FORMATS["speculators"], **KW, embed_tokens=embed) == []
    assert validate_format_dir(with_embed, FORMATS["speculators"], **KW, embed_tokens=True) == []  # shape-only (reuse)
    unrequested = validate_format_dir(with_embed, FORMATS["speculators"], **KW)
    assert any("unexpected tensor 'embed_tokens.weight'" in p for p in unrequested)
    other = validate_format_dir(with_embed, FORMATS["speculators"], **KW, embed_tokens=target_embed(seed=4))
    assert any("is not the target's embedding" in p for p in other)
    missing = validate_format_dir(speculators_dir(tmp_path, name="without"), FORMATS["speculators"], **KW, embed_tokens=embed)
    assert any("missing tensor 'embed_tokens.weight'" in p for p in missing)
    short = speculators_dir(tmp_path, embed[:-1], name="short")
    assert any("embed_tokens.weight" in p and "shape" in p
               for p in validate_format_dir(short, FORMATS["speculators"], **KW, embed_tokens=embed))
    with pytest.raises(ValueError, match="only into the speculators directory"):
        spec.expected_tensors(spec.DrafterShape.from_hf_dict(SF_CONFIG), "sglang", embed=True)


def test_our_loader_uses_a_shipped_embedding_and_checks_it(tmp_path):
    embed = target_embed()
    d = speculators_dir(tmp_path, embed)
    model = load_speculators_dir(d)
    assert torch.equal(model.embed_tokens.weight, embed) and model.load_report["embed_tokens"] == "from the directory"
    assert torch.equal(load_speculators_dir(d, embed_tokens=embed).embed_tokens.weight, embed)
    with pytest.raises(ValueError, match="is not the target's embedding"):
        load_speculators_dir(d, embed_tokens=target_embed(seed=4))
    bare = load_speculators_dir(speculators_dir(tmp_path, name="bare"))
    assert bare.load_report["embed_tokens"].startswith("NOT LOADED")


def test_unknown_speculators_keys_reported(tmp_path, caplog):
    d = speculators_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vendor_knob": 1}))
    with caplog.at_level("WARNING"):
        model = load_speculators_dir(d)
    assert model.load_report["unknown_config_keys"] == ["vendor_knob"] and "vendor_knob" in caplog.text


def test_serve_note_says_when_the_embedding_is_needed():
    assert "speculators_embed=true" in speculators_embed_note(False) and "all-zero" in speculators_embed_note(False)
    assert "also holds the target's" in speculators_embed_note(True)


# ------------------------------------------------------------------ speculators' own loader (not in CI)

def test_speculators_own_loader_reads_both_variants(tmp_path):
    pytest.importorskip("speculators.models.eagle3", reason="speculators 0.9.0 not installed (pip install --no-deps)")
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the verifier: a tiny Llama whose embedding speculators reads as the target's
    verifier = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=6,
                                            num_attention_heads=4, tie_word_embeddings=False))
    verifier.save_pretrained(tmp_path / "target")
    embed = verifier.model.embed_tokens.weight.detach().clone()
    w = tiny_weights()
    for shipped in (False, True):
        d = speculators_dir(tmp_path, embed if shipped else None, verifier=tmp_path / "target", name=f"sp{int(shipped)}")
        model = Eagle3DraftModel.from_pretrained(str(d))
        assert torch.equal(model.fc.weight.float(), w["fc.weight"])
        assert torch.equal(model.lm_head.weight.float(), w["lm_head.weight"])
        assert torch.equal(model.layers[0].self_attn.q_proj.weight.float(), w["midlayer.self_attn.q_proj.weight"])
        # shipped: the directory's copy (the target's). Not shipped: on this stack (transformers 5.24) speculators
        # 0.9.0 fills its NaN-initialised embedding from the verifier checkpoint, which must then be reachable at
        # the path the config names; the outside check of issue 20 saw it keep zeros instead on its setup.
        assert torch.equal(model.embed_tokens.weight.float(), embed)
