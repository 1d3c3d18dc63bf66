"""The execution plan an engine makes once at start-up (:mod:`flashserve.engine.execution`): what it decided,
in the log and on ``engine.plan``; the int8 kernel choice timed at start-up, never at import, and overridable."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from flashserve.config import ConfigError
from flashserve.engine.engine_config import EngineConfig
from flashserve.model import packed

OPTS = dict(model="tiny-v41", kv_memory="8MiB", max_num_seqs=2, enforce_eager=True)


def test_importing_the_model_times_nothing():
    """Importing the packed-weight module used to time torch's int8 kernel (a second, on every import of the
    CLI's engine paths): now the engine's plan does, once."""
    code = ("import flashserve.model.packed as p, flashserve.model.loader; "
            "assert p._INT8PACK_TIMED is None and p._INT8PACK is None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_plan_is_logged_and_kept(caplog, monkeypatch):
    from flashserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(packed, "_INT8PACK", packed._INT8PACK)  # the plan sets it process-wide
    with caplog.at_level(logging.INFO, logger="flashserve"):
        engine = LLMEngine(EngineConfig(**OPTS, quantization="int8", int8_kernel="chunked"))
    plan = engine.plan
    assert (plan.device, plan.compiled) == ("cpu", False)
    assert plan.formats["int8"] > 0 and plan.formats["int8 experts"] == engine.model_config.num_hidden_layers
    assert plan.int8_aten == (False, False) and plan.int8_source == "given"
    assert "index_topk" in plan.kernels  # built by the warm-up: the packed V4.1 cache's indexer
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("execution plan:")]
    assert len(logged) == 1 and "decode eager" in logged[0] and "int8 experts" in logged[0]
    assert "chunked float products (given)" in logged[0]


def test_a_model_without_int8_weights_times_nothing(monkeypatch):
    """The int8 timing costs a second or two of start-up: an engine of float weights does not pay it."""
    from flashserve.engine.llm_engine import LLMEngine

    def timed():
        raise AssertionError("the int8 kernel was timed for a model without int8 weights")

    monkeypatch.setattr(packed, "int8pack_pays", timed)
    monkeypatch.setattr(packed, "_INT8PACK", packed._INT8PACK)
    assert LLMEngine(EngineConfig(**OPTS, dtype="float32")).plan.int8_source == "no int8 weights"


@pytest.mark.parametrize("choice,calls", [("aten", True), ("chunked", False)])
def test_int8_kernel_choice_is_what_runs(choice, calls, monkeypatch):
    """``int8_kernel`` decides whether eager int8 products call torch's int8 kernel, whatever this CPU's timing
    would say; both give the same tokens."""
    from flashserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(packed, "_INT8PACK", packed._INT8PACK)
    seen = []
    real = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(packed.torch.ops.aten, "_weight_int8pack_mm", lambda *a: seen.append(1) or real(*a),
                        raising=False)
    engine = LLMEngine(EngineConfig(**OPTS, quantization="int8", int8_kernel=choice, dtype="float32"))
    seen.clear()  # the warm-up's products
    from flashserve import SamplingParams

    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert bool(seen) == calls


def test_a_bad_int8_kernel_is_refused_before_loading():
    from flashserve.engine import preflight

    with pytest.raises(ConfigError, match="int8_kernel: must be one of auto, aten, chunked"):
        preflight.check(EngineConfig(**OPTS, int8_kernel="fast"))


def test_the_plan_counts_the_bytes_it_laid_out_again(monkeypatch, caplog):
    """Weights laid out again for the chosen path are counted by weight and by byte in the logged plan (here every
    float32 linear weight made column-major, by lowering what counts as tall)."""
    from flashserve.engine.execution import plan_execution
    from flashserve.model import weight_layout
    from flashserve.model.loader import load_model

    monkeypatch.setattr(weight_layout, "TALL_RATIO", 1)
    monkeypatch.setattr(weight_layout, "TALL_MIN_ELEMENTS", 1)
    model = load_model("tiny-v4", with_mtp=False)
    plan = plan_execution(model, device="cpu", compiled=False, rows=1, int8_kernel="chunked")
    names = plan.relayouts["column-major tall weights"]
    weights = [model.get_parameter(n) for n in names]
    assert names and all(w.stride() == (1, w.shape[0]) for w in weights)
    nbytes = sum(w.numel() * 4 for w in weights)
    assert plan.relayout_bytes["column-major tall weights"] == nbytes
    assert f"column-major tall weights: {len(names)} weights, {nbytes / 1e6:.1f} MB" in plan.describe()
