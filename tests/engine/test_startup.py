"""What an engine does before it serves: the CPU kernels its first request calls are built (or loaded from
inductor's disk cache) while the engine starts, with a log line for each, so no first request waits for a
compiler in silence."""

from __future__ import annotations

import logging

from flashserve.model import cpu_kernels


def test_the_first_request_builds_no_kernel(monkeypatch, caplog):
    """The embedded default model (MXFP4 experts, FP4 index keys) calls C++ kernels from its first step: every
    kernel a request asks for was asked for while the engine started, and the log named each."""
    from flashserve import SamplingParams
    from flashserve.engine.engine_config import EngineConfig
    from flashserve.engine.llm_engine import LLMEngine
    from flashserve.models import default_model

    asked: list[str] = []
    load = cpu_kernels._load

    def recording(kernel: str, isa: str = "native"):
        asked.append(kernel)
        return load(kernel, isa)

    monkeypatch.setattr(cpu_kernels, "_load", recording)
    load.cache_clear()  # a build loaded by an earlier test in this process must be loaded (and logged) again
    with caplog.at_level(logging.INFO, logger="flashserve"):
        engine = LLMEngine(EngineConfig(model=default_model(), enforce_eager=True, max_num_seqs=4))
    at_start = set(asked)
    assert {"mxfp4_pairs", "index_topk"} <= at_start, at_start  # what this model's layers call on the CPU
    logged = " ".join(r.getMessage() for r in caplog.records)
    for kernel in at_start:
        assert f"CPU kernel {kernel} (native) ready in" in logged or f"CPU kernel {kernel} unavailable" in logged
    assert "decode step (eager) warmed up in" in logged

    asked.clear()
    engine.add_request("r", "def fibonacci(n):", SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert asked and set(asked) <= at_start  # the request called kernels, all of them built before it came
