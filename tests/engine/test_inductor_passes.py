"""The compiled step writes the cache's rings in place (:class:`SinkInputWrites`), with the eager step's values."""

from __future__ import annotations

import re

import pytest
import torch

from flashserve.config.model_config import config_from_dict
from flashserve.config.presets import preset_json
from flashserve.engine.cache import KVCache
from flashserve.engine.fixed_state import FixedBatchState
from flashserve.engine.graphs.inductor_passes import SinkInputWrites
from flashserve.model.state import CacheKey


def _cache() -> KVCache:
    """V4's first layers: a window-only layer and a CSA layer (ratio 4, overlapping groups: a 7-row ring)."""
    raw = preset_json("tiny-v4")
    raw.update(num_hidden_layers=2, compress_ratios=[0, 4], num_hash_layers=0, num_nextn_predict_layers=0)
    return KVCache(config_from_dict(raw), dtype=torch.float32, device="cpu", packed=False, kv_memory=0,
                   max_num_seqs=4, num_pages=6, block_size=16)


def _loops_over(code: str, numel: int) -> int:
    """Loops of inductor's C++ that run over ``numel`` elements (a whole ring's copy)."""
    return len(re.findall(rf"<static_cast<int64_t>\({numel}L\);", code))


@pytest.mark.parametrize("sink", [False, True])
def test_a_compiled_step_writes_its_rings_in_place(sink):
    """A step's window and compressor rings read, then written, as the decode step does. Inductor alone copies
    each ring whole before the write and back after it (which shows the check can fail); with the pass no loop
    runs over a whole ring, and outputs and ring contents equal eager's bit for bit."""
    from torch._inductor.utils import run_and_get_code

    cache = _cache()
    layer = cache.storage.layers[1]
    rings = (layer.window.rows, layer.main_ring.rows)
    g = torch.Generator().manual_seed(0)
    for t in rings:
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in cache.storage.tensors()]
    slots, start = torch.tensor([2, 0, 1]), torch.tensor([40, 7, 19])
    table = torch.tensor([[0, 1, 2], [3, 6, 6], [4, 5, 6]])
    kv = torch.randn(3, 1, rings[0].shape[-1], generator=g)
    raw = torch.randn(3, 1, rings[1].shape[-1], generator=g)

    def step(kv, raw, start, slots, table):
        state = FixedBatchState(cache, slots, table)
        state.begin(1, start)
        full, pos = state.window(1, kv)
        groups = state.compressor_raw(CacheKey(1), raw, keep_from=start)
        return full * pos[..., None], groups.sum(1)

    with torch.inference_mode():
        want = step(kv, raw, start, slots, table)
        after = [t.clone() for t in cache.storage.tensors()]
        for t, b in zip(cache.storage.tensors(), before, strict=True):
            t.copy_(b)
        torch._dynamo.reset()
        options = {"post_grad_custom_pre_pass": SinkInputWrites()} if sink else {}
        compiled = torch.compile(step, fullgraph=True, dynamic=False, options=options)
        got, code = run_and_get_code(compiled, kv, raw, start, slots, table)
    copies = sum(_loops_over("\n".join(code), t.numel()) for t in rings)
    assert (copies == 0) == sink, copies
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(cache.storage.tensors(), after, strict=True))
