"""eagle3/stage_dir.py, the stage skeleton: a stage directory written before the scaffold is reused after it,
the reuse decision takes the stage's own rule and its inputs' fingerprints, a publish replaces members at once,
and an interrupted whole-directory swap is put back."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from eagle3.formats.manifest import ManifestError, read_manifest, write_manifest
from eagle3.stage_dir import StageDir

# a prepare split and the vocab stage directory the pre-scaffold code (commit 586bec6) wrote on it, with relative
# paths so the copy reads as written (tests/fixtures/stage_dirs_586bec6; the prepare dir is the CI demo's)
BEFORE = Path(__file__).parent / "fixtures" / "stage_dirs_586bec6"
VOCAB_OVERRIDES = ["paths.root=.", "in_dir=prepare", "out_dir=vocab", "target.path=no-target",
                   "target.tokenizer=no-target", "target_vocab_size=512", "draft_vocab_size=16"]


def test_a_vocab_dir_written_before_the_scaffold_is_reused(tmp_path, monkeypatch, capsys):
    from data.vocab import run_vocab
    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.vocab import VocabConfig

    shutil.copytree(BEFORE, tmp_path / "w")
    monkeypatch.chdir(tmp_path / "w")
    written = Path("vocab/manifest.json").read_text()
    cfg = to_schema(compose("vocab", VOCAB_OVERRIDES), VocabConfig)
    run_vocab(cfg)
    assert "reusing it" in capsys.readouterr().out
    assert Path("vocab/manifest.json").read_text() == written  # not redone
    run_vocab(to_schema(compose("vocab", VOCAB_OVERRIDES[:-1] + ["draft_vocab_size=8"]), VocabConfig))
    assert read_manifest(Path("vocab"), "vocab")["counts"]["draft_vocab_size"] == 8  # a changed config is redone


def _finished(out: Path, stage: str = "s", **fields) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, stage, {"lr": 1}, **fields)


def test_reuse_needs_the_record_the_files_the_inputs_and_the_stage_rule(tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    _finished(inp, "prev")
    _finished(out, inputs={"prev": inp}, counts={"failed": 0})
    (out / "data").mkdir()
    stage = StageDir(out, "s")
    from eagle3.fingerprints import stage_dir

    recorded = {"prev": stage_dir(inp)}
    assert stage.reused({"config": {"lr": 1}}, needs=["data"], inputs=recorded) is not None
    assert stage.reused({"config": {"lr": 2}}) is None                         # another config
    assert stage.reused({"config": {"lr": 1}}, needs=["missing"]) is None      # incomplete
    assert stage.reused({"config": {"lr": 1}}, inputs={"prev": "other"}) is None  # an input changed
    assert stage.reused({"config": {"lr": 1}}, rule=lambda m: m["counts"]["failed"] == 1) is None  # the stage's rule
    assert StageDir(tmp_path / "none", "s").reused({"config": {"lr": 1}}) is None


def test_input_raises_the_stage_error(tmp_path):
    class MyError(ManifestError):
        pass

    with pytest.raises(MyError, match="run the prev stage first"):
        StageDir(tmp_path / "out", "s", MyError).input(tmp_path / "absent", "prev")


def test_publish_swaps_members_and_writes_the_manifest_last(tmp_path):
    out = tmp_path / "out"
    _finished(out)
    (out / "keep").mkdir()  # not a member (prepare's regenerated/ cache): left alone
    (out / "final").mkdir()
    (out / "final" / "old").write_text("old")
    stage = StageDir(out, "s")
    with stage.staging() as tmp:
        (tmp / "final").mkdir()
        (tmp / "final" / "new").write_text("new")
        stage.publish({"lr": 3}, staged=tmp, members=["final"], counts={"n": 1})
    assert sorted(p.name for p in out.iterdir()) == ["final", "keep", "manifest.json"]  # no staging, no .old left
    assert [p.name for p in (out / "final").iterdir()] == ["new"]
    assert read_manifest(out, "s")["config"] == {"lr": 3}


def test_a_failed_work_leaves_no_staging_and_the_old_result(tmp_path):
    out = tmp_path / "out"
    _finished(out)
    stage = StageDir(out, "s")
    with pytest.raises(RuntimeError):
        with stage.staging() as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("work failed")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def test_an_interrupted_whole_swap_is_put_back(tmp_path, monkeypatch):
    import eagle3.stage_dir as mod

    out = tmp_path / "export"
    stage = StageDir(out, "export", whole=True)
    with stage.staging() as tmp:
        (tmp / "a").write_text("first")
        stage.publish_whole({"v": 1}, tmp)
    real = os.replace

    def dies_moving_the_new_one_in(src, dst):
        if Path(dst) == out:
            raise KeyboardInterrupt("killed between the renames")
        return real(src, dst)

    monkeypatch.setattr(mod.os, "replace", dies_moving_the_new_one_in)
    with pytest.raises(KeyboardInterrupt):
        with stage.staging() as tmp:
            (tmp / "a").write_text("second")
            stage.publish_whole({"v": 2}, tmp)
    monkeypatch.setattr(mod.os, "replace", real)
    assert not out.exists() and list(tmp_path.glob(".export.old-*"))
    StageDir(out, "export", whole=True)  # what the next run does first
    assert (out / "a").read_text() == "first" and json.loads((out / "manifest.json").read_text())["config"] == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_setting_added_since_the_manifest_was_written_is_no_difference_at_its_default(tmp_path):
    """An upgrade that adds a knob (here capture's stream.cache_first_pass_gb) reuses the stage directories
    written before it while the knob holds its declared default; set to anything else, the run is redone."""
    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.capture import CaptureConfig
    from eagle3.formats.manifest import stale_keys

    cfg = to_schema(compose("capture", [f"paths.root={tmp_path}", "target=k25_mini"]), CaptureConfig)
    out = tmp_path / "cap"
    out.mkdir()
    write_manifest(out, "capture", cfg, fingerprints={"target": "t"})
    m = read_manifest(out)
    del m["config"]["stream"]["cache_first_pass_gb"]  # as a manifest written before the knob existed
    del m["config"]["overwrite"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert stale_keys(out, "capture", {"config": cfg, "fingerprints": {"target": "t"}}) == []
    cfg.stream.cache_first_pass_gb = 1.0
    assert stale_keys(out, "capture", {"config": cfg}) == ["config.stream"]
    cfg.stream.cache_first_pass_gb = 0.0
    m["config"]["removed_knob"] = 1  # a setting the code no longer has: not the same run
    (out / "manifest.json").write_text(json.dumps(m))
    assert stale_keys(out, "capture", {"config": cfg}) == ["config.removed_knob"]
