"""eagle3/formats/manifest.py: the one JSON reader and the stage skeleton's reuse check (stale_keys)."""
from __future__ import annotations

import json

import pytest

from eagle3.formats.manifest import ManifestError, read_json, stale_keys, write_manifest


def test_read_json_names_the_file_and_the_cause(tmp_path):
    with pytest.raises(ManifestError, match="nothing here"):
        read_json(tmp_path / "a.json", missing="nothing here")
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"a\.json: bad \(Expecting"):
        read_json(tmp_path / "a.json", ValueError, unreadable="bad ({e})")
    (tmp_path / "a.json").write_text("[1, 2]")
    with pytest.raises(ManifestError, match="a JSON object expected, found list"):
        read_json(tmp_path / "a.json")
    (tmp_path / "a.json").write_text('{"k": 1}')
    assert read_json(tmp_path / "a.json") == {"k": 1}


def test_stale_keys_lists_what_differs(tmp_path):
    assert stale_keys(tmp_path, "vocab", {"config": {}}) == ["no finished manifest"]
    config = {"lr": 0.1, "sizes": (1, 2), "name": "a"}
    write_manifest(tmp_path, "vocab", config, fingerprints={"prepare": "f1"}, world_size=1)
    # the same values as the manifest records them (a tuple is a JSON list): nothing stale
    assert stale_keys(tmp_path, "vocab", {"config": config, "fingerprints": {"prepare": "f1"}, "world_size": 1}) == []
    assert stale_keys(tmp_path, "vocab", {"config": {**config, "lr": 0.2}, "fingerprints": {"prepare": "f2"},
                                          "world_size": 2}) == ["config.lr", "fingerprints.prepare", "world_size"]
    assert stale_keys(tmp_path, "capture", {"config": config}) == ["no finished manifest"]  # another stage's
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": "vocab"})[:-1])  # corrupt
    assert stale_keys(tmp_path, "vocab", {"config": config}) == ["no finished manifest"]
