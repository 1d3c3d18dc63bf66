"""The indexer's top-k kernel (cpu_kernels.index_topk) against the model's torch code: Indexer.scores' formula
over the unpacked keys, then select_topk and candidate_pool."""

import pytest
import torch

from flashserve.model import cpu_kernels, quant
from flashserve.model.attention import candidate_pool, select_topk

# (sequences, rows each, heads, head dim, entries a page, pages a sequence, k, block, pool blocks)
SHAPES = {"tiny-v41": (1, 1, 8, 32, 64, 4, 8, 4, 4),
          "rows and sequences": (3, 2, 5, 64, 7, 9, 5, 3, 3),  # blocks of 3: not a whole number a tile
          "released": (1, 1, 64, 128, 64, 40, 64, 8, 16)}


def _case(B, S, H, d, epp, P, seed, ties=False, rounded=True):
    """Random FP4 index pages (sequences on shuffled pages), queries, head weights and visible counts: the first
    row sees 3 entries, the last none. ``ties``: 5 distinct keys repeated, so most scores equal others."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B * P + 3, epp, d, generator=g)
    if ties:
        keys = torch.randn(5, d, generator=g)[torch.randint(0, 5, keys.shape[:2], generator=g)]
    pages = quant.pack_fp4_ue8m0(keys)
    table = torch.stack([torch.randperm(B * P + 3, generator=g)[:P] for _ in range(B)])
    q = torch.randn(B * S, H, d, generator=g)
    if rounded:  # as the model rounds them: the kernel multiplies integers
        q = quant.fake_quant_fp4(q, block=32, e4m3_scale=False)
    w = torch.randn(B * S, H, generator=g)
    limit = torch.randint(0, P * epp + 1, (B * S,), generator=g)
    limit[0], limit[-1] = 3, 0
    return q, w, pages, table, limit


def _scores(q, w, pages, table, S):
    """Indexer.scores' arithmetic in torch, on the keys unpacked: [B, S, T]."""
    B = table.shape[0]
    keys = quant.unpack_fp4_ue8m0(pages[table].flatten(1, 2))
    s = torch.einsum("bshd,btd->bsht", q.view(B, S, *q.shape[1:]), keys).relu() * q.shape[-1] ** -0.5
    return torch.einsum("bsht,bsh->bst", s, w.view(B, S, -1))


def _blocks(mask: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """The ids of the blocks a candidate mask [B, S, T] keeps, ascending, -1 past the end: [B*S, n]."""
    B, S, T = mask.shape
    nb = -(-T // block)
    kept = torch.nn.functional.pad(mask, (0, nb * block - T)).view(B * S, nb, block).any(-1)
    out = torch.full((B * S, n), -1)
    for r in range(B * S):
        ids = kept[r].nonzero().flatten()
        out[r, :len(ids)] = ids
    return out


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("keys", ["distinct", "ties", "query unrounded"])
def test_index_topk_equals_the_indexers_torch_code(isa, shape, keys):
    """Every visible entry scored (top-k and the candidate pool), then only the pool's entries: the torch code's
    indices and validity exactly, ties going to the lower index, rows with fewer than k visible entries (filled
    with the lowest others, invalid) and none. Rounded queries take the integer products, others the float ones."""
    B, S, H, d, epp, P, k, block, n_blocks = SHAPES[shape]
    q, w, pages, table, limit = _case(B, S, H, d, epp, P, seed=len(shape), ties=keys == "ties",
                                      rounded=keys != "query unrounded")
    scores = _scores(q, w, pages, table, S)
    visible = torch.arange(P * epp) < limit.view(B, S, 1)
    none = torch.zeros(B * S, 0, dtype=torch.long)

    idx, valid, pool = cpu_kernels.index_topk_eager(q, w, pages, table, limit, none, k, block, n_blocks, isa=isa)
    want_idx, want_valid = select_topk(scores, visible, k)
    assert torch.equal(idx, want_idx.view(B * S, k)) and torch.equal(valid, want_valid.view(B * S, k))
    assert valid.sum(-1).tolist() == limit.clamp(max=k).tolist()
    cand = candidate_pool(scores, visible, visible.sum(-1), block, n_blocks)
    assert torch.equal(pool, _blocks(cand, block, n_blocks))
    assert (pool[-1] == -1).all() and (pool[:-1, 0] >= 0).all()

    idx, valid, _ = cpu_kernels.index_topk_eager(q, w, pages, table, limit, pool, k, block, 0, isa=isa)
    want_idx, want_valid = select_topk(scores, visible & cand, k)
    assert torch.equal(idx, want_idx.view(B * S, k)) and torch.equal(valid, want_valid.view(B * S, k))


@pytest.mark.parametrize("keys", ["distinct", "ties"])
def test_index_topk_does_not_depend_on_the_number_of_threads(keys):
    """Long rows are split between threads (ranges of at least 4096 entries, merged keeping the lower index of
    equal scores): the torch code's picks and pool with two threads and with one."""
    q, w, pages, table, limit = _case(2, 1, 8, 32, 64, 160, seed=5, ties=keys == "ties")
    limit[:] = torch.tensor([10_000, 9_001])
    none = torch.zeros(2, 0, dtype=torch.long)
    scores = _scores(q, w, pages, table, 1)
    visible = torch.arange(160 * 64) < limit.view(2, 1, 1)
    want_idx, want_valid = select_topk(scores, visible, 8)
    want_pool = _blocks(candidate_pool(scores, visible, visible.sum(-1), 4, 4), 4, 4)
    threads = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            idx, valid, pool = cpu_kernels.index_topk_eager(q, w, pages, table, limit, none, 8, 4, 4)
            assert torch.equal(idx, want_idx.view(2, 8)) and torch.equal(valid, want_valid.view(2, 8))
            assert torch.equal(pool, want_pool)
    finally:
        torch.set_num_threads(threads)


def test_index_topk_operator_runs_the_cpp_implementation_and_refuses_mismatches():
    """The native build registers the operator's CPU implementation: the binding's values, and its own checks."""
    assert cpu_kernels.index_topk_available()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flashserve::index_topk", "CPU")
    q, w, pages, table, limit = _case(2, 1, 8, 32, 16, 6, seed=7)
    none = torch.zeros(2, 0, dtype=torch.long)
    got = torch.ops.flashserve.index_topk(q, w, pages, table, limit, none, 8, 4, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, cpu_kernels.index_topk_eager(q, w, pages, table, limit, none,
                                                                                    8, 4, 4)))
    bad = {"a head dim not a multiple of 32": (q[..., :16], w, pages, table, limit, none, 8, 4, 4),
           "no head dim": (q[..., :0], w, pages[..., :0], table, limit, none, 8, 4, 4),
           "records of another width": (q, w, pages[..., :16], table, limit, none, 8, 4, 4),
           "more picks than entries": (q, w, pages, table, limit, none, 97, 4, 4),
           "a pool in listed mode": (q, w, pages, table, limit, torch.zeros(2, 3, dtype=torch.long), 8, 4, 4),
           "rows not a multiple of the sequences": (q[:1], w[:1], pages, table, limit[:1], none[:1], 8, 4, 4)}
    for why, args in bad.items():
        with pytest.raises(ValueError, match="index_topk: q .* do not match"):
            cpu_kernels.index_topk_eager(*args)
        with pytest.raises(RuntimeError, match="index_topk: q .* do not match"):
            torch.ops.flashserve.index_topk(*args)
    with pytest.raises(ValueError, match="pages must be uint8"):
        cpu_kernels.index_topk_eager(q, w, pages.float(), table, limit, none, 8, 4, 4)
    with pytest.raises(IndexError, match="page id out of range"):  # torch's translation of std::out_of_range
        torch.ops.flashserve.index_topk(q, w, pages, table + pages.shape[0], limit, none, 8, 4, 4)
    empty = torch.ops.flashserve.index_topk(q[:0], w[:0], pages, table, limit[:0], none[:0], 8, 4, 4)
    assert [t.shape for t in empty] == [(0, 8), (0, 8), (0, 4)]
