"""The Anthropic Messages API over real HTTP with the official ``anthropic`` client, against one tiny-v41 server
process: plain and streamed messages, the event sequence, stop sequences, thinking blocks, a tool-use round
trip, x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from flashserve.server.chat_encoding import encode_v41

from serverproc import MODEL, start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = pytest.mark.xdist_group("test_anthropic")

KEY = "anthropic-test-key"
MSGS = [{"role": "user", "content": "Say hello to the fox."}]
NO_THINK = {"type": "disabled"}
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 12}}}}


@pytest.fixture(scope="module")
def server():
    srv = start_server("--kv-memory", "64MiB", api_key=KEY)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def test_plain_message_usage_matches_the_encoder(client, tokenizer):
    m = client.messages.create(model=MODEL, max_tokens=5, system="You are terse.", messages=MSGS,
                               thinking=NO_THINK)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("max_tokens", "end_turn")
    assert [b.type for b in m.content] in (["text"], [])
    prompt = encode_v41([{"role": "system", "content": "You are terse."}, *MSGS], thinking=False)
    assert m.usage.input_tokens == len(tokenizer.encode(prompt))
    assert 1 <= m.usage.output_tokens <= 5


def test_max_tokens_and_thinking_blocks(client):
    m = client.messages.create(model=MODEL, max_tokens=6, messages=MSGS, thinking={"type": "enabled",
                                                                                    "budget_tokens": 1024},
                               extra_body={"ignore_eos": True})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    assert m.content[0].type == "thinking" and m.content[0].thinking  # cut off inside its reasoning


def test_streamed_events_and_final_message(client):
    with client.messages.stream(model=MODEL, max_tokens=8, messages=MSGS, thinking=NO_THINK,
                                extra_body={"ignore_eos": True}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "message_delta" in events and events.index("message_delta") < events.index("message_stop")
    # 8 output tokens always make at least one block, and every block opens and closes once
    assert len(final.content) >= 1
    assert events.count("content_block_start") == events.count("content_block_stop") == len(final.content)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_stop_sequences(client):
    free = client.messages.create(model=MODEL, max_tokens=12, messages=MSGS, thinking=NO_THINK,
                                  extra_body={"ignore_eos": True, "temperature": 0})
    text = "".join(b.text for b in free.content if b.type == "text")
    stop = text[3:5]
    if not stop.strip():
        pytest.fail(f"greedy text too short to pick a stop sequence: {text!r}")
    m = client.messages.create(model=MODEL, max_tokens=12, messages=MSGS, thinking=NO_THINK,
                               stop_sequences=[stop], extra_body={"ignore_eos": True, "temperature": 0})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content if b.type == "text") == text[:text.index(stop)]


def test_tool_use_round_trip(client):
    m = client.messages.create(model=MODEL, max_tokens=120, messages=MSGS, tools=[WEATHER], thinking=NO_THINK,
                               tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) >= 1 and use[0].name == "get_weather" and isinstance(use[0].input["city"], str)
    history = MSGS + [{"role": "assistant", "content": m.content},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                    "content": "sunny, 21 C"}]}]
    follow = client.messages.create(model=MODEL, max_tokens=4, messages=history, tools=[WEATHER],
                                    thinking=NO_THINK)
    assert follow.type == "message" and follow.usage.input_tokens > m.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER], thinking=NO_THINK)
    assert counted.input_tokens == follow.usage.input_tokens


def test_streamed_tool_use(client):
    with client.messages.stream(model=MODEL, max_tokens=120, messages=MSGS, tools=[WEATHER], thinking=NO_THINK,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    use = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use[0].name == "get_weather" and "city" in use[0].input


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=MSGS)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    for call in (lambda **kw: client.messages.create(max_tokens=4, **kw), client.messages.count_tokens):
        with pytest.raises(anthropic.NotFoundError) as e:  # an unknown model: 404, as Anthropic answers it
            call(model="no-such-model", messages=MSGS)
        assert e.value.status_code == 404 and e.value.body["type"] == "error"
        err = e.value.body["error"]
        assert err["type"] == "not_found_error" and "no-such-model" in err["message"]
    assert client.messages.create(model=MODEL, max_tokens=1, messages=MSGS).usage.output_tokens == 1  # serving on
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}],
                         "max_tokens": 4})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
