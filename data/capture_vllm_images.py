"""The vLLM capture's image sequences (data/capture_vllm.py): a prepared row -> the chat request the engine
renders back into prepare's own token ids (eagle3/engines/vllm_images.py), and the check of the engine's expansion.

A sequence whose kept tokens hold images goes to the engine's chat endpoint: its ids with each `<|media_pad|>`
run cut to one pad, decoded (special tokens kept), and its images as data URIs. The engine expands each pad
by its own image rule and returns the prompt ids it ran; those must be prepare's exactly (same ids, same pad
run lengths), or the sequence is a counted skip and its connector file is discarded. Skip reasons:
  image_mismatch          capture's max_seq_len cut an image (as the HF backend)
  undecodable_image / oversized_image  a stored image no longer decodes (eagle3/target_model/images.py's reasons)
  image_prompt_unrenderable  the decoded text does not hold one K2.5 placeholder per image (the engine would
                          put the missing ones in front: another prompt)
  engine_refused_image    the engine answered the request with an error (HTTP 400: a refused image, ...)
  engine_image_mismatch   the engine's `<|media_pad|>` runs differ from prepare's (another image rule)
  engine_ids_mismatch     same runs, other ids (a decode / re-tokenization that does not round-trip)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from data.capture_hf import kept_image_count
from data.capture_plan import CaptureError
from data.image_messages import pad_runs
from eagle3.target_model import images as img_rule
from eagle3.engines import vllm_images

SKIP_REASONS = ("image_mismatch", "undecodable_image", "oversized_image", "image_prompt_unrenderable", "engine_refused_image",
                "engine_image_mismatch", "engine_ids_mismatch")


@dataclass
class ImageRequest:
    """One sequence's chat request: the prompt text (one placeholder per image) and its images as data URIs."""
    text: str
    image_uris: list[str]


class ImageSkip(Exception):
    """A sequence that is not stored, with its skip reason (SKIP_REASONS) and a one-line detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def image_request(row: dict, kept_ids: torch.Tensor, pad_id: int, tokenizer) -> ImageRequest | None:
    """The chat request of a sequence whose kept tokens hold images, None for one without (a token-id
    completion then). Raises ImageSkip."""
    try:
        k = kept_image_count(row, kept_ids, pad_id)
    except CaptureError as e:
        raise ImageSkip("image_mismatch", str(e)) from None
    if k == 0:
        return None
    uris = []
    for i, data in enumerate(row["images"][:k]):
        try:
            img_rule.decode_image(data)
        except img_rule.ImageError as e:
            raise ImageSkip(e.reason, f"image {i}: {e.detail}") from None
        uris.append(img_rule.data_uri(data, img_rule.sniff_mime(data)))
    text = tokenizer.decode(vllm_images.collapse_runs(kept_ids.tolist(), pad_id), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
    found = text.count(vllm_images.PLACEHOLDER)
    if found != k:
        raise ImageSkip("image_prompt_unrenderable", f"the decoded prompt holds {found} image placeholders "
                        f"{vllm_images.PLACEHOLDER!r} for {k} images")
    return ImageRequest(text, uris)


def expansion_problem(prepared: list[int], engine: list[int], pad_id: int) -> ImageSkip | None:
    """None when the engine ran prepare's ids exactly, else the skip naming how they differ."""
    if engine == prepared:
        return None
    mine, theirs = [n for _, n in pad_runs(prepared, pad_id)], [n for _, n in pad_runs(engine, pad_id)]
    if mine != theirs:
        return ImageSkip("engine_image_mismatch", f"the engine expanded the images to <|media_pad|> runs of "
                         f"{theirs}, prepare to {mine}")
    first = next((i for i, (a, b) in enumerate(zip(prepared, engine)) if a != b), min(len(prepared), len(engine)))
    return ImageSkip("engine_ids_mismatch", f"the engine's prompt ({len(engine)} ids) differs from prepare's "
                     f"({len(prepared)} ids) from position {first}")


def build_requests(batch: list, rows: list[dict], ids: list[torch.Tensor], writer, images: tuple | None,
                   stats: dict) -> list:
    """One request per sequence of a batch (its ids, an ImageRequest, or None for one skipped here: its images
    cannot be sent; counted in the store `writer`). images: (image_token_id, tokenizer) when the data holds images."""
    out = []
    for s, r, x in zip(batch, rows, ids):
        request = x.tolist()
        if images is not None:
            try:
                request = image_request(r, x, images[0], images[1]) or request
            except ImageSkip as e:
                skip(writer, s.id, e, stats)
                request = None
        out.append(request)
    return out


def skip(writer, seq_id: str, e: ImageSkip, stats: dict) -> None:
    """Record a skipped sequence in the store writer and this run's counts, and say so in one line."""
    writer.skip(seq_id, e.reason)
    stats["image_skips"][e.reason] = stats["image_skips"].get(e.reason, 0) + 1
    print(f"[capture] skipped {seq_id!r} ({e.reason}): {e.detail}")
