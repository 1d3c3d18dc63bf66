"""Numerics of flashserve.model.quant: fake-quant, packed KV records and checkpoint weight formats."""

from __future__ import annotations

import pytest
import torch

from flashserve.model import quant

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _block_with_max(values: list[float], amax: float, block: int) -> torch.Tensor:
    """One block: ``values`` followed by ``amax`` and zeros, so the block's scale is fixed by ``amax``."""
    row = torch.zeros(block)
    row[: len(values)] = torch.tensor(values)
    row[-1] = amax
    return row


# ------------------------------------------------------------------------------------------ E2M1 rounding


def test_e2m1_round_to_nearest_ties_to_even_code() -> None:
    # codes: 0->0, .5->1, 1->2, 1.5->3, 2->4, 3->5, 4->6, 6->7; ties pick the even code
    cases = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0,
             0.26: 0.5, 0.74: 0.5, 1.3: 1.5, 2.6: 3.0, 4.9: 4.0, 5.1: 6.0, 7.0: 6.0, 100.0: 6.0}
    v = torch.tensor(list(cases))
    got = quant.e2m1_decode(quant.e2m1_encode(v))
    assert got.tolist() == list(cases.values())
    assert quant.e2m1_decode(quant.e2m1_encode(-v)).tolist() == [-x for x in cases.values()]


def test_e2m1_codes_roundtrip_and_sign_bit() -> None:
    codes = quant.e2m1_encode(torch.cat([E2M1, -E2M1[1:]]))
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert torch.equal(quant.e2m1_decode(codes), torch.cat([E2M1, -E2M1[1:]]))


def test_fake_quant_fp4_ue8m0_scale_is_power_of_two_fitting_block_max() -> None:
    # amax 6 -> scale 2^ceil(log2(1)) = 1: values round on the plain E2M1 grid
    x = _block_with_max([0.75, 1.25, 2.5, 3.5, 5.0, -0.75], 6.0, 32)
    y = quant.fake_quant_fp4(x, 32, e4m3_scale=False)
    assert y[:6].tolist() == [1.0, 1.0, 2.0, 4.0, 4.0, -1.0] and y[-1] == 6.0
    # amax 6.01 -> scale 2: 0.75 becomes 0.375 on the grid -> 0.5 -> 1.0; 6.01/2 = 3.005 -> 3 -> 6
    y = quant.fake_quant_fp4(_block_with_max([0.75, 2.0], 6.01, 32), 32, e4m3_scale=False)
    assert y[:2].tolist() == [1.0, 2.0] and y[-1] == 6.0


def test_fake_quant_fp4_e4m3_scale() -> None:
    # amax 6.5 -> scale e4m3(6.5/6 = 1.0833) = 1.125; 6.5/1.125 = 5.78 -> 6 -> 6.75; 1.0/1.125 = .89 -> 1 -> 1.125
    y = quant.fake_quant_fp4(_block_with_max([1.0], 6.5, 16), 16, e4m3_scale=True)
    assert y[0].item() == 1.125 and y[-1].item() == 6.75
    # the scale floor 6*2^-9 / 6 = 2^-9 keeps tiny blocks finite: values below 2^-10 flush to zero
    tiny = _block_with_max([2.0 ** -12], 2.0 ** -9, 16)
    y = quant.fake_quant_fp4(tiny, 16, e4m3_scale=True)
    assert y[0].item() == 0.0 and y[-1].item() == 2.0 ** -9


def test_fake_quant_fp8_scale_choice() -> None:
    e4m3_values = torch.tensor([448.0, -1.5, 0.875, 3.25, 0.0] + [1.0] * 27)
    assert torch.equal(quant.fake_quant_fp8(e4m3_values), e4m3_values)  # amax 448 -> scale 1: exact
    # amax 449 -> scale 2: 449/2 = 224.5 -> e4m3 224 -> 448
    x = _block_with_max([1.0], 449.0, 32)
    y = quant.fake_quant_fp8(x)
    assert y[-1].item() == 448.0 and y[0].item() == 1.0
    # floor: amax below 1e-4 uses 2^ceil(log2(1e-4/448)) = 2^-22
    # 1e-9 / 2^-22 = 0.0042 -> nearest e4m3 subnormal 2 * 2^-9 -> 2^-8 * 2^-22 = 2^-30
    assert quant.fake_quant_fp8(_block_with_max([], 1e-9, 32))[-1].item() == 2.0 ** -30
    # 1e-10 / 2^-22 = 0.00042 < half the smallest e4m3 subnormal (2^-10): flushes to zero
    assert quant.fake_quant_fp8(_block_with_max([], 1e-10, 32))[-1].item() == 0.0


def test_fake_quant_keeps_shape_dtype_and_skips_ragged_last_dim() -> None:
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    for y in (quant.fake_quant_fp8(x), quant.fake_quant_fp4(x, 16, True), quant.fake_quant_fp4(x, 32, False)):
        assert y.shape == x.shape and y.dtype == x.dtype and not torch.equal(y, x)
    ragged = torch.randn(4, 40)
    assert quant.fake_quant_fp8(ragged) is ragged
    assert quant.fake_quant_fp4(ragged, 16, True) is ragged
    assert quant.fake_quant_fp4(ragged, 32, False) is ragged


def test_fake_quant_is_idempotent() -> None:
    x = torch.randn(8, 128) * 5
    for fq in (quant.fake_quant_fp8, lambda t: quant.fake_quant_fp4(t, 32, False)):
        once = fq(x)
        assert torch.equal(fq(once), once)


# ------------------------------------------------------------------------------------------ packed KV records


def _kv_like(*shape: int) -> torch.Tensor:
    """Random rows with a wide per-row dynamic range (exercises every scale path)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=g) * torch.logspace(-6, 3, shape[-2]).unsqueeze(-1)


def test_pack_sizes_match_spec_records() -> None:
    assert quant.pack_fp4_e4m3(torch.randn(3, 512)).shape == (3, 288)
    assert quant.pack_fp4_ue8m0(torch.randn(3, 128)).shape == (3, 68)
    assert quant.pack_fp8_ue8m0(torch.randn(3, 512)).shape == (3, 528)
    assert quant.pack_fp8_ue8m0(torch.randn(1, 512)).dtype == torch.uint8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_of_pack_equals_fake_quant_exactly(dtype: torch.dtype) -> None:
    x = _kv_like(2, 37, 512).to(dtype)
    assert torch.equal(quant.unpack_fp4_e4m3(quant.pack_fp4_e4m3(x), dtype), quant.fake_quant_fp4(x, 16, True))
    assert torch.equal(quant.unpack_fp8_ue8m0(quant.pack_fp8_ue8m0(x), dtype), quant.fake_quant_fp8(x, 32))
    xi = x[..., :128]
    assert torch.equal(quant.unpack_fp4_ue8m0(quant.pack_fp4_ue8m0(xi), dtype), quant.fake_quant_fp4(xi, 32, False))


def test_pack_layout_values_then_scales() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 31] = 0.5, -1.0, 6.0  # scale 1 (UE8M0 byte 127); codes 1 and 8|2
    p = quant.pack_fp4_ue8m0(x)
    assert p[0, 0].item() == (1 | (10 << 4)) and p[0, 15].item() == (7 << 4) and p[0, 16].item() == 127
    p8 = quant.pack_fp8_ue8m0(x * 448 / 6)  # amax 448 -> scale 1
    assert p8[0, 32].item() == 127 and p8[0, :32].view(torch.float8_e4m3fn)[31].item() == 448.0


def test_pack_rejects_ragged_dims() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.pack_fp4_e4m3(torch.randn(2, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.pack_fp8_ue8m0(torch.randn(2, 48))
    with pytest.raises(ValueError):
        quant.unpack_fp4_ue8m0(torch.zeros(2, 60, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------ weight formats


def test_e8m0_decoding() -> None:
    b = torch.tensor([0, 1, 120, 126, 127, 128, 254], dtype=torch.uint8)
    want = [2.0 ** -127, 2.0 ** -126, 2.0 ** -7, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert quant.e8m0_to_float(b).tolist() == want
    assert quant.e8m0_to_float(b.view(torch.float8_e8m0fnu)).tolist() == want


def test_cpu_decode_tables_equal_the_formats_definitions() -> None:
    """The CPU's table lookups against each format's definition, for every byte: E2M1 pairs (low nibble
    first, sign bit 3, magnitudes 0 .5 1 1.5 2 3 4 6), E4M3 (torch's own float8 conversion, NaN included) and
    UE8M0 (2^(b-127), byte 0 = 2^-127)."""
    b = torch.arange(256, dtype=torch.uint8)
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    nib = lambda c: (-1.0 if c & 8 else 1.0) * mags[c & 7]
    want_pairs = [[nib(v & 15), nib(v >> 4)] for v in range(256)]
    assert quant.decode_e2m1_bytes(b[:, None]).tolist() == want_pairs
    assert quant.decode_e2m1_bytes(b.view(torch.int8)[:, None]).tolist() == want_pairs
    assert quant.decode_e2m1_bytes(torch.zeros(3, 0, dtype=torch.uint8)).shape == (3, 0)  # empty reads
    torch.testing.assert_close(quant.decode_e4m3_bytes(b.view(16, 16)),
                               b.view(torch.float8_e4m3fn).to(torch.float32).view(16, 16),
                               rtol=0, atol=0, equal_nan=True)
    # byte 255 is NaN in the format and never written (encoders clamp to 254)
    assert quant.e8m0_to_float(b[:255]).tolist() == [2.0 ** (v - 127) if v else 2.0 ** -127 for v in range(255)]


def test_quantize_fp8_blocks_shapes_scales_and_error() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(100, 72, generator=g) * torch.logspace(-3, 2, 100).unsqueeze(1)
    w8, s = quant.quantize_fp8_blocks(w, 32)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (100, 72)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (4, 3)
    scale = quant.e8m0_to_float(s)
    tiles = torch.nn.functional.pad(w, (0, 96 - 72, 0, 128 - 100)).view(4, 32, 3, 32).abs().amax(dim=(1, 3))
    assert torch.all(tiles / scale <= 448) and torch.all(tiles / scale > 224)  # smallest power of two that fits
    back = quant.dequantize_fp8_blocks(w8, s, torch.float32)  # block inferred from shapes
    assert torch.equal(back, quant.dequantize_fp8_blocks(w8, s, torch.float32, block=32))
    per_elem = scale.repeat_interleave(32, 0)[:100].repeat_interleave(32, 1)[:, :72]
    assert torch.all((back - w).abs() <= w.abs() * 2.0 ** -4 + per_elem * 2.0 ** -10)


def test_dequantize_accepts_uint8_and_float_scales() -> None:
    w = torch.randn(64, 64)
    w8, s = quant.quantize_fp8_blocks(w, 32)
    ref = quant.dequantize_fp8_blocks(w8, s, torch.float32)
    assert torch.equal(quant.dequantize_fp8_blocks(w8, s.view(torch.uint8), torch.float32), ref)
    assert torch.equal(quant.dequantize_fp8_blocks(w8, quant.e8m0_to_float(s), torch.float32), ref)


def test_mxfp4_nibble_order_and_scale() -> None:
    w = torch.zeros(2, 64)
    w[0, :4] = torch.tensor([0.5, 1.0, -6.0, 3.0])  # amax 6 -> scale byte 127
    w[1, 32:34] = torch.tensor([12.0, 1.0])  # second group amax 12 -> scale 2 (byte 128); 1/2 -> 0.5
    packed, s = quant.quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 32) and s.shape == (2, 2)
    p = packed.view(torch.uint8)
    assert p[0, 0].item() == 0x21 and p[0, 1].item() == (0x5 << 4) | 0xF  # low nibble = even column
    assert s.view(torch.uint8).tolist() == [[127, 1], [1, 128]]  # all-zero groups get the floor 2^-126
    back = quant.dequantize_mxfp4(packed, s, torch.float32)
    assert back[0, :4].tolist() == [0.5, 1.0, -6.0, 3.0] and back[1, 32:34].tolist() == [12.0, 1.0]


def test_mxfp4_roundtrip_error_within_half_grid_step() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 128, generator=g) * torch.logspace(-4, 1, 48).unsqueeze(1)
    packed, s = quant.quantize_mxfp4(w)
    back = quant.dequantize_mxfp4(packed, s, torch.float32)
    scale = quant.e8m0_to_float(s).repeat_interleave(32, 1)
    amax = w.view(48, 4, 32).abs().amax(-1)
    assert torch.all(amax / quant.e8m0_to_float(s) <= 6) and torch.all(amax / quant.e8m0_to_float(s) > 3)
    # E2M1 spacing is 0.5 up to 2, 1 up to 4, 2 up to 6: the error is at most max(scale/4, |w|/4)
    assert torch.all((back - w).abs() <= torch.maximum(scale / 4, w.abs() / 4) + 1e-12)
    assert torch.equal(quant.dequantize_mxfp4(packed, s, torch.bfloat16), back.to(torch.bfloat16))


def test_fp8_rows_per_32_columns() -> None:
    w = torch.randn(10, 80) * torch.logspace(-2, 2, 10).unsqueeze(1)
    w8, s = quant.quantize_fp8_rows(w)
    assert s.shape == (10, 3) and s.dtype == torch.float8_e8m0fnu
    back = quant.dequantize_fp8_rows(w8, s, torch.float32)
    scale = quant.e8m0_to_float(s).repeat_interleave(32, 1)[:, :80]
    assert torch.all((back - w).abs() <= w.abs() * 2.0 ** -4 + scale * 2.0 ** -10)
    narrow = torch.randn(5, 16)  # a table narrower than one scale group (tiny engram heads)
    w8, s = quant.quantize_fp8_rows(narrow)
    assert s.shape == (5, 1)
    assert torch.allclose(quant.dequantize_fp8_rows(w8, s, torch.float32), narrow, rtol=2.0 ** -4, atol=1e-6)


def test_infer_block() -> None:
    assert quant.infer_block(64, 2, 32) == 32
    assert quant.infer_block(100, 1, 128) == 128
    assert quant.infer_block(100, 4, 128) == 32  # the hint does not fit; 32 does
    assert quant.infer_block(10, 10, 32) == 1  # per-row table scales
    with pytest.raises(ValueError):
        quant.infer_block(10, 11)
    assert quant.infer_square_block((100, 72), (4, 3)) == 32
    assert quant.infer_square_block((100, 72), (1, 1), 128) == 128
    with pytest.raises(ValueError):
        quant.infer_square_block((128, 32), (3, 5))  # would need blocks of 43 x 7
