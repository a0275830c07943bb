"""Validation of a written export directory from disk, for both formats: a good directory passes, each
deliberate breakage is named; the speculators loader maps names back strictly."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from export import spec
from eagle3.config.dtypes import torch_dtype
from export.directory import export_tensors, validate_format_dir, write_format_dir
from export.formats import FORMATS
from export.format_speculators import load_speculators_dir
from tests.fixtures.export_world import AUX_IDS, HF_INDICES, tiny_drafter

V, CTX = 512, 4096
KW = dict(vocab_size=V, max_position_embeddings=CTX, hf_indices=HF_INDICES,
          dtype="bfloat16", rope=(10000.0, None))


def write_dir(path, fmt, model=None, dtype="bfloat16"):
    model = model or tiny_drafter()
    sg = spec.sglang_config(model.config.to_hf_dict(), vocab_size=V, max_position_embeddings=CTX,
                            hf_indices=HF_INDICES, dtype=dtype)
    cfg = sg if fmt == "sglang" else spec.speculators_config(
        sg, hf_indices=HF_INDICES, verifier_path="/t", verifier_architectures=["X"], speculative_tokens=2)
    write_format_dir(path, cfg, export_tensors(model.export_state_dict(), fmt, torch_dtype(dtype)), fmt)
    return path


def tamper(path, change):
    t = load_file(str(path / "model.safetensors"))
    change(t)
    save_file(t, str(path / "model.safetensors"))


LAYER = {"sglang": "midlayer.", "speculators": "layers.0."}


def _renamed(fmt):
    def change(t):
        t[LAYER[fmt] + "self_attn.qproj.weight"] = t.pop(LAYER[fmt] + "self_attn.q_proj.weight")
    return change, f"missing tensor '{LAYER[fmt]}self_attn.q_proj.weight'"


def _wrong_shape(fmt):
    def change(t):
        t["lm_head.weight"] = t["lm_head.weight"][:-1].contiguous()
    return change, "'lm_head.weight' has shape [39, 64], expected [40, 64]"


def _missing_d2t(fmt):
    return (lambda t: t.pop("d2t")), "missing tensor 'd2t'"


def _bad_t2d(fmt):
    def change(t):
        t2d = t["t2d"].clone()
        t2d[int(t2d.nonzero()[0])] = False
        t2d[int((~t2d).nonzero()[0])] = True
        t["t2d"] = t2d
    return change, "t2d does not mark the target ids that d2t maps to"


def _fp32_weight(fmt):
    def change(t):
        t["norm.weight"] = t["norm.weight"].float()
    return change, "'norm.weight' has dtype float32, expected bfloat16"


def _nan(fmt):
    def change(t):
        t["fc.weight"][0, 0] = float("nan")
    return change, "'fc.weight' has 1 non-finite values"


def _embed(fmt):
    def change(t):
        t["embed_tokens.weight"] = torch.zeros(V, 64, dtype=torch.bfloat16)
    return change, "unexpected tensor 'embed_tokens.weight'"


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("case", [_renamed, _wrong_shape, _missing_d2t, _bad_t2d, _fp32_weight, _nan, _embed])
def test_each_breakage_is_named(tmp_path, fmt, case):
    d = write_dir(tmp_path / fmt, fmt)
    assert validate_format_dir(d, FORMATS[fmt], **KW) == []
    change, needle = case(fmt)
    tamper(d, change)
    problems = validate_format_dir(d, FORMATS[fmt], **KW)
    assert any(needle in p for p in problems), problems
    assert all(p.startswith(f"{fmt}: ") for p in problems)


def test_all_problems_are_listed_together(tmp_path):
    d = write_dir(tmp_path / "s", "sglang")
    tamper(d, lambda t: (t.pop("d2t"), t.__setitem__("norm.weight", t["norm.weight"].float())))
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 131072 // 64
    (d / "config.json").write_text(json.dumps(cfg))
    problems = validate_format_dir(d, FORMATS["sglang"], **KW)
    assert len(problems) == 3, problems


def test_config_faults_and_stray_files(tmp_path):
    d = write_dir(tmp_path / "s", "sglang")
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = HF_INDICES  # right in new SGLang, one off in old
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "pytorch_model.bin").write_bytes(b"old weights")
    problems = "\n".join(validate_format_dir(d, FORMATS["sglang"], **KW))
    assert "mean h = [2, 4, 6] only in SGLang with PR #25454" in problems and "h = [3, 5, 7]" in problems
    assert "pytorch_model.bin: would be loaded as weights too" in problems
    (d / "config.json").write_text("{")
    assert "not valid JSON" in validate_format_dir(d, FORMATS["sglang"], **KW)[0]


def test_truncated_weights_file_is_named(tmp_path):
    d = write_dir(tmp_path / "s", "sglang")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    problems = validate_format_dir(d, FORMATS["sglang"], **KW)
    assert any("model.safetensors" in p and ("unreadable" in p or "corrupt" in p) for p in problems), problems


def test_speculators_ids_must_be_hf_indices(tmp_path):
    d = write_dir(tmp_path / "v", "speculators")
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = AUX_IDS
    del cfg["norm_before_residual"]
    (d / "config.json").write_text(json.dumps(cfg))
    problems = "\n".join(validate_format_dir(d, FORMATS["speculators"], **KW))
    assert "vLLM would capture other states than the trained h = [2, 4, 6]" in problems
    assert "norm_before_residual" in problems


def test_speculators_loader_maps_back_exactly_and_strictly(tmp_path):
    model = tiny_drafter(seed=5)
    d = write_dir(tmp_path / "v", "speculators", model, dtype="float32")
    back = load_speculators_dir(d)
    ref = model.export_state_dict()
    got = back.export_state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert back.config.aux_hf_indices == HF_INDICES and back.config.max_position_embeddings == CTX
    tamper(d, lambda t: t.__setitem__("layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected tensor 'layers.0.extra.weight'"):  # the name in the file
        load_speculators_dir(d)


def test_the_format_table_is_the_config_choice_list():
    """export.format's choices (eagle3/config/choices.py, read by the schema) and the table the stage reads agree:
    a format added to one and not the other fails here."""
    from eagle3.config.choices import EXPORT_FORMATS
    from export.formats import formats_of

    assert tuple(FORMATS) == EXPORT_FORMATS
    assert [f.name for f in formats_of("both")] == list(EXPORT_FORMATS)
    assert formats_of("speculators") == [FORMATS["speculators"]]
    assert FORMATS["sglang"].dir_in(Path("/x")) == Path("/x")
    assert FORMATS["speculators"].dir_in(Path("/x")) == Path("/x/speculators")
    with pytest.raises(ValueError, match="export format 'onnx'"):
        formats_of("onnx")
