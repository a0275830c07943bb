"""K2.5's image rule (eagle3/target_model/images.py) on hand-checked sizes, its pixels and patches, the image sources,
and the media tokens (eagle3/media_tokens.py); against transformers' kimi_k25 image processor where it
imports (it needs torchvision)."""
import io

import numpy as np
import pytest

from eagle3.target_model import images
from eagle3 import media_tokens
from eagle3.target_model.images import ImageError, ImageRule, grid_thw, media_pad_count, resized_and_padded


def png_bytes(w, h, color=(200, 30, 60), mode="RGB"):
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


# (h, w) -> (resized, padded, pads), by hand:
#  28x28: fits, already a multiple of 28 -> grid 2x2 -> 4 patches / 4 = 1 pad
#  30x50: fits (2x3 whole patches), padded up to 56x56 -> grid 4x4 -> 4 pads
#  1x1: at least one patch a side, padded to 28x28 -> 1 pad
#  10000x100: 714x7 patches < 16384 but 714 > 512 a side: scale 7168/10000 = 0.7168 -> 7168 x int(71.68)=71,
#             width padded to 84 -> grid 512x6 -> 768 pads
#  4000x3000: 285*214 = 60990 patches > 16384: scale sqrt(16384/60990) = 0.51830 -> int(2073.2)=2073 x
#             int(1554.9)=1554, padded to 2100 (75*28) x 1568 (56*28) -> grid 150x112 -> 4200 pads (the padding
#             takes the grid past the 16384-patch budget: 16800 patches, as in transformers)
#  7168x7168: 512x512 patches: scale sqrt(1/16) = 0.25 -> 1792 x 1792 (64*28) -> grid 128x128 -> 4096 pads
HAND = [((28, 28), (28, 28), (28, 28), 1),
        ((30, 50), (30, 50), (56, 56), 4),
        ((1, 1), (1, 1), (28, 28), 1),
        ((10000, 100), (7168, 71), (7168, 84), 768),
        ((4000, 3000), (2073, 1554), (2100, 1568), 4200),
        ((7168, 7168), (1792, 1792), (1792, 1792), 4096)]


@pytest.mark.parametrize("size,resized,padded,pads", HAND)
def test_resize_and_pad_rule_on_hand_checked_sizes(size, resized, padded, pads):
    assert resized_and_padded(*size) == (resized, padded)
    g = grid_thw(*size)
    assert g == (1, padded[0] // 14, padded[1] // 14)
    assert media_pad_count(g) == pads


def test_rule_invariants_over_many_sizes():
    rng = np.random.default_rng(0)
    for h, w in rng.integers(1, 12000, size=(300, 2)):
        (rh, rw), (ph, pw) = resized_and_padded(int(h), int(w))
        assert 1 <= rh <= h and 1 <= rw <= w  # never upscaled
        assert rh <= 512 * 14 and rw <= 512 * 14
        assert ph % 28 == 0 and pw % 28 == 0 and 0 <= ph - rh < 28 and 0 <= pw - rw < 28
        if (h // 14) * (w // 14) <= 16384 and max(h, w) <= 512 * 14:
            assert (rh, rw) == (h, w)  # within the caps: no resize
        # (the budget counts the original's whole patches, so a shrunk image may hold a few more: 936x3489)


def test_bad_sizes_and_grids_are_refused():
    with pytest.raises(ImageError, match="0x5"):
        resized_and_padded(0, 5)
    with pytest.raises(ImageError, match="merge size"):
        media_pad_count((1, 3, 4))


def test_pixels_patches_and_padding():
    """A 30x50 image of one colour: 4x4 patches of 14; pixels in the image normalize to c/255*2-1, the
    black padding (bottom rows 30.., right columns 50..) to -1; patches row by row."""
    from PIL import Image

    img = Image.new("RGB", (50, 30), (255, 0, 51))  # PIL size is (w, h)
    pv, g = images.preprocess(img)
    assert g == (1, 4, 4) and pv.shape == (16, 3, 14, 14) and pv.dtype == np.float32
    full = pv.reshape(4, 4, 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(56, 56, 3)  # back to an image
    np.testing.assert_allclose(full[:30, :50], np.broadcast_to([1.0, -1.0, 51 / 255 * 2 - 1], (30, 50, 3)),
                               atol=1e-6)
    assert (full[30:] == -1).all() and (full[:, 50:] == -1).all()
    # patch 5 = grid row 1, column 1: image rows 14..27, columns 14..27, channel-first
    np.testing.assert_array_equal(pv[5], full[14:28, 14:28].transpose(2, 0, 1))


def test_resize_is_bicubic_to_the_rule_size():
    from PIL import Image

    rule = ImageRule(max_patches=4)  # a 56x84 image (4x6 = 24 patches) must shrink
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))
    (rh, rw), (ph, pw) = resized_and_padded(56, 84, rule)
    assert (rh, rw) == (22, 34) and (ph, pw) == (28, 56)  # sqrt(4/24) = 0.408 -> int(22.86), int(34.29)
    pv, g = images.preprocess(img, rule)
    want = np.asarray(img.resize((34, 22), Image.Resampling.BICUBIC), np.float32) / 255 * 2 - 1
    full = pv.reshape(2, 4, 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(28, 56, 3)
    np.testing.assert_allclose(full[:22, :34], want, atol=1e-6)


def test_preprocess_many_concatenates_in_order():
    from PIL import Image

    a, b = Image.new("RGB", (28, 28), (0, 0, 0)), Image.new("RGB", (60, 20), (255, 255, 255))
    pv, thw = images.preprocess_many([a, b])
    assert thw.tolist() == [[1, 2, 2], [1, 2, 6]] and pv.shape == (4 + 12, 3, 14, 14)
    assert (pv[:4] == -1).all() and (pv[4] == 1).all()


def test_decode_composites_alpha_onto_white_and_refuses_bad_bytes():
    img = images.decode_image(png_bytes(3, 2, (0, 0, 0, 0), mode="RGBA"))
    assert img.mode == "RGB" and np.asarray(img).min() == 255  # transparent -> white
    with pytest.raises(ImageError) as e:
        images.decode_image(b"\x89PNG not really")
    assert e.value.reason == "undecodable_image"
    with pytest.raises(ImageError) as e:
        images.decode_image(png_bytes(100, 100), max_pixels=5000)
    assert e.value.reason == "oversized_image" and "100x100" in str(e.value)


def test_image_sources(tmp_path):
    data = png_bytes(4, 4)
    (tmp_path / "a.png").write_bytes(data)
    assert images.image_bytes(images.data_uri(data)) == data
    assert images.image_bytes("a.png", tmp_path) == data
    assert images.image_bytes(f"file://{tmp_path / 'a.png'}") == data
    assert images.sniff_mime(data) == "image/png"
    for src, reason in [("b.png", "missing_image"), ("", "missing_image"), ("https://x/y.png", "remote_image"),
                        ("data:image/png;base64,@@@", "undecodable_image"),
                        ("data:image/png,rawtext", "undecodable_image")]:
        with pytest.raises(ImageError) as e:
            images.image_bytes(src, tmp_path)
        assert e.value.reason == reason, src
    with pytest.raises(ImageError) as e:
        images.image_bytes("a.png", tmp_path, max_bytes=10)
    assert e.value.reason == "oversized_image"


def test_media_tokens_block_and_ids(tiny_tokenizer):
    from transformers import AutoTokenizer

    assert media_tokens.image_block(2) == "<|media_begin|>image<|media_content|><|media_pad|><|media_pad|><|media_end|>"
    assert media_tokens.user_content([1], "hi") == media_tokens.image_block(1) + "\nhi"
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    n = len(tok)
    assert media_tokens.media_token_ids(tok) is None  # the mini world's tokenizer predates images
    with pytest.raises(media_tokens.MediaTokenError, match="text-only"):
        media_tokens.image_token_id(tok)
    ids = media_tokens.add_media_tokens(tok)
    assert sorted(ids.values()) == list(range(n, n + 4))  # its own ids, after its vocabulary
    pad = ids["<|media_pad|>"]
    enc = tok(media_tokens.user_content([3], "hi"), add_special_tokens=False)["input_ids"]
    assert enc.count(pad) == 3 and enc[0] == ids["<|media_begin|>"]
    assert media_tokens.image_token_id(tok, {"vision_config": {}, "image_token_id": pad}) == pad
    with pytest.raises(media_tokens.MediaTokenError, match="163605"):  # K2.5's id is the default
        media_tokens.image_token_id(tok, {"vision_config": {}})
    with pytest.raises(media_tokens.MediaTokenError, match="no vision tower"):
        media_tokens.image_token_id(tok, {"image_token_id": pad})


def _hf_image_processor():
    try:
        from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
        return Kimi_K25ImageProcessor()
    except ImportError as e:  # torchvision absent (the project's CPU machines)
        pytest.skip(f"transformers' kimi_k25 image processor is not importable here ({e})")


def test_matches_transformers_kimi_k25_image_processor():
    proc = _hf_image_processor()
    from PIL import Image

    rule = ImageRule(max_patches=1024)  # keeps the big case small; the processor gets the same cap
    for hw in [(28, 28), (30, 50), (300, 200), (1000, 3000)]:
        rng = np.random.default_rng(hw[0])
        img = Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8))
        ref = proc(images=[img], max_patches=rule.max_patches, return_tensors="np")
        pv, g = images.preprocess(img, rule)
        assert ref["image_grid_thw"].tolist() == [list(g)], hw
        assert proc.get_number_of_image_patches(*hw, {"max_patches": rule.max_patches}) == g[1] * g[2]
        ref_pv = np.asarray(ref["pixel_values"])
        assert ref_pv.shape == pv.shape, hw
        resized = resized_and_padded(*hw, rule)[0] != hw
        # no resize: the same pixels; a resize: torchvision's and PIL's bicubic round a pixel apart in places
        np.testing.assert_allclose(pv, ref_pv, atol=(2 * 2 / 255 + 1e-6) if resized else 1e-6, err_msg=str(hw))


def test_size_rule_equals_transformers_navit_resize_source():
    """transformers' `navit_resize` (its module imports torchvision, so the function alone is taken from the
    source with ast and run) gives the same sizes as eagle3/target_model/images.py on many random sizes."""
    import ast
    import math
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("transformers.models.kimi_k25")
    src = (Path(spec.submodule_search_locations[0]) / "image_processing_kimi_k25.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    ns = {"math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "navit_resize", "exec"), ns)
    rng = np.random.default_rng(2)
    sizes = [s for s, *_ in HAND] + [tuple(int(x) for x in hw) for hw in rng.integers(1, 20000, size=(2000, 2))]
    for h, w in sizes:
        ref = ns["navit_resize"](h, w, patch_size=14, merge_kernel_size=2, max_patches=16384, max_size_per_side=512)
        assert resized_and_padded(h, w) == ref, (h, w)
