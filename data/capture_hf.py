"""The hf capture backend (capture.backend=hf): the target loaded with transformers in this process,
forward hooks on the aux layers (eagle3/target_model/target_io.py), the final norm's post-norm state and a chunked
full-vocab argmax, written batch by batch into the split's store. One `CaptureBackend`
(data/capture_backends.py).

After each batch the loop fires the test hook point `capture.after_batch` (eagle3/hooks.py; nothing
is installed outside tests): a resume test slows the capture there so it can kill it mid-work.
"""
from __future__ import annotations

import time

import torch

from data.capture_plan import CaptureError, Seq, make_batches
from eagle3 import hooks
from eagle3.target_model import target_io
from eagle3.config.dtypes import torch_dtype
from eagle3.formats.store_format import FUSED
from eagle3.formats.store import HiddenStateWriter, NonFiniteHiddenStateError

PAD_ID = 0  # any valid id: padded positions are masked out of attention and never stored


class HfBackend:
    """The target in this process (transformers), one device per process unless device_map places it."""
    name = "hf"
    image_rows = FUSED  # an image capture keeps the fused input embedding of every image row

    def __init__(self) -> None:
        self.model = None

    def check(self, cfg, hf_indices: list[int], num_layers: int, max_len: int, dist,
              image_token_id: int | None = None) -> None:
        """Nothing to check before the work: the model load is the work's first step."""

    def open(self, cfg, text_cfg: dict, max_len: int, dist) -> None:
        self.model, _ = target_io.load_target(cfg.target.path, cfg.target.layout, cfg.target.dtype,
                                              cfg.target.device_map, cfg.target.trust_remote_code)
        if cfg.target.device_map is None:
            self.model.to(_process_device(dist))

    def capture_split(self, ds, seqs: list[Seq], writer: HiddenStateWriter, cfg, hf_indices: list[int], dist,
                      desc: str, image_token_id: int | None = None) -> dict:
        return capture_split(self.model, ds, seqs, writer, cfg, hf_indices, dist, desc=desc,
                             image_token_id=image_token_id)

    def close(self) -> None:
        self.model = None


def capture_batch(model, text_model, batch_ids: list[torch.Tensor], hf_indices: list[int], store_dtype: torch.dtype,
                  argmax_chunk_tokens: int, images: list | None = None, image_token_id: int | None = None):
    """Forward one right-padded batch with hooks. Returns per sequence (aux [T,3H], last [T,H],
    argmax [T], finite: bool, image rows [n,H] or None): aux/last in the store dtype, left on the device (the
    store writer copies them to pinned host memory on a side stream, overlapping the next forward); argmax on
    the CPU. The finiteness check runs on the device (a CPU scan of 57 KB/token costs more).

    `images` (an image capture): per sequence None or (pixel_values, image_grid_thw); the text model then
    runs on the fused input embeddings (eagle3/target_model/target_images.py), whose image rows come back per sequence."""
    B, Tmax = len(batch_ids), max(len(x) for x in batch_ids)
    device = target_io.input_device(model)
    input_ids = torch.full((B, Tmax), PAD_ID, dtype=torch.long)
    attn = torch.zeros((B, Tmax), dtype=torch.long)
    for b, x in enumerate(batch_ids):
        input_ids[b, : len(x)] = x
        attn[b, : len(x)] = 1
    input_ids = input_ids.to(device)
    with torch.no_grad(), target_io.AuxHiddenCapture(model, hf_indices) as cap:
        fused = None
        if image_token_id is not None:
            fused = _fused_embeddings(model, input_ids, image_token_id, images or [None] * B)
        if fused is None:
            text_model(input_ids=input_ids, attention_mask=attn.to(device), use_cache=False)
        else:
            text_model(inputs_embeds=fused, attention_mask=attn.to(device), use_cache=False)
        last = cap.last.to(store_dtype)  # [B, Tmax, H], what lm_head consumes
        argmax = target_io.argmax_from_last(model, cap.last, argmax_chunk_tokens)  # [B, Tmax]
        aux = cap.aux_concat().to(store_dtype)  # [B, Tmax, 3H]
        pad = attn.to(aux.device) == 0
        finite = ((torch.isfinite(aux).all(-1) & torch.isfinite(last.to(aux.device)).all(-1)) | pad).all(-1)
        argmax, finite = argmax.cpu(), finite.cpu().tolist()
        rows = [None] * B
        if image_token_id is not None:  # only the image rows' fused embeddings are kept
            emb = fused if fused is not None else None
            rows = [(emb[b, : len(x)][x.to(device) == image_token_id].to(store_dtype) if emb is not None
                     else torch.empty(0, last.shape[-1], dtype=store_dtype)) for b, x in enumerate(batch_ids)]
    return [(aux[b, : len(x)], last[b, : len(x)], argmax[b, : len(x)], finite[b], rows[b])
            for b, x in enumerate(batch_ids)]


def _fused_embeddings(model, input_ids: torch.Tensor, image_token_id: int, images: list):
    """Fused input embeddings [B, T, H] of a batch with images (None when it has none)."""
    from eagle3.target_model import target_images

    present = [im for im in images if im is not None]
    if not present:
        return None
    pixel_values = torch.cat([pv for pv, _ in present])
    grid = torch.cat([g for _, g in present])
    features = target_images.image_features(model, pixel_values, grid)
    return target_images.fused_input_embeddings(model, input_ids, image_token_id, features)


def kept_image_count(row: dict, kept_ids: torch.Tensor, image_token_id: int) -> int:
    """How many of a prepared row's images its kept tokens hold: all of them, or the first k when capture
    truncated the sequence after the k-th image's last row. Raises CaptureError when the truncation cuts an
    image (its sequence is skipped)."""
    from eagle3.target_model import images as rule

    data, grid_flat = row.get("images") or [], row.get("image_grid_thw") or []
    n_rows = int((kept_ids == image_token_id).sum())
    if not data and n_rows == 0:
        return 0
    counts = [rule.media_pad_count(grid_flat[3 * i: 3 * i + 3]) for i in range(len(data))]
    ends = [sum(counts[:k]) for k in range(len(counts) + 1)]
    if n_rows not in ends:
        raise CaptureError(f"{n_rows} image rows in the kept tokens match no whole number of the images' "
                           f"{counts} rows (an image cut by max_seq_len, or ids from another tokenizer)")
    return ends.index(n_rows)


def sequence_images(row: dict, kept_ids: torch.Tensor, image_token_id: int):
    """(pixel_values, image_grid_thw) of the images a sequence's kept tokens hold (kept_image_count), None
    without images. Raises CaptureError when the truncation cuts an image (its sequence is skipped)."""
    from eagle3.target_model.target_images import pixel_inputs

    data, grid_flat = row.get("images") or [], row.get("image_grid_thw") or []
    k = kept_image_count(row, kept_ids, image_token_id)
    if k == 0:
        return None
    try:
        return pixel_inputs(data[:k], grid_flat[: 3 * k])
    except (target_io.TargetError, ValueError) as e:
        raise CaptureError(str(e)) from e


def capture_split(model, ds, seqs: list[Seq], writer: HiddenStateWriter, cfg, hf_indices: list[int], dist: Dist,
                  desc: str, image_token_id: int | None = None) -> dict:
    """Capture this process's batches of one split into `writer` (resuming: committed sequences
    are skipped, a batch partly committed is recomputed whole so its values are unchanged)."""
    from tqdm import tqdm

    store_dtype = torch_dtype(cfg.dtype)
    batches = make_batches(seqs, cfg.max_tokens_per_batch)[dist.rank::dist.world]
    todo = [b for b in batches if any(s.id not in writer.done_ids for s in b)]
    tm = target_io.text_model(model)
    non_finite: list[str] = []
    total = sum(s.length for b in todo for s in b)
    start = time.time()
    with tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not (cfg.progress and dist.is_main),
              mininterval=1.0, smoothing=0.1) as bar:
        for batch in todo:
            rows = [ds[s.index] for s in batch]
            ids = [torch.as_tensor(r["input_ids"][: s.length], dtype=torch.long) for r, s in zip(rows, batch)]
            masks = [torch.as_tensor(r["loss_mask"][: s.length], dtype=torch.bool) for r, s in zip(rows, batch)]
            images, cut = [None] * len(batch), {}
            if image_token_id is not None:
                for i, (r, x) in enumerate(zip(rows, ids)):
                    try:
                        images[i] = sequence_images(r, x, image_token_id)
                    except CaptureError as e:
                        cut[i] = str(e)
                keep = [i for i in range(len(batch)) if i not in cut]
                for i, why in cut.items():
                    if batch[i].id not in writer.done_ids:
                        writer.skip(batch[i].id, "image_mismatch")
                        print(f"[capture] skipped {batch[i].id!r}: {why}")
                batch, ids, masks, images = ([v[i] for i in keep] for v in (batch, ids, masks, images))
                if not batch:
                    continue
            outs = capture_batch(model, tm, ids, hf_indices, store_dtype, cfg.argmax_chunk_tokens, images,
                                 image_token_id)
            for s, x, m, (aux, last, am, finite, image_rows) in zip(batch, ids, masks, outs):
                if s.id in writer.done_ids:
                    continue
                if not finite:
                    writer.skip(s.id, "non_finite")
                    non_finite.append(s.id)
                    print(f"[capture] skipped: {NonFiniteHiddenStateError(s.id, 'aux/last')}")
                    continue
                writer.add(s.id, x, m, aux, last, am, order=s.order, check_finite=False, image_embeds=image_rows)
            bar.update(sum(s.length for s in batch))
            hooks.fire(hooks.CAPTURE_AFTER_BATCH, sequences=[s.id for s in batch])
    return {"batches": len(batches), "batches_run": len(todo), "tokens_run": total,
            "seconds": round(time.time() - start, 3), "non_finite_this_run": non_finite}


def _process_device(dist: Dist) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", dist.rank % torch.cuda.device_count())
    return torch.device("cpu")
