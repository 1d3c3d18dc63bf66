"""flashserve's V4.1 text forward against mlx-lm 0.32.2's ``deepseek_v41`` (the independent V4.1 oracle).

mlx-lm implements the V4.1 text model without engram, DSpark or vision, so the configs here drop those
(they are covered part by part in test_v41_parts.py). Both sides run fp32 without the QAT fake-quant.
"""

from __future__ import annotations

import json

import pytest
import torch

from flashserve.config import preset_config
from flashserve.config.model_config import replace
from flashserve.model import load_model
from flashserve.model.checkpoint import save_checkpoint
from flashserve.model.init import random_init
from flashserve.model.transformer import Transformer

mx = pytest.importorskip("mlx.core", reason="mlx[cpu] is not installable on this platform")
mlx_utils = pytest.importorskip("mlx_lm.utils", reason="mlx-lm is not installable on this platform")
mlx_v41 = pytest.importorskip("mlx_lm.models.deepseek_v41", reason="this mlx-lm has no deepseek_v41")

VARIANTS = {
    "tiny": {},
    "wide-window4": {"hidden_size": 96, "num_attention_heads": 2, "sliding_window": 4, "index_topk": 4,
                     "candidate_topk_blocks": 3, "candidate_block_size": 2},
}


def _text_only(**changes):
    cfg = preset_config("tiny-v41")
    return replace(cfg, engram_layer_ids=(), engram_num_embeddings=(), num_nextn_predict_layers=0,
                   dspark_target_layer_ids=(), **changes)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory, monkeypatch_module):
    cfg = _text_only(**VARIANTS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model = random_init(Transformer(cfg, with_mtp=False), seed=11)
    save_checkpoint(model.checkpoint_tensors(), path, cfg, quantize=False)
    conf = json.loads((path / "config.json").read_text())
    conf.pop("quantization_config", None)  # float weights: no packed layers on the mlx side
    (path / "config.json").write_text(json.dumps(conf))
    monkeypatch_module.setattr(mlx_v41, "_fake_quant_fp8", lambda x, *a, **k: x)
    monkeypatch_module.setattr(mlx_v41, "_fake_quant_fp4", lambda x, *a, **k: x)
    oracle, _ = mlx_utils.load_model(path, strict=True)
    ours = load_model(path, dtype=torch.float32, fake_quant=False)
    return oracle, ours, cfg


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("length", [1, 5, 37, 90])
def test_logits_match_mlx(pair, length):
    oracle, ours, cfg = pair
    ids = torch.randint(3, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    expected = torch.from_numpy(__import__("numpy").array(oracle(mx.array(ids.numpy())).astype(mx.float32)))
    with torch.no_grad():
        got = ours(ids).logits
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-4, f"max relative error {rel:.2e} at length {length}"
