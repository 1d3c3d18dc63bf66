"""The vision path against a plain per-patch computation written here from docs/architecture.md#vision, and the
preprocessing's pixel layout."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from flashserve.engine.images import preprocess
from flashserve.model.loader import load_model


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-v41", dtype=torch.float64, with_mtp=False)


def _rms(x, w, eps=1e-6):
    return [xi / math.sqrt(sum(t * t for t in x) / len(x) + eps) * wi for xi, wi in zip(x, w)]


def _linear(x, weight, bias=None):
    out = [sum(a * b for a, b in zip(row, x)) for row in weight]
    return out if bias is None else [o + b for o, b in zip(out, bias)]


def _rope(x, a, b, theta):
    """Rotate the pair (x[c], x[c + hd/2]) by angle c: the first hd/4 angles follow row ``a``, the rest col ``b``."""
    hd = len(x)
    half, quarter = hd // 2, hd // 4
    out = list(x)
    for c in range(half):
        pos = a if c < quarter else b
        ang = pos * theta ** (-2 * (c % quarter) / half)
        out[c] = x[c] * math.cos(ang) - x[c + half] * math.sin(ang)
        out[c + half] = x[c] * math.sin(ang) + x[c + half] * math.cos(ang)
    return out


def naive_span(model, patches, grid):
    v = model.cfg.vision
    L = lambda t: t.detach().double().tolist()  # noqa: E731
    rows, cols = grid
    W, H = v.hidden_size, v.num_attention_heads
    hd = W // H
    pe = model.vision.patch_embed.proj
    z = [_linear(p, L(pe.weight), L(pe.bias)) for p in L(patches)]
    pos = [(i // cols, i % cols) for i in range(rows * cols)]
    for blk in model.vision.blocks:
        h = [_rms(x, L(blk.norm1.weight)) for x in z]
        qkv = [_linear(x, L(blk.attn.wqkv.weight), L(blk.attn.wqkv.bias)) for x in h]
        heads_out = []
        for i in range(len(z)):
            out = []
            for hh in range(H):
                def part(which, j):
                    vec = qkv[j][which * W + hh * hd: which * W + (hh + 1) * hd]
                    return _rope(vec, *pos[j], v.rope_theta) if which < 2 else vec
                q = part(0, i)
                scores = [sum(a * b for a, b in zip(q, part(1, j))) / math.sqrt(hd) for j in range(len(z))]
                m = max(scores)
                e = [math.exp(s - m) for s in scores]
                tot = sum(e)
                vals = [part(2, j) for j in range(len(z))]
                out.extend(sum(e[j] / tot * vals[j][d] for j in range(len(z))) for d in range(hd))
            heads_out.append(out)
        z = [[a + b for a, b in zip(x, _linear(o, L(blk.attn.wo.weight), L(blk.attn.wo.bias)))]
             for x, o in zip(z, heads_out)]
        h = [_rms(x, L(blk.norm2.weight)) for x in z]
        mlp = []
        for x in h:
            gu = _linear(x, L(blk.mlp.w1.weight))
            I = len(gu) // 2
            act = [gu[c] / (1 + math.exp(-gu[c])) * gu[I + c] for c in range(I)]
            mlp.append(_linear(act, L(blk.mlp.w2.weight)))
        z = [[a + b for a, b in zip(x, m)] for x, m in zip(z, mlp)]
    z = [_rms(x, L(model.vision.norm.weight)) for x in z]
    k = v.downsample_ratio
    R, C = -(-rows // k), -(-cols // k)
    al = model.aligner
    span = [L(model.image_start)]
    for r in range(R):
        for c in range(C):
            feat = []
            for ch in range(W):  # channel-major: feature index ch·k² + k·di + dj
                for di in range(k):
                    for dj in range(k):
                        y, x = r * k + di, c * k + dj
                        feat.append(z[y * cols + x][ch] if y < rows and x < cols else 0.0)
            hid = _linear(feat, L(al.w1.weight), L(al.w1.bias))
            hid = [0.5 * t * (1 + math.erf(t / math.sqrt(2))) for t in hid]
            span.append(_linear(hid, L(al.w2.weight), L(al.w2.bias)))
        span.append(L(model.image_newline))
    span.append(L(model.image_end))
    return torch.tensor(span, dtype=torch.float64)


@pytest.mark.parametrize("grid", [(4, 5), (3, 3), (1, 7)])
def test_tower_aligner_and_span_equal_a_per_patch_computation(model, grid):
    g = torch.Generator().manual_seed(grid[0] * 10 + grid[1])
    patches = torch.randn(grid[0] * grid[1], 3 * 14 * 14, generator=g, dtype=torch.float64)
    with torch.no_grad():
        ours = model.embed_image(patches, grid)
    want = naive_span(model, patches, grid)
    R, C = -(-grid[0] // 3), -(-grid[1] // 3)
    assert ours.shape == want.shape == (R * (C + 1) + 2, model.cfg.hidden_size)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9)


def test_preprocess_pads_centred_and_cuts_row_major_channel_first_patches(model):
    v = model.cfg.vision
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(600, 610, 3), dtype=np.uint8)  # h, w: above min_pixels, no resize
    inp = preprocess(Image.fromarray(pixels), v)
    assert inp.grid.size == (610, 600) and inp.grid.padded == (616, 602)
    canvas = np.full((602, 616, 3), 127, dtype=np.float64)
    canvas[1:601, 3:613] = pixels  # centred: (616-610)/2 = 3 columns, (602-600)/2 = 1 row
    norm = (canvas / 255 - 0.5) / 0.5
    rows, cols = inp.grid.patches
    assert inp.patches.shape == (rows * cols, 588)
    for idx in (0, 1, cols, rows * cols - 1, 17 * cols + 23):
        r, c = divmod(idx, cols)
        block = norm[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14]  # [py, px, ch]
        want = torch.tensor(block.transpose(2, 0, 1).reshape(-1), dtype=torch.float32)  # (channel, py, px)
        torch.testing.assert_close(inp.patches[idx], want)


def test_equal_pixels_share_a_digest_and_different_ones_do_not(model):
    v = model.cfg.vision
    a = Image.new("RGB", (50, 40), (1, 2, 3))
    b = Image.new("RGB", (50, 40), (1, 2, 4))
    assert preprocess(a, v).digest == preprocess(a.copy(), v).digest != preprocess(b, v).digest
