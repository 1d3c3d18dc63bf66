"""Reasoning / content / DSML tool-call splitting on fixed strings, whole and streamed in any chunking."""

from __future__ import annotations

import json
import random

import pytest

from flashserve.server.tool_parser import ChatOutputParser, parse_chat_output

CALL = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris, "FR"</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="opts" string="false">{"units": ["C"], "alerts": true}</｜DSML｜ parameter>\n'
        '</｜DSML｜ invoke>\n<｜DSML｜ invoke name="noop">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')

TEXTS = [
    (True, True, "let me think</think>The answer.\n\n" + CALL),
    (True, True, "no closing think at all"),
    (True, False, "r</think>c <｜DSML｜ calls> stays text"),
    (False, True, "plain answer with a < sign and <｜DS partial"),
    (False, True, CALL),
    (False, True, "before\n\n" + CALL + "\ntrailing \n"),
    (True, True, "a</think>b</think>c"),
    (False, True, '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="v4">\n<｜DSML｜parameter name="x" string="false">1'
                  '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'),
    (False, True, 'cut off <｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">x'
                  '</｜DSML｜ parameter>\n<｜DSML｜ param'),
    (True, True, ""),
]


def test_reasoning_split():
    assert parse_chat_output("why</think>because", True, False) == ("why", "because", [])
    assert parse_chat_output("still thinking", True, False) == ("still thinking", None, [])
    assert parse_chat_output("</think>", True, False) == ("", "", [])
    assert parse_chat_output("chat answer", False, False) == (None, "chat answer", [])
    # a second </think> is ordinary content
    assert parse_chat_output("a</think>b</think>c", True, False) == ("a", "b</think>c", [])


def test_tool_calls_parsed():
    reasoning, content, calls = parse_chat_output("let me think</think>The answer.\n\n" + CALL, True, True)
    assert reasoning == "let me think" and content == "The answer."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris, "FR"', "days": 3,
                                                            "opts": {"units": ["C"], "alerts": True}}
    assert calls[1]["function"]["arguments"] == "{}"
    # content is null when the turn is only tool calls
    assert parse_chat_output(CALL, False, True)[1] is None


def test_tools_not_parsed_without_tools():
    text = "x\n\n" + CALL
    assert parse_chat_output(text, False, False) == (None, text, [])


def test_v4_spelling_and_bad_json_value():
    text = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">{oops'
            '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    _, _, calls = parse_chat_output(text, False, True)
    assert calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": "{oops"}


def test_truncated_call_is_dropped_not_closed():
    """A call cut off before its invoke closed is not reported (no made-up closing of its arguments)."""
    for truncated in (True, False):
        _, content, calls = parse_chat_output(TEXTS[8][2], False, True, truncated=truncated)
        assert content == "cut off" and calls == []


def test_text_after_block_and_non_dsml_inside():
    _, content, calls = parse_chat_output("before\n\n" + CALL + "\ntrailing \n", False, True)
    assert content == "before\ntrailing \n" and len(calls) == 2
    _, content, calls = parse_chat_output("<｜DSML｜ calls>\nhello <b>\n</｜DSML｜ calls>", False, True)
    assert calls == [] and "hello" in content


def _stream(thinking, tools, text, chunks):
    p = ChatOutputParser(thinking, tools)
    deltas = [p.feed(c) for c in chunks] + [p.finish()]
    return p, deltas


@pytest.mark.parametrize("case", range(len(TEXTS)))
def test_streaming_equals_whole(case):
    thinking, tools, text = TEXTS[case]
    whole_r, whole_c, whole_calls = parse_chat_output(text, thinking, tools)
    rng = random.Random(case)
    chunkings = [[ch for ch in text]]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, max(len(text), 2)), min(6, max(len(text) - 1, 0))))
        chunkings.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for chunks in chunkings:
        p, deltas = _stream(thinking, tools, text, chunks)
        r, c, calls = p.result()
        assert (r, c) == (whole_r, whole_c)
        assert [(x["function"]["name"], x["function"]["arguments"]) for x in calls] == \
            [(x["function"]["name"], x["function"]["arguments"]) for x in whole_calls]
        assert "".join(d.reasoning for d in deltas) == (whole_r or "")
        assert "".join(d.content for d in deltas) == (whole_c or "")
        # tool-call deltas: first carries id/type/name, the rest only argument text; they add up
        seen: dict[int, dict] = {}
        for d in deltas:
            for tc in d.tool_calls:
                if tc["index"] not in seen:
                    assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                    seen[tc["index"]] = {"name": tc["function"]["name"], "args": tc["function"]["arguments"]}
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    seen[tc["index"]]["args"] += tc["function"]["arguments"]
        assert [(v["name"], v["args"]) for _, v in sorted(seen.items())] == \
            [(x["function"]["name"], x["function"]["arguments"]) for x in whole_calls]
        for v in seen.values():
            json.loads(v["args"])


def test_partial_markers_are_held_then_released():
    p = ChatOutputParser(True, True)
    assert p.feed("abc</thi").reasoning == "abc"  # '</thi' may become </think>
    d = p.feed("s is not it")
    assert d.reasoning == "</this is not it"
    p = ChatOutputParser(False, True)
    assert p.feed("answer <｜DS").content == "answer"
    assert p.feed("x").content == " <｜DSx"


# ------------------------------------------------------------------------------------ cut off inside a DSML block

ANSWER = "The answer."
V4_CALL = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="v4">\n<｜DSML｜parameter name="x" string="false">1'
           '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
CUT_TEXTS = [(True, "let me think</think>" + ANSWER + "\n\n" + CALL, len("let me think</think>")),
             (False, ANSWER + "\n\n" + CALL, 0), (False, CALL, 0), (True, "hm</think>" + V4_CALL, len("hm</think>"))]


def _streamed(thinking, text, truncated, chunks):
    p = ChatOutputParser(thinking, True)
    deltas = [p.feed(c) for c in chunks] + [p.finish(truncated)]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls:
            e = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            e["name"] += tc["function"].get("name") or ""
            e["arguments"] += tc["function"].get("arguments") or ""
    content = "".join(d.content for d in deltas)
    return p.result(), content, [(v["name"], v["arguments"]) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("case", range(len(CUT_TEXTS)))
@pytest.mark.parametrize("truncated", [True, False])
def test_cut_anywhere_in_a_calls_block(case, truncated):
    """Text that stops at any character: no DSML markup in content (whole or streamed), and only the calls
    whose invoke closed, each with exactly the arguments of the uncut text; streamed deltas add up to the
    whole answer."""
    thinking, text, start = CUT_TEXTS[case]
    _, _, full_calls = parse_chat_output(text, thinking, True)
    full = [(c["function"]["name"], c["function"]["arguments"]) for c in full_calls]
    answer_raw = text[start:text.index("<｜DSML｜")]  # the answer text before the block, as generated
    rng = random.Random(case)
    for k in range(start, len(text) + 1):
        prefix = text[:k]
        reasoning, content, calls = parse_chat_output(prefix, thinking, True, truncated=truncated)
        pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        closed = prefix.count("</｜DSML｜ invoke>") + prefix.count("</｜DSML｜invoke>")
        assert pairs == full[:closed], (k, prefix[-30:])
        for _, args in pairs:
            json.loads(args)
        assert content is None or ("DSML" not in content and "｜" not in content), (k, content)
        # the answer as generated, never more (a text that ended on its own may end in a lone "<")
        assert content is None or (answer_raw + ("" if truncated else "<")).startswith(content), (k, content)
        cuts = sorted(rng.sample(range(1, max(k, 2)), min(3, max(k - 1, 0))))
        for chunks in ([ch for ch in prefix], [prefix[a:b] for a, b in zip([0] + cuts, cuts + [k])]):
            result, streamed_content, streamed_calls = _streamed(thinking, prefix, truncated, chunks)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in result[2]] == pairs
            assert result[:2] == (reasoning, content)
            assert streamed_content == (content or "") and streamed_calls == pairs


def test_trailing_lt_withheld_only_when_cut_off():
    """A reply cut off right after "<" (the first character of a calls tag under a forced tool call) does not
    end in "<"; one that ended there on its own keeps it."""
    assert parse_chat_output("a <", False, True, truncated=True) == (None, "a", [])
    # no answer text before the cut-off block: content is null, as beside a call
    assert parse_chat_output("<", False, True, truncated=True) == (None, None, [])
    assert parse_chat_output(CALL[:40], False, True, truncated=True) == (None, None, [])
    assert parse_chat_output("a <", False, True) == (None, "a <", [])
    # a longer partial tag is markup either way
    assert parse_chat_output("a\n\n<｜DSML｜ cal", False, True) == (None, "a", [])
    assert parse_chat_output("a <｜", False, True) == (None, "a", [])


def test_content_null_when_cut_off_inside_reasoning():
    for text in ("still thinking", "", "abc</thi"):
        for tools in (True, False):
            reasoning, content, calls = parse_chat_output(text, True, tools, truncated=True)
            assert content is None and calls == [] and reasoning == (text or None)
