"""flashserve's V4 forward against transformers 5.24's DeepseekV4ForCausalLM (the independent oracle).

Three random tiny configs (different widths, CSA/HCA/window-only patterns, hash layers, o_groups > 1, one
with YaRN) are saved with ``save_pretrained`` and loaded through flashserve's checkpoint reader; logits
must agree to 1e-4 relative (eager attention and experts, no QAT simulation on either side).

Both models run in float64: in float32 a random input can put two experts' router scores within rounding of
each other, and which one wins then depends on each side's summation order, not on its formulas. "deep" at
length 300 has one (batch row 1, position 188, the first MoE layer: the 2nd and 3rd scores 2.3e-7 apart,
relative), which an AVX-512 CPU's float32 sums resolved differently from transformers' (1.3e-1 relative error
from there on). flashserve's float32 paths are compared with each other and with float64 elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from flashserve import load_model
from hf_oracle import tiny_hf_v4

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CONFIGS = {
    "narrow-yarn": dict(hidden=64, heads=4, head_dim=64, rope=16, layer_types=[SWA, CSA, HCA, CSA, SWA],
                        n_hash=1, o_groups=2, window=8, hca=16, yarn=True, seed=1),
    "wide": dict(hidden=96, heads=8, head_dim=32, rope=8, layer_types=[HCA, CSA, CSA, HCA],
                 n_hash=2, o_groups=4, window=16, hca=32, seed=2),
    "deep": dict(hidden=64, heads=2, head_dim=64, rope=32, layer_types=[SWA, SWA, CSA, HCA, CSA, HCA, SWA],
                 n_hash=3, o_groups=2, window=32, hca=8, index_topk=16, seed=3),
}
LENGTHS = (1, 5, 131, 300)


@pytest.fixture(autouse=True)
def oracle_tie_order(monkeypatch):
    """Compare formulas, not tie-breaking: an index score can tie exactly (0 when every head's ReLU is 0,
    as happens in "deep" at length 131). transformers keeps ``torch.topk``'s order; flashserve gives ties to
    the lower index so that chunking cannot change a selection (tested in test_fast_paths.py)."""
    from flashserve.model import attention

    def torch_topk(x, k):
        top = x.topk(min(k, x.shape[-1]), dim=-1)
        return top.values, top.indices

    monkeypatch.setattr(attention, "top_k", torch_topk)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf_v4(path, **CONFIGS[request.param])
    hf.config._experts_implementation = "eager"  # its grouped_mm takes no float64 on the CPU
    ours = load_model(path, dtype=torch.float64, fake_quant=False)
    return hf.double(), ours


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers(pair, length):
    hf, ours = pair
    ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids).logits
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-4, f"max relative error {rel:.2e} at length {length}"


def test_cached_decode_matches_transformers_forward(pair):
    """Token-by-token decoding through our state equals the oracle's whole-sequence forward."""
    hf, ours = pair
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(ids).logits
        state = ours.new_state(1)
        got = torch.cat([ours(ids[:, i:i + 1], state).logits for i in range(ids.shape[1])], dim=1)
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-4, f"max relative error {rel:.2e}"
