"""The target's image path for capture: stored image bytes -> pixel_values / image_grid_thw (eagle3/target_model/images.py),
the vision tower + projector's features, and the fused input embeddings the text model reads.

This is the K2.5 multimodal forward (transformers 5.24 `Kimi_K25Model.forward`) taken apart so the fused
embeddings can be kept: the image rows' ids are embedded as id 0 and then overwritten, in row-major order over
[B, T], by the projector's output rows (`masked_scatter`); the text model runs on those embeddings, so
`hidden_states[0]` at an image row is the projector output and every later state is the wrapper's own.

Imports only torch (and eagle3's PIL/numpy image rule when pixels are made).
"""
from __future__ import annotations

import torch

from eagle3.target_model.target_io import TargetError, text_model


def pixel_inputs(images: list[bytes], grid_flat: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A record's stored images -> (pixel_values float32 [N, 3, 14, 14], image_grid_thw int64 [n, 3]); each
    image's grid recomputed by K2.5's rule must be the one prepare stored."""
    import numpy as np

    from eagle3.target_model import images as rule

    grids = np.asarray(grid_flat, dtype=np.int64).reshape(-1, 3)
    if len(grids) != len(images):
        raise TargetError(f"{len(images)} images but {len(grids)} image_grid_thw rows")
    pv, thw = rule.preprocess_many([rule.decode_image(b) for b in images])
    if thw.tolist() != grids.tolist():
        raise TargetError(f"image_grid_thw {thw.tolist()} of the decoded images != the prepared {grids.tolist()} "
                          "(another image rule?); rerun prepare")
    return torch.from_numpy(pv), torch.from_numpy(thw)


def image_features(model: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """The projector's output rows [M, H] (M = sum of grid.prod() // 4), images in order."""
    wrapper = getattr(model, "model", None)
    fn = getattr(wrapper, "get_image_features", None)
    if fn is None:
        raise TargetError(f"{type(model).__name__}: no vision tower path (model.get_image_features); image capture "
                          "needs transformers' native Kimi_K25ForConditionalGeneration")
    vision = wrapper.vision_tower
    dtype = next(vision.parameters()).dtype
    device = next(vision.parameters()).device
    out = fn(pixel_values.to(device, dtype), image_grid_thw=grid_thw.to(device), return_dict=True)
    return torch.cat(list(out.pooler_output), dim=0)


def fused_input_embeddings(model: torch.nn.Module, input_ids: torch.Tensor, image_token_id: int,
                           features: torch.Tensor) -> torch.Tensor:
    """[B, T, H] input embeddings with the image rows (input_ids == image_token_id, row-major) replaced by
    `features` [M, H]; a count mismatch is an error (as in transformers)."""
    emb_layer = text_model(model).embed_tokens
    is_image = input_ids == image_token_id
    n = int(is_image.sum())
    if n != features.shape[0]:
        raise TargetError(f"{n} image token positions (id {image_token_id}) but {features.shape[0]} image feature "
                          "rows: the <|media_pad|> count does not match the images")
    ids = input_ids.masked_fill(is_image, 0)
    emb = emb_layer(ids)
    return emb.masked_scatter(is_image.unsqueeze(-1).to(emb.device), features.to(emb.device, emb.dtype))
