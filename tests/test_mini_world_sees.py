"""k25-mini sees: the synthetic scenes (seeded, no resize under K2.5's rule), the image conversations the world
trains on and holds out, hf regeneration feeding a seeing target its projector rows (equal to the wrapper's own
multimodal greedy decode, and the answers depend on the image), and bad input refused clearly."""
import random

import pytest
import torch

from data.mini_world import scenes
from data.mini_world import vision as eyes
from eagle3.target_model import images as img_rule
from eagle3.media_tokens import image_block
from eagle3.config.conf import ConfigError, compose, to_schema
from eagle3.config.schema.mini_world import MiniWorldConfig
from tests.fixtures.images import media_tokenizer, seeing_k25_target  # noqa: F401 (fixtures)


def test_scenes_are_seeded_need_no_resize_and_answers_state_the_facts():
    a = [scenes.random_scene(random.Random(3)) for _ in range(2)]
    assert a[0] == a[1]  # same seed, same scene
    scene = scenes.Scene("circle", "blue", 2, "7", (0, 3, 1))
    png = scenes.png(scenes.draw_scene(scene, 56))
    assert png == scenes.png(scenes.draw_scene(scene, 56))
    img = img_rule.decode_image(png)
    assert img.size == (56, 56) and img_rule.grid_thw(56, 56) == (1, 4, 4)
    assert img_rule.media_pad_count(img_rule.grid_thw(112, 112)) == 16
    pixels = img.load()
    assert pixels[14, 14] == pixels[42, 42] == scenes.COLOURS["blue"] and pixels[14, 42] == (255, 255, 255)  # 0, 3 drawn
    assert scenes.answer(scene, "caption") == "Two blue circles and the number 7."
    assert scenes.answer(scene, "count") == "There are two circles."
    assert scenes.answer(scenes.Scene("square", "red", 1, None, (2,)), "text") == "Nothing is written."
    with pytest.raises(ValueError, match="multiple of 28"):
        scenes.draw_scene(scene, 50)
    with pytest.raises(ValueError, match="unknown question kind"):
        scenes.answer(scene, "weather")


def test_image_conversations_render_as_prepare_and_learn_only_the_answers(media_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(media_tokenizer))
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    scene = scenes.Scene("square", "green", 1, "cat", (1, 2))
    ex = eyes.encode_example(tok, [("How many shapes are there?", "There is one square."),
                                   ("What colour?", "It is green.")], scenes.png(scenes.draw_scene(scene, 56)))
    assert ex.ids.count(pad) == 4 and ex.pixels.shape == (16, 3, 14, 14) and ex.grid.tolist() == [1, 4, 4]
    learned = [i for i, lab in zip(ex.ids, ex.labels) if lab != eyes.IGNORE]
    assert tok.decode(learned) == "There is one square.<|im_end|>It is green.<|im_end|>"
    whole = tok.apply_chat_template([
        {"role": "user", "content": image_block(4) + "\nHow many shapes are there?"},
        {"role": "assistant", "content": "There is one square."}, {"role": "user", "content": "What colour?"},
        {"role": "assistant", "content": "It is green."}], tokenize=False)
    assert ex.ids == tok(whole, add_special_tokens=False)["input_ids"]  # the pieces tokenize as the whole
    records = eyes.corpus_records(3, seed=5, size=56, max_turns=2)
    assert records == eyes.corpus_records(3, seed=5, size=56, max_turns=2)
    assert records[0]["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    mixed = eyes.interleave([{"t": i} for i in range(5)], [{"m": i} for i in range(3)], every=3)
    assert [("m" in r) for r in mixed] == [False, False, True, False, False, True, False, True]


def test_hf_regeneration_feeds_a_seeing_target_its_image_rows(seeing_k25_target):
    """HFGenerator's answers to image conversations = the wrapper's own greedy multimodal decode (pixel_values
    through transformers' forward, one token at a time), and two images give two different answers."""
    from transformers import AutoTokenizer
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    from data.hf_generator import HFGenerator
    from data.image_messages import template_messages

    tok = AutoTokenizer.from_pretrained(str(seeing_k25_target))
    model = Kimi_K25ForConditionalGeneration.from_pretrained(str(seeing_k25_target)).eval()
    pngs = [scenes.png(scenes.draw_scene(scenes.Scene(s, c, n, None, (0, 1, 2)), 56))
            for s, c, n in (("circle", "red", 1), ("triangle", "blue", 3))]
    prompts = [[{"role": "user", "content": "What is in this image?", "images": [img_rule.data_uri(p)]}] for p in pngs]
    gen = HFGenerator(model, tok, max_new_tokens=6)
    got = [text for text, _, _ in gen.generate(prompts)]
    for prompt, png, text in zip(prompts, pngs, got):
        ids = tok(tok.apply_chat_template(template_messages(prompt), tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False, return_tensors="pt")["input_ids"]
        pixel_values, thw = eyes.pixel_batch([png])
        out = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=thw).logits[0, -1].argmax())
                if nxt in gen.stop_ids:
                    break
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert text == tok.decode(out, skip_special_tokens=True)
    assert got[0] != got[1]  # the answer depends on the picture


def test_a_target_that_does_not_see_fails_the_image_conversation_only(tiny_k25_target, tiny_tokenizer):
    """A K2.5-layout target whose tokenizer has no media tokens: the image conversation fails with one line
    (a counted regen_failed in prepare); a text conversation still generates."""
    from transformers import AutoTokenizer
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    from data.hf_generator import HFGenerator
    from data.regen_common import GenerationFailed

    gen = HFGenerator(Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_k25_target)).eval(),
                      AutoTokenizer.from_pretrained(str(tiny_tokenizer)), max_new_tokens=3)
    uri = img_rule.data_uri(scenes.png(scenes.draw_scene(scenes.Scene("square", "red", 1, None, (0,)), 28)))
    with pytest.raises(GenerationFailed, match="image conversation: .*no <\\|media_pad\\|> token"):
        gen.generate([[{"role": "user", "content": "what is it?", "images": [uri]}]])
    assert len(gen.generate([[{"role": "user", "content": "hello"}]])) == 1


def test_bad_vision_settings_are_refused(tmp_path):
    def cfg(*o):
        return to_schema(compose("mini_world", [f"paths.root={tmp_path}", *o]), MiniWorldConfig)

    assert cfg().vision.image_size == 56
    with pytest.raises(ConfigError, match="vision.image_size=50: must be a multiple of 28"):
        cfg("vision.image_size=50")
    with pytest.raises(ConfigError, match="corpus_every >= 2"):
        cfg("vision.corpus_every=1")
    with pytest.raises(ConfigError, match="multiple of vision.num_attention_heads"):
        cfg("vision.hidden_size=30", "vision.num_attention_heads=4")
    with pytest.raises(ConfigError, match="text_loss_weight must be > 0"):
        cfg("vision.text_loss_weight=0")
    with pytest.raises(ConfigError, match="tower_lr_scale must be >= 0"):
        cfg("vision.tower_lr_scale=-0.1")
    assert cfg("vision.tower_lr_scale=0").vision.tower_lr_scale == 0
