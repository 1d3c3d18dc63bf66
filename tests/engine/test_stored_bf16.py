"""A float32 engine on the CPU holds a checkpoint's large bfloat16 token embeddings and LM head as the files store
them (mapped where they lie, or copied as they are) instead of float32 copies: the same values, half the bytes,
nothing converted at load. Decode rows read the head through bfloat16 panels made from it, other products and the
embedding rows convert; the greedy tokens and the logits are those of the float32 copies
(flashserve/model/loader.py ``hold_as_stored``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import prompt_of, run_greedy
from flashserve.engine import EngineConfig, LLMEngine
from flashserve.model import blas, loader
from flashserve.model.loader import load_model

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 3, 9]])


@pytest.fixture(scope="module")
def released(released_tiny_v41) -> Path:
    """tiny-v41 as released: BF16 embedding and head (512 x 64)."""
    return released_tiny_v41


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_memory="64MiB", max_num_seqs=4,
                                  speculative_config=None, enforce_eager=True, **kw))


def _in_files(model, t: torch.Tensor) -> bool:
    ranges = model._mapped_files.ranges()
    return any(a <= t.data_ptr() < a + n for a, n in ranges)


def test_large_bf16_embeddings_and_head_are_held_as_stored_with_the_tokens_of_float32_copies(released, monkeypatch):
    monkeypatch.setattr(blas, "BF16_PANEL_MIN_ELEMENTS", 1)  # the tiny head counts as large, for panels
    prompts = [prompt_of(30, seed=1), prompt_of(12, seed=2), prompt_of(21, seed=3)]
    monkeypatch.setattr(loader, "KEEP_STORED_MIN_ELEMENTS", 1 << 40)  # the float32 copies, as for small tables
    copies = _engine(released)
    assert copies.model.head.weight.dtype == copies.model.embed.weight.dtype == torch.float32
    expected = run_greedy(copies, prompts, 8)

    monkeypatch.setattr(loader, "KEEP_STORED_MIN_ELEMENTS", 1)
    held = _engine(released)
    model = held.model
    assert model.dtype == torch.float32 and model.norm.weight.dtype == torch.float32
    for name, mod in (("embed", model.embed), ("head", model.head)):
        assert mod.weight.dtype == torch.bfloat16 and _in_files(model, mod.weight), name
        assert name in model.load_report.mapped and name not in model.load_report.copied
        assert torch.equal(mod.weight.float(), getattr(copies.model, name).weight), name
    panels = blas.panels(model.head, "weight")
    assert panels is not None and torch.equal(panels, blas.panels(copies.model.head, "weight"))
    assert run_greedy(held, prompts, 8) == expected
    with torch.inference_mode():
        out = model(IDS).logits  # 10 rows: the head's panels, as the copies' decode rows read theirs
        assert out.dtype == torch.float32 and torch.equal(out, copies.model(IDS).logits)
        # 40 rows: the held head's panels still (no float32 copy made), the copies torch's product: the same
        # values summed in another order
        long = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(model(long).logits, copies.model(long).logits, rtol=1e-5, atol=1e-5)

    # copied as stored without mmap, and kept float32 for a bfloat16 model or a small table
    plain = load_model(released, with_mtp=False, mmap=False)
    assert plain.head.weight.dtype == torch.bfloat16 and "head" in plain.load_report.copied
    assert load_model(released, dtype="bfloat16", with_mtp=False).head.weight.dtype == torch.bfloat16
    monkeypatch.setattr(loader, "KEEP_STORED_MIN_ELEMENTS", 512 * 64 + 1)
    assert load_model(released, with_mtp=False).head.weight.dtype == torch.float32


def test_a_compiled_step_reads_a_held_head_through_its_panels(released, monkeypatch):
    """A compiled CPU step's plan gives a head held in bf16 its bf16 panels, as the eager plan does: without them
    each step's product would convert the whole head to float32."""
    from flashserve.engine.execution import plan_execution

    monkeypatch.setattr(blas, "BF16_PANEL_MIN_ELEMENTS", 1)
    monkeypatch.setattr(loader, "KEEP_STORED_MIN_ELEMENTS", 1)
    model = load_model(released, with_mtp=False)
    assert model.head.weight.dtype == torch.bfloat16 and blas.panels(model.head, "weight") is None
    plan = plan_execution(model, device="cpu", compiled=True, rows=4)
    panels = blas.panels(model.head, "weight")
    assert panels is not None and panels.dtype == torch.bfloat16
    assert "head.weight_panels" in plan.relayouts["bfloat16 panels of bf16 weights"]


def test_a_hybrid_model_moves_float32_copies_to_its_device(released, monkeypatch):
    """The device of a hybrid model computes in the compute dtype: the held tables are converted before the move."""
    monkeypatch.setattr(loader, "KEEP_STORED_MIN_ELEMENTS", 1)
    model = load_model(released, with_mtp=False, gpu_experts=2, device="cpu")
    assert model.head.weight.dtype == model.embed.weight.dtype == torch.float32
