"""Bad input to the train stage: each case is a clear error naming the problem, before any
work, or (non-finite loss) a stop naming the step and sequences without a corrupt checkpoint."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import eagle3.ttt.unroll_common
from eagle3.formats.store import HiddenStateWriter
from tests.fixtures.train_world import config_for, world  # noqa: F401  (fixture)
from train.inputs import TrainInputError
from train.stage import run_train
from train.trainer import NonFiniteLossError


def copy_world(world, tmp_path) -> dict:
    new = dict(world)
    for key in ("capture", "vocab"):
        dst = tmp_path / "w" / key
        shutil.copytree(world[key], dst)
        new[key] = dst
    return new


def test_vocab_for_another_target_is_refused(world, tmp_path):
    w = copy_world(world, tmp_path)
    path = w["vocab"] / "vocab.safetensors"
    t = load_file(str(path))
    t["t2d"] = torch.cat([t["t2d"], torch.zeros(8, dtype=torch.bool)])
    save_file(t, str(path))
    with pytest.raises(TrainInputError, match="t2d covers 520 ids but the captured target's vocab is 512"):
        run_train(config_for(w, tmp_path / "o", "scratch"))


def test_empty_split_is_refused(world, tmp_path):
    w = copy_world(world, tmp_path)
    shutil.rmtree(w["capture"] / "train")
    HiddenStateWriter(w["capture"] / "train", hidden_size=64, target_hidden_size=64, hf_indices=world["hf_indices"]).finish()
    with pytest.raises(TrainInputError, match="holds no sequences"):
        run_train(config_for(w, tmp_path / "o", "scratch"))


def test_states_captured_from_another_target_are_refused(world, tmp_path):
    w = copy_world(world, tmp_path)
    m = json.loads((w["capture"] / "manifest.json").read_text())
    m["target"]["config_sha256"] = "0" * 64
    (w["capture"] / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrainInputError, match="captured from .* differs from the configured target"):
        run_train(config_for(w, tmp_path / "o", "scratch"))


def test_init_drafter_reading_other_layers_is_refused(world, tmp_path):
    w = copy_world(world, tmp_path)
    old = tmp_path / "old"
    shutil.copytree(world["old_drafter"], old)
    cfg = json.loads((old / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
    (old / "config.json").write_text(json.dumps(cfg))
    w["old_drafter"] = old
    with pytest.raises(TrainInputError, match=r"drafter reads hidden states h = \[0, 2, 5\]"):
        run_train(config_for(w, tmp_path / "o", "aqmedai_k2"))


def test_missing_vocab_stage_names_the_file(world, tmp_path):
    w = copy_world(world, tmp_path)
    (w["vocab"] / "vocab.safetensors").unlink()
    with pytest.raises(TrainInputError, match="vocab.safetensors: missing; run the vocab stage"):
        run_train(config_for(w, tmp_path / "o", "scratch"))


class NaNTeacherAt:
    """Wraps eagle3.ttt.unroll_common.teacher_logits (both unrolls' teacher): call number `n` (1-based) returns NaN."""

    def __init__(self, n):
        self.n, self.calls, self.real = n, 0, eagle3.ttt.unroll_common.teacher_logits

    def __call__(self, last, rows):
        self.calls += 1
        out = self.real(last, rows)
        return out * float("nan") if self.calls == self.n else out


def test_nonfinite_loss_stops_naming_step_and_sequences(world, tmp_path, monkeypatch):
    monkeypatch.setattr(eagle3.ttt.unroll_common, "teacher_logits", NaNTeacherAt(7))
    out = tmp_path / "nan"
    # no validation: every teacher call is one training micro-batch, so call 7 is step 7
    cfg = config_for(world, out, "scratch", max_steps=10, epochs="null", **{"data.val_split": ""})
    with pytest.raises(NonFiniteLossError, match=r"step 7, micro-batch 0 \(sequences \['train-\d+'"):
        run_train(cfg)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004"]
    assert not (out / "final").exists() and not (out / "manifest.json").exists()
    ckpt = load_file(str(out / "checkpoints" / "step-000004" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in ckpt.values() if v.is_floating_point())


def test_nonfinite_loss_can_be_skipped_and_counted(world, tmp_path, monkeypatch):
    monkeypatch.setattr(eagle3.ttt.unroll_common, "teacher_logits", NaNTeacherAt(3))
    out = tmp_path / "skip"
    cfg = config_for(world, out, "scratch", max_steps=6, epochs="null", on_nonfinite="skip",
                     **{"data.val_split": ""})
    run_train(cfg)
    m = json.loads((out / "manifest.json").read_text())
    assert m["steps"] == 6 and m["nonfinite_skips"] == 1
    final = load_file(str(out / "final" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())


def test_token_ids_outside_the_vocab_are_named(world, tmp_path):
    from eagle3.formats.store import HiddenStateStore

    w = copy_world(world, tmp_path)
    src = HiddenStateStore(world["capture"] / "train")
    shutil.rmtree(w["capture"] / "train")
    dst = HiddenStateWriter(w["capture"] / "train", hidden_size=64, target_hidden_size=64,
                            hf_indices=world["hf_indices"])
    for i in range(len(src)):
        s = src[i]
        ids = s["input_ids"].clone()
        if i == 0:
            ids[3] = 700                      # a token of a bigger tokenizer
        dst.add(s["id"], ids, s["loss_mask"], s["aux"], s["last"], s["target_argmax"])
    dst.finish()
    with pytest.raises(TrainInputError, match=r"input_ids of sequences .*'train-0'.* holds id 700, outside the target vocab of 512"):
        run_train(config_for(w, tmp_path / "o", "scratch", max_steps=12, epochs="null", **{"data.val_split": ""}))
