"""The OpenAI-compatible API over real HTTP, against one ``tiny-v41`` server process, with the official client.

Random tiny weights make gibberish, so these tests check protocol behaviour: shapes, usage numbers against the
tokenizer and the V4.1 encoder, logprobs, stop strings, n, streams, reasoning/tool fields, disconnects,
concurrency and metrics.
"""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from flashserve.server.chat_encoding import encode_v41

from serverproc import MODEL, start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.xdist_group("test_api")]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-num-seqs", "64", "--max-model-len", "4096")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the fox."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def n_prompt(tokenizer, messages, **kw) -> int:
    return len(tokenizer.encode(encode_v41(messages, **kw)))


# ------------------------------------------------------------------------------------------------- basics

def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_nonstream_usage_matches_encoder(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, extra_body={**NO_THINK,
                                                                                          "ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    ch = r.choices[0]
    assert ch.index == 0 and ch.finish_reason == "length"
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str)
    assert r.usage.prompt_tokens == n_prompt(tokenizer, MSGS, thinking=False)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_mode_chosen_per_request(client, tokenizer):
    """thinking on/off and reasoning_effort change the prompt exactly as the V4.1 encoder says (the released
    budgets: low 50, high 75, max 100; default high)."""
    cases = [
        ({}, dict(thinking=True, reasoning_effort=75)),  # server default: thinking, effort high
        ({"chat_template_kwargs": {"thinking": True}}, dict(thinking=True, reasoning_effort=75)),
        ({"reasoning_effort": "low"}, dict(thinking=True, reasoning_effort=50)),
        ({"reasoning_effort": "high"}, dict(thinking=True, reasoning_effort=75)),
        ({"reasoning_effort": "max"}, dict(thinking=True, reasoning_effort=100)),
        ({"reasoning_effort": "none"}, dict(thinking=False)),
        ({"chat_template_kwargs": {"thinking": False}}, dict(thinking=False)),
        ({"thinking": {"type": "disabled"}}, dict(thinking=False)),  # DeepSeek's API field
        ({"thinking": {"type": "enabled"}, "reasoning_effort": "max"}, dict(thinking=True, reasoning_effort=100)),
        ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": False}}, dict(thinking=False)),
    ]
    for extra, kw in cases:
        r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, extra_body=extra)
        assert r.usage.prompt_tokens == n_prompt(tokenizer, MSGS, **kw), extra
    low = n_prompt(tokenizer, MSGS, thinking=True, reasoning_effort=50)
    off = n_prompt(tokenizer, MSGS, thinking=False)
    assert low > off  # the effort line is really there


def test_reasoning_content_in_thinking_mode(client):
    """In thinking mode the generated text before ``</think>`` (all of it when the model never closes the
    thought) is ``reasoning_content``; the raw tokens (logprobs) reassemble reasoning + </think> + content."""
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, logprobs=True, seed=3,
                                       extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}})
    msg = r.choices[0].message
    extra = msg.model_extra or {}
    assert "reasoning_content" in extra
    reasoning = extra["reasoning_content"] or ""
    raw = "".join(t.token for t in r.choices[0].logprobs.content)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens == 12
    if "\ufffd" not in raw and "<｜" not in raw:
        if "</think>" in raw:
            head, _, tail = raw.partition("</think>")
            assert reasoning == head and (msg.content or "") == tail
        else:
            assert reasoning == raw and not msg.content


def test_chat_stream_matches_nonstream(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=10, seed=7, temperature=0.9,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}})
    full = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    m = full.choices[0].message
    assert reasoning == ((m.model_extra or {}).get("reasoning_content") or "")
    assert content == (m.content or "")


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, logprobs=True, top_logprobs=3,
                                       extra_body={**NO_THINK, "ignore_eos": True})
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens == 5
    for e in lp:
        assert e.logprob <= 0 and isinstance(e.token, str) and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        vals = [t.logprob for t in e.top_logprobs]
        assert vals == sorted(vals, reverse=True)
        assert e.logprob <= vals[0] + 1e-5


def test_chat_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, n=3,
                                       extra_body={**NO_THINK, "ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 12
    s = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, n=2, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={**NO_THINK, "ignore_eos": True})
    chunks = list(s)
    ends = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert ends == [0, 1] and chunks[-1].usage.completion_tokens == 8


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, seed=1234, temperature=1.0,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


# ------------------------------------------------------------------------------------------------- completions

def test_completion_usage_and_logprobs(client, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 7
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) <= 3
        assert len(top) >= 2 or "\ufffd" in top  # top-2 strings differ unless both are byte pieces ('\ufffd')
        if tok in top and "\ufffd" not in tok:  # byte pieces of split characters share the string '\ufffd'
            assert top[tok] == pytest.approx(val)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(7)]


def test_streamed_completion_logprob_offsets_continue(client):
    """Streamed logprob pieces carry offsets into the whole completion, the same as the one-piece answer."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=9, logprobs=1, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    tokens, offsets, text = [], [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens and len(tokens) == 9
    assert offsets == whole.logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(9)]


def test_completion_token_prompt_and_batch(client):
    r = client.completions.create(model=MODEL, prompt=[[20, 30, 40, 50], [60, 70]], max_tokens=3, n=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 12
    r = client.completions.create(model=MODEL, prompt=["Hello world", "The model"], max_tokens=2,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    chunks = list(r)
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 4


def test_echo_prompt_logprobs_lm_eval_style(client, tokenizer):
    """What lm-eval's local-completions sends for loglikelihood: echo + logprobs + max_tokens 1 (or 0)."""
    prompt = "The quick brown fox jumps over the lazy dog"
    n = len(tokenizer.encode(prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n]) == prompt
    # greedy: the generated token is the top-1 of its distribution
    top = lp.top_logprobs[-1]
    assert max(top, key=top.get) == lp.tokens[-1]
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 1
    # max_tokens=0: only the prompt comes back
    r0 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert r0.choices[0].text == prompt and r0.usage.completion_tokens == 0
    assert r0.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n], abs=1e-4) or \
        r0.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-3)


def test_stop_sequence_honoured(client):
    kw = dict(model=MODEL, prompt="Hello, world! This is", max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    clean = [i for i in range(3, len(text) - 3) if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2]]
    assert clean, f"the seeded greedy text has no printable stop point: {text!r}"
    stop = text[clean[len(clean) // 2]:clean[len(clean) // 2] + 2]
    cut = text.find(stop)
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    # streamed: same cut
    s = client.completions.create(stop=stop, stream=True, **kw)
    assert "".join(c.choices[0].text for c in s if c.choices) == text[:cut]


def test_max_completion_tokens_and_penalties(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=3, top_p=0.9,
                                       presence_penalty=0.5, frequency_penalty=0.5,
                                       extra_body={**NO_THINK, "ignore_eos": True, "top_k": 20, "min_p": 0.01,
                                                   "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------------- tools

def test_tool_call_round_trip(client, tokenizer):
    """A full tool-use exchange is accepted and encoded as the V4.1 encoder says; any tool_calls the model
    produces are well-formed, with finish_reason 'tool_calls'."""
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == n_prompt(tokenizer, history, thinking=True, tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason in ("length", "stop", "tool_calls")
    for tc in ch.message.tool_calls or []:
        assert tc.type == "function" and tc.id.startswith("call_")
        json.loads(tc.function.arguments)
    if ch.message.tool_calls:
        assert ch.finish_reason == "tool_calls"
    # streamed, with tools: chunks well-formed and tool-call deltas (if any) reassemble into valid JSON
    s = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="auto",
                                       max_tokens=8, stream=True, extra_body={"ignore_eos": True})
    args: dict[int, str] = {}
    for c in s:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    for a in args.values():
        json.loads(a)


# ------------------------------------------------------------------------------------------------- cut-off calls

CITY_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# the system text right after the effort line keeps other tests' prompts from sharing a cached page with this one
# (a prefix computed from the cache may differ in the last bits and so change a greedy reply of random weights)
CUT_PROMPT = ("Be brief.", "Weather in London?")


def _forced(thinking: bool, max_tokens: int, bias: dict[str, float] | None = None) -> dict:
    """A greedy chat request that must call get_weather (the same reply on each API); ``bias``: its logit_bias."""
    extra = {"chat_template_kwargs": {"thinking": thinking}, **({"logit_bias": bias} if bias else {})}
    return dict(model=MODEL, messages=[{"role": "system", "content": CUT_PROMPT[0]},
                                       {"role": "user", "content": CUT_PROMPT[1]}],
                tools=CITY_TOOL, tool_choice="required", max_tokens=max_tokens, temperature=0, extra_body=extra)


_BLOCK_CUTS: dict[bool, tuple[dict | None, list[int]]] = {}


def block_cuts(client, tokenizer, thinking: bool) -> tuple[dict | None, list[int]]:
    """A logit_bias (None without reasoning) with which the greedy forced call gets to its parameter, and three
    max_tokens values that end the reply inside the calls block: in its opening tag, in the invoke tag, and in the
    parameter tag (the invoke tag complete, the call not). Found once per thinking mode, from the raw tokens
    (logprobs). Random weights end their reasoning only when they happen to emit </think> (within 100 tokens
    for some prompts on one CPU, for none of three on another): a bias on </think>, raised until the reasoning
    ends within 60 tokens after at least one, makes it end on any CPU."""
    if thinking in _BLOCK_CUTS:
        return _BLOCK_CUTS[thinking]
    end = str(tokenizer.encode("</think>")[-1])
    seen = []
    for bias in ([{end: b} for b in (0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12)] if thinking else [None]):
        r = client.chat.completions.create(logprobs=True, **_forced(thinking, 100 if thinking else 60, bias))
        toks = [t.token for t in r.choices[0].logprobs.content]
        seen.append("".join(toks))
        prefixes = ["".join(toks[:n]) for n in range(len(toks) + 1)]
        think_end = prefixes[-1].find("</think>") if thinking else 0
        if think_end == 0 and thinking:
            break  # no reasoning left: a larger bias would not give any either
        start = prefixes[-1].find("<｜DSML｜ calls>", think_end)
        if think_end < 0 or start < 0 or start - think_end > 60:
            continue

        def first(cond):
            return next((n for n, p in enumerate(prefixes) if len(p) > start and cond(p[start:])), None)

        cuts = [first(lambda b: "DSML" in b), first(lambda b: 'invoke name="' in b),
                first(lambda b: 'name="city"' in b)]
        if None not in cuts:
            _BLOCK_CUTS[thinking] = (bias, cuts)
            return bias, cuts
    pytest.fail(f"no greedy forced call (thinking={thinking}) of {CUT_PROMPT} got to its parameter: {seen}")


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_call_cut_off_by_max_tokens(server, client, tokenizer, thinking):
    """A forced call cut off by max_tokens, anywhere in the calls block: no DSML markup in content (whole or
    any streamed delta), no call reported (none was complete: never one with made-up arguments), content null,
    finish_reason "length"; streamed equals whole, and /v1/messages (whole and streamed) says the same."""
    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    bias, cuts = block_cuts(client, tokenizer, thinking)
    for max_tokens in cuts:
        kw = _forced(thinking, max_tokens, bias)
        r = client.chat.completions.create(logprobs=True, **kw)
        raw = "".join(t.token for t in r.choices[0].logprobs.content)
        assert "｜DSML｜" in raw and "</｜DSML｜ invoke>" not in raw  # cut in the block, before a call ended
        ch = r.choices[0]
        assert ch.finish_reason == "length", max_tokens
        assert ch.message.content is None and not ch.message.tool_calls, (max_tokens, ch.message)

        content, calls, finish = None, {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                d = c.delta
                if d.content is not None:  # accumulated as the openai client does
                    assert "DSML" not in d.content and "｜" not in d.content
                    content = (content or "") + d.content
                for tc in d.tool_calls or []:
                    calls.setdefault(tc.index, []).append(tc)
                finish = c.finish_reason or finish
        assert (content, calls, finish) == (None, {}, "length"), max_tokens

        body = dict(model=MODEL, max_tokens=max_tokens, system=CUT_PROMPT[0], messages=kw["messages"][1:],
                    extra_body={"temperature": 0, **({"logit_bias": bias} if bias else {})},
                    tools=[{"name": "get_weather", "description": "Weather for a city",
                            "input_schema": CITY_TOOL[0]["function"]["parameters"]}], tool_choice={"type": "any"},
                    thinking={"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"})
        m = ant.messages.create(**body)
        with ant.messages.stream(**body) as s:
            texts = [e.text for e in s if e.type == "text"]
            final = s.get_final_message()
        for msg in (m, final):
            assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == max_tokens
            assert [b.type for b in msg.content] == (["thinking"] if thinking else []), (max_tokens, msg.content)
            if thinking:
                assert msg.content[0].thinking == ch.message.reasoning_content
        assert texts == []
    ant.close()


def test_cut_inside_reasoning_content_is_null(client):
    """A reply cut off inside its reasoning has content null, whole and streamed (as the official client
    accumulates a stream), with tools declared or not."""
    for tools in ({}, {"tools": CITY_TOOL}, {"tools": CITY_TOOL, "tool_choice": "required"}):
        kw = dict(model=MODEL, messages=MSGS, max_tokens=4, seed=1, **tools,
                  extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}})
        r = client.chat.completions.create(logprobs=True, **kw)
        ch = r.choices[0]
        assert "</think>" not in "".join(t.token for t in ch.logprobs.content)  # still reasoning at the cut
        assert ch.finish_reason == "length" and (ch.message.model_extra or {}).get("reasoning_content")
        assert ch.message.content is None and not ch.message.tool_calls
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **kw):
            state.handle_chunk(chunk)
        final = state.current_completion_snapshot
        assert final.choices[0].finish_reason == "length" and final.choices[0].message.content is None


# ------------------------------------------------------------------------------------------------- tokenize

def test_tokenize_endpoint(server, tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": MSGS,
                                                   "chat_template_kwargs": {"thinking": False}}).json()
    assert r["count"] == n_prompt(tokenizer, MSGS, thinking=False)
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world")


EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


@pytest.mark.parametrize("name,budget", [(None, 75), ("minimal", 50), ("low", 50), ("medium", 75), ("high", 75),
                                         ("xhigh", 75), ("max", 100)])
def test_reasoning_effort_renders_the_released_budgets(server, name, budget):
    """The released V4.1 encoder's table (low 50, high 75, max 100; default high) is the server's default."""
    body = {"model": MODEL, "messages": MSGS, **({"reasoning_effort": name} if name else {})}
    prompt = httpx.post(server.url + "/tokenize", json=body).json()["prompt"]
    assert prompt.startswith("<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_LINE.format(budget) + "You are terse.")


def test_tokenizer_info_endpoint(server, tokenizer):
    """vLLM's GET /tokenizer_info: what lm-eval's remote tokenizer reads (the special-token strings, which
    /tokenize turns into the tokenizer's BOS and EOS ids) and tokenizer_config.json's other fields."""
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert isinstance(info["tokenizer_class"], str) and info["model_max_length"] == 4096
    assert info["add_bos_token"] is False and info["add_eos_token"] is False
    for field, token_id in (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id)):
        r = httpx.post(server.url + "/tokenize", json={"prompt": info[field], "add_special_tokens": False}).json()
        assert r["tokens"] == [token_id], field
        assert httpx.post(server.url + "/detokenize", json={"tokens": [token_id]}).json()["prompt"] == info[field]
    assert tokenizer.encode(info["pad_token"]) == [tokenizer.token_to_id(info["pad_token"])]
    assert "chat_template" not in info  # V4.1's encoder is code, not a Jinja template
    # no tokens added: a prompt tokenizes to what the tokenizer alone makes of it
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}).json()["tokens"] == tokenizer.encode("Hi")


# ------------------------------------------------------------------------------------------------- disconnect

def _sample(m: dict, name: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def test_disconnect_mid_stream_frees_pages(server):
    base = server.metrics()
    assert _sample(base, "flashserve_kv_pages_used") == 0
    before = _sample(base, "flashserve_engine_generation_tokens_total")
    body = {"model": MODEL, "prompt": "The quick brown fox " * 10, "max_tokens": 3900, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            got = 0
            for line in it:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
            mid = server.metrics()
            assert _sample(mid, "flashserve_kv_pages_used") > 0
            assert _sample(mid, "flashserve_num_requests_running") == 1
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if _sample(m, "flashserve_kv_pages_used") == 0 and _sample(m, "flashserve_num_requests_running") == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"pages not freed after disconnect: {m}")
    assert _sample(m, "flashserve_engine_generation_tokens_total") - before < 3900  # aborted, not finished
    assert m.get('flashserve_requests_total{endpoint="completions",status="499"}', 0) >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def _wait_idle(server, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if _sample(m, "flashserve_kv_pages_used") == 0 and _sample(m, "flashserve_num_requests_running") == 0:
            return m
        time.sleep(0.05)
    pytest.fail(f"pages not freed: {m}")


def test_disconnect_non_streaming_aborts(server):
    before = _sample(server.metrics(), "flashserve_engine_generation_tokens_total")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    m = _wait_idle(server)
    assert _sample(m, "flashserve_engine_generation_tokens_total") - before < 4000  # stopped early
    assert m['flashserve_request_finish_total{finish_reason="abort",model_name="tiny-v41"}'] >= 1


# ------------------------------------------------------------------------------------------------- concurrency

async def _one_stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[list[str], dict]:
    chat = i % 2 == 0
    if chat:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"client {i} says hi"}],
                "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                "chat_template_kwargs": {"thinking": i % 4 == 0}}
        path = "/v1/chat/completions"
    else:
        body = {"model": MODEL, "prompt": f"Client number {i} writes", "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        path = "/v1/completions"
    events: list[str] = []
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line[6:])
    return events, body


def test_64_concurrent_streaming_clients(server, tokenizer):
    async def main():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            return await asyncio.gather(*[_one_stream(c, server.url, i) for i in range(64)])

    results = asyncio.run(main())
    assert len(results) == 64
    for events, body in results:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in ch for ch in chunks)
        assert len({ch["id"] for ch in chunks}) == 1
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == []
        assert usage["completion_tokens"] == 6
        if "messages" in body:
            thinking = body["chat_template_kwargs"]["thinking"]
            expect = n_prompt(tokenizer, body["messages"], thinking=thinking)
        else:
            expect = len(tokenizer.encode(body["prompt"]))
        assert usage["prompt_tokens"] == expect
        assert usage["total_tokens"] == expect + 6
        finishes = [ch["choices"][0]["finish_reason"] for ch in chunks[:-1] if ch["choices"][0]["finish_reason"]]
        assert finishes == ["length"]


# ------------------------------------------------------------------------------------------------- metrics

def test_metrics_exposed(server, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=3, extra_body={"ignore_eos": True})
    m = server.metrics()
    assert m['flashserve_requests_total{endpoint="completions",status="200"}'] >= 1
    assert _sample(m, "flashserve_prompt_tokens_total") > 0
    assert _sample(m, "flashserve_generation_tokens_total") > 0
    for h in ("flashserve_time_to_first_token_seconds_count", "flashserve_time_per_output_token_seconds_count",
              "flashserve_e2e_request_latency_seconds_count"):
        assert _sample(m, h) >= 1, h
    for g in ("flashserve_num_requests_running", "flashserve_num_requests_waiting", "flashserve_kv_pages_used",
              "flashserve_kv_pages_total", "flashserve_prefix_cache_hit_rate"):
        assert any(k.split("{")[0] == g for k in m), g
    assert _sample(m, "flashserve_kv_pages_total") > 0
