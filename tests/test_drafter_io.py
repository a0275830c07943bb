"""Drafter directories: round trip, the SpecForge/AQ-MedAI layout variants, strict key checks,
and the drafter <-> target compatibility check."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.drafter import vocab_map
from eagle3.drafter.drafter_io import (CompatibilityError, DrafterLoadError, assert_compatible, check_compatibility,
                                       check_drafter_dir, compatibility_mismatches, load_drafter_dir, mapping_mismatches,
                                       raise_on_fatal, save_drafter_dir)
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter


def tiny_cfg(**kw):
    base = dict(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                vocab_size=60, draft_vocab_size=20, target_hidden_size=16, aux_hf_indices=[2, 3, 4],
                max_position_embeddings=128, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return DrafterConfig(**base)


TARGET = {"hidden_size": 16, "num_hidden_layers": 6, "vocab_size": 60, "max_position_embeddings": 256,
          "bos_token_id": 1, "eos_token_id": 2}


def make_model(cfg=None, seed=0):
    cfg = cfg or tiny_cfg()
    torch.manual_seed(seed)
    m = Eagle3Drafter(cfg)
    ids = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    m.set_vocab_mapping(ids - torch.arange(cfg.draft_vocab_size), t2d)
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
    return m


def pair_mismatches(cfg, d2t, t2d):
    """A live d2t/t2d pair's check against the config's sizes, as mismatches."""
    return mapping_mismatches(vocab_map.mapping_problems(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size),
                              vocab_map.order_problems(d2t))


def tensors_of(d):
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_round_trip_and_layout(tmp_path):
    m = make_model()
    emb = torch.randn(60, 16)
    m.set_embeddings(emb)
    d = save_drafter_dir(m, tmp_path / "drafter", dtype="bfloat16")
    torch.save({"optimizer": 1}, d / "training_state.pt")  # SpecForge ships this; must be ignored
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["torch_dtype"] == "bfloat16"
    # h [2, 3, 4] is written as ids [1, 2, 3]: the form every SGLang version reads as h (eagle3/engines/aux_layers.py)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle3_aux_hidden_states"]["hf_indices"] == [2, 3, 4]
    stored = tensors_of(d)
    assert "embed_tokens.weight" not in stored
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert stored["fc.weight"].dtype == torch.bfloat16
    loaded = load_drafter_dir(d, embed_tokens=emb, dtype="float32")
    assert "training_state.pt" in loaded.load_report["ignored_files"]
    for k, v in m.state_dict().items():
        want = v if not v.is_floating_point() or k == "embed_tokens.weight" else v.bfloat16().float()
        assert torch.equal(loaded.state_dict()[k], want), k
    assert not loaded.embed_tokens.weight.requires_grad
    assert [p.requires_grad for p in loaded.parameters()].count(False) == 1
    assert not list(tmp_path.glob("drafter/.*tmp"))  # no temp files left


def test_sharded_index_and_model_prefix(tmp_path):
    m = make_model()
    sd = m.export_state_dict()
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(m.config.to_hf_dict()))
    names = sorted(sd)
    parts = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for fname, keys in parts.items():
        save_file({f"model.{k}": sd[k].contiguous() for k in keys}, str(d / fname))
    index = {"weight_map": {f"model.{k}": f for f, ks in parts.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_drafter_dir(d, embed_tokens=torch.zeros(60, 16))
    for k, v in sd.items():
        assert torch.equal(loaded.state_dict()[k], v), k


def write_dir(tmp_path, cfg, tensors, name="bad"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    return d


def test_strict_load_lists_every_problem(tmp_path):
    m = make_model()
    sd = dict(m.export_state_dict())
    del sd["midlayer.mlp.up_proj.weight"]
    sd["midlayer.self_attn.qkv_proj.weight"] = torch.zeros(3, 3)  # SGLang would silently skip this
    sd["fc.weight"] = torch.zeros(16, 47)
    d = write_dir(tmp_path, m.config, sd)
    with pytest.raises(DrafterLoadError) as e:
        load_drafter_dir(d)
    msg = str(e.value)
    assert "midlayer.mlp.up_proj.weight" in msg and "qkv_proj" in msg and "fc.weight: [16, 47]" in msg
    _, problems = check_drafter_dir(d, TARGET)
    assert sum(p.key == "weights" for p in problems) == 3 and all(p.fatal for p in problems if p.key == "weights")


def test_shipped_embeddings_tolerated_and_reported(tmp_path):
    m = make_model()
    shipped = torch.randn(60, 16)
    d = write_dir(tmp_path, m.config, {**m.export_state_dict(), "embed_tokens.weight": shipped})
    own = load_drafter_dir(d)
    assert torch.equal(own.embed_tokens.weight, shipped) and "checkpoint" in own.load_report["embed_tokens"]
    target = torch.randn(60, 16)
    tgt = load_drafter_dir(d, embed_tokens=target)
    assert torch.equal(tgt.embed_tokens.weight, target) and "ignored" in tgt.load_report["embed_tokens"]
    with pytest.raises(DrafterLoadError, match="target embeddings"):
        load_drafter_dir(d, embed_tokens=torch.zeros(61, 16))


def test_missing_t2d_is_rebuilt_and_bad_mapping_rejected(tmp_path):
    m = make_model()
    sd = dict(m.export_state_dict())
    t2d = sd.pop("t2d")
    loaded = load_drafter_dir(write_dir(tmp_path, m.config, sd, "no_t2d"), embed_tokens=torch.zeros(60, 16))
    assert torch.equal(loaded.t2d, t2d) and "rebuilt" in loaded.load_report["t2d"]
    bad = dict(m.export_state_dict())
    bad["d2t"] = bad["d2t"].clone()
    bad["d2t"][1] = bad["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id
    with pytest.raises(DrafterLoadError, match="same target id"):
        load_drafter_dir(write_dir(tmp_path, m.config, bad, "dup"))


def test_full_vocab_drafter_needs_no_mapping(tmp_path):
    cfg = tiny_cfg(draft_vocab_size=60)
    m = Eagle3Drafter(cfg)
    sd = {k: v for k, v in m.export_state_dict().items() if k not in ("d2t", "t2d")}
    loaded = load_drafter_dir(write_dir(tmp_path, cfg, sd, "full"))
    assert torch.equal(loaded.draft_ids_to_target(torch.arange(60)), torch.arange(60)) and loaded.t2d.all()


def test_missing_config_or_weights_named(tmp_path):
    with pytest.raises(DrafterLoadError, match="no config.json"):
        load_drafter_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg().to_hf_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(DrafterLoadError, match="pytorch_model.bin"):
        load_drafter_dir(tmp_path)


def test_compatible_pair_has_no_fatal_mismatch():
    cfg = tiny_cfg(max_position_embeddings=256)
    m = make_model(cfg)
    assert check_compatibility(cfg, TARGET, [2, 3, 4]) == [] and pair_mismatches(cfg, m.d2t, m.t2d) == []
    assert assert_compatible(cfg, TARGET, [2, 3, 4]) == []


@pytest.mark.parametrize("change,key,fatal", [
    (dict(hidden_size=32, intermediate_size=32), "hidden_size", True),
    (dict(target_hidden_size=12), "target_hidden_size", True),
    (dict(vocab_size=61), "vocab_size", True),
    (dict(aux_hf_indices=[2, 3, 6]), "aux_hf_indices", True),   # 6 layers: h = 6 is past the last input
    (dict(aux_hf_indices=[2, 3]), "aux_hf_indices", True),
    (dict(aux_hf_indices=[2, 3, 3]), "aux_hf_indices", True),
    (dict(max_position_embeddings=128), "max_position_embeddings", False),
    (dict(aux_hf_indices=None), "eagle_config", False),
    (dict(eos_token_id=5), "eos_token_id", False),
])
def test_each_mismatch_is_named(change, key, fatal):
    base = dict(max_position_embeddings=256)
    base.update(change)
    found = compatibility_mismatches(tiny_cfg(**base), TARGET)
    assert [(m.key, m.fatal) for m in found] == [(key, fatal)], found
    assert "Fix:" in str(found[0])


def test_captured_ids_and_mapping_checked():
    cfg = tiny_cfg(max_position_embeddings=256)
    found = compatibility_mismatches(cfg, TARGET, hf_indices_captured=[3, 4, 5])
    assert [m.key for m in found] == ["aux_hf_indices"] and "the store holds h = [3, 4, 5]" in found[0].problem
    m = make_model(cfg)
    short_t2d = m.t2d[:-1]
    found = pair_mismatches(cfg, m.d2t, short_t2d)
    assert found and found[0].key == "d2t/t2d" and found[0].fatal
    with pytest.raises(CompatibilityError, match="t2d has shape"):
        raise_on_fatal(found, "drafter is not compatible with the target")
    shuffled = m.d2t.clone()                                # draft ids 0 and 1 swap target ids: valid, unsorted
    shuffled[0], shuffled[1] = m.d2t[1] + 1, m.d2t[0] - 1
    found = pair_mismatches(cfg, shuffled, m.t2d)
    assert [(f.key, f.fatal) for f in found] == [("d2t", False)] and "strictly increasing" in found[0].problem


def test_check_drafter_dir_reads_mapping(tmp_path):
    m = make_model(tiny_cfg(max_position_embeddings=256))
    d = save_drafter_dir(m, tmp_path / "ok")
    read, found = check_drafter_dir(d, TARGET, [2, 3, 4])
    assert read.config == m.config and found == []
    _, found = check_drafter_dir(d, {**TARGET, "vocab_size": 70})
    assert {f.key for f in found} >= {"vocab_size"}
