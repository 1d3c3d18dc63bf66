"""The V4.1 DSML prompt encoder (docs/architecture.md#tokenizer-and-chat-format) on fixed conversations, and the plain
fallback template."""

from __future__ import annotations

import json

import pytest

from flashserve.server.chat_encoding import (ASSISTANT, BOS, EOS, SYSTEM, USER, effort_value, encode_plain,
                                             encode_tool_calls, encode_v41, render_tools, resolve_mode)
from flashserve.server.tool_parser import parse_chat_output


def effort(n: int) -> str:
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


U = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_chat_mode_single_turn():
    assert encode_v41(U, thinking=False) == BOS + USER + "hi" + ASSISTANT + "</think>"


# The budget each table renders, from the encoders themselves: DeepSeek-V4.1's encoding/encoding.py from its
# release revision on (low 50, high 75, max 100; the default effort is high), with DeepSeek's API aliases
# (minimal -> low, medium -> high) and deepseek-recipe's xhigh -> high; and the pre-release revision's table
# (low 25, high 50, xhigh 75, max 100). None: the request names no effort.
RELEASED = {None: 75, "minimal": 50, "low": 50, "medium": 75, "high": 75, "xhigh": 75, "max": 100}
PRE_RELEASE = {None: 50, "minimal": 25, "low": 25, "medium": 50, "high": 50, "xhigh": 75, "max": 100}
DEFAULT = RELEASED[None]


def test_thinking_mode_default_effort():
    assert encode_v41(U, thinking=True) == BOS + SYSTEM + effort(75) + USER + "hi" + ASSISTANT + "<think>"


@pytest.mark.parametrize("table,budgets", [("released", RELEASED), ("pre-release", PRE_RELEASE)])
@pytest.mark.parametrize("name", [None, "minimal", "low", "medium", "high", "xhigh", "max"])
def test_effort_tables_render_every_documented_value(table, budgets, name):
    n = budgets[name]
    assert effort_value(name, table) == n
    assert encode_v41(U, thinking=True, reasoning_effort=name, effort_table=table) == (
        BOS + SYSTEM + effort(n) + USER + "hi" + ASSISTANT + "<think>")
    assert resolve_mode(None, name, True, table) == (True, n)


def test_the_released_table_is_the_default():
    for name, n in RELEASED.items():
        assert effort_value(name) == n
        assert encode_v41(U, thinking=True, reasoning_effort=name) == encode_v41(
            U, thinking=True, reasoning_effort=name, effort_table="released")


@pytest.mark.parametrize("table", ["released", "pre-release"])
@pytest.mark.parametrize("n", [1, 33, 100])
def test_integer_efforts_are_the_same_in_both_tables(table, n):
    assert effort_value(n, table) == n
    assert encode_v41(U, thinking=True, reasoning_effort=n, effort_table=table).startswith(
        BOS + SYSTEM + effort(n) + USER)


@pytest.mark.parametrize("bad", [0, 101, "extreme", 2.5, True, ""])
def test_effort_invalid(bad):
    with pytest.raises(ValueError):
        effort_value(bad)


def test_unknown_effort_table():
    with pytest.raises(ValueError, match="reasoning-effort table"):
        effort_value("high", "final")


def test_resolve_mode():
    assert resolve_mode(None, None, True) == (True, 75)
    assert resolve_mode(None, None, False) == (False, 75)
    assert resolve_mode(False, "max", True) == (False, 100)
    assert resolve_mode(None, "none", True)[0] is False
    assert resolve_mode(True, "low", False) == (True, 50)
    assert resolve_mode(True, "low", False, "pre-release") == (True, 25)
    assert resolve_mode(True, "none", False, "pre-release") == (True, 50)  # thinking asked for: the default


def test_first_system_message():
    msgs = [{"role": "system", "content": "Be brief."}] + U
    assert encode_v41(msgs, thinking=False) == BOS + SYSTEM + "Be brief." + USER + "hi" + ASSISTANT + "</think>"
    # thinking: one <｜System｜> leads both the effort line and the system text
    assert encode_v41(msgs, thinking=True) == (BOS + SYSTEM + effort(DEFAULT) + "Be brief." + USER + "hi" + ASSISTANT
                                               + "<think>")


def test_multi_turn_drops_old_reasoning():
    msgs = U + [{"role": "assistant", "content": "A1", "reasoning_content": "R1"},
                {"role": "user", "content": "again"}]
    assert encode_v41(msgs, thinking=True) == (
        BOS + SYSTEM + effort(DEFAULT) + USER + "hi" + ASSISTANT + "</think>" + "A1" + EOS
        + USER + "again" + ASSISTANT + "<think>")
    assert encode_v41(msgs, thinking=False) == (
        BOS + USER + "hi" + ASSISTANT + "</think>" + "A1" + EOS + USER + "again" + ASSISTANT + "</think>")
    # drop_thinking=False keeps the earlier reasoning
    assert encode_v41(msgs, thinking=True, drop_thinking=False) == (
        BOS + SYSTEM + effort(DEFAULT) + USER + "hi" + ASSISTANT + "<think>" + "R1</think>A1" + EOS
        + USER + "again" + ASSISTANT + "<think>")


def test_mid_conversation_system_counts_as_user_turn():
    msgs = U + [{"role": "assistant", "content": "A"}, {"role": "system", "content": "Now be formal."}]
    assert encode_v41(msgs, thinking=False) == (
        BOS + USER + "hi" + ASSISTANT + "</think>A" + EOS + SYSTEM + "Now be formal." + ASSISTANT + "</think>")


def test_consecutive_user_messages_and_content_parts_merge():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"},
                                                                         {"type": "text", "text": "c"}]}]
    assert encode_v41(msgs, thinking=False) == BOS + USER + "a\n\nb\n\nc" + ASSISTANT + "</think>"


def test_tools_and_tool_round_trip():
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "need weather", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    calls = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    out = encode_v41(msgs, thinking=True, tools=TOOLS)
    # tools make an (empty) first system message carrying the "## Tools" section; reasoning is kept
    assert out == (BOS + SYSTEM + effort(DEFAULT) + "\n\n" + render_tools(TOOLS) + USER + "Weather in Paris?"
                   + ASSISTANT + "<think>" + "need weather</think>" + "\n\n" + calls + EOS
                   + USER + "<tool_result>sunny</tool_result>" + ASSISTANT + "<think>")
    tools_text = render_tools(TOOLS)
    assert tools_text.startswith("## Tools\n\n") and '<｜DSML｜ calls>' in tools_text
    assert json.dumps(TOOLS[0]["function"]) in tools_text
    # chat mode: no reasoning, generation header closes the thought
    out = encode_v41(msgs, thinking=False, tools=TOOLS)
    assert out.endswith(ASSISTANT + "</think>" + "\n\n" + calls + EOS + USER
                        + "<tool_result>sunny</tool_result>" + ASSISTANT + "</think>")


def test_tools_go_into_existing_system_message():
    msgs = [{"role": "system", "content": "S"}] + U
    out = encode_v41(msgs, thinking=False, tools=TOOLS)
    assert out == BOS + SYSTEM + "S\n\n" + render_tools(TOOLS) + USER + "hi" + ASSISTANT + "</think>"


def test_tool_results_follow_call_order():
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ("a", "b")]
    msgs = U + [{"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "B"},
                {"role": "tool", "tool_call_id": "a", "content": "A"}]
    out = encode_v41(msgs, thinking=False, tools=TOOLS)
    assert out.endswith(USER + "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>" + ASSISTANT
                        + "</think>")


def test_tool_call_arguments_encoding():
    enc = encode_tool_calls([{"function": {"name": "f", "arguments": json.dumps(
        {"s": "x", "n": 1.5, "b": True, "l": [1, "a"], "o": {"k": None}})}}])
    assert '<｜DSML｜ parameter name="s" string="true">x</｜DSML｜ parameter>' in enc
    assert '<｜DSML｜ parameter name="n" string="false">1.5</｜DSML｜ parameter>' in enc
    assert '<｜DSML｜ parameter name="b" string="false">true</｜DSML｜ parameter>' in enc
    assert '<｜DSML｜ parameter name="l" string="false">[1, "a"]</｜DSML｜ parameter>' in enc
    assert '<｜DSML｜ parameter name="o" string="false">{"k": null}</｜DSML｜ parameter>' in enc
    # not a JSON object: kept whole under "arguments"
    enc = encode_tool_calls([{"function": {"name": "f", "arguments": "not json"}}])
    assert '<｜DSML｜ parameter name="arguments" string="true">not json</｜DSML｜ parameter>' in enc


def test_encoded_tool_call_parses_back():
    args = {"city": "Paris", "days": 3, "units": ["C"], "deep": {"a": True}}
    block = encode_tool_calls([{"function": {"name": "get_weather", "arguments": json.dumps(args)}},
                               {"function": {"name": "noop", "arguments": "{}"}}])
    reasoning, content, calls = parse_chat_output("thought</think>answer\n\n" + block, True, True)
    assert reasoning == "thought" and content == "answer"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0]["function"]["arguments"]) == args
    assert json.loads(calls[1]["function"]["arguments"]) == {}


def test_no_generation_prompt():
    msgs = U + [{"role": "assistant", "content": "A"}]
    assert encode_v41(msgs, thinking=False, add_generation_prompt=False) == (
        BOS + USER + "hi" + ASSISTANT + "</think>A" + EOS)


def test_plain_template():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "A"}, {"role": "tool", "content": "R"}]
    assert encode_plain(msgs, bos="<s>") == "<s>System: S\n\nUser: hi\n\nAssistant: A\n\nTool result: R\n\nAssistant:"
    assert "get_weather" in encode_plain(U, tools=TOOLS)


def test_openai_developer_role_is_the_system_prompt():
    from flashserve.server.protocol import parse_chat_request

    dev = parse_chat_request({"model": "m", "messages": [{"role": "developer", "content": "DEV RULES"}] + U},
                             vocab_size=512)
    sys_ = parse_chat_request({"model": "m", "messages": [{"role": "system", "content": "DEV RULES"}] + U},
                              vocab_size=512)
    for thinking in (True, False):
        text = encode_v41(dev.messages, thinking=thinking)
        assert "DEV RULES" in text and text == encode_v41(sys_.messages, thinking=thinking)


def test_an_explicit_effort_turns_thinking_on_even_when_the_default_is_off():
    assert resolve_mode(None, "high", default_thinking=False) == (True, 75)
    assert resolve_mode(None, None, default_thinking=False)[0] is False
    assert resolve_mode(False, "high", default_thinking=True)[0] is False  # the explicit switch wins
