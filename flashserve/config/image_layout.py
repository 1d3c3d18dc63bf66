"""Image geometry of V4.1 (docs/architecture.md#image-preprocessing, #image-span): the size an image is brought to, its
14-pixel patch grid, the 3×3 merged grid the language model sees, and the span of tokens it fills. Pure arithmetic (no
torch, no Pillow), so the planner, the server's limits and the preprocessing all count the same tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .model_config import VisionConfig


@dataclass(frozen=True)
class ImageGrid:
    """Where an image of ``source`` size ends up."""

    source: tuple[int, int]  # (width, height) as decoded
    size: tuple[int, int]  # (width, height) after min-pixel upscaling and any shrink to the token budget
    padded: tuple[int, int]  # (width, height) padded to whole patches: the pixels the ViT reads
    patches: tuple[int, int]  # (rows, cols) of 14-pixel patches
    cells: tuple[int, int]  # (rows, cols) of 3×3-merged cells: aligner rows, one per IMAGE slot

    @property
    def span_tokens(self) -> int:
        """Positions of the image's span: start, rows of IMAGE slots each closed by a newline slot, end."""
        rows, cols = self.cells
        return rows * (cols + 1) + 2


def span_tokens_for(width: int, height: int, v: VisionConfig) -> int:
    """Span positions of a ``width``×``height`` image with no shrinking (may exceed ``max_image_tokens``)."""
    rows, cols = _cells(width, height, v)
    return rows * (cols + 1) + 2


def _cells(width: int, height: int, v: VisionConfig) -> tuple[int, int]:
    p, k = v.patch_size, v.downsample_ratio
    return math.ceil(math.ceil(height / p) / k), math.ceil(math.ceil(width / p) / k)


def _upscaled(width: int, height: int, min_pixels: int) -> tuple[int, int]:
    """Small images are scaled up (both sides by the same factor, truncated) to about ``min_pixels``."""
    if 0 < width * height < min_pixels:
        s = math.sqrt(min_pixels / (width * height))
        return max(1, int(width * s)), max(1, int(height * s))
    return width, height


def _shrunk(width: int, height: int, v: VisionConfig) -> tuple[int, int]:
    """The largest aspect-preserving size whose span fits ``max_image_tokens``: a binary search on the scale
    (the span grows with it). Each side keeps at least one pixel, so a very tall image ends as one column
    of cells and a very wide one as one row."""
    if span_tokens_for(width, height, v) <= v.max_image_tokens:
        return width, height

    def at(s: float) -> tuple[int, int]:
        return max(1, int(width * s)), max(1, int(height * s))

    lo, hi = 0.0, 1.0  # span(at(lo)) fits (or lo = 0), span(at(hi)) does not
    for _ in range(60):
        mid = (lo + hi) / 2
        if span_tokens_for(*at(mid), v) <= v.max_image_tokens:
            lo = mid
        else:
            hi = mid
    w, h = at(lo)
    if span_tokens_for(w, h, v) > v.max_image_tokens:
        raise ValueError(f"max_image_tokens = {v.max_image_tokens} cannot hold even a one-cell image")
    return w, h


def image_grid(width: int, height: int, v: VisionConfig) -> ImageGrid:
    """The geometry of a ``width``×``height`` image under ``v`` (both sides must be at least 1)."""
    if width < 1 or height < 1:
        raise ValueError(f"an image needs both sides of at least 1 pixel, got {width}x{height}")
    w, h = _shrunk(*_upscaled(width, height, v.min_pixels), v)
    p = v.patch_size
    prow, pcol = math.ceil(h / p), math.ceil(w / p)
    return ImageGrid(source=(width, height), size=(w, h), padded=(pcol * p, prow * p), patches=(prow, pcol),
                     cells=_cells(w, h, v))
