"""What an engine does before it serves: the CPU kernels its requests call are built (or their cached build
loaded) while the engine starts, with a log line saying how long it took, so no first request waits for a
compiler in silence."""

from __future__ import annotations

import logging

import torch.utils.cpp_extension

from flashserve.model import cpu_kernels


def test_the_kernels_are_built_at_start_and_no_request_builds_any(monkeypatch, caplog):
    """The embedded default model (MXFP4 experts, FP4 index keys) calls C++ kernels from its first step: the
    engine built them (through torch's extension API) while it started and logged it, and a request then runs
    them without building anything."""
    from flashserve import SamplingParams
    from flashserve.engine.engine_config import EngineConfig
    from flashserve.engine.llm_engine import LLMEngine
    from flashserve.models import default_model

    builds: list[str] = []
    load = torch.utils.cpp_extension.load

    def recording(name, *args, **kwargs):
        builds.append(name)
        return load(name, *args, **kwargs)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", recording)
    with caplog.at_level(logging.INFO, logger="flashserve"):
        engine = LLMEngine(EngineConfig(model=default_model(), enforce_eager=True, max_num_seqs=4))
    assert cpu_kernels.built() == list(cpu_kernels.KERNELS)
    assert [b.split("_")[2] for b in builds] in (["native"], [])  # built or loaded now, or by an earlier test
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "C++ kernels: mxfp4_pairs" in logged and "decode step (eager) warmed up in" in logged
    if builds:
        assert "CPU kernels (native) ready in" in logged

    builds.clear()
    engine.add_request("r", "def fibonacci(n):", SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert builds == []
