"""One joint step of k25-mini's vision training without per-step overhead (`JointStep`), the same numbers
as `wrapper(**collate(batch), labels=...)` + the text blocks' loss, bit for bit.

What the plain loop did every step, and what this does instead (benchmarks/vision_step.py measures both):
- collate: per-example `torch.tensor` copies and a `torch.cat` of 64 pixel tensors -> the pool is padded and
  stacked once (`PoolTensors`, on the training device); a batch is one gather per tensor and a slice to the
  batch's longest conversation (known on the host, no sync).
- the tower's index tensors (position ids, position-table interpolation taps, frame index, sequence bounds,
  the 2 x 2 merge index) came from per-image Python loops over `grid_thw.tolist()` (host syncs on CUDA) ->
  computed once per distinct batch of grids (`tower_inputs`) and handed to the tower, which pops them
  (transformers' vision_utils contract for precomputed values).
- the wrapper's fused embedding: `ids[mask] = 0` (a nonzero, a sync), the placeholder-count check (a sync),
  `split(...tolist())` + `cat` of the projector rows (a sync) -> `masked_fill`, the count checked once per pool
  example on the host, the projector rows used as they come. Same ops on the same values otherwise.
- the losses stay on the device (`losses()` reads them at the end; `optimise` checks them every few steps).
"""
from __future__ import annotations

import torch

IGNORE = -100  # labels outside the assistant answers (transformers' ignore_index)


class PoolTensors:
    """The image pool padded and stacked once, on `device`: ids / labels / attention mask [P, T_max],
    pixel_values [P, N, 3, 14, 14], image_grid_thw [P, 3]; `batch(idx)` = `vision.collate` of those examples."""

    def __init__(self, pool, pad_id: int, image_token_id: int, media_pads, device: torch.device):
        if not pool:
            raise ValueError("the image pool is empty")
        lens = [len(e.ids) for e in pool]
        shapes = {tuple(e.pixels.shape) for e in pool}
        if len(shapes) != 1:
            raise ValueError(f"the pool's images differ in patch count ({sorted(shapes)}); the stacked pool needs "
                             "one image size")
        for i, e in enumerate(pool):  # the wrapper's placeholder check, once per example instead of per step
            if e.ids.count(image_token_id) != media_pads(e.grid):
                raise ValueError(f"pool example {i}: {e.ids.count(image_token_id)} <|media_pad|> ids for an image "
                                 f"of {media_pads(e.grid)} rows")
        T = max(lens)
        ids = torch.full((len(pool), T), pad_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE)
        for i, e in enumerate(pool):
            ids[i, : lens[i]] = torch.tensor(e.ids)
            labels[i, : lens[i]] = torch.tensor(e.labels)
        self.lens = torch.tensor(lens)  # host copy: a batch's length without a device sync
        self.device = device
        self.ids, self.labels = ids.to(device), labels.to(device)
        self.mask = (torch.arange(T) < self.lens[:, None]).long().to(device)
        self.pixels = torch.stack([e.pixels for e in pool]).to(device)  # [P, N, 3, 14, 14]
        self.grids = torch.stack([e.grid for e in pool])  # [P, 3], host: the tower's index tensors are keyed on it

    def batch(self, idx: torch.Tensor) -> dict:
        """The examples `idx` (host indices), as `vision.collate` builds them, on the device."""
        T = int(self.lens[idx].max())
        d = idx.to(self.device)
        return {"input_ids": self.ids[d, :T], "labels": self.labels[d, :T], "attention_mask": self.mask[d, :T],
                "pixel_values": self.pixels[d].flatten(0, 1), "image_grid_thw": self.grids[idx]}


def tower_inputs(tower, grid_thw: torch.Tensor, device: torch.device) -> dict:
    """The index tensors transformers 5.24's Kimi-K2.5 vision tower derives from `grid_thw` on every call
    (by its own helpers, so they are the same values), on `device`, under the keys the tower pops."""
    from transformers.models.kimi_k25 import modeling_kimi_k25 as mk
    from transformers import vision_utils as vu

    pe = tower.patch_embed.pos_emb
    indices, weights = vu.get_vision_interpolation_indices_and_weights(
        grid_thw, pe.num_grid_per_side, mode=pe.interpolation_mode, align_corners=pe.interpolation_align_corners)
    cu_seqlens, max_seqlen = vu.get_vision_attention_seqlens(grid_thw, tower.config, merge_temporal=True)
    dest, weight, n_merged = mk.get_vision_temporal_merge_index(grid_thw, *tower.merge_kernel_size)
    out = {"interp_indices": indices, "interp_weights": weights, "frame_index": mk.get_vision_frame_index(grid_thw),
           "position_ids": vu.get_vision_position_ids(grid_thw, spatial_merge_size=1), "cu_seqlens": cu_seqlens,
           "temporal_merge_index": (dest.to(device), weight.to(device), n_merged)}
    if max_seqlen is not None:
        out["max_seqlen"] = max_seqlen
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in out.items()}


class JointStep:
    """`step(i)` -> the joint loss of the next image batch and text batch (the samplers' order; the text loss
    times `text_weight`), as the wrapper's own forward computes it. `image_losses()` / `losses()`: every step's
    figures, read once."""

    def __init__(self, wrapper, pool, text_blocks: torch.Tensor, pad_id: int, images, texts, device: torch.device,
                 text_weight: float = 1.0):
        from eagle3.target_model import images as img_rule

        self.wrapper, self.images, self.texts, self.device = wrapper, images, texts, device
        self.text_weight = text_weight  # the text blocks' loss counts this much next to the image loss
        m = wrapper.model
        self.image_token_id, self.video_token_id = m.config.image_token_id, m.config.video_token_id
        self.pool = PoolTensors(pool, pad_id, self.image_token_id,
                                lambda g: img_rule.media_pad_count(g.tolist()), device)
        self.text_blocks = text_blocks.to(device) if texts is not None else None
        self._tower: dict[bytes, dict] = {}
        self._image_losses: list[torch.Tensor] = []

    def image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The projector rows [n_merged, H] of `Kimi_K25Model.get_image_features`, without its split."""
        m = self.wrapper.model
        key = grid_thw.numpy().tobytes()
        if key not in self._tower:
            self._tower[key] = tower_inputs(m.vision_tower, grid_thw, self.device)
        pre = dict(self._tower[key])  # the tower pops what it uses
        out = m.vision_tower(pixel_values, grid_thw=grid_thw.to(self.device), **pre)
        return m.mm_projector(out.pooler_output).squeeze(1)

    def token_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """`Kimi_K25Model.forward`'s embedding of `ids`, placeholder ids as id 0 (its `ids[mask] = 0` syncs)."""
        placeholders = (ids == self.image_token_id) | (ids == self.video_token_id)
        return self.wrapper.model.get_input_embeddings()(ids.masked_fill(placeholders, 0))

    def fused_embeddings(self, ids: torch.Tensor, image_rows: torch.Tensor) -> torch.Tensor:
        """`Kimi_K25Model.forward`'s inputs_embeds: the token embeddings, the image placeholders replaced in
        order by the image rows."""
        emb = self.token_embeddings(ids)
        image_mask = (ids == self.image_token_id).unsqueeze(-1)
        return emb.masked_scatter(image_mask, image_rows.to(emb.dtype))

    def image_loss(self, idx: torch.Tensor) -> torch.Tensor:
        b = self.pool.batch(idx)
        emb = self.fused_embeddings(b["input_ids"], self.image_features(b["pixel_values"], b["image_grid_thw"]))
        return self.wrapper(inputs_embeds=emb, attention_mask=b["attention_mask"], labels=b["labels"]).loss

    def __call__(self, step: int) -> torch.Tensor:
        loss = self.image_loss(self.images.next())
        self._image_losses.append(loss.detach())
        if self.texts is not None:
            blocks = self.text_blocks[self.texts.next().to(self.device)]
            text_loss = self.wrapper(inputs_embeds=self.token_embeddings(blocks), labels=blocks).loss
            loss = loss + self.text_weight * text_loss
        return loss

    def image_losses(self) -> list[float]:
        return torch.stack(self._image_losses).tolist() if self._image_losses else []
