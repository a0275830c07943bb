"""The real loop and the eval stage with image prompts (issue 34): the target's prefill reads the fused rows
(its multimodal forward), the drafter's prefill reads what the image_embeddings convention feeds
(eagle3/drafter/image_embeddings.py: fused rows or embed(<|media_pad|>)), shifted by one like the ids; the loop stays
lossless; the eval stage resolves `image_embeddings: auto` to SGLang's convention and passes it on."""
import json

import pytest
import torch

from eagle3.engines.serve_launch import SpecKnobs
from eagle3.config.conf import compose, to_schema
from eagle3.drafter.drafter_io import save_drafter_dir
from eagle3.real_loop.chain import PromptImages, greedy_decode, speculative_decode
from eagle3.real_loop.check import capture_sequence
from eagle3.real_loop.tree import tree_speculative_decode
from eagle3.config.schema.eval import EvalConfig
from eagle3.formats.store import HiddenStateWriter
from eagle3.target_model.target_io import load_target, text_model
from eval.report import prompt_images_from_store
from eval.stage import run_eval
from tests.fixtures.real_loop import AUX_H, new_drafter, prompts
from tests.fixtures.tiny import TINY_TARGET_HIDDEN

PAD = 511         # this tiny world's image row id (prompts draw ids below 500)
IMAGE_AT = slice(1, 4)


def image_prompt(seed=0, L=6):
    p = prompts(1, L=L, seed=seed)[0].clone()
    p[IMAGE_AT] = PAD
    rows = torch.randn(IMAGE_AT.stop - IMAGE_AT.start, TINY_TARGET_HIDDEN, generator=torch.Generator().manual_seed(seed))
    return p, rows * 2


@pytest.fixture(scope="module")
def target(tiny_k25_target):
    model, _ = load_target(tiny_k25_target, "kimi_k25", dtype="float32")
    return model


def first_call_input(module, fn):
    """The first positional input of `module`'s first call while fn() runs."""
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).detach().clone()), with_kwargs=True)
    try:
        out = fn()
    finally:
        handle.remove()
    return seen[0], out


def test_the_target_prefill_reads_the_fused_rows(target):
    p, rows = image_prompt()
    layer0 = text_model(target).layers[0]
    x, base = first_call_input(layer0, lambda: greedy_decode(target, p, 6, images=PromptImages(PAD, rows, "fused")))
    torch.testing.assert_close(x[0, IMAGE_AT], rows)
    table = text_model(target).embed_tokens.weight
    text = [i for i in range(p.numel()) if p[i] != PAD]
    torch.testing.assert_close(x[0, text], table[p[text]])
    # the drafter's convention does not change what the target reads
    again = greedy_decode(target, p, 6, images=PromptImages(PAD, rows, "placeholder"))
    assert again.tokens == base.tokens


@pytest.mark.parametrize("knobs", [SpecKnobs(2, 1, 3), SpecKnobs(2, 2, 4)])
def test_the_drafter_prefill_follows_the_convention_and_the_loop_stays_lossless(target, tiny_k25_target, knobs):
    p, rows = image_prompt(seed=1)
    d = new_drafter(tiny_k25_target).eval()
    table = d.embed_tokens.weight
    shifted = [t - 1 for t in range(IMAGE_AT.start, IMAGE_AT.stop)]  # row t of the prefill embeds token t+1
    text = [t for t in range(p.numel() - 1) if p[t + 1] != PAD]
    got = {}
    for conv in ("fused", "placeholder"):
        img = PromptImages(PAD, rows, conv)
        base = greedy_decode(target, p, 10, images=img)

        def run():
            if knobs.topk == 1:
                return speculative_decode(target, d, p, 10, knobs.num_steps, knobs.num_draft_tokens, images=img)
            return tree_speculative_decode(target, d, p, 10, knobs, images=img)
        x, spec = first_call_input(d.midlayer, run)
        assert spec.tokens == base.tokens
        assert x.shape[1] == p.numel()  # the prefill: pairs of the prompt + the first generated token
        torch.testing.assert_close(x[0, text], table[p[1:][text]])
        got[conv] = x[0, shifted]
    torch.testing.assert_close(got["fused"], rows)
    torch.testing.assert_close(got["placeholder"], table[PAD].expand(len(shifted), -1))


def test_prompt_images_must_match_the_image_positions(target):
    p, rows = image_prompt()
    with pytest.raises(ValueError, match="3 image rows need 3 fused embeddings"):
        greedy_decode(target, p, 4, images=PromptImages(PAD, rows[:2], "fused"))
    with pytest.raises(ValueError, match="expected one of"):
        PromptImages(PAD, rows, "clamped")


@pytest.fixture(scope="module")
def image_world(tiny_k25_target, target, tmp_path_factory):
    """A validation store of two sequences, one with an image in its prompt, captured with fused rows."""
    root = tmp_path_factory.mktemp("eval_image_world")
    w = HiddenStateWriter(root / "capture" / "validation", hidden_size=TINY_TARGET_HIDDEN,
                          target_hidden_size=TINY_TARGET_HIDDEN, hf_indices=AUX_H, dtype="float32", shard_tokens=64,
                          image_token_id=PAD)
    p_img, rows = image_prompt(seed=2)
    for n, (p, r) in enumerate(((p_img, rows), (prompts(1, L=5, seed=3)[0], None))):
        img = None if r is None else PromptImages(PAD, r, "fused")
        gen = torch.tensor(greedy_decode(target, p, 12, images=img).tokens)
        assert not (gen == PAD).any()
        ids = torch.cat([p, gen])
        aux, argmax = capture_sequence(target, ids, AUX_H, img)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[p.numel():] = True
        w.add(f"v{n}", ids, mask, aux, torch.zeros(ids.numel(), TINY_TARGET_HIDDEN), argmax, image_embeds=r)
    w.finish()
    return root, save_drafter_dir(new_drafter(tiny_k25_target), root / "drafter", dtype="float32"), rows


def test_eval_stage_resolves_auto_and_runs_the_real_loop_on_image_prompts(image_world, tiny_k25_target, capsys):
    root, drafter_dir, rows = image_world
    from eagle3.formats.store import HiddenStateStore

    store = HiddenStateStore(root / "capture" / "validation")
    imgs = prompt_images_from_store(store, 2, "fused")
    assert imgs[1] is None and imgs[0].convention == "fused"
    torch.testing.assert_close(imgs[0].rows, rows)
    reports = {}
    for choice in ("auto", "placeholder"):
        cfg = to_schema(compose("eval", [f"paths.root={root}", f"target.path={tiny_k25_target}",
                                         f"drafter_dir={drafter_dir}", f"name=img-{choice}",
                                         f"capture_dir={root}/capture", "wandb.mode=disabled", "progress=false",
                                         "ttt_length=2", "real_loop.num_prompts=2", "real_loop.max_new_tokens=8",
                                         "knobs=[{num_steps:2,topk:1,num_draft_tokens:3}]",
                                         f"image_embeddings={choice}"]), EvalConfig)
        reports[choice] = json.loads((run_eval(cfg) / "report.json").read_text())
        assert "By traffic" in capsys.readouterr().out
    assert reports["auto"]["image_embeddings"] == "fused"
    assert reports["placeholder"]["image_embeddings"] == "placeholder"
    # text vs image traffic: one sequence each; the parts add up to the whole
    for r in reports.values():
        parts = r["by_traffic"]
        assert parts["image"]["sequences"] == parts["text"]["sequences"] == 1
        for key in ("cycles", "tokens", "assistant_positions"):
            whole = r["accept"]["2/1/3"]["drafter"][key]
            assert whole == parts["text"]["accept"]["2/1/3"]["drafter"][key] + \
                parts["image"]["accept"]["2/1/3"]["drafter"][key]
            assert parts["image"]["accept"]["2/1/3"]["drafter"][key] > 0
        pos = [a + b for a, b in zip(parts["text"]["accuracy"]["positions"], parts["image"]["accuracy"]["positions"])]
        assert pos == r["accuracy"]["positions"]
    # the text sequence scores the same under both conventions, the image one is what they differ on
    assert json.dumps(reports["auto"]["by_traffic"]["text"]) == json.dumps(reports["placeholder"]["by_traffic"]["text"])
    for r in reports.values():
        real = r["real_loop"]["knobs"]["2/1/3"]
        # the simulation on the target's greedy output (captured with the image rows) agrees with the real loop
        assert real["lossless"] and abs(real["real_accept_length"] - real["sim_accept_length"]) <= 0.05


def test_a_bad_choice_is_the_schemas_error(tmp_path):
    from eagle3.config.conf import ConfigError

    with pytest.raises(ConfigError, match="image_embeddings"):
        to_schema(compose("eval", [f"paths.root={tmp_path}", "image_embeddings=clamped"]), EvalConfig)


def test_auto_is_the_export_engines_convention():
    from eagle3.config.resolve import image_embeddings as resolve
    from eagle3.drafter import image_embeddings as ie

    assert resolve("auto") == "fused" and resolve("auto", "vllm") == "placeholder"
    assert resolve("placeholder") == "placeholder"
    with pytest.raises(ValueError, match="expected one of"):
        resolve("clamped")
    assert ie.serving_mismatch("fused", "sglang") is None
    assert "vllm feeds placeholder" in ie.serving_mismatch("fused", "vllm")
