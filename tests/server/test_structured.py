"""Structured outputs over real HTTP with the official client, on random tiny weights: the mask alone must make
the output valid. JSON schemas validate (jsonschema, an independent validator), forced tool calls parse into
tool_calls, logit_bias moves tokens, and a schema the backend cannot compile is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from serverproc import MODEL, start_server, stop_server

# one worker runs the module: its server fixture starts once
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.xdist_group("test_structured")]

NO_THINK = {"chat_template_kwargs": {"thinking": False}}
MSGS = [{"role": "user", "content": "Describe a fox as JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "legs", "wild", "color"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                         "wild": {"type": "boolean"},
                         "color": {"enum": ["red", "grey", "white"]}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]


@pytest.fixture(scope="module")
def client():
    srv = start_server("--max-num-seqs", "16", "--kv-memory", "64MiB")
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()
    stop_server(srv)


def test_json_schema_outputs_validate(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=150, n=4, seed=1, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "fox", "schema": SCHEMA, "strict": True}})
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)


def test_json_object_output_is_an_object(client):
    # the random default model's greedy object closes after 226 tokens (single-row products through OpenBLAS
    # round differently from torch's: it closed within 200 before); the budget leaves room for such shifts
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=400, temperature=0,
                                       response_format={"type": "json_object"}, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_choice_required_always_calls_a_tool(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=150, n=4, seed=3, tools=TOOLS,
                                       tool_choice="required", extra_body=NO_THINK)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_named_tool_choice_calls_that_tool(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=150, n=2, seed=4, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       extra_body=NO_THINK)
    for ch in r.choices:
        assert [c.function.name for c in ch.message.tool_calls] == ["get_time"]
        assert json.loads(ch.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")


def test_streamed_json_schema_output_validates(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=150, seed=2, stream=True, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "fox", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_logit_bias_forces_and_forbids_tokens(client, tokenizer):
    tid = tokenizer.encode(" fox")[-1]
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, logit_bias={str(tid): 100},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode([tid] * 4)
    x, y = tokenizer.encode("x")[0], tokenizer.encode("y")[0]
    only_xy = {str(t): -100 for t in range(tokenizer.vocab_size) if t not in (x, y)}
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, logit_bias=only_xy,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices[0].text) == 8 and set(r.choices[0].text) <= {"x", "y"}, r.choices[0].text


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     None, "response_format: the constraint cannot be compiled"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "outside"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
])
def test_bad_structured_requests_are_400(client, body, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, extra_body=body)
    err = e.value.body
    assert needle in err["message"] and (param is None or err["param"] == param), err


def test_tool_parameters_may_point_into_the_schemas_defs(tokenizer):
    """Pydantic-style tools keep shared types under $defs and point at them with $ref: the forced-call grammar
    carries the $defs into each parameter's schema (compiled alone, such a tool could not be forced at all)."""
    from flashserve.engine.guided import Guides
    from flashserve.engine.sampling_params import Constraint
    from flashserve.server.structured import tool_call_grammar

    point = {"type": "object", "required": ["x", "y"], "additionalProperties": False,
             "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "required": ["to"], "$defs": {"Point": point},
        "properties": {"to": {"$ref": "#/$defs/Point"}}}}}
    grammar = tool_call_grammar([tool], None, tokenizer.token_to_id("｜DSML｜"))
    Guides(tokenizer, 512).check(Constraint("lark", grammar, param="tool_choice"))


def test_forced_string_arguments_may_hold_angle_brackets(tokenizer):
    """A string parameter of a forced call is raw text up to the closing tag: '<b>' inside it is fine (code,
    HTML), only '</' would end it. Checked by feeding the encoded call, token by token, to the grammar."""
    from llguidance import LLMatcher

    from flashserve.engine.guided import Guides
    from flashserve.engine.sampling_params import Constraint
    from flashserve.server import chat_encoding as ce
    from flashserve.server.structured import tool_call_grammar

    tool = {"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "required": ["s"], "properties": {"s": {"type": "string"}}}}}
    guides = Guides(tokenizer, 512)
    grammar = guides.grammar(Constraint("lark", tool_call_grammar([tool], None, tokenizer.token_to_id(ce.DSML))))

    def accepted(value: str) -> bool:
        call = {"type": "function", "function": {"name": "say", "arguments": json.dumps({"s": value})}}
        m = LLMatcher(guides.ll_tokenizer, grammar)
        return all(m.consume_token(t) for t in tokenizer.encode(ce.encode_tool_calls([call]))) and m.is_accepting()

    assert accepted("plain words")
    assert accepted("if a < b: print('<b>")  # '<' and '<b>' inside
    assert not accepted("x</y")  # '</' ends the value: the call would close early
