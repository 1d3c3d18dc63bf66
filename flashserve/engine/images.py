"""Image input (docs/architecture.md#image-preprocessing, #image-span): bytes → checked, decoded image → patches on the
grid the model reads, and the expansion of each ``<｜deepseek_image｜>`` placeholder of a prompt into that image's span.

Every check runs before any pixel is decoded where it can (size in bytes, then the header's width and height),
so a decompression bomb costs a header read, not memory.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..config.image_layout import ImageGrid, image_grid
from ..config.model_config import VisionConfig
from .sampling_params import RequestError

FORMATS = ("PNG", "JPEG", "WEBP")
PAD_COLOUR = (127, 127, 127)


class ImageError(RequestError):
    """An image the engine will not read; the message says why (the server answers 400)."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send: images, encoded bytes per image, decoded pixels per image."""

    max_images: int = 8
    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000  # 40 MP (a 20000x20000 image is refused from its header)


@dataclass
class ImageInput:
    """One preprocessed image: its grid, the patches the ViT reads, and a digest of its pixels."""

    grid: ImageGrid
    patches: torch.Tensor  # [rows·cols, 3·p·p] float32, row-major patches, each (channel, py, px)
    digest: bytes  # blake2b of the decoded RGB pixels and size: equal images share prefix-cache pages

    @property
    def span_tokens(self) -> int:
        return self.grid.span_tokens


@dataclass
class ImageSpan:
    """An image placed in a prompt: positions ``start`` to ``start + length`` carry its embeddings."""

    start: int
    length: int
    digest: bytes
    embeds: torch.Tensor  # [length, D]


def bytes_from_data_url(url: str) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError("image_url: expected a data URL of the form data:image/png;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"image_url: the base64 data does not decode ({e})") from None


def decode_image(data: bytes, limits: ImageLimits):
    """Checked RGB ``PIL.Image`` from encoded ``data`` (PNG, JPEG or WebP)."""
    from PIL import Image

    if not data:
        raise ImageError("image: no bytes")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image: {len(data)} bytes exceed the limit of {limits.max_bytes}")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # Pillow's own guard, from the header, for far larger images
        raise ImageError(f"image: its pixels exceed the limit of {limits.max_pixels}") from None
    except Exception as e:  # Pillow raises UnidentifiedImageError and assorted errors for garbage
        raise ImageError(f"image: not a readable image ({type(e).__name__})") from None
    if img.format not in FORMATS:
        raise ImageError(f"image: format {img.format} is not accepted; send {', '.join(FORMATS)}")
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"image: zero size ({w}x{h})")
    if w * h > limits.max_pixels:
        raise ImageError(f"image: {w}x{h} = {w * h} pixels exceed the limit of {limits.max_pixels}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
    except Exception as e:
        raise ImageError(f"image: corrupt or truncated {img.format} data ({type(e).__name__}: {e})") from None
    return img.convert("RGB")


def preprocess(img, v: VisionConfig) -> ImageInput:
    """Resize (min-pixel upscaling, shrink to the token budget), pad centred with grey to whole patches,
    scale to [-1, 1], cut into row-major patches."""
    from PIL import Image

    digest = hashlib.blake2b(repr(img.size).encode() + img.tobytes(), digest_size=16).digest()
    grid = image_grid(*img.size, v)
    if grid.size != img.size:
        img = img.resize(grid.size, Image.Resampling.BICUBIC)
    (pw, ph), (w, h) = grid.padded, grid.size
    canvas = Image.new("RGB", (pw, ph), PAD_COLOUR)
    canvas.paste(img, ((pw - w) // 2, (ph - h) // 2))
    x = torch.from_numpy(np.asarray(canvas, dtype=np.float32).copy()) / 255.0  # [H, W, 3]
    x = (x - 0.5) / 0.5
    p, (rows, cols) = v.patch_size, grid.patches
    patches = x.view(rows, p, cols, p, 3).permute(0, 2, 4, 1, 3).reshape(rows * cols, 3 * p * p)
    return ImageInput(grid, patches, digest)


def load_images(items: list, v: VisionConfig | None, limits: ImageLimits) -> list[ImageInput]:
    """``items`` (encoded bytes, ``PIL.Image`` or :class:`ImageInput`) → preprocessed images."""
    if not items:
        return []
    if v is None:
        raise ImageError("this model reads text only (no vision tower): remove the images from the request")
    if len(items) > limits.max_images:
        raise ImageError(f"{len(items)} images exceed the limit of {limits.max_images} per request")
    out = []
    for item in items:
        if isinstance(item, ImageInput):
            out.append(item)
        elif isinstance(item, (bytes, bytearray)):
            out.append(preprocess(decode_image(bytes(item), limits), v))
        else:
            out.append(preprocess(item.convert("RGB"), v))
    return out


def expand_placeholders(ids: list[int], images: list[ImageInput], image_token_id: int) -> tuple[list[int], list[int]]:
    """Each placeholder (one ``image_token_id``) of ``ids`` becomes its image's span of that id, in order.
    Returns the expanded ids and each span's start."""
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(images):
        raise ImageError(f"prompt: {len(at)} image placeholders for {len(images)} images; put one "
                         f"image placeholder (token {image_token_id}) where each image goes")
    out: list[int] = []
    starts = []
    prev = 0
    for pos, img in zip(at, images):
        out.extend(ids[prev:pos])
        starts.append(len(out))
        out.extend([image_token_id] * img.span_tokens)
        prev = pos + 1
    out.extend(ids[prev:])
    return out, starts


def page_salt(spans: list[ImageSpan], lo: int, hi: int) -> bytes:
    """What besides token ids decides the cached state of positions [lo, hi): the digests (and offsets) of
    the images whose spans overlap it. Every span position has the same id, so without this two different
    images would share cached pages."""
    parts = [s.digest + s.start.to_bytes(8, "little") for s in spans if s.start < hi and s.start + s.length > lo]
    return b"".join(parts)


def chunk_embeds(spans: list[ImageSpan], lo: int, hi: int, out: torch.Tensor) -> bool:
    """Write the span rows that fall in positions [lo, hi) into ``out`` [hi - lo, D]; True if any did."""
    hit = False
    for s in spans:
        a, b = max(lo, s.start), min(hi, s.start + s.length)
        if a < b:
            out[a - lo:b - lo] = s.embeds[a - s.start:b - s.start]
            hit = True
    return hit
