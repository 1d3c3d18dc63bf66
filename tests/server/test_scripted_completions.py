"""Reasoning and tool calls end to end, deterministically: the real engine and app, with the sampler
replaced by a script of tokens (random tiny weights never emit ``</think>`` or DSML on their own).

The official ``openai`` client talks to the app in-process (httpx over ASGI, via Starlette's TestClient):
the HTTP request and response bodies, SSE framing, parsing and finish reasons are the real ones.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest
from openai import OpenAI
from starlette.testclient import TestClient

import flashserve.engine.model_runner as model_runner_mod
from flashserve.engine import EngineConfig, LLMEngine
from flashserve.engine.sampler import SampleResult
from flashserve.server.app import ServerConfig, create_app
from flashserve.server.chat_encoding import EOS, encode_tool_calls

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
SCRIPT = "Let me check the weather.</think>Checking now." + "\n\n" + encode_tool_calls([CALL]) + EOS


_SCRIPT: dict = {}  # the token script the sampler follows (a test may swap it), the tokenizer and the app


@pytest.fixture(scope="module")
def client():
    engine = LLMEngine(EngineConfig(model="tiny-v41", max_num_seqs=8, max_num_batched_tokens=256,
                                    enforce_eager=True))
    _SCRIPT.update(tok=engine.tokenizer, ids=engine.tokenizer.encode(SCRIPT))

    def scripted(logits, rows, generator=None):
        script = _SCRIPT["ids"]
        return SampleResult([script[min(len(r.output_ids), len(script) - 1)] for r in rows], [None] * len(rows))

    mp = pytest.MonkeyPatch()
    mp.setattr(model_runner_mod, "sample", scripted)  # where a step samples
    app = create_app(engine, ServerConfig(model_name="tiny-v41"))
    with TestClient(app) as http:
        _SCRIPT["http"] = http
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
    mp.undo()


def test_reasoning_content_tool_calls_and_finish_reason(client):
    r = client.chat.completions.create(model="tiny-v41", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Let me check the weather."
    assert choice.message.content == "Checking now."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_streamed_tool_call_deltas_rebuild_the_call(client):
    stream = client.chat.completions.create(model="tiny-v41", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=TOOLS, max_tokens=200, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, content, name, args, finish, usage = "", "", "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert (reasoning, content, name) == ("Let me check the weather.", "Checking now.", "get_weather")
    assert json.loads(args) == {"city": "Paris", "days": 2}
    assert finish == "tool_calls"
    assert usage is not None and usage.completion_tokens > 10


def test_tool_result_round_trip_is_encoded(client):
    """The assistant's call and the tool's answer go back in; the next turn is generated normally."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = client.chat.completions.create(model="tiny-v41", messages=msgs, tools=TOOLS, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.usage.prompt_tokens > 30


def test_cut_off_after_one_complete_call(client):
    """max_tokens ends the reply inside a second call: the complete first call comes back (its arguments as
    generated), the second not at all and no markup as content; whole and streamed alike, and the same on
    /v1/messages. finish_reason stays "length" (stop_reason "max_tokens")."""
    rome = {"id": "call_2", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "days": 1})}}
    tok = _SCRIPT["tok"]
    ids = tok.encode("Let me check.</think>" + encode_tool_calls([CALL, rome]) + EOS)
    texts = [tok.decode(ids[:n], skip_special_tokens=False) for n in range(len(ids) + 1)]
    # a token count that ends after the first invoke closed, inside the second call's first parameter
    close = texts[-1].index("</｜DSML｜ invoke>")
    n = next(n for n, t in enumerate(texts) if "Ro" in t[close:])
    assert texts[n].count("</｜DSML｜ invoke>") == 1
    kw = dict(model="tiny-v41", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=n)
    body = dict(model="tiny-v41", max_tokens=n, messages=kw["messages"],
                tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}])
    ant = anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=_SCRIPT["http"])
    def streamed_message():
        with ant.messages.stream(**body) as stream:
            return stream.get_final_message()

    old, _SCRIPT["ids"] = _SCRIPT["ids"], ids
    try:  # the four requests at once: the engine decodes them in one batch
        with ThreadPoolExecutor(4) as pool:
            r, chunks, m, final = [f.result() for f in (
                pool.submit(client.chat.completions.create, **kw),
                pool.submit(lambda: list(client.chat.completions.create(stream=True, **kw))),
                pool.submit(ant.messages.create, **body), pool.submit(streamed_message))]
    finally:
        _SCRIPT["ids"] = old

    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == n
    assert ch.message.content is None and ch.message.reasoning_content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    content, calls, finish = None, {}, None
    for chunk in chunks:
        for c in chunk.choices:
            if c.delta.content is not None:  # accumulated as the openai client does
                content = (content or "") + c.delta.content
            for tc in c.delta.tool_calls or []:
                e = calls.setdefault(tc.index, ["", ""])
                e[0] += tc.function.name or ""
                e[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert (content, finish) == (None, "length")
    assert calls == {0: [ch.message.tool_calls[0].function.name, ch.message.tool_calls[0].function.arguments]}
    for msg in (m, final):
        assert msg.stop_reason == "max_tokens"
        assert [(b.type, getattr(b, "input", None)) for b in msg.content] == \
            [("thinking", None), ("tool_use", {"city": "Paris", "days": 2})]
