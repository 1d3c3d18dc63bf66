"""The cache's device storage: typed per layer, all of it allocated at start-up and never replaced while serving."""

import pytest
import torch

from engine_helpers import make_engine, prompt_of, run_greedy
from flashserve.engine import SamplingParams
from flashserve.model.state import CacheKey


def _storage_tensors(cache) -> dict[str, torch.Tensor]:
    st = cache.storage
    out = {"history": st.history}
    for i, lay in enumerate(st.layers):
        out[f"{i}.window.rows"], out[f"{i}.window.first"] = lay.window.rows, lay.window.first
        for kind in ("main", "index"):
            rows = getattr(lay, kind)
            if rows is not None:
                out[f"{i}.{kind}.pages"], out[f"{i}.{kind}.counts"] = rows.pages, rows.counts
                out[f"{i}.{kind}.protected"] = rows.protected
            ring = getattr(lay, f"{kind}_ring")
            if ring is not None:
                out[f"{i}.{kind}.ring"], out[f"{i}.{kind}.keep"] = ring.rows, ring.keep
    return out


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_every_layer_gets_its_storage_at_start_up(models, name):
    """Each layer has a window ring; each KV source the global caches and rings its role needs, sized from the
    config (not from the first request)."""
    model = models(name, torch.float32)
    cfg = model.cfg
    engine = make_engine(model, name, dtype="float32", max_num_seqs=3)
    layers = engine.cache.storage.layers
    assert len(layers) == cfg.num_hidden_layers
    for i, lay in enumerate(layers):
        assert lay.window.rows.shape[:2] == (4, cfg.sliding_window - 1)  # 3 slots + the scratch slot
        ratio = cfg.compress_ratios[i]
        source = ratio > 0 and cfg.kv_source(i) == i
        assert (lay.main is not None) == source
        if not source:
            assert lay.index is None and lay.main_ring is None and lay.index_ring is None
            continue
        assert lay.main.key == CacheKey(i) and lay.main.ratio == ratio
        assert lay.main.pages.shape[:2] == (engine.cache.num_pages + 1, engine.cache.page_tokens // ratio)
        csa = (not cfg.is_v41) and ratio == cfg.compress_rate_csa
        assert (lay.index is not None) == (cfg.is_v41 or csa)
        assert (lay.main_ring is not None) == (ratio > 1)
        if ratio > 1:
            assert lay.main_ring.capacity == (2 * ratio - 1 if csa else ratio - 1)
        assert (lay.index_ring is not None) == csa
    # every attention layer reads its source's caches by typed key
    for i, block in enumerate(model.layers):
        attn = block.attn
        src = cfg.kv_source(i)
        assert attn.src_main == (CacheKey(src) if src is not None else None)


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_serving_never_replaces_storage(models, name):
    """Prefills (chunked, prefix hits, encoder-only with its replay stash), decode steps, aborts and slot reuse
    all write into the tensors made at start-up: same objects, same addresses."""
    model = models(name, torch.float32)
    engine = make_engine(model, name, dtype="float32", max_num_seqs=2, prefill_chunk=48)
    before = {k: (t, t.data_ptr()) for k, t in _storage_tensors(engine.cache).items()}
    # what a CUDA-graph step marks as static addresses is every tensor a step can write
    assert {id(t) for t, _ in before.values()} == {id(t) for t in engine.cache.storage.tensors()}
    shared = prompt_of(150, seed=1)
    run_greedy(engine, [shared], 4)
    run_greedy(engine, [shared + prompt_of(20, seed=2), prompt_of(90, seed=3), prompt_of(30, seed=5)], 12)
    engine.add_request("gone", prompt_of(60, seed=4), SamplingParams(max_tokens=20))
    engine.step()
    engine.abort_request("gone")
    after = _storage_tensors(engine.cache)
    assert after.keys() == before.keys()
    for k, t in after.items():
        assert t is before[k][0] and t.data_ptr() == before[k][1], k
    assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert not engine.cache.storage.replay.rows  # stash dropped once each prefill ended
