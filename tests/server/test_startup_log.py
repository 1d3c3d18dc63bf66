"""A server says what it builds before it serves: the C++ kernels of its model's first step and the execution
plan are in its log before the line that says it serves, and its first request then answers."""

from __future__ import annotations

from pathlib import Path

from openai import OpenAI

from flashserve.model import cpu_kernels

from serverproc import start_server, stop_server


def test_kernels_are_built_and_logged_before_serving():
    srv = start_server("--log-level", "info", model=None)  # the embedded model: MXFP4 experts, FP4 index keys
    try:
        reply = OpenAI(base_url=srv.url + "/v1", api_key="unused").completions.create(
            model="flashserve-default", prompt="def f(x):", max_tokens=2, temperature=0)
        log = Path(srv.log_path).read_text()
    finally:
        stop_server(srv)
    assert reply.choices[0].text
    serving = log.index(" serving flashserve-default on http://")
    for line in ("CPU kernels (native) ready in", "decode step (eager) warmed up in", "execution plan: cpu",
                 "C++ kernels: " + ", ".join(cpu_kernels.KERNELS)):
        assert -1 < log.find(line) < serving, line
    assert "CPU kernels" not in log[serving:]  # nothing built once serving
