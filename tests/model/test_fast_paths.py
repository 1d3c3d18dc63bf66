"""Fast formulations equal their plain references: Sinkhorn as baddbmm, MoE as grouped matmuls."""

import pytest
import torch

from torch._inductor.utils import run_and_get_code

from flashserve.model import cpu_kernels, mhc, modes
from flashserve.model.mhc import _sinkhorn_scalings, sinkhorn
from flashserve.model.moe import Experts
from step_modes import compile_as_step


def plain_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb.clone()
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (0, 2)])
def test_sinkhorn_equals_plain_loop(dtype, shape):
    g = torch.Generator().manual_seed(0)
    comb = torch.softmax(3 * torch.randn(*shape, 4, 4, generator=g, dtype=dtype), -1) + 1e-6
    want = plain_sinkhorn(comb, 20, 1e-6)
    got = sinkhorn(comb.clone(), 20, 1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    if comb.numel():
        torch.testing.assert_close(got.sum(-2), torch.ones_like(got.sum(-2)), rtol=0, atol=1e-4)


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (0, 2)])
def test_sinkhorn_as_row_and_column_scalings_equals_plain_loop(iters, shape):
    g = torch.Generator().manual_seed(iters)
    comb = torch.softmax(3 * torch.randn(*shape, 4, 4, generator=g, dtype=torch.float64), -1) + 1e-6
    got = _sinkhorn_scalings(comb, iters, 1e-6)
    assert got.shape == comb.shape
    torch.testing.assert_close(got, plain_sinkhorn(comb, iters, 1e-6), rtol=0, atol=1e-12)


def test_compiled_sinkhorn_grows_by_a_few_ops_an_iteration_in_a_few_kernels():
    """Traced as a compiled step off the CPU runs it (no C++ kernel), Sinkhorn has no batched product (which
    inductor would call as an external kernel per half-step), its graph grows by a handful of ops an iteration
    (entry by entry it grew by 88, and tracing them was most of a compile), and inductor keeps it in the same few
    kernels whatever the iterations."""
    graphs = []

    def recording(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(1)
    comb = torch.softmax(3 * torch.randn(2, 3, 4, 4, generator=g), -1) + 1e-6
    nodes = {}
    for iters in (3, 6, 20):
        torch._dynamo.reset()
        graphs.clear()
        got = compile_as_step(sinkhorn, modes.COMPILED, backend=recording, fullgraph=True)(comb.clone(), iters, 1e-6)
        torch.testing.assert_close(got, sinkhorn(comb.clone(), iters, 1e-6), rtol=1e-6, atol=1e-7)
        ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        assert ops and not any("bmm" in op for op in ops)
        nodes[iters] = len(ops)
    assert 0 < (nodes[20] - nodes[6]) / 14 == (nodes[6] - nodes[3]) / 3 <= 12

    torch._dynamo.reset()
    kernels = {}
    for iters in (3, 6):
        got, code = run_and_get_code(compile_as_step(sinkhorn, modes.COMPILED, fullgraph=True), comb[:1, :1].clone(), iters, 1e-6)
        torch.testing.assert_close(got, plain_sinkhorn(comb[:1, :1], iters, 1e-6), rtol=1e-6, atol=1e-7)
        kernels[iters] = "\n".join(code).count("cpp_fused")
    assert 0 < kernels[6] == kernels[3] <= 2


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_a_compiled_cpu_sinkhorn_is_one_kernel_call_with_the_traced_values(iters):
    """In a compiled CPU step, float32 Sinkhorn is one call of the C++ kernel whatever the iterations (its graph
    does not grow with them), and gives the traced scalings' values bit for bit; float64 stays traced."""
    assert cpu_kernels.sinkhorn_available()
    graphs = []

    def recording(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(iters)
    comb = torch.softmax(3 * torch.randn(5, 2, 4, 4, generator=g), -1) + 1e-6
    torch._dynamo.reset()
    got = compile_as_step(sinkhorn, backend=recording, fullgraph=True)(comb.clone(), iters, 1e-6)
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("flashserve.sinkhorn" in op for op in ops) == 1 and len(ops) <= 2
    assert torch.equal(got, _sinkhorn_scalings(comb, iters, 1e-6))
    through_cpp = compile_as_step(sinkhorn, fullgraph=True, options={"cpp_wrapper": True})
    assert torch.equal(through_cpp(comb.clone(), iters, 1e-6), got)
    graphs.clear()
    torch._dynamo.reset()
    compile_as_step(sinkhorn, backend=recording, fullgraph=True)(comb.double(), iters, 1e-6)
    assert graphs and not any("flashserve.sinkhorn" in str(n.target) for gm in graphs for n in gm.graph.nodes)


def _experts(dtype):
    torch.manual_seed(0)
    ex = Experts(16, 64, 32, limit=7.0)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.2)
    return ex.to(dtype)


@pytest.mark.parametrize("tokens", [1, 3, 64, 257])
def test_grouped_mm_equals_expert_loop(tokens):
    ex = _experts(torch.float32)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
    if tokens == 3:
        idx = torch.tensor([[1, 2, 3, 4]] * 3)  # twelve experts with no token
    w = torch.rand(tokens, 4, generator=g)
    assert ex._grouped_mm_ok(x)
    with torch.no_grad():
        want = ex._grouped(x, idx, w)
        torch.testing.assert_close(ex._grouped_mm(x, idx, w), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ex._gathered(x, idx, w), want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_not_used_where_unsupported():
    ex = _experts(torch.float64)
    assert not ex._grouped_mm_ok(torch.zeros(2, 64, dtype=torch.float64))
    odd = Experts(4, 6, 5, limit=7.0)  # rows of 24 and 20 bytes: not 16-byte aligned
    assert not odd._grouped_mm_ok(torch.zeros(2, 6))


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_blocked_window_attention_equals_dense(preset, monkeypatch):
    """Long chunks attend to the window block by block; the logits equal one dense masked softmax, for a
    whole prompt and for a chunk that continues a cached state (prior window rows in the key buffer).
    Fake quantisation is off: its rounding would turn the last-bit differences of a different summation
    order into different FP4 codes."""
    from flashserve.model import attention
    from flashserve.model.loader import load_model

    model = load_model(preset, dtype=torch.float64, with_mtp=False, fake_quant=False)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 700), generator=torch.Generator().manual_seed(1))
    block = max(attention.WINDOW_BLOCK, model.cfg.sliding_window)
    assert ids.shape[1] - 150 > 2 * block  # several blocks, the last one partial, in both runs

    def run():
        whole = model(ids).logits
        state = model.new_state(2)
        first = model(ids[:, :150], state).logits
        rest = model(ids[:, 150:], state).logits
        return whole, torch.cat([first, rest], 1)

    with torch.inference_mode():
        blocked_whole, blocked_chunked = run()
        monkeypatch.setattr(attention, "WINDOW_BLOCK", 10 ** 9)
        dense_whole, dense_chunked = run()
    # a different summation order, amplified through eight random layers, moves logits by ~1e-9 in float64;
    # a key missing from a block would move them by ~1e-1
    torch.testing.assert_close(blocked_whole, dense_whole, rtol=0, atol=1e-7)
    torch.testing.assert_close(blocked_chunked, dense_chunked, rtol=0, atol=1e-7)


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_fake_quantised_prefill_does_not_depend_on_chunking(preset, monkeypatch):
    """FP4 index scores tie often; top-k breaks ties by entry order, so a row's selection cannot depend on
    how many entries its forward holds (with ``torch.topk``, tiny-v41 rows 26.. changed here)."""
    from flashserve.model import attention
    from flashserve.model.loader import load_model

    monkeypatch.setattr(attention, "WINDOW_BLOCK", 10 ** 9)  # one dense softmax: only tie-breaking differs
    model = load_model(preset, dtype=torch.float64, with_mtp=False, fake_quant=True)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 400), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = model(ids).logits
        for cut in (100, 128):
            state = model.new_state(2)
            parts = [model(ids[:, :cut], state).logits, model(ids[:, cut:], state).logits]
            torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=1e-9)


def test_top_k_breaks_ties_by_index():
    from flashserve.model.attention import top_k

    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("-inf")],   # a tie across the cut at k = 2
                      [5.0, 1.0, 4.0, 2.0, 0.0, 3.0]])             # no ties
    values, indices = top_k(x, 2)
    assert indices.tolist() == [[1, 2], [0, 2]] and values.tolist() == [[3.0, 3.0], [5.0, 4.0]]
    values, indices = top_k(x, 4)  # ascending index order
    assert indices.tolist() == [[1, 2, 3, 4], [0, 2, 3, 5]] and values.tolist() == [[3, 3, 2, 3], [5, 4, 2, 3]]
    assert top_k(x[1:], 4)[1].tolist() == [[0, 2, 3, 5]]  # the no-tie path alone
    assert top_k(x, 6)[1].tolist() == [[0, 1, 2, 3, 4, 5]] * 2  # k = length


def test_top_k_equals_a_stable_sort_on_heavily_tied_rows():
    """Against the plain definition: sort descending, stably (ties keep index order), keep k, then order
    the kept entries by index. Small integer scores and -inf make ties everywhere."""
    from flashserve.model.attention import top_k

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        T = int(torch.randint(1, 40, (1,), generator=g))
        k = int(torch.randint(1, 45, (1,), generator=g))
        x = torch.randint(-3, 4, (3, 5, T), generator=g).float()
        x[torch.rand(x.shape, generator=g) < 0.3] = float("-inf")
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        keep = min(k, T)
        order = indices[..., :keep].argsort(-1)
        got_values, got_indices = top_k(x, k)
        assert torch.equal(got_indices, indices[..., :keep].gather(-1, order))
        assert torch.equal(got_values, values[..., :keep].gather(-1, order))


def test_compiled_index_scores_store_no_product_per_head_entry_and_column():
    """The indexer's scores of one row against a long packed (FP4) index cache, compiled by inductor: the keys
    are unpacked into one stored [T, d] buffer and the query rounded once, and no buffer holds the [H, T, d]
    products. One did (the unpacking and the query's rounding fused into the product, redone per head, entry and
    column): tiny-v41's compiled step took 179 ms at 32K context against 7.8 ms at 1K. Scores equal eager's."""
    import re
    from types import SimpleNamespace

    from flashserve.config import load_config
    from flashserve.engine.kv_codec import codecs
    from flashserve.model.attention import Indexer, qat_points

    cfg = load_config("tiny-v41")
    g = torch.Generator().manual_seed(8)
    indexer = Indexer(cfg, 1, keys=False, queries=True)
    for p in indexer.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    codec = codecs(cfg, packed=True)["index"]
    T, H, d = 2048, cfg.index_n_heads, cfg.index_head_dim
    packed = codec.pack(torch.randn(1, T, d, generator=g))
    x, qr = torch.randn(1, 1, cfg.hidden_size, generator=g), torch.randn(1, 1, cfg.q_lora_rank, generator=g)
    angle = torch.rand(1, 1, 8, generator=g)
    ctx = SimpleNamespace(angles=lambda kind: (angle.cos(), angle.sin()))

    def scores(x, qr, packed):
        return indexer.scores(x, qr, codec.unpack(packed, torch.float32), ctx, qat_points(cfg).index_query)

    with torch.inference_mode():
        want = scores(x, qr, packed)
        torch._dynamo.reset()
        got, (code,) = run_and_get_code(compile_as_step(scores, fullgraph=True, dynamic=False), x, qr, packed)
    sizes = [eval(s) for s in re.findall(r"empty_strided_cpu\(\((\d+(?:, *\d+)*,?)\)", code)]
    largest = max(torch.Size(s if isinstance(s, tuple) else (s,)).numel() for s in sizes)
    assert T * d <= largest < H * T * d  # the unpacked keys are stored; their products per head are not
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
