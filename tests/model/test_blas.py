"""Single-row float32 products through numpy's OpenBLAS (flashserve.model.blas)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashserve.model import blas, cpu_kernels
from step_modes import compile_as_step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture
def calls(monkeypatch):
    """Shapes of the products that went through numpy."""
    seen = []
    real = blas._mm_np
    monkeypatch.setattr(blas, "_mm_np", lambda x, w: (seen.append((tuple(x.shape), tuple(w.shape))), real(x, w))[1])
    return seen


def test_numpys_blas_is_openblas():
    """numpy's wheels ship OpenBLAS, which the engine's single-row products rely on."""
    assert blas.OPENBLAS


@pytest.mark.parametrize("column_major", [False, True])
def test_a_single_row_goes_through_openblas_with_torchs_values(column_major, calls):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    if column_major:  # the LM head's layout (weight_layout)
        w = w.t().contiguous().t()
    x = torch.randn(1, 1, 64, generator=g)
    with torch.inference_mode():
        got = blas.linear(x, w)
        lin = blas.Linear(64, 300, bias=False)
        lin.weight.data = w
        by_module = lin(x)
    want = x @ w.t()
    assert calls == [((1, 64), (300, 64))] * 2
    assert got.shape == (1, 1, 300) and _rel(got, want) <= 1e-6
    assert torch.equal(by_module, got)


def test_several_rows_gradients_and_other_dtypes_stay_torchs(calls):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 32, generator=g)
    with torch.inference_mode():
        rows = blas.linear(torch.randn(2, 32, generator=g), w)
        double = blas.linear(torch.randn(1, 32, dtype=torch.float64), w.double())
    x = torch.randn(1, 32, requires_grad=True)
    with torch.enable_grad():  # gradients on: torch's product, which autograd can differentiate
        blas.linear(x, w).sum().backward()
    assert calls == [] and rows.shape == (2, 40) and double.dtype == torch.float64
    assert torch.allclose(x.grad, w.sum(0), atol=1e-5)  # MKL's backward sums in its own order (Ice Lake: 3e-7 apart)


def test_a_linear_module_keeps_its_bias():
    lin = blas.Linear(16, 8, bias=True)
    x = torch.randn(1, 16)
    with torch.inference_mode():
        assert _rel(lin(x), F.linear(x, lin.weight, lin.bias)) <= 1e-6


def _compiled(f, *args):
    """``f(*args)`` compiled by inductor, and the call targets of the graph dynamo traced."""
    graphs = []

    def recording(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compile_as_step(f, backend=recording, fullgraph=True)(*args)
    got = compile_as_step(f, backend="inductor", fullgraph=True)(*args)
    return got, {str(n.target) for g in graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")}


@pytest.mark.parametrize("column_major", [False, True])
def test_a_compiled_row_is_inductors_own_product_with_eagers_values(column_major, calls):
    """Inside ``torch.compile`` on the CPU one row's product is a multiply and a sum (inductor's reduction
    kernel, no matmul call or Python op), equal to the eager product to float32 rounding."""
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(48, 32, generator=g), torch.randn(32, 48, generator=g)
    if column_major:
        w1 = w1.t().contiguous().t()
    x = torch.randn(1, 32, generator=g)

    def f(x):
        return blas.linear(torch.tanh(blas.linear(x, w1)), w2)

    with torch.inference_mode():
        want = f(x)
        got, targets = _compiled(f, x)
    assert not any(t.endswith(("linear", "mm", "matmul", "blas_linear")) for t in targets), targets
    assert "sum" in targets
    assert _rel(got, want) <= 1e-6


def test_compiled_rows_of_int8_weights_and_gathered_experts_equal_eager():
    """The int8 weight-only product and the gathered experts, compiled on the CPU (int8 bytes converted and
    experts picked inside inductor's product), equal their eager forms."""
    from flashserve.model.moe import Experts
    from flashserve.model.packed import ROW_INT8, PackedExperts, encode, int8_mm

    g = torch.Generator().manual_seed(3)
    q, scale = encode(torch.randn(40, 32, generator=g), ROW_INT8)
    x = torch.randn(1, 1, 32, generator=g)
    experts, packed = Experts(6, 32, 16, 7.0), PackedExperts(6, 32, 16, 7.0, ROW_INT8)
    for name in ("w1", "w2", "w3"):
        w = torch.randn(getattr(experts, name).shape, generator=g)
        getattr(experts, name).data = w
        getattr(packed, f"{name}_packed").set_float(w)
    idx, weights = torch.tensor([[4, 1]]), torch.tensor([[0.7, 0.3]])
    with torch.inference_mode():
        for f, args in ((int8_mm, (x, q, scale)), (experts, (x[0], idx, weights)), (packed, (x[0], idx, weights))):
            want = f(*args)
            got, targets = _compiled(f, *args)
            assert not any(t.endswith(("mm", "bmm", "linear")) for t in targets), targets
            assert got.shape == want.shape and _rel(got, want) <= 1e-6


EINSUMS = [("bshd,btd->bsht", (2, 1, 8, 16), (2, 40, 16)), ("bsht,bsh->bst", (2, 1, 8, 40), (2, 1, 8)),
           ("bshd,btd->bhst", (2, 3, 8, 16), (2, 40, 16)), ("bhst,btd->bshd", (2, 8, 3, 40), (2, 40, 16)),
           ("bhsk,bskd->bshd", (2, 8, 3, 5), (2, 3, 5, 16)), ("bshd,bskd->bhsk", (2, 3, 8, 16), (2, 3, 5, 16)),
           ("...jk,...jd->...kd", (2, 1, 4, 4), (2, 1, 4, 32)), ("...jk,jd->...kd", (2, 1, 4, 4), (4, 32)),
           ("ij,jk->ikj", (3, 4), (4, 5))]


@pytest.mark.parametrize("eq,sa,sb", EINSUMS)
def test_compiled_einsum_is_a_fused_product_with_torchs_values(eq, sa, sb):
    """The model's two-operand einsums (attention, indexer, hyper-connection mixing) at the sizes of the tiny and
    peers checkpoints, compiled on the CPU, are a broadcast product and a sum (no ``bmm`` or ``einsum`` call left
    in the graph) with torch.einsum's values and shape; eager they are torch.einsum itself."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(sa, generator=g, dtype=torch.float64), torch.randn(sb, generator=g, dtype=torch.float64)
    want = torch.einsum(eq, a, b)
    assert torch.equal(blas.einsum(eq, a, b), want)
    got, targets = _compiled(lambda a, b: blas.einsum(eq, a, b), a, b)
    assert not any(t.endswith(("bmm", "mm", "einsum", "matmul")) for t in targets), targets
    assert got.shape == want.shape and _rel(got, want) <= 1e-12


# the V4-Flash slice's attention products per row (64 heads of 512: window keys, selected entries), few keys
LARGE_EINSUMS = [("bshd,btd->bhst", (2, 1, 64, 512), (2, 6, 512)), ("bhst,btd->bshd", (2, 64, 1, 6), (2, 6, 512)),
                 ("bshd,bskd->bhsk", (2, 1, 64, 512), (2, 1, 5, 512)), ("bhsk,bskd->bshd", (2, 64, 1, 5), (2, 1, 5, 512))]


@pytest.mark.parametrize("eq,sa,sb", LARGE_EINSUMS)
def test_a_large_compiled_einsum_is_one_bmm_for_every_batch_size(eq, sa, sb):
    """A product of at least FUSED_EINSUM_MACS multiply-adds for every batch size is one ``bmm`` in the compiled
    CPU step (inductor's fused loops took 27 ms of the V4-Flash slice's 45 ms attention layer at 16 rows), with
    torch.einsum's values; traced with the batch size varying, one graph serves two batch sizes (no graph break,
    no recompile)."""
    assert blas.FUSED_EINSUM_MACS <= 64 * 512 * 2 * 2  # 64 heads of 512, 2 rows (the least a batch can be), 2 keys
    g = torch.Generator().manual_seed(6)
    graphs = []

    def recording(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = compile_as_step(lambda a, b: blas.einsum(eq, a, b), backend=recording, fullgraph=True)
    for batch in (2, 3):
        a = torch.randn((batch, *sa[1:]), generator=g, dtype=torch.float64)
        b = torch.randn((batch, *sb[1:]), generator=g, dtype=torch.float64)
        torch._dynamo.mark_dynamic(a, 0)  # as the engine marks a step's batch
        torch._dynamo.mark_dynamic(b, 0)
        got, want = step(a, b), torch.einsum(eq, a, b)
        assert got.shape == want.shape and _rel(got, want) <= 1e-12
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")}
    assert any("bmm" in t for t in targets) and not any("einsum" in t for t in targets), targets
    torch._dynamo.reset()


def _reduction_loops(code: str) -> list[str]:
    """The bodies of the generated C++ loops that accumulate a reduction (from the loop's ``for`` to the
    accumulating line)."""
    lines, bodies = code.splitlines(), []
    for i, line in enumerate(lines):
        if "tmp_acc" in line and "_vec = " in line and "tmp_acc" in line.split("=", 1)[1]:
            j = i
            while j > 0 and "for(" not in lines[j]:
                j -= 1
            bodies.append("\n".join(lines[j:i + 1]))
    return bodies


def test_a_compiled_product_reads_its_normalised_row_once_stored(monkeypatch):
    """An RMSNorm in front of a one-row product is computed once into a buffer of its own: inductor would
    otherwise inline it into the product's reduction and take a square root for every output row (the LM
    head 3-7x slower). Checked in inductor's C++ for an int8 weight (inductor's product, as on AVX-512 CPUs;
    AVX2-only ones take the C++ kernel), and the values equal eager's."""
    from torch._inductor.utils import run_and_get_code

    from flashserve.model import cpu_kernels
    from flashserve.model.packed import ROW_INT8, encode, int8_mm

    monkeypatch.setattr(cpu_kernels, "int8_pairs_preferred", lambda: False)

    g = torch.Generator().manual_seed(6)
    q, scale = encode(torch.randn(64, 32, generator=g), ROW_INT8)
    nw, x = torch.rand(32, generator=g), torch.randn(1, 32, generator=g)

    def f(x):
        return int8_mm(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw, q, scale)

    with torch.inference_mode():
        want = f(x)
        torch._dynamo.reset()
        got, code = run_and_get_code(compile_as_step(f, fullgraph=True), x)
    loops = _reduction_loops("\n".join(code))
    assert any("int8" in body for body in loops), loops  # the product is inductor's reduction ...
    assert not any("sqrt" in body for body in loops if "int8" in body), loops  # ... over the stored row
    assert _rel(got, want) <= 1e-6
    view = blas.materialized(x)
    assert torch.equal(view, x) and view.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("rows", [1, 3])
def test_an_operand_several_products_read_is_computed_once_for_several_rows(rows):
    """Keys gathered from a table and transformed (a sine standing for the cache's unpacking and RoPE), read by a
    score product and a value product as attention reads them. With several rows they are stored once before the
    products: no sine inside a product's reduction loop. One row keeps the fused form (the sine inside), which
    shows the check can fail. Values equal eager's either way."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(7)
    table, q = torch.randn(50, 64, generator=g), torch.randn(rows, 4, 64, generator=g)
    idx = torch.randint(0, 50, (rows, 9), generator=g)

    def f(q, idx):
        keys = blas.shared_operand(torch.sin(table[idx]), q.shape[0])  # [rows, 9, 64]
        probs = torch.softmax(blas.einsum("bhd,btd->bht", q, keys), dim=-1)
        return blas.einsum("bht,btd->bhd", probs, keys)

    with torch.inference_mode():
        want = f(q, idx)
        torch._dynamo.reset()
        got, code = run_and_get_code(compile_as_step(f, fullgraph=True, dynamic=False), q, idx)
    products = [body for body in _reduction_loops("\n".join(code)) if "sin" in body]
    assert (products == []) == (rows > 1), products
    assert _rel(got, want) <= 1e-6


def test_the_engines_threads_keep_openblas_at_one_thread():
    """torch's second thread spins between its parallel regions; a second OpenBLAS thread would fight it for
    the core (the compiled batch-1 step fell 3x), so setting the engine's threads holds OpenBLAS at one."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from flashserve.engine.threads import set_threads

    def numpys() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if "numpy" in i["filepath"] and i["user_api"] == "blas"]

    before = torch.get_num_threads()
    with threadpool_limits(limits=2, user_api="blas"):
        assert numpys() == [2]
        set_threads(2)
        try:
            assert numpys() == [1] and torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(before)


def test_a_grouped_projection_takes_each_groups_panels_for_several_compiled_rows():
    """The grouped output projection with a panel copy: several compiled rows call the panel kernel once per
    group over that group's panels (no batched product), one row keeps inductor's own product; both equal the
    eager einsum to float32 rounding, for 2 and 4 groups."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(1)
    for G in (2, 4):
        lin = blas.Linear(48, G * 32, bias=False)  # G groups of 32 outputs (2 panels each) from 48 inputs
        assert blas.make_panels(lin, "weight")
        with torch.inference_mode():
            torch._dynamo.reset()
            f = compile_as_step(lambda x: lin.grouped(torch.tanh(x)), dynamic=False, options={"cpp_wrapper": True})
            for rows in (5, 1):
                x = torch.randn(rows, 1, G, 48)
                got, (code,) = run_and_get_code(f, x)
                want = torch.einsum("...gk,gnk->...gn", torch.tanh(x), lin.weight.view(G, 32, 48))
                assert got.shape == (rows, 1, G, 32) and _rel(got, want) < 1e-6
                assert code.count("flashserve::dense_rows") == (G if rows > 1 else 0)
                assert "bmm" not in code


def test_stream_panels_serve_compiled_rows_with_the_panels_values(monkeypatch):
    """A weight given stream panels (as a large float32 weight on an AVX2 CPU is) serves several rows of a
    compiled CPU graph through the same operator, with the 16-column panels' values bit for bit."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(3)
    lin, ref = blas.Linear(64, 40, bias=False), blas.Linear(64, 40, bias=False)
    ref.weight.data.copy_(lin.weight.data)
    monkeypatch.setattr(cpu_kernels, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert blas.make_panels(lin, "weight") and blas.panels(lin, "weight").shape[-1] == cpu_kernels.STREAM_LANES
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert blas.make_panels(ref, "weight") and blas.panels(ref, "weight").shape[-1] == cpu_kernels.LANES
    x = torch.randn(9, 64)
    with torch.inference_mode():
        torch._dynamo.reset()
        f = compile_as_step(lambda x: (torch.tanh(x), lin(torch.tanh(x))), dynamic=False, options={"cpp_wrapper": True})
        (h, got), (code,) = run_and_get_code(f, x)
    assert "flashserve::dense_rows" in code
    assert torch.equal(got, cpu_kernels.dense_rows(h, blas.panels(ref, "weight"), 40))


def test_weights_of_one_input_share_one_joint_product_with_their_own_sums():
    """Weights a module multiplies one input by (widths 40, 8 and 33: none a whole number of panels) get one joined
    panel copy; several rows of a compiled CPU graph multiply all three in one call, each output the sum its own
    panels give, bit for bit. One row, eager code, a group of one, or a weight that is not a float32 parameter
    get no joint product."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(4)
    mod = torch.nn.ModuleDict({"a": blas.Linear(64, 40, bias=False), "b": blas.Linear(64, 8, bias=False),
                               "c": blas.Linear(64, 33, bias=False)})
    paths = ("a.weight", "b.weight", "c.weight")
    assert blas.make_joint_panels(mod, "x", paths)
    assert mod.x_joint_panels.shape == (3 + 1 + 3, 64, cpu_kernels.LANES) and mod.x_joint_of == (paths, (40, 8, 33))
    assert not blas.make_joint_panels(mod, "one", ("a.weight",))
    assert not blas.make_joint_panels(mod, "missing", ("a.weight", "d.weight"))
    x = torch.randn(2, 3, 64)
    assert blas.joint_products(x, mod, "x") == {}  # eager
    with torch.inference_mode():
        torch._dynamo.reset()
        f = compile_as_step(lambda x: (torch.tanh(x), blas.joint_products(torch.tanh(x), mod, "x")), dynamic=False,
                          options={"cpp_wrapper": True})
        (h, got), (code,) = run_and_get_code(f, x)
        torch._dynamo.reset()
        one = compile_as_step(lambda x: blas.joint_products(x, mod, "x"), dynamic=False)(x[:1, :1])
    assert code.count("flashserve::dense_rows") == 1 and one == {}
    for path, n in zip(paths, (40, 8, 33)):
        w = mod.get_parameter(path)
        want = cpu_kernels.dense_rows(h.reshape(6, 64), cpu_kernels.pack_panels(w), n).view(2, 3, n)
        assert got[path].shape == (2, 3, n) and torch.equal(got[path], want)


def test_a_weights_panels_serve_several_compiled_rows_with_torchs_values():
    """A float32 weight with a panel copy: several rows of a compiled CPU graph (inductor, C++ wrapper) call the
    panel kernel, one row keeps inductor's own product, eager keeps torch's; values equal ``F.linear`` to float32
    rounding, for a column-major weight too. Non-float32 weights get no copy."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    lin = blas.Linear(64, 40, bias=True)
    assert blas.panels(lin, "weight") is None and blas.make_panels(lin, "weight")
    assert blas.panels(lin, "weight").shape == (3, 64, 16)  # 40 columns in panels of 16
    assert "weight_panels" not in lin.state_dict()
    wide = blas.Linear(64, 8192).double()
    assert not blas.make_panels(wide, "weight") and blas.panels(wide, "weight") is None
    tall = blas.Linear(64, 40, bias=False)
    tall.weight.data = tall.weight.t().contiguous().t()  # column-major, as weight_layout stores a tall head
    assert blas.make_panels(tall, "weight")
    with torch.inference_mode():
        for mod in (lin, tall):
            torch._dynamo.reset()
            f = compile_as_step(lambda x, m=mod: m(torch.tanh(x)), dynamic=False, options={"cpp_wrapper": True})
            for rows in (3, 1):
                x = torch.randn(rows, 64)
                got, (code,) = run_and_get_code(f, x)
                want = F.linear(torch.tanh(x), mod.weight, mod.bias)
                assert _rel(got, want) < 1e-6
                assert ("flashserve::dense_rows" in code) == (rows > 1)
        x = torch.randn(3, 64)
        assert _rel(lin(x), F.linear(x, lin.weight, lin.bias)) < 1e-6  # eager: torch's own product


def test_one_compiled_row_reads_bfloat16_panels_of_a_bf16_weight():
    """A float32 weight whose values bfloat16 holds (a bf16 checkpoint's LM head computed in float32) gets
    bfloat16 panels: one row of a compiled CPU step reads them (half the weight's bytes) instead of the weight,
    with F.linear's values to float32 rounding."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    head = blas.Linear(64, 40, bias=False)
    head.weight.data = head.weight.data.bfloat16().float().t().contiguous().t()  # column-major, as a tall head
    assert blas.make_panels(head, "weight") and blas.panels(head, "weight").dtype == torch.bfloat16
    with torch.inference_mode():
        torch._dynamo.reset()
        f = compile_as_step(lambda x: head(torch.tanh(x)), dynamic=False, options={"cpp_wrapper": True})
        x = torch.randn(1, 64)
        got, (code,) = run_and_get_code(f, x)
        assert "flashserve::dense_rows" in code
        assert _rel(got, F.linear(torch.tanh(x), head.weight)) < 1e-6


def test_eager_decode_rows_read_bfloat16_panels_of_a_large_bf16_weight(monkeypatch):
    """An eager engine gives a large float32 weight whose values bfloat16 holds (a bf16 checkpoint's LM head)
    bfloat16 panels, and its decode rows read them (half the bytes) with F.linear's values to float32 rounding;
    a prompt's rows, a weight bfloat16 would round and a small weight keep torch's product."""
    from flashserve.model import weight_layout

    monkeypatch.setattr(blas, "BF16_PANEL_MIN_ELEMENTS", 64 * 40)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.head = blas.Linear(64, 40, bias=False)
    model.head.weight.data = model.head.weight.data.bfloat16().float()
    model.rounded = blas.Linear(64, 40, bias=False)  # float32 values bfloat16 would round
    model.small = blas.Linear(8, 4, bias=False)
    model.small.weight.data = model.small.weight.data.bfloat16().float()
    assert weight_layout.bf16_panels_for_decode(model) == ["head.weight_panels"]
    calls = []
    real = cpu_kernels.dense_rows
    monkeypatch.setattr(cpu_kernels, "dense_rows", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, 16, blas.BF16_PANEL_MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            assert _rel(model.head(x), F.linear(x, model.head.weight)) < 1e-6
        model.rounded(torch.randn(1, 64))
    assert calls == [1, 16]


def test_one_row_products_of_weights_that_stream_from_memory_take_every_thread(monkeypatch):
    """OpenBLAS (one thread) makes one-row float32 products of weights up to ``OPENBLAS_MAX_VALUES``; larger ones,
    which stream from memory, go to torch's product on every thread; the values agree either way."""
    import torch.nn.functional as F

    small, large, x = torch.randn(16, 32), torch.randn(64, 32), torch.randn(1, 32)
    monkeypatch.setattr(blas, "OPENBLAS_MAX_VALUES", 1000)
    with torch.no_grad():
        assert blas.takes(x, small) == blas.OPENBLAS and not blas.takes(x, large)
        for w in (small, large):
            torch.testing.assert_close(blas.linear(x, w), F.linear(x, w), rtol=1e-6, atol=1e-6)


def test_bf16_exact_reads_each_values_low_half():
    """bfloat16 holds a float32 value exactly when its low 16 bits are zero: a bf16 tensor read into float32,
    in any layout, is held; one value off by its last bit, or a subnormal bfloat16 cannot hold, is not; the
    same answers as converting to bfloat16 and back."""
    w = torch.randn(300, 70, generator=torch.Generator().manual_seed(3))
    held = w.bfloat16().float()
    off = held.clone()
    off.view(torch.int32)[7, 7] += 1
    tiny = torch.tensor([1.0, 2.0 ** -140])  # bfloat16's smallest subnormal is 2^-133
    cases = [(w, False), (held, True), (held.t(), True), (held.t().contiguous().t(), True), (held[:, ::3], True),
             (off, False), (tiny, False), (held.double(), True), (w.double(), False)]
    for t, want in cases:
        assert cpu_kernels.bf16_exact(t) is want
        assert torch.equal(t.to(torch.bfloat16).to(t.dtype), t) is want
