"""The C++ CPU kernels (flashserve.model.cpu_kernels) against the decoded-weights reference."""

import pytest
import torch

from flashserve.model import blas, cpu_kernels, mhc
from flashserve.model.packed import EXPERT_FP4, PackedWeights
from step_modes import compile_as_step


@pytest.fixture(autouse=True, scope="module")
def _built():
    """The kernels built (or their cached build loaded) before the tests call their operators, as an engine does
    when it starts."""
    assert cpu_kernels.build() == "flashserve"


def _experts(E: int, N: int, K: int, seed: int) -> PackedWeights:
    """MXFP4 experts holding every byte value and scales from 2^-20 to 2^20, one scale byte 0 (2^-127)."""
    g = torch.Generator().manual_seed(seed)
    pw = PackedWeights((E, N, K), EXPERT_FP4)
    pw.set_float(torch.randn(E, N, K, generator=g))
    pw.qweight.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    pw.scale.copy_(torch.randint(107, 148, pw.scale.shape, generator=g, dtype=torch.uint8))
    pw.scale.view(-1)[1] = 0
    return pw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("K", [96, 352])
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_mxfp4_pair_products_equal_the_decoded_weights_on_every_path(isa, K):
    """Each path of the source (AVX-512 where the CPU has it, AVX2, plain C++) gives every pair's row times its
    expert's decoded matrix: experts used once, by more rows than share one decode (11), or not at all, and a
    matrix height that is neither a whole number of tiles (64 rows) nor even (few rows take two at a time); rows
    shorter than the 128 values AVX-512 decodes at a time, and rows of two such chunks and three 32-blocks more
    (a row scaled by 2^-127 throughout, checked against its own size)."""
    pw = _experts(5, 71, K, seed=11)
    pw.scale[0, 3] = 0  # expert 0's row 3: every block 2^-127 (a subnormal scale)
    experts = torch.tensor([4, 0, 0, 2, 3, 1, 4] + [2] * 11)
    x = torch.randn(len(experts), K, generator=torch.Generator().manual_seed(1))
    want = torch.bmm(pw.dequantize(torch.float64)[experts], x.double()[:, :, None])[..., 0]
    got = cpu_kernels.mxfp4_pairs_eager(x, experts, pw.qweight, pw.scale, isa)
    assert got.dtype == torch.float32 and got.shape == (18, 71)
    assert _rel(got, want) <= 1e-6
    tiny = want[1:3, 3]  # the pairs of expert 0: products of about 1e-37 (subnormal weights on the paths that scale
    assert 0 < tiny.abs().min() < 1e-35  # each weight first, so 1e-4 below)
    assert _rel(got[1:3, 3], tiny) <= 1e-4


@pytest.mark.parametrize("K", [64, 288])
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_a_tokens_row_serves_its_k_pairs_and_gate_and_up_run_in_one_pass(isa, K):
    """``x [T, K]`` with ``experts [T, k]`` gives each token's row to its k pairs (no [T*k, K] copy), and the
    gate's and up projection's products in one pass equal two separate calls, bit for bit, on every path; so do
    the operators (their C++ implementations on the native path)."""
    g = torch.Generator().manual_seed(6)
    gate, up = _experts(6, 71, K, seed=1), _experts(6, 71, K, seed=2)
    x = torch.randn(5, K, generator=g)
    experts = torch.tensor([[0, 5, 2], [0, 1, 5], [0, 3, 4], [0, 2, 5], [1, 3, 0]])  # expert 0: 5 pairs
    one_each = cpu_kernels.mxfp4_pairs_eager(x.repeat_interleave(3, 0), experts.flatten(), gate.qweight,
                                             gate.scale, isa)
    assert torch.equal(cpu_kernels.mxfp4_pairs_eager(x, experts, gate.qweight, gate.scale, isa), one_each)
    both = cpu_kernels.mxfp4_pairs_eager(x, experts, gate.qweight, gate.scale, isa, up=(up.qweight, up.scale))
    assert both.shape == (2, 15, 71) and torch.equal(both[0], one_each)
    assert torch.equal(both[1], cpu_kernels.mxfp4_pairs_eager(x, experts, up.qweight, up.scale, isa))
    if isa == "native":
        assert torch.equal(cpu_kernels.mxfp4_gate_up(x, experts, gate.qweight, gate.scale, up.qweight, up.scale),
                           both)
        assert torch.equal(cpu_kernels.mxfp4_pairs(x, experts, gate.qweight, gate.scale), one_each)
        with pytest.raises(RuntimeError, match="does not match the gate's"):
            cpu_kernels.mxfp4_gate_up(x, experts, gate.qweight, gate.scale, up.qweight[:, :8], up.scale)


def test_mxfp4_pair_products_do_not_depend_on_the_number_of_threads():
    pw = _experts(4, 64, 256, seed=3)
    experts = torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(4))
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.flashserve.mxfp4_pairs(x, experts, pw.qweight, pw.scale)
        torch.set_num_threads(2)
        two = torch.ops.flashserve.mxfp4_pairs(x, experts, pw.qweight, pw.scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_mxfp4_pair_products_refuse_what_they_cannot_read():
    pw = _experts(3, 16, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(IndexError, match="expert index out of range"):  # torch's translation of std::out_of_range
        cpu_kernels.mxfp4_pairs_eager(x, torch.tensor([0, 3]), pw.qweight, pw.scale)
    with pytest.raises(ValueError, match=r"x \(2, 32\), experts \(2,\), q \(3, 16, 32\), s \(3, 16, 2\) do not match"):
        cpu_kernels.mxfp4_pairs_eager(x[:, :32], torch.tensor([0, 1]), pw.qweight, pw.scale)


def _scattered(pw: PackedWeights) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each expert's bytes and scales copied into tensors of their own (as a mapped checkpoint holds them: each
    where its file put it), with another allocation between each two so that none follows the last."""
    qs, ss, spacers = [], [], []
    for e in range(pw.qweight.shape[0]):
        qs.append(pw.qweight[e].clone())
        spacers.append(torch.empty(4099, dtype=torch.uint8))
        ss.append(pw.scale[e].clone())
    return qs, ss


def _table(*matrices: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
    return torch.tensor([[t.data_ptr() for t in ts] for q, s in matrices for ts in (q, s)], dtype=torch.int64)


@pytest.mark.parametrize("a8", [False, True])
def test_experts_held_a_matrix_each_give_the_stacked_experts_products_bit_for_bit(a8):
    """``mxfp4_mapped`` reads each expert's matrix at the address its table gives (experts one tensor each, as a
    mapped checkpoint holds them): the gate and up products and the down products equal the stacked operators',
    bit for bit, exact and with 8-bit activations, eager and in a compiled graph; a table entry never filled, or a
    table of another shape, is refused."""
    gate, up, down = _experts(6, 71, 64, seed=1), _experts(6, 71, 64, seed=2), _experts(6, 64, 96, seed=3)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 64, generator=g)
    experts = torch.tensor([[0, 5, 2], [0, 1, 5], [0, 3, 4], [0, 2, 5], [1, 3, 0]]).flatten()
    act = torch.randn(15, 96, generator=g)
    held = [_scattered(pw) for pw in (gate, up, down)]
    gate_up_table, down_table = _table(held[0], held[1]), _table(held[2])
    want = cpu_kernels.mxfp4_gate_up(x, experts.view(5, 3), gate.qweight, gate.scale, up.qweight, up.scale, a8)
    got = cpu_kernels.mxfp4_mapped(x, experts, gate_up_table, 71, a8)
    assert got.shape == (2, 15, 71) and torch.equal(got, want)
    want_down = cpu_kernels.mxfp4_pairs(act, experts, down.qweight, down.scale, a8)
    assert torch.equal(cpu_kernels.mxfp4_mapped(act, experts, down_table, 64, a8)[0], want_down)

    def f(x, experts, table):
        return cpu_kernels.mxfp4_mapped(x * 2, experts, table, 71, a8).relu()

    torch._dynamo.reset()
    compiled = compile_as_step(f, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    assert torch.equal(compiled(x, experts, gate_up_table), f(x, experts, gate_up_table))
    unfilled = gate_up_table.clone()
    unfilled[3, 4] = 0
    with pytest.raises(RuntimeError, match=r"mxfp4_mapped: expert 4 has no matrix \(table entry 22\)"):
        cpu_kernels.mxfp4_mapped(x, experts, unfilled, 71, a8)
    with pytest.raises(RuntimeError, match=r"mxfp4_mapped: table \[3, 6\] must be int64 \[2 or 4, E\]"):
        cpu_kernels.mxfp4_mapped(x, experts, gate_up_table[:3], 71, a8)
    with pytest.raises(IndexError, match="expert index out of range"):
        cpu_kernels.mxfp4_mapped(x, torch.full((15,), 6), gate_up_table, 71, a8)


@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("cpp_wrapper", [False, True])
def test_a_compiled_graph_calls_the_kernel_with_the_eager_values(cpp_wrapper, a8):
    """Through either inductor wrapper (the engine's CPU steps use the C++ one), exact and with 8-bit
    activations (w4a8)."""
    pw = _experts(6, 32, 64, seed=7)
    experts = torch.tensor([5, 1, 1, 0])
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(8))

    def f(x, experts, q, s):
        return cpu_kernels.mxfp4_pairs(x * 2, experts, q, s, a8).relu()

    torch._dynamo.reset()
    compiled = compile_as_step(f, fullgraph=True, dynamic=False, options={"cpp_wrapper": cpp_wrapper})
    assert torch.equal(compiled(x, experts, pw.qweight, pw.scale), f(x, experts, pw.qweight, pw.scale))


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("rows", [2, 11, 16])
def test_dense_rows_equal_the_float64_product_on_every_path(isa, rows):
    """Panels of a weight whose height is not a whole number of panels (40 = 2.5 x 16), times a few rows (fewer
    than one pass takes, and more: 11 = 8 + 3 with AVX-512, 4 + 4 + 3 with AVX2)."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(40, 96, generator=g), torch.randn(rows, 96, generator=g)
    panels = cpu_kernels.pack_panels(w)
    assert panels.shape == (3, 96, cpu_kernels.LANES) and not panels[2, :, 8:].any()
    got = cpu_kernels.dense_rows_eager(x, panels, 40, isa)
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    assert _rel(got, x.double() @ w.double().t()) <= 1e-6


@pytest.mark.parametrize("n", [1033, 1050])
def test_wide_weights_take_panels_two_at_a_time_with_the_same_sums(n):
    """From 64 panels (1024 columns) AVX-512 multiplies two panels at a time: an odd count leaves the last panel
    alone (1033: 64 + 1 with 9 columns), an even one ends on a pair whose second panel is partial (1050: 65 + 1
    with 26 columns). Every output is the sum the one-panel path makes for the same columns, bit for bit, and
    every path equals the float64 product."""
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, 48, generator=g), torch.randn(11, 48, generator=g)
    got = cpu_kernels.dense_rows_eager(x, cpu_kernels.pack_panels(w), n)
    narrow = 63 * cpu_kernels.LANES  # fewer panels than the pairs start at: one panel at a time
    assert torch.equal(got[:, :narrow], cpu_kernels.dense_rows_eager(x, cpu_kernels.pack_panels(w[:narrow]), narrow))
    for isa in cpu_kernels.ISAS:
        assert _rel(cpu_kernels.dense_rows_eager(x, cpu_kernels.pack_panels(w), n, isa), x.double() @ w.double().t()) <= 1e-6


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_bfloat16_panels_give_the_float32_panels_sums_bit_for_bit(isa, rows):
    """A weight whose values bfloat16 holds (a bf16 checkpoint's, read into float32) packs into bfloat16 panels
    of half the bytes; every path widens them back exactly, so the products equal the float32 panels' bit for
    bit, with a partial last panel (40 columns) and a wide weight (1050: AVX-512's panel pairs)."""
    g = torch.Generator().manual_seed(rows)
    for n in (40, 1050):
        w = torch.randn(n, 96, generator=g).to(torch.bfloat16).float()
        x = torch.randn(rows, 96, generator=g)
        half = cpu_kernels.pack_panels(w, torch.bfloat16)
        full = cpu_kernels.pack_panels(w)
        assert half.dtype == torch.bfloat16 and half.shape == full.shape
        assert torch.equal(cpu_kernels.pack_panels(w.t().contiguous().t(), torch.bfloat16), half)  # any strides
        assert half.untyped_storage().nbytes() * 2 == full.untyped_storage().nbytes()
        got = cpu_kernels.dense_rows_eager(x, half, n, isa)
        assert torch.equal(got, cpu_kernels.dense_rows_eager(x, full, n, isa))
        assert _rel(got, x.double() @ w.double().t()) <= 1e-6
    assert torch.equal(torch.ops.flashserve.dense_rows(x, half, n), cpu_kernels.dense_rows_eager(x, full, n))


def test_bfloat16_panels_are_made_only_where_nothing_rounds():
    """``pack_panels`` refuses bfloat16 for a weight bfloat16 would round, and ``make_panels`` picks bfloat16
    exactly when the weight's values are all bfloat16's."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 64, generator=g)
    with pytest.raises(ValueError, match="would round this weight"):
        cpu_kernels.pack_panels(w, torch.bfloat16)
    exact, rounded = torch.nn.Linear(64, 40, bias=False), torch.nn.Linear(64, 40, bias=False)
    with torch.no_grad():
        exact.weight.copy_(w.to(torch.bfloat16).float())
        rounded.weight.copy_(exact.weight)
        rounded.weight[3, 7] += 2.0 ** -20  # one value bfloat16 does not hold
    assert blas.make_panels(exact, "weight") and blas.make_panels(rounded, "weight")
    assert blas.panels(exact, "weight").dtype == torch.bfloat16
    assert blas.panels(rounded, "weight").dtype == torch.float32


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_stream_panels_give_the_panels_sums_bit_for_bit(isa):
    """Stream panels (six columns a line) of a weight whose height is not a whole number of them (1033 = 172 x 6 +
    1) and whose depth is not a whole number of the kernel's 8-line steps (52): for every row count the kernel
    takes differently (columns in lanes up to 4, one register of rows up to 8, two up to 16, then 16 at a time),
    each output is the sum the 16-column panels make, term for term, bit for bit; the plain C++ path equals the
    float64 product to float32 rounding."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(1033, 52, generator=g)
    stream = cpu_kernels.pack_stream_panels(w)
    assert stream.shape == (173, 52, cpu_kernels.STREAM_LANES) and not stream[172, :, 1:].any()
    assert torch.equal(stream[3, :, 2], w[3 * 6 + 2])  # panel p, line k, slot c: w[6p + c, k]
    panels = cpu_kernels.pack_panels(w)
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 35):
        x = torch.randn(rows, 52, generator=g)
        got = cpu_kernels.dense_rows_eager(x, stream, 1033, isa)
        assert got.shape == (rows, 1033) and _rel(got, x.double() @ w.double().t()) <= 1e-6
        if isa != "scalar":
            assert torch.equal(got, cpu_kernels.dense_rows_eager(x, panels, 1033, isa)), rows
    assert torch.equal(torch.ops.flashserve.dense_rows(x, stream, 1033), cpu_kernels.dense_rows_eager(x, panels, 1033))


def test_large_float32_weights_get_stream_panels_on_avx2_cpus_only(monkeypatch):
    """``make_panels`` copies a float32 weight of at least ``STREAM_MIN_BYTES`` into stream panels on a CPU with
    AVX2 but not AVX-512, and into 16-column panels otherwise (smaller, AVX-512, or bfloat16-exact weights); the
    operator refuses bfloat16 stream panels and a width that does not fit them."""
    g = torch.Generator().manual_seed(8)
    monkeypatch.setattr(cpu_kernels, "STREAM_MIN_BYTES", 40 * 64 * 4)
    lin, small, exact = (torch.nn.Linear(64, n, bias=False) for n in (40, 39, 40))
    with torch.no_grad():
        for m in (lin, small, exact):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
        exact.weight.copy_(exact.weight.to(torch.bfloat16).float())
    for capability, lanes in (("AVX2", cpu_kernels.STREAM_LANES), ("AVX512", cpu_kernels.LANES)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert blas.make_panels(lin, "weight") and blas.make_panels(small, "weight") and blas.make_panels(exact, "weight")
        assert blas.panels(lin, "weight").shape == (-(-40 // lanes), 64, lanes)
        assert blas.panels(small, "weight").shape[-1] == cpu_kernels.LANES
        assert blas.panels(exact, "weight").dtype == torch.bfloat16
    stream = cpu_kernels.pack_stream_panels(lin.weight)
    x = torch.randn(5, 64, generator=g)
    with pytest.raises(ValueError, match="not torch.bfloat16"):
        cpu_kernels.dense_rows_eager(x, stream.to(torch.bfloat16), 40)
    with pytest.raises(ValueError, match="n 36 do not match"):  # 7 stream panels hold 37 to 42 columns
        cpu_kernels.dense_rows_eager(x, stream, 36)
    with pytest.raises(RuntimeError, match="dense_rows: panels must be"):
        torch.ops.flashserve.dense_rows(x, stream.to(torch.bfloat16), 40)


def test_dense_rows_do_not_depend_on_the_number_of_threads_and_refuse_mismatches():
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(200, 64, generator=g), torch.randn(16, 64, generator=g)
    panels = cpu_kernels.pack_panels(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.dense_rows(x, panels, 200)
        torch.set_num_threads(2)
        two = cpu_kernels.dense_rows(x, panels, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    with pytest.raises(ValueError, match=r"x \(16, 32\), panels \(13, 64, 16\), n 200 do not match"):
        cpu_kernels.dense_rows_eager(x[:, :32], panels, 200)
    with pytest.raises(ValueError, match="n 180 do not match"):  # one panel too many for 180 columns
        cpu_kernels.dense_rows_eager(x, panels, 180)


def test_the_operators_are_declared_and_implemented_in_cpp():
    """Loading the native build declares the operators (their schemas are C++'s) and registers their CPU
    implementations, with no Python implementation beside them (a compiled step's C++ calls them without Python);
    they check shapes in C++ too."""
    assert cpu_kernels.build() == "flashserve" and cpu_kernels.built() == list(cpu_kernels.KERNELS)
    for op in ("mxfp4_pairs", "mxfp4_gate_up", "mxfp4_mapped", "dense_rows", "int8_pairs", "int8_gate_up", "sinkhorn",
               "index_topk"):
        name = f"flashserve::{op}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
        assert getattr(torch.ops.flashserve, op).default._schema.name == name
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(40, 64, generator=g), torch.randn(5, 64, generator=g)
    panels = cpu_kernels.pack_panels(w)
    torch.testing.assert_close(torch.ops.flashserve.dense_rows(x, panels, 40), x @ w.T, rtol=1e-5, atol=1e-5)
    pw = _experts(4, 24, 64, seed=3)
    experts = torch.tensor([3, 0, 0, 1, 3])
    with pytest.raises(RuntimeError, match="dense_rows: x .* do not match"):
        torch.ops.flashserve.dense_rows(x, panels, 60)
    with pytest.raises(RuntimeError, match="mxfp4_pairs: x .* do not match"):
        torch.ops.flashserve.mxfp4_pairs(x[:, :32], experts, pw.qweight, pw.scale)
    with pytest.raises(IndexError, match="expert index out of range"):  # torch's translation of std::out_of_range
        torch.ops.flashserve.mxfp4_pairs(x, torch.tensor([0, 1, 2, 3, 4]), pw.qweight, pw.scale)


def _int8_experts(E: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-127, 128, (E, N, K), dtype=torch.int8, generator=g),
            torch.rand(E, N, generator=g) * 0.02 + 1e-3)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_int8_pair_products_equal_the_float64_product_on_every_path(isa):
    """Every pair's row times its expert's int8 rows and their scales: experts used by more rows than share one
    conversion (4), once, or not at all; a height that is not a whole number of tiles or of four-row groups, and
    a width with a tail past the 8-value vectors (100 = 12 x 8 + 4)."""
    q, scale = _int8_experts(4, 71, 100, seed=1)
    experts = torch.tensor([3, 0, 0, 3, 3, 3, 3, 1, 3])
    x = torch.randn(len(experts), 100, generator=torch.Generator().manual_seed(2))
    want = torch.bmm((q.double() * scale.double()[..., None])[experts], x.double()[:, :, None])[..., 0]
    got = cpu_kernels.int8_pairs_eager(x, experts, q, scale, isa)
    assert got.dtype == torch.float32 and got.shape == (9, 71)
    assert _rel(got, want) <= 1e-6
    tokens = x[:3]  # [T, K] with experts [T, k]: token t's row serves its k pairs
    by_token = cpu_kernels.int8_pairs_eager(tokens, experts.view(3, 3), q, scale, isa)
    assert torch.equal(by_token, cpu_kernels.int8_pairs_eager(tokens.repeat_interleave(3, 0), experts, q, scale, isa))


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_int8_gate_and_up_run_in_one_call_with_the_sums_of_two(isa):
    """The gate's and up projection's int8 pair products in one call (one token's row to its k pairs) equal two
    separate calls bit for bit, on every path, and so does the operator; an up projection of another shape is
    refused by both."""
    gate, up = _int8_experts(6, 71, 100, seed=7), _int8_experts(6, 71, 100, seed=8)
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(9))
    experts = torch.tensor([[0, 5, 2, 1], [0, 1, 5, 4], [3, 0, 2, 5]])
    both = cpu_kernels.int8_pairs_eager(x, experts, *gate, isa, up=up)
    assert both.shape == (2, 12, 71)
    assert torch.equal(both[0], cpu_kernels.int8_pairs_eager(x, experts, *gate, isa))
    assert torch.equal(both[1], cpu_kernels.int8_pairs_eager(x, experts, *up, isa))
    with pytest.raises(ValueError, match="int8_pairs: x .* do not match"):
        cpu_kernels.int8_pairs_eager(x, experts, *gate, isa, up=(up[0][:, :8], up[1][:, :8]))
    if isa == "native":
        assert torch.equal(cpu_kernels.int8_gate_up(x, experts, *gate, *up), both)
        with pytest.raises(RuntimeError, match="int8_pairs: x .* do not match"):
            cpu_kernels.int8_gate_up(x, experts, *gate, up[0][:, :8], up[1][:, :8])


def test_int8_linear_and_the_operator_agree_and_threads_do_not_matter():
    q, scale = _int8_experts(1, 300, 64, seed=4)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    want = x.double() @ (q[0].double() * scale[0].double()[:, None]).T
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.int8_linear(x, q[0], scale[0])
        torch.set_num_threads(2)
        two = cpu_kernels.int8_linear(x, q[0], scale[0])
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (2, 3, 300) and torch.equal(one, two) and _rel(one, want) <= 1e-6
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flashserve::int8_pairs", "CPU")  # the C++ one
    experts = torch.tensor([0, 0])
    assert torch.equal(torch.ops.flashserve.int8_pairs(x[0, :2], experts, q, scale), one[0, :2])
    bits = scale.view(torch.int32)  # the scales as the int8 quantization stores them: read as float32 bits
    for f in (torch.ops.flashserve.int8_pairs, cpu_kernels.int8_pairs_eager):
        assert torch.equal(f(x[0, :2], experts, q, bits), f(x[0, :2], experts, q, scale))
    with pytest.raises(RuntimeError, match="scale float32"):
        torch.ops.flashserve.int8_pairs(x[0, :2], experts, q, scale.double())
    with pytest.raises(RuntimeError, match="int8_pairs: x .* do not match"):
        torch.ops.flashserve.int8_pairs(x[0, :2, :32], experts, q, scale)
    with pytest.raises(IndexError, match="expert index out of range"):
        torch.ops.flashserve.int8_pairs(x[0, :2], torch.tensor([0, 1]), q, scale)
    with pytest.raises(ValueError, match="int8_pairs: x .* do not match"):
        cpu_kernels.int8_pairs_eager(x[0], experts[:1], q.float(), scale)


def test_a_compiled_int8_layer_uses_the_kernel_where_preferred(monkeypatch):
    """One row through a compiled int8 ``PackedLinear`` (plain and grouped, as the attention's output
    projection) and int8 experts' pair products take the kernel when it is preferred (AVX2-only CPUs) and give
    the eager layer's values within the int8 summation's rounding."""
    from flashserve.model import packed

    calls = []
    real = cpu_kernels.int8_pairs
    monkeypatch.setattr(cpu_kernels, "int8_pairs_preferred", lambda: True)
    monkeypatch.setattr(cpu_kernels, "int8_pairs", lambda *a: calls.append(a[0].shape) or real(*a))
    g = torch.Generator().manual_seed(9)
    lin = packed.PackedLinear(64, 96, packed.ROW_INT8)
    lin.packed.set_float(torch.randn(96, 64, generator=g))
    experts = packed.PackedExperts(4, 64, 32, 10.0, packed.ROW_INT8)
    for name in ("w1", "w2", "w3"):
        pw = getattr(experts, f"{name}_packed")
        pw.set_float(torch.randn(*pw.shape, generator=g))
    x, idx = torch.randn(1, 64, generator=g), torch.tensor([3, 1])

    def f(x):
        y, pairs = lin(x), experts.pair_products("w1", x.expand(2, 64), idx)
        return y, pairs, lin.grouped(x.expand(4, 64).reshape(1, 1, 4, 64))

    torch._dynamo.reset()
    with torch.inference_mode():
        want = f(x)
        got = compile_as_step(f, fullgraph=True, dynamic=False)(x)
    assert calls == [(1, 64), (2, 64), (4, 64)]  # traced once each: 4 groups of 24 rows are 4 pairs
    assert got[2].shape == (1, 1, 4, 24)
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("shape", [(1, 4, 4), (9, 4, 4), (2, 8, 4, 4), (3, 2, 2), (16, 3, 3), (7, 8, 8)])
def test_sinkhorn_gives_the_traced_scalings_bit_for_bit(shape):
    """Batches that fill the kernel's eight lanes, leave some empty, or take several passes, for n up to 8:
    against the plain loop in float64, and for n <= 4 (mHC's 4) the traced scalings bit for bit (torch sums 8
    terms in another order)."""
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    comb = torch.softmax(3 * torch.randn(*shape, generator=g), -1) + 1e-6
    for iters in (1, 2, 20):
        got = cpu_kernels.sinkhorn_eager(comb, iters, 1e-6)
        assert got.shape == comb.shape
        if shape[-1] <= 4:
            assert torch.equal(got, mhc._sinkhorn_scalings(comb, iters, 1e-6))
        assert _rel(got, mhc._sinkhorn_sums(comb.double(), iters, 1e-6)) <= 1e-6


def test_sinkhorn_refuses_what_it_cannot_normalise():
    """Eagerly (before the kernel runs) and through the operator's C++ implementation, loaded with the build."""
    assert cpu_kernels.sinkhorn_available()
    comb = torch.softmax(torch.randn(2, 4, 4), -1)
    for bad, iters in ((comb.double(), 20), (comb[..., :3], 20), (torch.ones(2, 9, 9), 20), (comb, 0)):
        with pytest.raises(ValueError, match="sinkhorn: comb .* expected float32"):
            cpu_kernels.sinkhorn_eager(bad, iters, 1e-6)
        with pytest.raises(RuntimeError, match="sinkhorn: comb .* expected float32"):
            torch.ops.flashserve.sinkhorn(bad, iters, 1e-6)


def test_without_a_compiler_the_kernels_say_so_once_and_torchs_code_runs(tmp_path):
    """A machine whose C++ compiler does not work (here: one that does not exist, and no cached build) gets one
    warning naming the path, the kernels report themselves unavailable, and a compiled CPU step's Sinkhorn runs
    torch's code. In a process of its own: a process that loaded the kernels keeps them."""
    import os
    import subprocess
    import sys

    script = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from flashserve.model import cpu_kernels, modes
from flashserve.model.mhc import _sinkhorn_scalings, sinkhorn
assert cpu_kernels.build() is None and cpu_kernels.build() is None
assert not cpu_kernels.sinkhorn_available() and cpu_kernels.built() == []
comb = torch.softmax(torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1)), -1) + 1e-6
with modes.running(modes.COMPILED_CPU):
    got = torch.compile(sinkhorn, backend="eager", fullgraph=True)(comb.clone(), 5, 1e-6)
assert torch.equal(got, _sinkhorn_scalings(comb, 5, 1e-6))
print("ok")
"""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING CPU kernels")]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING CPU kernels (native) unavailable"), warnings


def _fp8(N: int, K: int, block: int, seed: int):
    from flashserve.model.packed import Format

    pw = PackedWeights((N, K), Format("fp8", block, block))
    g = torch.Generator().manual_seed(seed)
    pw.set_float(torch.randn(N, K, generator=g) * 0.05)
    codes = [c for c in range(256) if c & 0x7F != 0x7F]  # every E4M3 code but the NaNs: subnormals and zeros too
    pw.qweight.view(-1)[:len(codes)] = torch.tensor(codes, dtype=torch.uint8)
    pw.scale.view(-1)[0] = 0  # the subnormal scale 2^-127
    return pw


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("N, K, block", [(40, 96, 32), (130, 264, 128)])
def test_fp8_pair_products_equal_the_decoded_weights_on_every_path(isa, N, K, block):
    """Block FP8 read as stored, with partial blocks at both edges and every E4M3 code: the float64 product of
    the weights flashserve.model.packed.decode gives, on every path, one matrix for all rows or one a row."""
    pw = _fp8(N, K, block, seed=N)
    w = pw.dequantize(torch.float32).double()
    g = torch.Generator().manual_seed(K)
    for rows in (1, 5, 17):
        x = torch.randn(rows, K, generator=g)
        got = cpu_kernels.fp8_pairs_eager(x, torch.zeros(rows, dtype=torch.long), pw.qweight[None], pw.scale[None],
                                          block, block, isa)
        assert got.shape == (rows, N) and _rel(got, x.double() @ w.T) <= 1e-6
    # three matrices, each row its own (a grouped projection)
    three = [_fp8(N, K, block, seed=s) for s in (1, 2, 3)]
    q, s = torch.stack([p.qweight for p in three]), torch.stack([p.scale for p in three])
    x, experts = torch.randn(6, K, generator=g), torch.tensor([2, 0, 1, 1, 2, 0])
    want = torch.stack([x[i].double() @ three[e].dequantize(torch.float32).double().T for i, e in enumerate(experts)])
    assert _rel(cpu_kernels.fp8_pairs_eager(x, experts, q, s, block, block, isa), want) <= 1e-6


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_fp8_weights_are_decoded_exactly_at_every_scale(isa):
    """Each weight the kernel multiplies is e4m3(code) x 2^(b - 127) to the bit, for every E4M3 code and scales
    from the subnormal 2^-127 to 2^127 (where the 2^8 the AVX2 path folds into the scale would overflow): one-hot
    rows of x read the weights back one column at a time."""
    from flashserve.model.packed import Format

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    scales = torch.tensor([0, 1, 100, 127, 200, 246, 247, 250, 254], dtype=torch.uint8)
    N, K = len(scales) * 8, 32 * 8  # 8 matrix rows per scale, each row 256 codes
    q = codes[torch.arange(N * K) % len(codes)].reshape(N, K)
    big = scales.repeat_interleave(8) >= 247
    q[big] &= 0xBF  # exponent below 8 (values under 2): finite weights at 2^120..2^127, so 0 x weight stays 0
    s = scales.reshape(-1, 1).expand(len(scales), K // 32).contiguous()

    pw = PackedWeights((N, K), Format("fp8", 8, 32))
    pw.qweight.copy_(q)
    pw.scale.copy_(s)
    want = pw.dequantize(torch.float32)
    assert torch.isfinite(want).all() and (want[big] != 0).any()
    x = torch.eye(K)
    got = cpu_kernels.fp8_pairs_eager(x, torch.zeros(K, dtype=torch.long), q[None], s[None], 8, 32, isa)
    assert torch.equal(got.T, want)


def test_fp8_pair_products_do_not_depend_on_threads_or_rows_and_refuse_mismatches():
    pw = _fp8(300, 256, 128, seed=9)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(9))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.fp8_linear(x, pw.qweight, pw.scale, 128, 128)
        torch.set_num_threads(2)
        two = cpu_kernels.fp8_linear(x, pw.qweight, pw.scale, 128, 128)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(cpu_kernels.fp8_linear(x[3:4], pw.qweight, pw.scale, 128, 128),
                                                 one[3:4])
    with pytest.raises(ValueError, match=r"fp8_pairs: x \(9, 128\), .* blocks 128x128 do not match"):
        cpu_kernels.fp8_pairs_eager(x[:, :128], torch.zeros(9, dtype=torch.long), pw.qweight[None], pw.scale[None],
                                    128, 128)
    with pytest.raises(RuntimeError, match="fp8_pairs: x .* do not match"):
        torch.ops.flashserve.fp8_pairs(x, torch.zeros(9, dtype=torch.long), pw.qweight[None], pw.scale[None], 64, 128)


def test_fp8_rows_give_the_same_bits_whether_or_not_they_can_be_prescaled():
    """The AVX2 path multiplies rows of x prescaled by their blocks' scales where every such product is exact, and
    falls back to scaling the weights where it is not: a row beside one with an overflowing value (1e38 x 2^113),
    scales above 134, and a thread that reads subnormal inputs as zero (torch.set_flush_denormal) give the same
    bits as the prescaled rows, whose subnormal weights (every E4M3 code is in the first matrix row) count."""
    from flashserve.model.packed import Format

    N, K = 96, 384
    pw = PackedWeights((N, K), Format("fp8", 32, 128))
    g = torch.Generator().manual_seed(5)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    pw.qweight.copy_(codes[torch.randint(len(codes), (N, K), generator=g)])
    pw.qweight[0, :len(codes)] = codes
    pw.scale.copy_(torch.randint(112, 122, pw.scale.shape, generator=g, dtype=torch.uint8))  # 2^-15 .. 2^-6
    q, s = pw.qweight[None], pw.scale[None]
    x = torch.randn(7, K, generator=g)  # more rows than one decode serves on AVX2 (4), within AVX-512's (8)
    want = x.double() @ pw.dequantize(torch.float32).double().T
    ex = torch.zeros(8, dtype=torch.long)

    def products(rows: torch.Tensor, scales: torch.Tensor = s) -> torch.Tensor:
        return cpu_kernels.fp8_pairs_eager(rows, ex[:len(rows)], q, scales, 32, 128)[:7]

    alone = products(x)
    assert _rel(alone, want) <= 1e-6
    huge = torch.zeros(1, K)
    huge[0, 7] = 1e38
    assert torch.equal(products(torch.cat([x, huge])), alone)
    high = s.clone()
    high[0, 1, 2] = 140  # one block of matrix rows 32..63: their products change, the other rows' do not
    beside = products(x, high)
    assert torch.equal(beside[:, :32], alone[:, :32]) and torch.equal(beside[:, 64:], alone[:, 64:])
    scales = pw.scale.clone()
    pw.scale.copy_(high[0])
    assert _rel(beside, x.double() @ pw.dequantize(torch.float32).double().T) <= 1e-6
    pw.scale.copy_(scales)
    assert not torch.equal(beside[:, 32:64], alone[:, 32:64])
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the kernel runs on this thread, whose MXCSR set_flush_denormal changes
        assert torch.set_flush_denormal(True)
        assert torch.equal(products(x), alone)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(was)


def test_fp8_layers_multiply_decode_rows_as_stored_and_prompts_as_decoded():
    """A block-FP8 layer's decode-sized products go through the kernel (in the engine's modes alike), a prompt's
    rows through the decoded matrix; the grouped output projection takes one matrix a group. All agree with the
    decoded weights' products."""
    from flashserve.model import packed
    from flashserve.model.packed import Format, PackedLinear

    lin = PackedLinear(256, 192, Format("fp8", 32, 32))
    lin.packed.set_float(torch.randn(192, 256, generator=torch.Generator().manual_seed(4)) * 0.05)
    w = lin.packed.dequantize(torch.float32)
    calls = []
    real = cpu_kernels.fp8_pairs

    def counting(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    wo = PackedLinear(64, 4 * 64, Format("fp8", 32, 32))  # 4 groups of 64 outputs from 64 inputs each
    wo.packed.set_float(torch.randn(256, 64, generator=torch.Generator().manual_seed(6)) * 0.05)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(5))
    import unittest.mock as mock

    rows = packed.FP8_KERNEL_ROWS  # tokens: each group's matrix reads this many rows
    xg = torch.randn(rows + 1, 4, 64, generator=torch.Generator().manual_seed(7))
    with mock.patch.object(cpu_kernels, "fp8_pairs", counting):
        few = lin(x[:packed.FP8_KERNEL_ROWS])
        many = lin(x)
        grouped = wo.grouped(x[:3].view(3, 4, 64))
        batch = wo.grouped(xg[:rows])  # a decode batch: rows x 4 pairs, still read as stored
        prompt = wo.grouped(xg)  # one token more: decoded
    assert calls == [packed.FP8_KERNEL_ROWS, 3 * 4, rows * 4]
    torch.testing.assert_close(few, x[:packed.FP8_KERNEL_ROWS] @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many, x @ w.T, rtol=1e-5, atol=1e-5)
    wg = wo.packed.dequantize(torch.float32).view(4, 64, 64)
    want = torch.einsum("tgk,gnk->tgn", x[:3].view(3, 4, 64), wg)
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch, torch.einsum("tgk,gnk->tgn", xg[:rows], wg), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prompt, torch.einsum("tgk,gnk->tgn", xg, wg), rtol=1e-5, atol=1e-5)


def _fp8_codes(N: int, K: int, row_block: int, col_block: int, seed: int, scales: tuple[int, int] = (112, 122)):
    """Block-FP8 weights of random codes (every E4M3 code but the NaNs) and random scales in ``scales``."""
    from flashserve.model.packed import Format

    pw = PackedWeights((N, K), Format("fp8", row_block, col_block))
    g = torch.Generator().manual_seed(seed)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    pw.qweight.copy_(codes[torch.randint(len(codes), (N, K), generator=g)])
    pw.qweight.view(-1)[:len(codes)] = codes
    pw.scale.copy_(torch.randint(*scales, pw.scale.shape, generator=g, dtype=torch.uint8))
    return pw


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("N, K, row_block, col_block", [(40, 96, 16, 32), (300, 520, 128, 128), (72, 200, 32, 24)])
def test_fp8_panel_products_equal_the_decoded_weights_and_do_not_depend_on_rows_or_threads(isa, N, K, row_block,
                                                                                           col_block):
    """fp8_panels over pack_fp8_panels' copy: the float64 product of the decoded weights on every path, for
    a matrix height that is not a whole number of panels (16) or of tiles (128 columns), partial column blocks,
    row counts below, at and past one pass (12 rows on AVX-512, 6 on AVX2); each row's products are the same bits
    alone, beside other rows, and with one or two threads; a grouped projection takes one matrix a group."""
    pw = _fp8_codes(N, K, row_block, col_block, seed=N)
    w = pw.dequantize(torch.float32).double()
    panels = cpu_kernels.pack_fp8_panels(pw.qweight[None])
    assert panels.shape == (1, -(-N // 16), K, 16) and panels[0, 1, 5, 3] == pw.qweight[19, 5]
    g = torch.Generator().manual_seed(K)
    x = torch.randn(25, K, generator=g)

    def products(rows: torch.Tensor) -> torch.Tensor:
        experts = torch.zeros(len(rows), dtype=torch.long)
        return cpu_kernels.fp8_panels_eager(rows, experts, panels, pw.scale[None], N, row_block, col_block, isa)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        every = products(x)
        torch.set_num_threads(1)
        assert torch.equal(products(x), every)
    finally:
        torch.set_num_threads(threads)
    assert every.shape == (25, N) and _rel(every, x.double() @ w.T) <= 1e-6
    for rows in (1, 2, 5, 12, 16):
        assert torch.equal(products(x[3:3 + rows]), every[3:3 + rows])
    three = [_fp8_codes(N, K, row_block, col_block, seed=s) for s in (1, 2, 3)]
    pan3 = cpu_kernels.pack_fp8_panels(torch.stack([p.qweight for p in three]))
    s3 = torch.stack([p.scale for p in three])
    experts = torch.tensor([2, 0, 1, 1, 2, 0, 2])
    want = torch.stack([x[i].double() @ three[e].dequantize(torch.float32).double().T for i, e in enumerate(experts)])
    got = cpu_kernels.fp8_panels_eager(x[:7], experts, pan3, s3, N, row_block, col_block, isa)
    assert _rel(got, want) <= 1e-6
    with pytest.raises(ValueError, match=r"fp8_panels: .* blocks 8x32 do not match"):
        cpu_kernels.fp8_panels_eager(x, torch.zeros(25, dtype=torch.long), panels, pw.scale[None], N, 8, 32, isa)
    with pytest.raises(RuntimeError, match="fp8_panels: x .* do not match"):
        torch.ops.flashserve.fp8_panels(x[:, :K - 8], torch.zeros(25, dtype=torch.long), panels, pw.scale[None], N,
                                        row_block, col_block)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_fp8_panel_weights_are_decoded_exactly_at_every_scale_and_denormal_setting(isa):
    """Each weight fp8_panels multiplies is e4m3(code) x 2^(b - 127) to the bit: every E4M3 code, scales from the
    subnormal 2^-127 through 134 (one multiply) to 254 (two), read back a column at a time by one-hot rows; and
    the same bits where the thread reads subnormal inputs as zero (subnormal codes decode to subnormal floats)."""
    from flashserve.model.packed import Format

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    scales = torch.tensor([0, 1, 100, 127, 134, 135, 200, 246, 247, 254], dtype=torch.uint8)
    N, K = len(scales) * 16, 256
    q = codes[torch.arange(N * K) % len(codes)].reshape(N, K)
    big = scales.repeat_interleave(16) >= 247
    q[big] &= 0xBF  # values under 2 at the largest scales: finite weights, so 0 x weight stays 0
    pw = PackedWeights((N, K), Format("fp8", 16, 32))
    pw.qweight.copy_(q)
    pw.scale.copy_(scales.reshape(-1, 1).expand(len(scales), K // 32))
    want = pw.dequantize(torch.float32)
    tiny = (want != 0) & (want.abs() < 2.0 ** -126)
    assert torch.isfinite(want).all() and (want[big].abs() > 2.0 ** 120).any() and tiny.any()  # subnormal weights
    panels = cpu_kernels.pack_fp8_panels(pw.qweight[None])
    x = torch.eye(K)
    got = cpu_kernels.fp8_panels_eager(x, torch.zeros(K, dtype=torch.long), panels, pw.scale[None], N, 16, 32, isa)
    assert torch.equal(got.T, want)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the kernel runs on this thread, whose MXCSR set_flush_denormal changes
        assert torch.set_flush_denormal(True)
        flushed = cpu_kernels.fp8_panels_eager(x, torch.zeros(K, dtype=torch.long), panels, pw.scale[None], N, 16,
                                               32, isa)
        assert (torch.tensor([2.0 ** -130]) * 1.0).item() == 0.0  # the thread's flags as they were: still flushing
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(was)
    assert torch.equal(flushed, got)


def test_fp8_layers_read_their_panels_once_made_and_their_codes_once_changed():
    """A block-FP8 layer given panels (the engine's plan does it on a CPU, once however many engines) multiplies
    its decode rows over them, its grouped products too; a set_float afterwards is read from the new codes (the
    panels are stale), and a layer whose row block is not a multiple of 16 gets none."""
    from flashserve.model.packed import Format, PackedLinear

    lin = PackedLinear(256, 192, Format("fp8", 32, 32))
    lin.packed.set_float(torch.randn(192, 256, generator=torch.Generator().manual_seed(4)) * 0.05)
    wo = PackedLinear(64, 4 * 64, Format("fp8", 32, 32))
    wo.packed.set_float(torch.randn(256, 64, generator=torch.Generator().manual_seed(6)) * 0.05)
    odd = PackedLinear(64, 48, Format("fp8", 8, 32))
    assert lin.make_fp8_panels() and wo.make_fp8_panels() and not odd.make_fp8_panels()
    assert lin.fp8_panels.shape == (12, 256, 16) and "fp8_panels" not in lin.state_dict()
    made = lin.fp8_panels
    assert lin.make_fp8_panels() and lin.fp8_panels is made  # a second engine's plan: no second copy
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    xg = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(7))
    calls = []
    real = cpu_kernels.fp8_panels

    def counting(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    import unittest.mock as mock

    w = lin.packed.dequantize(torch.float32)
    with mock.patch.object(cpu_kernels, "fp8_panels", counting):
        y = lin(x)
        yg = wo.grouped(xg)
        assert calls == [5, 3 * 4]
        lin.packed.set_float(torch.randn(192, 256, generator=torch.Generator().manual_seed(8)) * 0.05)
        changed = lin(x)
        assert calls == [5, 3 * 4] and lin.current_fp8_panels() is None
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
    wg = wo.packed.dequantize(torch.float32).view(4, 64, 64)
    torch.testing.assert_close(yg, torch.einsum("tgk,gnk->tgn", xg, wg), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(changed, x @ lin.packed.dequantize(torch.float32).T, rtol=1e-5, atol=1e-5)


def _attend_reference(q, win, win_ok, ent, ent_ok, sink, scale):
    """Attention._attend's masked softmax and products in float64: every key and entry multiplied, the ones a row
    may not see masked."""
    B, S, H, D = q.shape
    q, win, ent, sink = q.double(), win.double(), ent.double(), sink.double()
    ent = ent.expand(B, S, *ent.shape[2:])
    lw = torch.einsum("bshd,btd->bhst", q, win) * scale
    le = torch.einsum("bshd,bsed->bhse", q, ent) * scale
    logits = torch.cat([lw.masked_fill(~win_ok[:, None], float("-inf")), le.masked_fill(~ent_ok[:, None], float("-inf")),
                        sink.view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    T = win.shape[1]
    return (torch.einsum("bhst,btd->bshd", probs[..., :T], win)
            + torch.einsum("bhse,bsed->bshd", probs[..., T:-1], ent))


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("H, D, shared", [(20, 96, True), (64, 128, False), (40, 64, False), (18, 64, True)])
def test_attend_rows_equal_the_masked_softmax_over_every_key(isa, H, D, shared):
    """attend_rows reads only the keys and entries each row may see and gives the float64 masked softmax's result
    over all of them: head counts that are not a whole number of vectors (of 16) or of the four heads the sums
    take at a time, widths not a multiple of 64, one entry list for every row or one per row, a row that may see
    nothing (its sink takes the whole probability: zeros), and one row alone (its heads split between threads)."""
    g = torch.Generator().manual_seed(H + D)
    B, S, T, E = 3, 2, 7, 9
    q = torch.randn(B, S, H, D, generator=g)
    win, ent = torch.randn(B, T, D, generator=g), torch.randn(B, 1 if shared else S, E, D, generator=g)
    win_ok = torch.rand(B, S, T, generator=g) < 0.6
    ent_ok = torch.rand(B, S, E, generator=g) < 0.5
    win_ok[1, 0], ent_ok[1, 0] = False, False
    win_ok[0, :, :2], ent_ok[0, :, :3] = False, False  # keys no row of sequence 0 may see
    sink = torch.randn(H, generator=g)
    got = cpu_kernels.attend_rows_eager(q, win, win_ok, ent, ent_ok, sink, D ** -0.5, isa)
    want = _attend_reference(q, win, win_ok, ent, ent_ok, sink, D ** -0.5)
    assert got.shape == (B, S, H, D) and _rel(got, want) <= 1e-5
    assert torch.equal(got[1, 0], torch.zeros(H, D))
    # keys a row may not see are not read: changing them changes nothing
    win2, ent2 = win.clone(), ent.clone()
    win2[0, :2], ent2[0, :, :3] = float("nan"), float("nan")
    assert torch.equal(cpu_kernels.attend_rows_eager(q, win2, win_ok, ent2, ent_ok, sink, D ** -0.5, isa), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        one = cpu_kernels.attend_rows_eager(q[2:, 1:], win[2:], win_ok[2:, 1:], ent[2:, (0 if shared else 1):][:, :1],
                                            ent_ok[2:, 1:], sink, D ** -0.5, isa)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, got[2:, 1:])
    with pytest.raises(ValueError, match=r"attend_rows: q \(3, 2, .*\) do not match"):
        cpu_kernels.attend_rows_eager(q, win, win_ok[:, :1], ent, ent_ok, sink, D ** -0.5, isa)


def _within(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eq: str) -> bool:
    """Whether ``got`` is the float64 product ``einsum(eq, x, w)`` up to float32 sums' rounding (1e-5 of the sum
    of the products' sizes, each output)."""
    want = torch.einsum(eq, x.double(), w)
    return bool(((got.double() - want).abs() <= 1e-5 * torch.einsum(eq, x.double().abs(), w.abs()) + 1e-30).all())


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_fp8_kernels_give_every_released_layer_its_decoded_products_at_every_row_count(isa, released_tiny_v41):
    """What the model calls, on each path the build can take: every block-FP8 layer of the released tiny-v41, fed
    rows its forward gives it, through fp8_pairs (the codes as stored) and fp8_panels (their panel copy), at every
    row count the engine passes (1 .. FP8_KERNEL_ROWS), and the grouped output projections as the model views them
    (one matrix a group), against the decoded weights' products in float64."""
    from flashserve.model import packed
    from flashserve.model.loader import load_model

    model = load_model(released_tiny_v41, with_mtp=False)
    layers = {n: m for n, m in model.named_modules()
              if isinstance(m, packed.PackedLinear) and m.packed.fmt.name == packed.FP8}
    rows_max, G = packed.FP8_KERNEL_ROWS, model.cfg.o_groups
    seen: dict[str, torch.Tensor] = {}  # each layer's input rows in a forward of rows_max tokens

    def keep(name):
        def hook(module, args):
            seen.setdefault(name, args[0].detach().reshape(-1, args[0].shape[-1]))
        return hook

    hooks = [m.register_forward_pre_hook(keep(n)) for n, m in layers.items()]
    with torch.no_grad():
        model(torch.randint(0, model.cfg.vocab_size, (1, rows_max), generator=torch.Generator().manual_seed(3)))
    for h in hooks:
        h.remove()
    grouped = [n for n in layers if n not in seen]  # called through .grouped, not forward
    assert seen and grouped and all(layers[n].packed.shape[0] % G == 0 for n in grouped)
    kinds = {}  # one layer of each shape and way of calling
    for name, m in layers.items():
        kinds.setdefault((m.packed.shape, m.packed.fmt, name in seen), name)
    assert len(kinds) >= 4
    for name in kinds.values():
        m = layers[name]
        p = m.packed
        (N, K), rb, cb = p.shape, p.fmt.row_block, p.fmt.col_block
        w, panels = p.dequantize(torch.float64), cpu_kernels.pack_fp8_panels(p.qweight[None])
        if name in seen:
            x = seen[name].float()
            for rows in range(1, rows_max + 1):
                xr, one = x[:rows], torch.zeros(rows, dtype=torch.long)
                pairs = cpu_kernels.fp8_pairs_eager(xr, one, p.qweight[None], p.scale[None], rb, cb, isa)
                pan = cpu_kernels.fp8_panels_eager(xr, one, panels, p.scale[None], N, rb, cb, isa)
                assert _within(pairs, xr, w, "tk,nk->tn"), (name, rows, "fp8_pairs")
                assert _within(pan, xr, w, "tk,nk->tn"), (name, rows, "fp8_panels")
            continue
        Ng = N // G  # the grouped view: x [tokens, G, K], group g's Ng matrix rows (whole row blocks and panels)
        wg, sg = w.view(G, Ng, K), p.scale.view(G, Ng // rb, -1)
        for rows in range(1, rows_max + 1):
            xg = torch.randn(rows, G, K, generator=torch.Generator().manual_seed(rows))
            flat, exp = xg.view(-1, K), torch.arange(G).repeat(rows)
            pairs = cpu_kernels.fp8_pairs_eager(flat, exp, p.qweight.view(G, Ng, K), sg, rb, cb, isa)
            pan = cpu_kernels.fp8_panels_eager(flat, exp, panels[0].view(G, -1, K, cpu_kernels.LANES), sg, Ng, rb,
                                               cb, isa)
            assert _within(pairs.view(rows, G, Ng), xg, wg, "tgk,gnk->tgn"), (name, rows, "fp8_pairs grouped")
            assert _within(pan.view(rows, G, Ng), xg, wg, "tgk,gnk->tgn"), (name, rows, "fp8_panels grouped")
