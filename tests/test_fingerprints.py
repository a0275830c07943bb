"""eagle3/fingerprints.py: each rule's value is the one manifests already store (the values below are what
the rules gave before they moved there, on the same inputs: a change makes every finished stage stale),
and each rule sees a change of what it covers."""
from __future__ import annotations

import pytest

from eagle3 import fingerprints as fp

# computed by the pre-move rules (eagle3/world.py weights_fingerprint, data/capture.py target_fingerprint,
# data/prepare.py input_fingerprint, eval/stage.py drafter_checksum, train's sha256 of model.safetensors)
BEFORE = {"target_weights": "43a3f450adad0013",
          "target_checkpoint": "98ddf1f9f9236d0092444d8f508c4c0e59d6aa6dddfc9d378aa8ad4e1af4190e",
          "input_file": "888fdab87774c8b9f130385b88254a725d20a191672236cd1fa17fd2d5cfd2f5",
          "input_dir": "331ef6e7f0d6bb0c319595bd621dda0ebc3e2def932da0d22c3a617e980b6766",
          "drafter_dir": "a962758a08d9b245317b93663982b4b70a5f94c5abb1c2edb2116b9ae4d56bd6",
          "drafter_weights": "935b42d6115acb8f2e250558b797e34730999d5c20ad1c40b531c509b9b1cc8a"}


def _model(d, value: float = 0.0):
    import torch
    from safetensors.torch import save_file

    d.mkdir(exist_ok=True)
    w = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    w[0, 0] += value
    save_file({"w": w}, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text('{"hidden_size": 64}\n')
    return d


def test_every_rule_gives_the_value_manifests_store(tmp_path):
    d = _model(tmp_path / "model")
    (tmp_path / "input.jsonl").write_text('{"id": "a"}\n')
    got = {"target_weights": fp.target_weights(d), "target_checkpoint": fp.target_checkpoint(d),
           "input_file": fp.input_file(tmp_path / "input.jsonl"), "input_dir": fp.input_file(d),
           "drafter_dir": fp.drafter_dir(d), "drafter_weights": fp.drafter_weights(d)}
    assert got == BEFORE


def test_rules_see_a_changed_weight_and_a_missing_drafter(tmp_path):
    d = _model(tmp_path / "model")
    before = (fp.target_weights(d), fp.target_checkpoint(d), fp.drafter_dir(d), fp.drafter_weights(d))
    _model(d, 1.0)
    after = (fp.target_weights(d), fp.target_checkpoint(d), fp.drafter_dir(d), fp.drafter_weights(d))
    assert all(a != b for a, b in zip(before, after))
    assert fp.drafter_weights(tmp_path / "absent") is None and fp.target_part(tmp_path) == f"unread:{tmp_path.name}"
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        fp.target_weights(tmp_path)


def test_target_weights_samples_a_large_checkpoint(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "m"
    d.mkdir()
    w = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    save_file({"w": w}, str(d / "model.safetensors"))
    whole = fp.target_weights(d)
    monkeypatch.setattr(fp, "FULL_HASH_LIMIT", 10)  # a "large" checkpoint: header + sampled bytes
    sampled = fp.target_weights(d)
    assert sampled != whole
    w[-1] += 1  # the last MiB is sampled
    save_file({"w": w}, str(d / "model.safetensors"))
    assert fp.target_weights(d) != sampled
