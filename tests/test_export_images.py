"""The export records the image_embeddings convention the drafter was trained with (export/image_convention.py):
in SGLang's config.json as `eagle3_image_embeddings` (a key the export's strict validation allows and no engine
reads), in SERVE.md with a warning for the engine that feeds the other rows, and in the manifest."""
import json
import shutil

import pytest

from eagle3.drafter import drafter_keys
from eagle3.config.conf import compose, to_schema
from eagle3.drafter.image_embeddings import CONFIG_KEY
from eagle3.formats.manifest import write_manifest
from eagle3.config.schema.export import ExportConfig
from export.stage import ExportError, run_export
from tests.fixtures.export_world import build_world

NO_EXPORTS = shutil.ignore_patterns("export-*", ".export-*")


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_k25_target):
    return build_world(tmp_path_factory.mktemp("export_images_world"), tiny_k25_target)


def copy_world(world, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(world["root"], root, symlinks=True, ignore=NO_EXPORTS)
    ckpt = root / world["checkpoint"].relative_to(world["root"])
    return {**world, "root": root, "checkpoint": ckpt, "capture": root / world["capture"].relative_to(world["root"])}


def export(w):
    return run_export(to_schema(compose("export", [f"paths.root={w['root']}", f"target.path={w['target']}",
                                                   "verify_sequences=1"]), ExportConfig))


def set_config_key(ckpt, value):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[CONFIG_KEY] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_a_drafter_without_a_record_exports_without_the_key(world, tmp_path):
    out = export(copy_world(world, tmp_path))
    assert CONFIG_KEY not in json.loads((out / "config.json").read_text())
    text = (out / "SERVE.md").read_text()
    assert "## Image traffic" in text and "not recorded" in text
    assert json.loads((out / "manifest.json").read_text())["image_embeddings"] is None


def test_the_checkpoints_record_is_carried_and_the_other_engine_warned(world, tmp_path):
    w = copy_world(world, tmp_path)
    set_config_key(w["checkpoint"], "fused")
    out = export(w)  # the strict validation of the written directory passes with the key
    sg = json.loads((out / "config.json").read_text())
    assert sg[CONFIG_KEY] == "fused"
    assert drafter_keys.check_config(sg, "sglang").unknown == []  # a known key, read by no engine
    spec = json.loads((out / "speculators" / "config.json").read_text())
    assert spec[CONFIG_KEY] == "fused"  # speculators' pydantic config keeps extra keys (eagle3/drafter/drafter_keys.py)
    assert drafter_keys.check_config(spec, "speculators").unknown == []
    text = (out / "SERVE.md").read_text()
    assert "trained with image_embeddings=**fused**" in text
    assert "warning**: trained with image_embeddings=fused but vllm feeds placeholder" in text
    assert "sglang feeds fused but" not in text
    assert json.loads((out / "manifest.json").read_text())["image_embeddings"] == "fused"


@pytest.mark.parametrize("choice,want,warned", [("auto", "fused", "vllm"), ("placeholder", "placeholder", "sglang")])
def test_the_train_manifest_names_it_when_the_config_does_not(world, tmp_path, choice, want, warned):
    w = copy_world(world, tmp_path)
    write_manifest(w["checkpoint"].parent, "train", {"image_embeddings": choice}, inputs={"capture": w["capture"]})
    out = export(w)
    assert json.loads((out / "config.json").read_text())[CONFIG_KEY] == want
    text = (out / "SERVE.md").read_text()
    assert f"image_embeddings={choice}" in text and f"but {warned} feeds" in text


def test_a_bad_record_stops_the_export_naming_the_file(world, tmp_path):
    w = copy_world(world, tmp_path)
    set_config_key(w["checkpoint"], "clamped")
    with pytest.raises(ExportError, match="config.json eagle3_image_embeddings: image_embeddings='clamped'"):
        export(w)
