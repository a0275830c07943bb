"""Prepare with image conversations: OpenAI image parts (data URI, path) and ShareGPT/LLaVA image fields become
K2.5 image blocks with `image_grid_thw.prod() // 4` pads, the images are kept with the record, no loss at
image tokens; every bad image is a counted skip and no other record is lost; a text-only target counts its
image records as `image_unsupported`; regeneration sends the images in the request."""
import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from data.prepare import SKIP_REASONS, run_prepare
from eagle3.target_model import images as img_rule
from eagle3.formats.manifest import read_manifest
from tests.fixtures.images import media_tokenizer, png_bytes, seeing_k25_target  # noqa: F401 (fixtures)
from tests.fixtures.prepare import GOOD, prepare_config, write_jsonl


def k25(tmp_path, target, src, *more):
    return prepare_config(tmp_path, target, src, f"target.path={target}", "target.layout=kimi_k25",
                          "validation_fraction=0.0", *more)


def image_rows(tmp_path):
    """Good image records of every accepted form, bad ones of every image reason, and text records."""
    from PIL import Image

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png_bytes(30, 50, seed=1))  # 30 wide, 50 high: grid 1x4x4 -> 4 pads
    (tmp_path / "img" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    Image.new("1", (9000, 8000)).save(tmp_path / "img" / "huge.png")  # 72 Mpixel > the 64 Mpixel limit
    uri = img_rule.data_uri(png_bytes(60, 20, seed=2))  # 60x20: grid 1x2x6 -> 3 pads

    def oa(cid, *parts, answer="it is a picture."):
        return {"id": cid, "messages": [{"role": "user", "content": list(parts)},
                                        {"role": "assistant", "content": answer}]}

    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    good = [
        oa("oa_uri", {"type": "image_url", "image_url": {"url": uri}}, text("what is this?")),
        oa("oa_path_two", {"type": "image_url", "image_url": "img/a.png"}, {"type": "image", "image": uri},
           text("compare them")),
        {"id": "llava", "image": "img/a.png",
         "conversations": [{"from": "human", "value": "<image>\ndescribe"}, {"from": "gpt", "value": "noise."}]},
        {"id": "sharegpt_images", "images": [uri],
         "conversations": [{"from": "human", "value": "look"}, {"from": "gpt", "value": "ok."}]},
    ]
    bad = {
        "missing_image": oa("b_missing", {"type": "image_url", "image_url": {"url": "img/nope.png"}}, text("x")),
        "undecodable_image": oa("b_bad", {"type": "image_url", "image_url": {"url": "img/bad.png"}}, text("x")),
        "oversized_image": oa("b_huge", {"type": "image_url", "image_url": {"url": "img/huge.png"}}, text("x")),
        "remote_image": oa("b_remote", {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                           text("x")),
        "image_unsupported": {"id": "b_asst", "messages": [
            {"role": "user", "content": "draw"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": uri}}]}]},
        "image_token_mismatch": {"id": "b_marks", "images": [uri],
                                 "conversations": [{"from": "human", "value": "<image> and <image>"},
                                                   {"from": "gpt", "value": "two?"}]},
    }
    return good, bad, GOOD[:4]


def rows_by_id(out):
    ds = datasets.load_from_disk(str(out / "train"))
    return {r["id"]: r for r in ds}, ds


def test_image_records_render_blocks_keep_images_and_skip_bad_ones(tmp_path, seeing_k25_target):
    good, bad, text = image_rows(tmp_path)
    src = write_jsonl(tmp_path / "mixed.jsonl", [*good[:2], bad["missing_image"], *text[:2], *good[2:],
                                                 *(bad[k] for k in bad if k != "missing_image"), *text[2:]])
    out = run_prepare(k25(tmp_path, seeing_k25_target, src))
    m = read_manifest(out, "prepare")
    assert m["counts"]["skipped"] == {r: int(r in bad) for r in SKIP_REASONS}
    rows, ds = rows_by_id(out)
    assert sorted(rows) == sorted([g["id"] for g in good] + [t["id"] for t in text])
    tok = AutoTokenizer.from_pretrained(str(seeing_k25_target))
    pad, begin, content, end = (tok.convert_tokens_to_ids(t) for t in
                                ("<|media_pad|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>"))
    want = {"oa_uri": [(1, 2, 6)], "oa_path_two": [(1, 4, 4), (1, 2, 6)], "llava": [(1, 4, 4)],
            "sharegpt_images": [(1, 2, 6)]}
    for cid, grids in want.items():
        r = rows[cid]
        ids, mask = np.asarray(r["input_ids"]), np.asarray(r["loss_mask"])
        assert np.asarray(r["image_grid_thw"]).reshape(-1, 3).tolist() == [list(g) for g in grids]
        counts = [img_rule.media_pad_count(g) for g in grids]
        assert [n for _, n in _runs(ids == pad)] == counts  # one whole run per image, in order
        assert (ids == begin).sum() == (ids == content).sum() == (ids == end).sum() == len(grids)
        assert not mask[ids == pad].any() and mask.any()  # no loss at image tokens
        assert m["counts"]["image_tokens"] >= sum(counts)
        for data, g in zip(r["images"], grids):  # the bytes decode to an image of that grid
            im = img_rule.decode_image(data)
            assert img_rule.grid_thw(im.height, im.width) == g
    assert rows["oa_path_two"]["images"][0] == (tmp_path / "img" / "a.png").read_bytes()
    # the llava marker is gone from the text; the image block comes first in the user turn
    text_ids = tok(tok.decode(rows["llava"]["input_ids"], skip_special_tokens=False), add_special_tokens=False)
    assert "<image>" not in tok.decode(rows["llava"]["input_ids"]) and text_ids["input_ids"]
    for t in text:
        assert rows[t["id"]]["images"] == [] and rows[t["id"]]["image_grid_thw"] == []
    assert m["counts"]["images"] == 5 and m["media_token_ids"] == {"pad": pad, "begin": begin}


def _runs(flags):
    out, start = [], None
    for i, f in enumerate(list(flags) + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i - start))
            start = None
    return out


def test_a_text_only_target_counts_image_records_and_keeps_the_rest(tmp_path, tiny_tokenizer, seeing_k25_target):
    good, _, text = image_rows(tmp_path)
    src = write_jsonl(tmp_path / "c.jsonl", [*good, *text])
    # K2 (layout causal_lm), and a K2.5-layout run whose tokenizer has no media tokens
    runs = (("target.layout=causal_lm",), (f"target.path={seeing_k25_target}", "target.layout=kimi_k25"))
    for i, layout_args in enumerate(runs):
        out = run_prepare(prepare_config(tmp_path / f"run{i}", tiny_tokenizer, src, "validation_fraction=0.0",
                                         *layout_args))
        m = read_manifest(out, "prepare")
        assert m["counts"]["skipped"]["image_unsupported"] == len(good)
        assert m["counts"]["kept"] == len(text) and m["counts"]["images"] == 0
        assert m["skip_examples"]["image_unsupported"][0]


def test_truncation_inside_an_image_cuts_before_the_image(tmp_path, seeing_k25_target):
    """max_length ends inside the second image's pads: the record keeps the first image whole and stops before
    the second one's <|media_begin|>; an image that starts the prompt and does not fit leaves nothing (too_long)."""
    uri_small, uri_big = img_rule.data_uri(png_bytes(28, 28, seed=3)), img_rule.data_uri(png_bytes(280, 280, seed=4))
    turns = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri_small}},
                                          {"type": "text", "text": "one"}]},
             {"role": "assistant", "content": "first answer here."},
             {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri_big}},
                                          {"type": "text", "text": "two"}]},  # 100 pads
             {"role": "assistant", "content": "second."}]
    src = write_jsonl(tmp_path / "t.jsonl", [{"id": "cut", "messages": turns},
                                             {"id": "nofit", "messages": turns[2:]}, *GOOD[:2]])
    out = run_prepare(k25(tmp_path, seeing_k25_target, src, "max_length=64"))
    m = read_manifest(out, "prepare")
    assert m["counts"]["skipped"]["too_long"] == 1 and "t.jsonl:2" in m["skip_examples"]["too_long"][0]
    rows, _ = rows_by_id(out)
    tok = AutoTokenizer.from_pretrained(str(seeing_k25_target))
    ids = rows["cut"]["input_ids"]
    assert len(ids) < 64 and ids.count(tok.convert_tokens_to_ids("<|media_pad|>")) == 1
    assert ids.count(tok.convert_tokens_to_ids("<|media_begin|>")) == 1
    assert np.asarray(rows["cut"]["image_grid_thw"]).tolist() == [1, 2, 2] and len(rows["cut"]["images"]) == 1


def test_regeneration_sends_the_images_in_the_request():
    """The chat client turns a user turn's images into image_url parts (data URIs) before its text."""
    import json

    import httpx

    from data.chat_client import ChatClient

    uri = img_rule.data_uri(png_bytes(28, 28))
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"content": "a red square"},
                                                      "finish_reason": "stop"}]})

    client = ChatClient("http://standin/v1", "m", max_retries=0)
    client.http = httpx.Client(transport=httpx.MockTransport(handler))
    text, reason, _ = client.complete([{"role": "user", "content": "what is it?", "images": [uri]}])
    assert (text, reason) == ("a red square", "stop")
    (msg,) = seen[0]["messages"]
    assert msg == {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                               {"type": "text", "text": "what is it?"}]}
