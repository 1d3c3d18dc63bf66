"""Image geometry against docs/architecture.md#image-preprocessing and #image-span, on the released vision settings
(14-px patches, 3x3 cells, min_pixels 544², at most 1024 span tokens)."""

import math

import pytest

from flashserve.config.image_layout import image_grid
from flashserve.config.presets import preset_config

V = preset_config("deepseek-v41-flash").vision


def spec_span(w: int, h: int) -> int:
    """The formula of docs/architecture.md#image-preprocessing, written out: n_llm_h·(n_llm_w + 1) + 2 with n_llm = ceil(ceil(side / 14) / 3)."""
    n_h = math.ceil(math.ceil(h / 14) / 3)
    n_w = math.ceil(math.ceil(w / 14) / 3)
    return n_h * (n_w + 1) + 2


@pytest.mark.parametrize("w,h,size,span", [
    (1, 1, (544, 544), 13 * 14 + 2),  # tiny: upscaled to min_pixels (544² exactly)
    (544, 544, (544, 544), 13 * 14 + 2),  # at min_pixels: unchanged
    (840, 420, (840, 420), 10 * 21 + 2),  # exact multiples of 42 px: 60x30 patches, 20x10 cells
    (841, 421, (841, 421), 11 * 22 + 2),  # one pixel over: one more patch, one more cell each way
    (640, 480, (640, 480), 12 * 17 + 2),
    (100, 3000, (100, 3000), spec_span(100, 3000)),  # tall and thin, within budget: 72 rows of 3 cells
    (10000, 10, (17202, 17), 1 * 411 + 2),  # extreme aspect, upscaled by sqrt(295936 / 100000) = 1.7203, truncated
])
def test_span_tokens_follow_the_spec(w, h, size, span):
    g = image_grid(w, h, V)
    assert g.size == size
    assert g.span_tokens == span == spec_span(*size)
    assert g.padded == (math.ceil(size[0] / 14) * 14, math.ceil(size[1] / 14) * 14)
    assert g.patches == (g.padded[1] // 14, g.padded[0] // 14)


@pytest.mark.parametrize("w,h", [(4000, 3000), (1920, 1080), (3000, 3000), (300, 100000), (100000, 300)])
def test_over_budget_images_shrink_to_the_largest_grid_that_fits(w, h):
    assert spec_span(w, h) > V.max_image_tokens
    g = image_grid(w, h, V)
    gw, gh = g.size
    assert g.span_tokens == spec_span(gw, gh) <= V.max_image_tokens
    if min(gw, gh) > 1:  # aspect kept to a pixel
        assert abs(gw / gh - w / h) <= (w / h) * (1 / min(gw, gh) + 1e-9) * 2
    # the largest: one more percent of scale would not fit
    bigger = (math.ceil(gw * 1.01), math.ceil(gh * 1.01))
    assert spec_span(*bigger) > V.max_image_tokens or bigger[0] >= w


def test_very_tall_and_very_wide_images_end_as_one_column_or_row():
    assert image_grid(10, 2_000_000, V).cells[1] == 1
    assert image_grid(2_000_000, 10, V).cells[0] == 1


def test_zero_size_is_refused():
    with pytest.raises(ValueError, match="at least 1 pixel"):
        image_grid(0, 10, V)
