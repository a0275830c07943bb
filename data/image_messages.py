"""Prepare's image conversations: image parts of a record -> validated images on its user messages, and the
two forms the images are sent in.

A validated user message with images is `{"role": "user", "content": text, "images": [data URI, ...]}`:
every image is read (a data URI, a `file://` URL or a local path relative to the input file), decoded and
size-checked when the record is read, so a bad image skips its record before any regeneration or
tokenization, and kept as a data URI (JSON-safe, for the regeneration store). From there:
  * `template_messages`: the image blocks written into the text (eagle3/media_tokens.py, one `<|media_pad|>`
    per LM position, the count from K2.5's rule in eagle3/target_model/images.py), what the chat template renders;
  * `openai_messages`: `image_url` parts before the text part, what a chat server is sent;
  * `conversation_images`: the image bytes and `image_grid_thw` rows in LM order, stored with the record.
Accepted record forms: OpenAI parts `{"type": "image_url", "image_url": {"url": ...} | "..."}` and
`{"type": "image", "image": "..."}`; ShareGPT / LLaVA records with `image` (one) or `images` (a list),
placed at the user turns' `<image>` markers (removed from the text) or, without markers, on the first
user turn. Images go before their turn's text (K2.5's chat layout).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from eagle3.target_model import images as img_rule
from eagle3.media_tokens import user_content

IMAGE_MARKER = "<image>"
# ImageError reasons -> prepare's skip reasons (data/conversations.py SKIP_REASONS)
IMAGE_SKIPS = ("missing_image", "undecodable_image", "oversized_image", "remote_image")


def image_part_source(part: dict) -> Optional[str]:
    """The image reference of an OpenAI-style content part, None for a part that is not an image."""
    kind = part.get("type")
    if kind == "image_url":
        ref = part.get("image_url")
        return ref.get("url") if isinstance(ref, dict) else ref
    if kind == "image":
        return part.get("image")
    return None


def load_image(source: Any, base_dir: Optional[Path], max_pixels: int = img_rule.MAX_IMAGE_PIXELS) -> str:
    """One image reference -> a data URI of its bytes, after decoding it once (raises eagle3.target_model.images.ImageError)."""
    data = img_rule.image_bytes(source, base_dir)
    img_rule.decode_image(data, max_pixels)
    return source if isinstance(source, str) and source.startswith("data:") else \
        img_rule.data_uri(data, img_rule.sniff_mime(data))


def record_images(value: dict) -> list:
    """A ShareGPT / LLaVA record's image references (`image`: one, `images`: a list), [] without."""
    refs = value.get("images", value.get("image"))
    if refs is None:
        return []
    return list(refs) if isinstance(refs, list) else [refs]


def place_record_images(messages: list[dict], refs: list) -> Optional[str]:
    """Attach a record's image references to its user messages (at `<image>` markers, else the first user
    turn); returns a problem, None when placed."""
    if not refs:
        return None
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        return "images but no user turn"
    marks = [m["content"].count(IMAGE_MARKER) for m in users]
    if sum(marks) == 0:
        users[0].setdefault("images", []).extend(refs)
        return None
    if sum(marks) != len(refs):
        return f"{sum(marks)} {IMAGE_MARKER} markers for {len(refs)} images"
    it = iter(refs)
    for m, n in zip(users, marks):
        if n:
            m.setdefault("images", []).extend(next(it) for _ in range(n))
            m["content"] = m["content"].replace(IMAGE_MARKER + "\n", "").replace(IMAGE_MARKER, "")
    return None


def _grid(uri: str) -> tuple[int, int, int]:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(img_rule.image_bytes(uri))) as im:  # the header is enough for the size
        w, h = im.size
    return img_rule.grid_thw(h, w)


def has_images(messages: list[dict]) -> bool:
    return any(m.get("images") for m in messages)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for the chat template: each user turn's images as K2.5 image blocks before its text."""
    out = []
    for m in messages:
        if m.get("images"):
            pads = [img_rule.media_pad_count(_grid(u)) for u in m["images"]]
            m = {k: v for k, v in m.items() if k != "images"}
            m["content"] = user_content(pads, m["content"])
        out.append(m)
    return out


def openai_messages(messages: list[dict]) -> list[dict]:
    """Messages for an OpenAI-compatible chat server: a turn's images as `image_url` parts before its text."""
    out = []
    for m in messages:
        if m.get("images"):
            parts = [{"type": "image_url", "image_url": {"url": u}} for u in m["images"]]
            m = {k: v for k, v in m.items() if k != "images"}
            m["content"] = parts + [{"type": "text", "text": m["content"]}]
        out.append(m)
    return out


def conversation_images(messages: list[dict]) -> tuple[list[bytes], list[tuple[int, int, int]]]:
    """(encoded bytes, image_grid_thw row) of every image, in the order the LM sees them."""
    uris = [u for m in messages for u in m.get("images") or []]
    return [img_rule.image_bytes(u) for u in uris], [_grid(u) for u in uris]


def pad_runs(ids, pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `pad_id` in `ids`."""
    runs, start = [], None
    for i, t in enumerate(list(ids) + [None]):
        if t == pad_id and start is None:
            start = i
        elif t != pad_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def images_kept(ids, counts: list[int], pad_id: int, begin_id: int, truncated: bool) -> tuple[int, int]:
    """(images kept, tokens kept) of an encoded conversation whose images need `counts` pads each, in order.
    Every image must be one whole run of pads. A truncation that cuts an image's run cuts the sequence before
    that image's `<|media_begin|>` instead (an image is seen whole or not at all). Raises ValueError."""
    runs = pad_runs(ids, pad_id)
    lengths = [n for _, n in runs]
    if not truncated or len(runs) == len(counts) and lengths == counts:
        if lengths != counts:
            raise ValueError(f"{len(runs)} runs of <|media_pad|> of {lengths} for {len(counts)} images of {counts}")
        return len(counts), len(ids)
    whole = lengths[:-1] if runs and runs[-1][0] + runs[-1][1] == len(ids) else lengths
    if whole != counts[: len(whole)] or len(whole) > len(counts):
        raise ValueError(f"runs of <|media_pad|> of {lengths} do not start the images' counts {counts}")
    if len(whole) == len(runs):
        return len(whole), len(ids)
    start = runs[-1][0]
    begins = [i for i in range(start) if ids[i] == begin_id]
    if not begins:
        raise ValueError("a run of <|media_pad|> without its <|media_begin|>")
    return len(whole), begins[-1]
