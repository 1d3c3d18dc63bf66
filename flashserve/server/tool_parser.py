"""Split generated chat text into reasoning, content and DSML tool calls, incrementally.

The same :class:`ChatOutputParser` serves streaming (``feed`` each delta, then ``finish``) and whole responses
(``feed`` the full text once, then ``finish``), so both paths agree exactly.

* Thinking mode (prompt ends with ``<think>``): text up to ``</think>`` is ``reasoning_content``; with no
  ``</think>`` at all, everything is reasoning.
* Tool calls (only when the request declared tools): a ``<｜DSML｜ calls>`` block of
  ``<｜DSML｜ invoke name="…">`` elements with ``<｜DSML｜ parameter name="…" string="true|false">v</…>``
  children. ``string="false"`` values are JSON. A call is reported once its ``</｜DSML｜ invoke>`` closes: one
  delta with its id, name and whole ``arguments`` (``json.dumps`` of the parameter dict), the same string the
  non-streamed call carries. The V4 spelling (``<｜DSML｜tool_calls>``, no space) is accepted as well.
* Cut off (``finish`` with ``truncated``, or any unfinished DSML element at the end): markup never becomes
  content; a call whose invoke did not close is dropped, not reported with made-up arguments. Nothing of such a
  call was streamed, so streamed and whole answers still agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .chat_encoding import DSML, THINK_END

_SP = r" ?"  # V4.1 has a space after ｜DSML｜, V4 none
_CALLS_OPEN = re.compile(r"<" + re.escape(DSML) + _SP + r"(?:tool_calls|function_calls|calls)>")
_CALLS_CLOSE = re.compile(r"</" + re.escape(DSML) + _SP + r"(?:tool_calls|function_calls|calls)>")
_INVOKE_OPEN = re.compile(r"<" + re.escape(DSML) + _SP + r'invoke\s+name="([^"]*)"\s*>')
_INVOKE_CLOSE = re.compile(r"</" + re.escape(DSML) + _SP + r"invoke>")
_PARAM = re.compile(r"<" + re.escape(DSML) + _SP + r'parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>'
                    r"(.*?)</" + re.escape(DSML) + _SP + r"parameter>", re.DOTALL)

_CALLS_OPEN_LITERALS = [f"<{DSML} calls>", f"<{DSML}calls>", f"<{DSML}tool_calls>", f"<{DSML} tool_calls>",
                        f"<{DSML}function_calls>", f"<{DSML} function_calls>"]
# Openers inside a calls block: once one of these is complete, wait for the regex to complete.
_BLOCK_OPENERS = [f"<{DSML} invoke", f"<{DSML}invoke", f"</{DSML} calls>", f"</{DSML}calls>",
                  f"</{DSML}tool_calls>", f"</{DSML} tool_calls>", f"</{DSML}function_calls>",
                  f"</{DSML} function_calls>"]
_INVOKE_OPENERS = [f"<{DSML} parameter", f"<{DSML}parameter", f"</{DSML} invoke>", f"</{DSML}invoke>"]


def _partial_suffix(text: str, literals: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``literals``."""
    best = 0
    for lit in literals:
        for k in range(min(len(lit) - 1, len(text)), best, -1):
            if text.endswith(lit[:k]):
                best = k
                break
    return best


def _waiting(buf: str, openers: list[str]) -> bool:
    """``buf`` may still grow into one of the elements starting with ``openers``."""
    return any(buf.startswith(o) or o.startswith(buf) for o in openers)


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _param_value(raw: str, is_string: str | None) -> Any:
    if is_string == "true":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one ``feed`` produced: text pieces and tool-call deltas (OpenAI streaming shape)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    REASONING, CONTENT, CALLS, INVOKE, DONE = range(5)

    def __init__(self, thinking: bool, parse_tools: bool):
        self.thinking = thinking
        self.parse_tools = parse_tools
        self.state = self.REASONING if thinking else self.CONTENT
        self.buf = ""
        self._reasoning: list[str] = []  # pieces, joined once by ``result`` (``+=`` copies per feed)
        self._content: list[str] = []
        self.tool_calls: list[ToolCall] = []  # complete calls only
        self._call: ToolCall | None = None  # the call being read: reported when its invoke closes
        self._n_params = 0
        self._saw_think_end = False
        self._after_text = False
        self._truncated = False
        self._calls_begun = False  # a calls block began (maybe cut off before any call completed)

    # -- output accumulation -------------------------------------------------------------------------------
    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content)

    def _emit_reasoning(self, d: Delta, text: str) -> None:
        if text:
            self._reasoning.append(text)
            d.reasoning += text

    def _emit_content(self, d: Delta, text: str) -> None:
        if text:
            self._content.append(text)
            d.content += text

    def _emit_call(self, d: Delta, call: ToolCall) -> None:
        call.index = len(self.tool_calls)
        self.tool_calls.append(call)
        d.tool_calls.append({"index": call.index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": call.arguments}})

    # -- parsing -------------------------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        self.buf += text
        return self._run(final=False)

    def finish(self, truncated: bool = False) -> Delta:
        """The end of the text. An unfinished calls tag at the end (``<｜DSML｜ ca``...) is withheld; a lone ``<``
        only when ``truncated`` (cut off by ``max_tokens`` or an abort: it may have been such a tag's start)."""
        self._truncated = truncated
        return self._run(final=True)

    def _run(self, final: bool) -> Delta:
        d = Delta()
        while True:
            buf = self.buf
            if self.state == self.REASONING:
                i = buf.find(THINK_END)
                if i >= 0:
                    self._emit_reasoning(d, buf[:i])
                    self.buf = buf[i + len(THINK_END):]
                    self._saw_think_end = True
                    self.state = self.CONTENT
                    continue
                keep = 0 if final else _partial_suffix(buf, [THINK_END])
                self._emit_reasoning(d, buf[:len(buf) - keep])
                self.buf = buf[len(buf) - keep:]
                return d
            if self.state == self.CONTENT:
                if not self.parse_tools:
                    self._emit_content(d, buf)
                    self.buf = ""
                    return d
                m = _CALLS_OPEN.search(buf)
                if m:
                    # whitespace separating the answer from the calls block is not content
                    self._emit_content(d, buf[:m.start()].rstrip())
                    self.buf = buf[m.end():]
                    self.state = self.CALLS
                    self._calls_begun = True
                    continue
                keep = _partial_suffix(buf, _CALLS_OPEN_LITERALS)
                if final:
                    tail = buf[len(buf) - keep:]
                    if keep and (self._truncated or len(tail) > 1):  # an unfinished calls tag is not content
                        buf = buf[:len(buf) - keep].rstrip()
                        self._calls_begun = True
                    self._emit_content(d, buf)
                    self.buf = ""
                    return d
                head = buf[:len(buf) - keep]
                stripped = head.rstrip()  # hold trailing whitespace back: it may precede a calls block
                self._emit_content(d, stripped)
                self.buf = buf[len(stripped):]
                return d
            if self.state == self.CALLS:
                buf = buf.lstrip()
                self.buf = buf
                if not buf:
                    return d
                m = _INVOKE_OPEN.match(buf)
                if m:
                    self._call = ToolCall(index=-1, id=new_tool_call_id(), name=m.group(1))
                    self._n_params = 0
                    self.buf = buf[m.end():]
                    self.state = self.INVOKE
                    continue
                m = _CALLS_CLOSE.match(buf)
                if m:
                    self.buf = buf[m.end():]
                    self.state = self.DONE
                    continue
                if _waiting(buf, _BLOCK_OPENERS):
                    if final:  # cut off inside a tag: markup, not content
                        self.buf = ""
                    return d
                # not DSML: keep it as content rather than lose it
                j = buf.find("<", 1)
                junk = buf if j < 0 else buf[:j]
                self._emit_content(d, junk)
                self.buf = buf[len(junk):]
                continue
            if self.state == self.INVOKE:
                buf = buf.lstrip()
                self.buf = buf
                m = _PARAM.match(buf)
                if m:
                    key = json.dumps(m.group(1), ensure_ascii=False)
                    val = json.dumps(_param_value(m.group(3), m.group(2)), ensure_ascii=False)
                    self._call.arguments += ("{" if self._n_params == 0 else ", ") + f"{key}: {val}"
                    self._n_params += 1
                    self.buf = buf[m.end():]
                    continue
                m = _INVOKE_CLOSE.match(buf)
                if m:
                    self._call.arguments += "}" if self._n_params else "{}"
                    self._emit_call(d, self._call)
                    self._call = None
                    self.buf = buf[m.end():]
                    self.state = self.CALLS
                    continue
                if final:  # cut off inside the call: no call rather than one with arguments it never finished
                    self._call = None
                    self.buf = ""
                    self.state = self.DONE
                    continue
                if not buf or _waiting(buf, _INVOKE_OPENERS):
                    return d
                j = buf.find("<", 1)
                junk = buf if j < 0 else buf[:j]
                self._emit_content(d, junk)
                self.buf = buf[len(junk):]
                continue
            # DONE: text after the calls block is kept as content (whitespace alone is not)
            if buf.strip() or self._after_text:
                self._emit_content(d, buf)
                self._after_text = True
                self.buf = ""
            elif final:
                self.buf = ""
            return d

    # -- results -------------------------------------------------------------------------------------------
    def result(self) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(reasoning_content, content, tool_calls) after ``finish``."""
        reasoning, content = self.reasoning, self.content
        reasoning = reasoning if (reasoning or self._saw_think_end) else None
        # no answer text: null beside tool calls or a calls block cut off before its first call, after reasoning,
        # and when cut off inside the reasoning; "" is an empty plain answer
        cut_in_reasoning = self.thinking and not self._saw_think_end
        null = self.tool_calls or self._calls_begun or reasoning or cut_in_reasoning
        content = content if content else (None if null else "")
        return reasoning, content, [c.to_openai() for c in self.tool_calls]


def parse_chat_output(text: str, thinking: bool, parse_tools: bool,
                      truncated: bool = False) -> tuple[str | None, str | None, list[dict]]:
    """Whole-text convenience wrapper: (reasoning_content, content, tool_calls)."""
    p = ChatOutputParser(thinking, parse_tools)
    p.feed(text)
    p.finish(truncated)
    return p.result()
