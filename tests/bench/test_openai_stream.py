"""The HTTP backend on synthetic server streams (httpx.MockTransport, no server): which chunks are tokens,
where the output token count comes from, and what each request body carries."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx
import pytest

from flashserve.bench.backends import OpenAIBackend, Sampling
from flashserve.bench.cli import add_serve_arguments, serve_config
from flashserve.bench.datasets import SampleRequest

REQ = SampleRequest("say hello", prompt_len=3, output_len=16)


def _sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _run(endpoint: str, stream: bytes, sampling: Sampling = Sampling()) -> tuple[Any, list[dict[str, Any]]]:
    """Send REQ through an OpenAIBackend whose transport answers with ``stream``; the result and the bodies."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    async def go() -> Any:
        backend = OpenAIBackend("http://test", endpoint, "", count_tokens=str.split)
        await backend.start()  # its client is built with the mock transport (patched below)
        try:
            return await backend.send(REQ, sampling)
        finally:
            await backend.close()

    original = httpx.AsyncClient.__init__

    def patched(self: httpx.AsyncClient, *a: Any, **kw: Any) -> None:
        kw["transport"] = httpx.MockTransport(handler)
        original(self, *a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(httpx.AsyncClient, "__init__", patched)
    try:
        return asyncio.run(go()), bodies
    finally:
        mp.undo()


def test_chat_stream_role_and_usage_chunks_are_not_tokens() -> None:
    stream = _sse({"choices": [{"delta": {"role": "assistant"}}]},
                  {"choices": [{"delta": {"reasoning_content": "hmm "}}]},
                  {"choices": [{"delta": {"content": "Hel"}}]},
                  {"choices": [{"delta": {"content": "lo there"}}]},
                  {"choices": [{"delta": {}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}})
    r, bodies = _run("/v1/chat/completions", stream)
    assert r.success and r.generated_text == "hmm Hello there"
    assert len(r.itl) == 2  # three chunks with text: role, empty finish and usage chunks are not timed
    assert r.output_tokens == 7  # the server's usage, not the chunk count or the tokenizer's 3 words
    assert bodies[0]["messages"] == [{"role": "user", "content": "say hello"}] and bodies[0]["model"] == "m"
    assert bodies[0]["stream_options"] == {"include_usage": True}


def test_completion_stream_without_usage_counts_with_the_tokenizer() -> None:
    stream = _sse({"choices": [{"text": "one two"}]}, {"choices": [{"text": " three"}]},
                  {"choices": [{"text": " four five"}]})
    r, bodies = _run("/v1/completions", stream)
    assert r.success and r.output_tokens == 5 and len(r.itl) == 2  # str.split counts 5 words
    assert bodies[0]["prompt"] == "say hello" and bodies[0]["max_tokens"] == 16


def test_stream_with_no_token_is_a_failed_request() -> None:
    r, _ = _run("/v1/completions", _sse({"choices": [], "usage": {"completion_tokens": 0}}))
    assert not r.success and "without a token" in r.error


def test_seed_samples_the_dataset_only_and_request_seed_is_sent() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    cfg = serve_config(parser.parse_args(["--base-url", "http://x", "--seed", "5"]), None)
    assert cfg.seed == 5 and cfg.sampling.seed is None
    _, bodies = _run("/v1/completions", _sse({"choices": [{"text": "a"}]}), cfg.sampling)
    assert "seed" not in bodies[0]
    cfg = serve_config(parser.parse_args(["--base-url", "http://x", "--request-seed", "9"]), None)
    _, bodies = _run("/v1/completions", _sse({"choices": [{"text": "a"}]}), cfg.sampling)
    assert bodies[0]["seed"] == 9
