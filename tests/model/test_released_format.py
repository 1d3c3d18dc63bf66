"""Released-format checkpoints of the tiny presets: exact float round trip, and FP8/MXFP4 weights whose
logits stay within quantisation tolerance of the float model they came from."""

from __future__ import annotations

import pytest
import torch

from flashserve.config.checkpoint_layout import BF16, FP4, FP8, FP8_TABLE, checkpoint_layout
from flashserve.model import load_model
from flashserve.model import quant as q
from flashserve.model.checkpoint import CheckpointError, save_checkpoint
from step_modes import compile_as_step

torch.set_grad_enabled(False)


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_round_trip_float_is_exact(preset, tmp_path):
    model = load_model(preset, fake_quant=False)
    save_checkpoint(model.checkpoint_tensors(), tmp_path, model.cfg, quantize=False)
    again = load_model(tmp_path, fake_quant=False)
    ids = torch.randint(3, 500, (2, 45), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(ids).logits, again(ids).logits)


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_quantised_checkpoint_stays_close(preset, tmp_path):
    model = load_model(preset, fake_quant=False)
    save_checkpoint(model.checkpoint_tensors(), tmp_path, model.cfg)
    names = {p.name for p in tmp_path.iterdir()}
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    quant = load_model(tmp_path, fake_quant=False)
    ids = torch.randint(3, 500, (2, 45), generator=torch.Generator().manual_seed(2))
    ref, got = model(ids).logits, quant(ids).logits
    # the file holds exactly the format's rounding of each weight: simulate it in memory and compare
    block = model.cfg.quantization.weight_block_size
    dest = model.checkpoint_tensors()
    for spec in checkpoint_layout(model.cfg, vision=False):
        w = dest[spec.name]
        if spec.kind == FP8:
            w.copy_(q.dequantize_fp8_blocks(*q.quantize_fp8_blocks(w, block), dtype=torch.float32))
        elif spec.kind == FP4:
            w.copy_(q.dequantize_mxfp4(*q.quantize_mxfp4(w), dtype=torch.float32))
        elif spec.kind == FP8_TABLE:
            w.copy_(q.dequantize_fp8_rows(*q.quantize_fp8_rows(w), dtype=torch.float32))
        elif spec.kind == BF16:
            w.copy_(w.to(torch.bfloat16).float())
    assert torch.equal(model(ids).logits, got)
    # and it is still the same model, roughly: random tiny MoEs amplify FP4 noise through routing flips
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    assert 0.5 < cos < 1.0, f"cosine similarity {cos:.3f}"


def test_incomplete_checkpoint_names_missing_tensor(tmp_path):
    model = load_model("tiny-v41", fake_quant=False)
    tensors = model.checkpoint_tensors()
    save_checkpoint(tensors, tmp_path, model.cfg, quantize=False)
    from safetensors.torch import load_file, save_file

    for shard in tmp_path.glob("*.safetensors"):
        data = load_file(shard)
        if "layers.3.attn.wq_a.weight" in data:
            del data["layers.3.attn.wq_a.weight"]
            save_file(data, shard)
    (tmp_path / "model.safetensors.index.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_a\.weight"):
        load_model(tmp_path)


def test_loaded_mxfp4_experts_decode_the_same_compiled_as_eager(tmp_path):
    """A checkpoint's model is built on ``meta`` and then allocated, which leaves computed buffers uninitialised:
    the E2M1 table a compiled step decodes whole experts with must be filled again (it held garbage once, and
    every 16-row compiled step of a released checkpoint computed with it)."""
    from flashserve.model.packed import PackedWeights

    save_checkpoint(load_model("tiny-v41", fake_quant=False).checkpoint_tensors(), tmp_path,
                    load_model("tiny-v41").cfg)
    model = load_model(tmp_path, fake_quant=False)
    tables = [m for m in model.modules() if isinstance(m, PackedWeights) and m.fmt.name == "mxfp4"]
    assert tables
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    for m in tables:
        assert m.e2m1_bits.view(torch.float32).tolist() == e2m1
    experts = tables[0]
    compiled = compile_as_step(lambda: experts.dequantize(torch.float32), fullgraph=True)()
    assert torch.equal(compiled, experts.dequantize(torch.float32))
