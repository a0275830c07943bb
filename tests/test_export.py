"""The export stage end to end on a tiny world: both formats written, validated from disk, the serve
commands, the logit round trip (independent of the export's own check), atomicity and reuse."""
import json
import shutil

import pytest
import torch

from eagle3.config.conf import compose, to_schema
from eagle3.drafter.drafter_io import load_drafter_dir
from eagle3.config.schema.export import ExportConfig
from eagle3.formats.store import HiddenStateStore
from eagle3.target_model.target_io import load_embed_tokens
from export.stage import ExportError, run_export
from export.format_speculators import load_speculators_dir
from export.roundtrip import drafter_logits, round_weights_, validation_batches
from tests.fixtures.export_world import build_world, tiny_drafter


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_k25_target):
    return build_world(tmp_path_factory.mktemp("export_world"), tiny_k25_target)


def export_config(world, *overrides):
    cfg = compose("export", [f"paths.root={world['root']}", f"target.path={world['target']}", *overrides])
    return to_schema(cfg, ExportConfig)


@pytest.fixture(scope="module")
def exported(world):
    """The default export (both formats, bf16), run once for the module."""
    return run_export(export_config(world))


def test_both_formats_written_with_the_right_config(exported, world):
    sg = json.loads((exported / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sg["max_position_embeddings"] == 4096            # the target's context, not the 128 it shipped with
    assert sg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    assert sg["vocab_size"] == 512 and sg["draft_vocab_size"] == 40 and sg["torch_dtype"] == "bfloat16"
    sp = json.loads((exported / "speculators" / "config.json").read_text())
    assert sp["architectures"] == ["Eagle3Speculator"]
    assert sp["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]   # the same states in vLLM's indexing
    assert sp["speculators_config"]["verifier"]["name_or_path"] == str(world["target"])
    assert sp["transformer_layer_config"]["max_position_embeddings"] == 4096
    from safetensors import safe_open
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert "embed_tokens.weight" not in names and "midlayer.self_attn.q_proj.weight" in names
    with safe_open(str(exported / "speculators" / "model.safetensors"), framework="pt") as f:
        assert {n.replace("layers.0.", "midlayer.") for n in f.keys()} == names
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["stage"] == "export" and manifest["formats"] == ["sglang", "speculators"]


def test_serve_md_has_the_commands_and_the_evidence(exported, world):
    text = (exported / "SERVE.md").read_text()
    assert "python -m sglang.launch_server" in text and "--speculative-algorithm EAGLE3" in text
    assert f"--speculative-draft-model-path {exported}" in text
    assert "--speculative-num-steps 2" in text and "--speculative-eagle-topk 1" in text
    assert "--speculative-num-draft-tokens 3" in text
    assert "vllm serve" in text and str(exported / "speculators") in text
    assert "no eval report" in text  # the knobs' source is stated when eval has not run


def _reference_logits(world, batches, dtype):
    embed = load_embed_tokens(world["target"], "kimi_k25").float()
    ref = load_drafter_dir(world["checkpoint"], embed_tokens=embed, dtype=torch.float32)
    if dtype is not None:
        round_weights_(ref, dtype)
    return drafter_logits(ref, batches), embed


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_round_trip_bf16_matches_the_checkpoint(exported, world, fmt):
    batches = validation_batches(HiddenStateStore(world["store"]), 3, 64)
    assert batches
    ref_rounded, embed = _reference_logits(world, batches, torch.bfloat16)
    ref_full, _ = _reference_logits(world, batches, None)
    d = exported if fmt == "sglang" else exported / "speculators"
    model = (load_drafter_dir(d, embed_tokens=embed, dtype=torch.float32) if fmt == "sglang"
             else load_speculators_dir(d, embed_tokens=embed).float())
    got = drafter_logits(model, batches)
    for g, r, f in zip(got, ref_rounded, ref_full):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5)           # exactly the bf16-rounded checkpoint
        assert (g - f).abs().max() <= 0.05 * f.abs().max()             # and bf16-close to the original


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_round_trip_fp32_export_is_exact(world, tmp_path, fmt):
    out = run_export(export_config(world, f"out_dir={tmp_path / 'fp32'}", "dtype=float32", f"format={fmt}"))
    batches = validation_batches(HiddenStateStore(world["store"]), 3, 64)
    ref, embed = _reference_logits(world, batches, None)
    d = out if fmt == "sglang" else out / "speculators"
    model = (load_drafter_dir(d, embed_tokens=embed, dtype=torch.float32) if fmt == "sglang"
             else load_speculators_dir(d, embed_tokens=embed))
    for g, r in zip(drafter_logits(model, batches), ref):
        assert torch.equal(g, r)
    assert (out / "speculators").exists() == (fmt == "speculators")
    assert (out / "model.safetensors").exists() == (fmt == "sglang")


def test_rerun_reuses_and_a_changed_config_redoes(world, tmp_path):
    cfg = export_config(world, f"out_dir={tmp_path / 'e'}", "format=sglang")
    out = run_export(cfg)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert run_export(cfg) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    run_export(export_config(world, f"out_dir={tmp_path / 'e'}", "format=sglang", "dtype=float32"))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert not list(tmp_path.glob(".e.*"))  # no temp or backup directories left behind


def test_eval_report_knobs_go_into_serve_md(world, tmp_path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "report.json").write_text(json.dumps({"best": {
        "num_steps": 3, "topk": 1, "num_draft_tokens": 4, "accept_length": 2.71, "speedup": 1.42}}))
    out = run_export(export_config(world, f"out_dir={tmp_path / 'e'}", f"eval_dir={eval_dir}"))
    text = (out / "SERVE.md").read_text()
    assert "--speculative-num-steps 3" in text and "--speculative-num-draft-tokens 4" in text
    assert "2.71" in text and "1.42" in text and "predicted to beat no speculation" in text
    sp = json.loads((out / "speculators" / "config.json").read_text())
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3


NO_EXPORTS = shutil.ignore_patterns("export-*", ".export-*")  # copies of the world start without exports


def _broken_checkpoint(world, tmp_path, change):
    """A copy of the world whose checkpoint was re-saved with `change(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    root = tmp_path / "root"
    shutil.copytree(world["root"], root, symlinks=True, ignore=NO_EXPORTS)
    ckpt = root / world["checkpoint"].relative_to(world["root"])
    tensors = load_file(str(ckpt / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))
    return {**world, "root": root, "checkpoint": ckpt}


def _rename(t):
    t["midlayer.self_attn.qproj.weight"] = t.pop("midlayer.self_attn.q_proj.weight")


def _reshape(t):
    t["fc.weight"] = t["fc.weight"][:, :96].contiguous()


def _drop_d2t(t):
    del t["d2t"]


def _bad_t2d(t):
    t2d = t["t2d"].clone()
    first = int(t2d.nonzero()[0])
    t2d[first] = False
    t2d[int((~t2d).nonzero()[-1])] = True
    t["t2d"] = t2d


@pytest.mark.parametrize("change,needle", [
    (_rename, "midlayer.self_attn.q_proj.weight"),
    (_reshape, "fc.weight"),
    (_drop_d2t, "d2t"),
    (_bad_t2d, "t2d"),
], ids=["renamed_weight", "wrong_shape", "missing_d2t", "inconsistent_t2d"])
def test_broken_checkpoint_stops_the_export_naming_the_problem(world, tmp_path, change, needle):
    broken = _broken_checkpoint(world, tmp_path, change)
    cfg = export_config(broken)
    with pytest.raises(ExportError, match=needle.replace(".", r"\.")):
        run_export(cfg)
    assert not (tmp_path / "root" / "stages" / "k25_mini" / "export-aqmedai_k2").exists()
    assert not list((tmp_path / "root" / "stages" / "k25_mini").glob(".export-*"))


def test_capture_with_other_layer_ids_is_refused(world, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(world["root"], root, symlinks=True, ignore=NO_EXPORTS)
    ckpt = root / world["checkpoint"].relative_to(world["root"])
    cfg = json.loads((ckpt / "config.json").read_text())
    # the capture holds h = [2, 4, 6]; ids [3, 4, 6] mean h = [3, 4, 6] in current SGLang (first id not 1)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 4, 6]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"mean h = \[3, 4, 6\].*holds h = \[2, 4, 6\].*not trained on this capture"):
        run_export(export_config({**world, "root": root}))


def test_failure_after_writing_keeps_the_previous_export(world, tmp_path, monkeypatch):
    out = run_export(export_config(world, f"out_dir={tmp_path / 'e'}", "format=sglang"))
    before = (out / "model.safetensors").read_bytes()
    import export.directory as directory_mod

    monkeypatch.setattr(directory_mod, "validate_format_dir", lambda *a, **k: ["sglang: injected failure"])
    with pytest.raises(ExportError, match="injected failure"):
        run_export(export_config(world, f"out_dir={tmp_path / 'e'}", "format=sglang", "dtype=float32"))
    assert (out / "model.safetensors").read_bytes() == before
    assert not list(tmp_path.glob(".e.*"))


def test_tiny_drafter_helper_is_deterministic():
    a, b = tiny_drafter(seed=3), tiny_drafter(seed=3)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_train_manifest_naming_another_capture_is_refused(world, tmp_path):
    from eagle3.formats.manifest import write_manifest

    root = tmp_path / "root"
    shutil.copytree(world["root"], root, symlinks=True, ignore=NO_EXPORTS)
    other = tmp_path / "other_capture"
    other.mkdir()
    write_manifest(other, "capture", {"note": "another capture"})
    train_dir = root / world["checkpoint"].relative_to(world["root"]).parent
    write_manifest(train_dir, "train", {}, inputs={"capture": other})
    with pytest.raises(ExportError, match="trained on capture .*other_capture"):
        run_export(export_config({**world, "root": root}))
    # the same capture, changed since training: refused too
    capture = root / "stages" / "k25_mini" / "capture"
    write_manifest(train_dir, "train", {}, inputs={"capture": capture})
    write_manifest(capture, "capture", {"note": "re-captured"})
    with pytest.raises(ExportError, match="changed since the checkpoint was trained"):
        run_export(export_config({**world, "root": root}))


def test_truncated_checkpoint_weights_are_named(world, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(world["root"], root, symlinks=True, ignore=NO_EXPORTS)
    weights = root / world["checkpoint"].relative_to(world["root"]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ExportError, match=r"final/model.safetensors: unreadable .*truncated or corrupt"):
        run_export(export_config({**world, "root": root}))


def test_bit_flipped_step_checkpoint_is_refused_by_its_checksums(world, tmp_path):
    """Exporting a training checkpoint (step-N, with checkpoint.json) verifies its sha256s first."""
    from eagle3.formats.manifest import atomic_write_json, sha256_file

    step = tmp_path / "step-000010"
    shutil.copytree(world["checkpoint"], step)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in step.iterdir()}
    atomic_write_json(step / "checkpoint.json", {"step": 10, "files": files})
    cfg = export_config(world, f"checkpoint_dir={step}", f"out_dir={tmp_path / 'e'}", "format=sglang")
    assert run_export(cfg).is_dir()
    data = bytearray((step / "model.safetensors").read_bytes())
    data[-11] ^= 0x01  # one bit in the last tensor's data: loads fine, would serve a different drafter
    (step / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"model.safetensors: does not match its sha256"):
        run_export(cfg)


def test_speculators_embed_option_ships_the_targets_embedding(world, tmp_path):
    """export.speculators_embed=true: speculators/ also holds embed_tokens.weight, the target's rounded to the
    export dtype, accepted by the validator and the round trip; SERVE.md says why; a rerun reuses it."""
    from safetensors import safe_open

    cfg = export_config(world, f"out_dir={tmp_path / 'e'}", "format=speculators", "speculators_embed=true")
    out = run_export(cfg)
    target = load_embed_tokens(world["target"], "kimi_k25")
    with safe_open(str(out / "speculators" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), target.to(torch.bfloat16))
    text = (out / "SERVE.md").read_text()
    assert "also holds the target's `embed_tokens.weight`" in text and "speculators' own Python API" in text
    stamp = (out / "speculators" / "model.safetensors").stat().st_mtime_ns
    assert run_export(cfg) == out and (out / "speculators" / "model.safetensors").stat().st_mtime_ns == stamp
    plain = run_export(export_config(world, f"out_dir={tmp_path / 'p'}", "format=speculators"))
    assert "export with `speculators_embed=true`" in (plain / "SERVE.md").read_text()
