"""An image store without fused rows (image_rows="none", what capture.backend=vllm writes: vLLM's connector has no
h = 0): training and evaluating under image_embeddings=fused (or auto, which resolves to fused) are refused before
any work with an error naming the store and the way out; placeholder trains and evaluates on it, and the eval's
real loop keeps to text prompts (the target's prefill of an image prompt reads the fused rows)."""
import json
import shutil

import pytest
import torch

from eagle3.config.conf import compose, to_schema
from eagle3.drafter.drafter_io import save_drafter_dir
from eagle3.drafter.image_embeddings import CONFIG_KEY, rows_problem
from eagle3.formats.manifest import write_manifest
from eagle3.real_loop.check import capture_sequence
from eagle3.replay.evaluate import EvalInputError
from eagle3.config.schema.eval import EvalConfig
from eagle3.config.schema.train import TrainConfig
from eagle3.formats.store import HiddenStateStore, HiddenStateWriter
from eagle3.target_model.target_io import load_target
from eval.report import prompts_from_store
from eval.stage import run_eval
from tests.fixtures.real_loop import AUX_H, new_drafter, prompts
from tests.fixtures.tiny import TINY_TARGET_HIDDEN
from tests.fixtures.train_world import overrides, write_world
from train.inputs import TrainInputError
from train.stage import run_train

PAD = 511  # the tiny vocab's last id: no toy sequence uses it
IMAGE_AT = slice(1, 4)


@pytest.fixture(scope="module")
def blind_world(tmp_path_factory, tiny_k25_target):
    """The train toy world rewritten as an image capture with no fused rows (positions 1..3: the image)."""
    root = tmp_path_factory.mktemp("image_rows_none")
    world = write_world(root, tiny_k25_target, n_train=8, n_val=3)
    for split in ("train", "validation"):
        d = world["capture"] / split
        old = HiddenStateStore(d)
        items = [old[i] for i in range(len(old))]
        shutil.rmtree(d)
        w = HiddenStateWriter(d, hidden_size=old.hidden_size, target_hidden_size=old.target_hidden_size,
                              hf_indices=old.hf_indices, dtype="bfloat16", shard_tokens=200, meta={"split": split},
                              image_token_id=PAD, image_rows="none")
        for it in items:
            ids, mask = it["input_ids"].clone(), it["loss_mask"].clone()
            ids[IMAGE_AT], mask[IMAGE_AT] = PAD, 0
            w.add(it["id"], ids, mask, it["aux"], it["last"], it["target_argmax"])
        w.finish()
    man = json.loads((world["capture"] / "manifest.json").read_text())
    write_manifest(world["capture"], "capture", {"toy": True, "images": True, "backend": "vllm"},
                   target=man["target"], hf_indices=man["hf_indices"])
    return world


def train_config(world, out, **extra):
    return to_schema(compose("train", overrides(world, out, "scratch", **extra)), TrainConfig)


@pytest.mark.parametrize("choice", ["fused", "auto"])
def test_training_fused_on_it_is_refused_before_any_work(blind_world, tmp_path, choice):
    with pytest.raises(TrainInputError) as e:
        run_train(train_config(blind_world, tmp_path / choice, image_embeddings=choice, max_steps=1, val_every=0))
    msg = str(e.value)
    assert "image_rows='none'" in msg and "capture.backend=vllm" in msg and "image_embeddings=placeholder" in msg
    assert ("auto resolves to fused" in msg) == (choice == "auto")
    assert not (tmp_path / choice / "final").exists() and not (tmp_path / choice / "checkpoints").exists()


def test_training_placeholder_on_it_runs_and_records_it(blind_world, tmp_path):
    out = run_train(train_config(blind_world, tmp_path / "ph", image_embeddings="placeholder", max_steps=1,
                                 val_every=0, **{"data.max_tokens_per_batch": 40}))
    assert json.loads((out / "final" / "config.json").read_text())[CONFIG_KEY] == "placeholder"


def test_rows_problem_only_for_fused_on_an_image_store_without_rows(blind_world):
    store = HiddenStateStore(blind_world["capture"] / "train")
    assert rows_problem("placeholder", store) is None and rows_problem("fused", store) is not None
    fake_text = type("S", (), {"image_token_id": None, "has_fused_image_rows": False, "dir": "x"})()
    assert rows_problem("fused", fake_text) is None


@pytest.fixture(scope="module")
def blind_eval_world(tiny_k25_target, tmp_path_factory):
    """A validation store (no fused rows) of an image-prompt sequence and a text one, and a fresh drafter."""
    root = tmp_path_factory.mktemp("eval_rows_none")
    target, _ = load_target(tiny_k25_target, "kimi_k25", dtype="float32")
    w = HiddenStateWriter(root / "capture" / "validation", hidden_size=TINY_TARGET_HIDDEN,
                          target_hidden_size=TINY_TARGET_HIDDEN, hf_indices=AUX_H, dtype="float32", shard_tokens=64,
                          image_token_id=PAD, image_rows="none")
    for n, p in enumerate(prompts(2, L=6, seed=4)):
        if n == 0:
            p = p.clone()
            p[IMAGE_AT] = PAD
        ids = torch.cat([p, prompts(1, L=8, seed=9 + n)[0]])
        aux, argmax = capture_sequence(target, ids, AUX_H, None)  # (stand-in states: the engine's are not HF's here)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[p.numel():] = True
        w.add(f"v{n}", ids, mask, aux, torch.zeros(ids.numel(), TINY_TARGET_HIDDEN), argmax)
    w.finish()
    return root, save_drafter_dir(new_drafter(tiny_k25_target), root / "drafter", dtype="float32")


def eval_config(root, target, drafter_dir, choice):
    return to_schema(compose("eval", [f"paths.root={root}", f"target.path={target}", f"drafter_dir={drafter_dir}",
                                      f"name=rows-none-{choice}", f"capture_dir={root}/capture", "wandb.mode=disabled",
                                      "progress=false", "ttt_length=2", "real_loop.num_prompts=2",
                                      "real_loop.max_new_tokens=6", "knobs=[{num_steps:2,topk:1,num_draft_tokens:3}]",
                                      f"image_embeddings={choice}"]), EvalConfig)


def test_eval_refuses_fused_and_runs_placeholder_with_text_prompts_in_the_real_loop(blind_eval_world,
                                                                                    tiny_k25_target):
    root, drafter_dir = blind_eval_world
    with pytest.raises(EvalInputError, match=r"image_rows='none'.*image_embeddings=placeholder"):
        run_eval(eval_config(root, tiny_k25_target, drafter_dir, "auto"))
    store = HiddenStateStore(root / "capture" / "validation")
    assert [int((p == PAD).sum()) for p in prompts_from_store(store, 2)] == [0]  # the image prompt left out
    report = json.loads((run_eval(eval_config(root, tiny_k25_target, drafter_dir, "placeholder")) / "report.json")
                        .read_text())
    assert report["image_embeddings"] == "placeholder" and report["by_traffic"]["image"]["sequences"] == 1
    assert any("real loop on text prompts only" in w for w in report["warnings"])
    assert report["real_loop"]["knobs"] and all(r["lossless"] for r in report["real_loop"]["knobs"].values())


def test_the_replay_itself_refuses_fused_on_it(blind_eval_world):
    """The study and the A/B call the replay without the eval stage: the refusal lives in evaluate_drafter."""
    from eagle3.drafter.drafter_io import load_drafter_dir
    from eagle3.engines.serve_launch import SpecKnobs
    from eagle3.replay.evaluate import evaluate_drafter

    root, drafter_dir = blind_eval_world
    store = HiddenStateStore(root / "capture" / "validation")
    drafter = load_drafter_dir(drafter_dir, dtype="float32").eval()
    knobs = [SpecKnobs(num_steps=2, topk=1, num_draft_tokens=3)]
    with pytest.raises(EvalInputError, match=r"image_rows='none'.*image_embeddings=placeholder"):
        evaluate_drafter(drafter, store, knobs=knobs, ttt_length=2, ngram=None, progress=False,
                         image_embeddings="fused")
    rep = evaluate_drafter(drafter, store, knobs=knobs, ttt_length=2, ngram=None, progress=False,
                           image_embeddings="placeholder")
    assert rep["image_embeddings"] == "placeholder" and rep["by_traffic"]["image"]["sequences"] == 1
