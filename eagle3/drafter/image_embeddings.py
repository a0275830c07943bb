"""What the drafter embeds at image rows: the one home of the `image_embeddings` convention.

  * `fused` (SGLang): the target's fused input embedding, the projector output at image rows (what an image
    capture stores, eagle3/formats/store.py `image_embeds`), shifted by one like the token embeddings;
  * `placeholder` (vLLM's Eagle3LlamaForCausalLM): the drafter's own table at the placeholder id
    (`<|media_pad|>`, 163605 for Kimi-K2.5).
Text rows are embed_tokens(id) under both. A sequence without images is the same under both.
The config switch (train, eval) is `image_embeddings: auto | fused | placeholder`; auto = the convention of the
engine the export serves with first (SGLang: its directory and SERVE.md's first command), i.e. fused: the rule is
eagle3/config/resolve.py `image_embeddings`, the convention each engine feeds eagle3/engines/serve_launch.py `ENGINE_DEFAULT`.
The export records the trained convention in config.json under CONFIG_KEY (engines ignore the key).

Standard library at import (drafter_keys and the schemas read its names); torch inside token_embeddings.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from eagle3.config.choices import IMAGE_CONVENTIONS as CONVENTIONS
from eagle3.engines.serve_launch import EXPORT_ENGINE, default_for_engine

CONFIG_KEY = "eagle3_image_embeddings"  # the exported config.json's record of the trained convention

if TYPE_CHECKING:
    import torch


def check_convention(convention: str) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(f"image_embeddings={convention!r}: expected one of {CONVENTIONS}")
    return convention


def rows_problem(convention: str, store, choice: Optional[str] = None) -> Optional[str]:
    """Why `convention` cannot read `store` (an eagle3.formats.store.HiddenStateStore), else None: `fused` needs the
    store's fused rows, which an image store captured with image_rows="none" (capture.backend=vllm: vLLM's
    connector has no h = 0, eagle3/engines/vllm_images.py) does not hold. `choice`: the config value (auto is named)."""
    check_convention(convention)
    if convention != "fused" or getattr(store, "image_token_id", None) is None or store.has_fused_image_rows:
        return None
    how = f"image_embeddings={choice} resolves to fused (the {EXPORT_ENGINE} export's)" if choice == "auto" \
        else "image_embeddings=fused"
    return (f"{store.dir}: {how} needs the target's fused input embeddings at image rows, but this store holds "
            f"none (image_rows={store.image_rows!r}: captured with capture.backend=vllm, whose hidden-state "
            "connector cannot give them); set image_embeddings=placeholder (what vLLM serves) or capture with "
            "capture.backend=hf")


def serving_mismatch(trained: str, engine: str) -> Optional[str]:
    """A one-line warning when `engine` feeds the drafter other image rows than it was trained on, else None."""
    served = default_for_engine(engine)
    if check_convention(trained) == served:
        return None
    return (f"trained with image_embeddings={trained} but {engine} feeds {served} rows at image positions: "
            "expect a lower accept length on image traffic (text traffic is unaffected)")


def token_embeddings(embed_tokens: torch.nn.Module, input_ids: torch.Tensor, convention: str,
                     image_token_id: Optional[int] = None, image_embeds: Optional[torch.Tensor] = None
                     ) -> Optional[torch.Tensor]:
    """The drafter's input embeddings [..., T, H] of `input_ids` [..., T] under `convention`, or None when they
    are plain embed_tokens(input_ids) (placeholder, or no image rows): callers then embed the ids themselves.
    fused: image rows (input_ids == image_token_id, row-major) take `image_embeds` [n, H] in order."""
    check_convention(convention)
    if convention == "placeholder" or image_token_id is None:
        return None
    is_image = input_ids == image_token_id
    n = int(is_image.sum())
    if n == 0:
        return None
    if image_embeds is None or image_embeds.shape[0] != n:
        got = None if image_embeds is None else tuple(image_embeds.shape)
        raise ValueError(f"image_embeddings=fused: {n} image rows need {n} fused embeddings, got {got} "
                         "(a store captured without images? use placeholder or recapture)")
    emb = embed_tokens(input_ids)
    return emb.masked_scatter(is_image.unsqueeze(-1), image_embeds.to(emb.device, emb.dtype))
