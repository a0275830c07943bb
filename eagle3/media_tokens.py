"""Kimi-K2.5's image tokens, the one home of their strings, ids and rendering (pure, stdlib only).

An image in a user turn is the block `<|media_begin|>image<|media_content|>` + `<|media_pad|>` x n +
`<|media_end|>`, then `\\n` and the turn's text; n = `image_grid_thw.prod() // 4` (eagle3/target_model/images.py).
Each `<|media_pad|>` is one LM position whose input embedding is the projector's output.

Ids. The real convention is Kimi-K2.5's: its tokenizer maps `<|media_pad|>` to 163605, the value of
`image_token_id` in its config (transformers 5.24's default too). A tokenizer without the media tokens
(the mini world's, trained before images existed) gets them from `add_media_tokens`, appended after its
vocabulary as special tokens, so those ids are its own; a target built for that tokenizer states the
tokenizer's `<|media_pad|>` id as its `image_token_id`. Which id an image row has is decided here, once:
`image_token_id(tokenizer, target_config)` requires the tokenizer and the target to agree.
"""
from __future__ import annotations

from typing import Optional

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)
K25_IMAGE_TOKEN_ID = 163605  # Kimi-K2.5's `<|media_pad|>` = config.image_token_id


class MediaTokenError(ValueError):
    """A tokenizer / target pair that cannot carry images, with the reason."""


def image_block(n_pads: int) -> str:
    """The text of one image's block (without the `\\n` that follows it)."""
    if n_pads < 1:
        raise MediaTokenError(f"an image needs at least one {MEDIA_PAD}, got {n_pads}")
    return f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{MEDIA_PAD * n_pads}{MEDIA_END}"


def user_content(n_pads_per_image: list[int], text: str) -> str:
    """A user turn's content with its images first (each block then `\\n`), then its text."""
    return "".join(image_block(n) + "\n" for n in n_pads_per_image) + text


def media_token_ids(tokenizer) -> Optional[dict[str, int]]:
    """{token: id} of the four media tokens when the tokenizer has each as one token, else None."""
    vocab = tokenizer.get_vocab()
    if not all(t in vocab for t in MEDIA_TOKENS):
        return None
    return {t: int(vocab[t]) for t in MEDIA_TOKENS}


def add_media_tokens(tokenizer) -> dict[str, int]:
    """Give a tokenizer that lacks them the four media tokens as special tokens (ids after its vocabulary;
    a tokenizer that has them is left as it is). Returns their ids."""
    if media_token_ids(tokenizer) is None:
        tokenizer.add_special_tokens({"additional_special_tokens": list(MEDIA_TOKENS)},
                                     replace_extra_special_tokens=False)
    ids = media_token_ids(tokenizer)
    if ids is None:
        raise MediaTokenError("adding the media tokens to the tokenizer failed")
    return ids


def image_token_id(tokenizer, target_config: Optional[dict] = None) -> int:
    """The id of an image row: the tokenizer's `<|media_pad|>`, which must be the target's `image_token_id`
    (a Kimi_K25 config; absent there means K2.5's 163605). `target_config` None: the tokenizer alone."""
    ids = media_token_ids(tokenizer)
    if ids is None:
        raise MediaTokenError(f"the tokenizer has no {MEDIA_PAD} token: this target reads no images "
                              "(a text-only target such as Kimi-K2)")
    tok_id = ids[MEDIA_PAD]
    if target_config is not None:
        if "vision_config" not in target_config:
            raise MediaTokenError("the target has no vision tower (no vision_config): it reads no images")
        cfg_id = int(target_config.get("image_token_id", K25_IMAGE_TOKEN_ID))
        if cfg_id != tok_id:
            raise MediaTokenError(f"the tokenizer's {MEDIA_PAD} is id {tok_id}, the target's image_token_id is "
                                  f"{cfg_id}: they must be the same token")
    return tok_id
