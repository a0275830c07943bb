"""Kimi-K2.5's image preprocessing, with PIL and numpy (torchvision cannot be imported on the project's
CPU machines): decode -> RGB -> resize by K2.5's rule -> pad -> rescale + normalize -> 14x14 patches.

The rule (transformers 5.24 `Kimi_K25ImageProcessor` / `navit_resize`, the release's preprocessor):
  * patches of 14 pixels, merged 2x2 into one LM position, so each side is padded to a multiple of 28;
  * the image is never upscaled; it is shrunk (aspect kept) until it holds at most `max_patches`
    (16384) patches of 14 and at most `max_side_patches` (512) patches along each side;
  * the new size truncates (`int(side * scale)`, at least 1); the padding goes at the bottom and the right
    with black (pixel value 0, so -1 after normalization); resampling is bicubic;
  * pixels are rescaled by 1/255 and normalized with mean 0.5, std 0.5 per channel;
  * `pixel_values` [N, 3, 14, 14] lists the patches row by row; `image_grid_thw` = (1, H/14, W/14);
  * the LM sees `image_grid_thw.prod() // merge**2` positions per image (one `<|media_pad|>` each).

What can differ from transformers: it resizes uint8 tensors with torchvision's antialiased bicubic, this
module with PIL's; the two round a pixel differently in places (no resize, as for an image whose sides
fit the caps, gives the same pixels). Sizes, grids and pad counts are the same arithmetic.

Sizes and counts are pure (stdlib); decoding and pixels import PIL / numpy when called.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from eagle3.errors import StageError

PATCH_SIZE = 14
MERGE_SIZE = 2
MAX_PATCHES = 16384  # patches of PATCH_SIZE per image, after the resize
MAX_SIDE_PATCHES = 512  # patches along one side (the processor's size.max_height = max_width)
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
# Decoded images larger than this are refused before any resize (a decompression bomb or a scan that
# would be shrunk by a factor of hundreds): 64 Mpixel, 4x K2.5's largest input (7168 x 7168 pixels).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(StageError, ValueError):
    """An image that cannot be used (missing, undecodable, too large, an unsupported source)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class ImageRule:
    """K2.5's resize / pad rule's knobs (the release's values by default)."""
    patch_size: int = PATCH_SIZE
    merge_size: int = MERGE_SIZE
    max_patches: int = MAX_PATCHES
    max_side_patches: int = MAX_SIDE_PATCHES

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size  # 28: each padded side is a multiple of this


K25 = ImageRule()


def resized_and_padded(height: int, width: int, rule: ImageRule = K25) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) of an image of `height` x `width` pixels under `rule`."""
    if height < 1 or width < 1:
        raise ImageError("bad_image", f"image of {height}x{width} pixels")
    p, side_cap = rule.patch_size, rule.max_side_patches * rule.patch_size
    patches = max(1, height // p) * max(1, width // p)  # whole patches in the original (at least one a side)
    scale = min(1.0, math.sqrt(rule.max_patches / patches), side_cap / height, side_cap / width)
    new_h = min(max(1, int(height * scale)), side_cap)
    new_w = min(max(1, int(width * scale)), side_cap)
    f = rule.factor
    return (new_h, new_w), (-(-new_h // f) * f, -(-new_w // f) * f)


def grid_thw(height: int, width: int, rule: ImageRule = K25) -> tuple[int, int, int]:
    """`image_grid_thw` of one image: (1, padded h / patch, padded w / patch)."""
    _, (ph, pw) = resized_and_padded(height, width, rule)
    return 1, ph // rule.patch_size, pw // rule.patch_size


def media_pad_count(grid: tuple[int, int, int] | list[int], rule: ImageRule = K25) -> int:
    """LM positions (`<|media_pad|>` tokens) of one image: `image_grid_thw.prod() // merge**2`."""
    t, h, w = (int(x) for x in grid)
    if h % rule.merge_size or w % rule.merge_size:
        raise ImageError("bad_grid", f"grid {t}x{h}x{w} is not a multiple of the merge size {rule.merge_size}")
    return t * h * w // rule.merge_size ** 2


# ---------------------------------------------------------------------------------------------- pixels

def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS):
    """Bytes -> an RGB PIL image (transparency composited onto white, as transformers does).
    Raises ImageError("undecodable_image" | "oversized_image", ...)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError("oversized_image", f"{w}x{h} pixels > the limit {max_pixels:,}")
            img.load()
            return _to_rgb(img)
    except ImageError:
        raise
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, DecompressionBombError...
        raise ImageError("undecodable_image", f"{type(e).__name__}: {e}") from e


def _to_rgb(img):
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB") if img.mode != "RGB" else img.copy()


def preprocess(img, rule: ImageRule = K25):
    """An RGB PIL image -> (pixel_values float32 [N, 3, p, p], image_grid_thw (1, gh, gw)), N = gh * gw,
    the patches row by row (row-major over the grid), each channel-first."""
    import numpy as np
    from PIL import Image

    (rh, rw), (ph, pw) = resized_and_padded(img.height, img.width, rule)
    if (rh, rw) != (img.height, img.width):
        img = img.resize((rw, rh), resample=Image.Resampling.BICUBIC)
    canvas = np.zeros((ph, pw, 3), dtype=np.uint8)  # black padding at the bottom and the right
    canvas[:rh, :rw] = np.asarray(img, dtype=np.uint8)
    x = canvas.astype(np.float32) / 255.0
    x = (x - np.asarray(MEAN, np.float32)) / np.asarray(STD, np.float32)
    p = rule.patch_size
    gh, gw = ph // p, pw // p
    patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return np.ascontiguousarray(patches), (1, gh, gw)


def preprocess_many(images: list, rule: ImageRule = K25):
    """Several RGB images -> (pixel_values [sum N, 3, p, p], image_grid_thw int64 [n, 3]) in order, the
    batch layout of the HF forward."""
    import numpy as np

    if not images:
        p = rule.patch_size
        return np.zeros((0, 3, p, p), np.float32), np.zeros((0, 3), np.int64)
    parts = [preprocess(img, rule) for img in images]
    return np.concatenate([pv for pv, _ in parts]), np.asarray([g for _, g in parts], dtype=np.int64)


# ---------------------------------------------------------------------------------------------- sources

def image_bytes(source: str, base_dir: Optional[Path] = None, max_bytes: int = 64 * 1024 * 1024) -> bytes:
    """The bytes an image reference names: a `data:image/...;base64,` URI, a `file://` URL or a local path
    (relative to `base_dir`). Remote URLs are refused (nothing is downloaded). Raises ImageError."""
    if not isinstance(source, str) or not source:
        raise ImageError("missing_image", f"image reference {source!r} is not a non-empty string")
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if not head.endswith(";base64"):
            raise ImageError("undecodable_image", f"data URI {head[:40]!r} is not base64")
        if len(payload) * 3 // 4 > max_bytes:
            raise ImageError("oversized_image", f"data URI of ~{len(payload) * 3 // 4:,} bytes > {max_bytes:,}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError("undecodable_image", f"data URI: bad base64 ({e})") from e
    if source.startswith(("http://", "https://")):
        raise ImageError("remote_image", f"{source[:80]}: remote images are not fetched; inline them as data URIs")
    path = Path(source[len("file://"):] if source.startswith("file://") else source)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise ImageError("missing_image", f"{path}: no such file")
    size = path.stat().st_size
    if size > max_bytes:
        raise ImageError("oversized_image", f"{path}: {size:,} bytes > {max_bytes:,}")
    return path.read_bytes()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    """Bytes -> a base64 data URI (what a chat request carries)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def sniff_mime(data: bytes) -> str:
    """The MIME type of encoded image bytes from their signature (PNG, JPEG, GIF, WebP, BMP), else PNG."""
    for sig, mime in ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"),
                      (b"BM", "image/bmp")):
        if data.startswith(sig):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"
