"""Anthropic's Messages API at ``POST /v1/messages`` (and ``/v1/messages/count_tokens``), as DeepSeek offers it
beside the OpenAI one, for agent tools that speak it.

A Messages request is translated into the equivalent OpenAI chat body and goes through the same validation,
encoding and engine path as ``/v1/chat/completions``; only the shapes differ: content blocks (``text``,
``thinking``, ``tool_use``, ``tool_result``), Anthropic's stop reasons, its stream of named events, and its error
body ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from .chat import ChatCall, start_chat
from .http import check_auth, read_json, server_of
from .protocol import invalid, parse_chat_request
from .streaming import merged_outputs, serve_call, sse

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


# ---------------------------------------------------------------------------------------------- request

def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(param, f"'{param}' must be a string or an array of content blocks", "invalid_type")
    for i, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise invalid(f"{param}[{i}]", f"'{param}[{i}]' must be a content block with a 'type'", "invalid_type")
    return content


def _text_of(content: Any, param: str) -> str:
    parts = []
    for i, b in enumerate(_blocks(content, param)):
        if b["type"] != "text" or not isinstance(b.get("text"), str):
            raise invalid(f"{param}[{i}]", f"'{param}[{i}]' must be a text block", "invalid_type")
        parts.append(b["text"])
    return "\n\n".join(parts)


def _image_part(block: dict[str, Any], param: str) -> dict[str, Any]:
    """An Anthropic ``image`` block (base64 or url source) as the OpenAI ``image_url`` part it means."""
    src = block.get("source")
    if isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str):
        media = src.get("media_type") if isinstance(src.get("media_type"), str) else "image/png"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{src['data']}"}}
    if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise invalid(f"{param}.source", f"'{param}.source' must be an image source: {{'type': 'base64', "
                  "'media_type': ..., 'data': ...} or {'type': 'url', 'url': ...}", "invalid_type")


def _user_messages(content: Any, param: str) -> list[dict[str, Any]]:
    """One Anthropic user turn: tool results become OpenAI tool messages, text and images a user message."""
    out, parts = [], []
    for i, b in enumerate(_blocks(content, param)):
        p = f"{param}[{i}]"
        if b["type"] == "text":
            parts.append({"type": "text", "text": b.get("text")})
        elif b["type"] == "image":
            parts.append(_image_part(b, p))
        elif b["type"] == "tool_result":
            inner = b.get("content", "")
            text = _text_of(inner, f"{p}.content") if inner != "" else ""
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise invalid(f"{p}.type", f"content block type {b['type']!r} is not supported in a user turn "
                          "(text, image and tool_result)", "unsupported_value")
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(content: Any, param: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    texts, calls = [], []
    for i, b in enumerate(_blocks(content, param)):
        p = f"{param}[{i}]"
        if b["type"] == "text":
            texts.append(b.get("text"))
        elif b["type"] == "thinking":
            msg["reasoning_content"] = b.get("thinking")
        elif b["type"] == "redacted_thinking":
            continue
        elif b["type"] == "tool_use":
            if not isinstance(b.get("input", {}), dict):
                raise invalid(f"{p}.input", f"'{p}.input' must be an object", "invalid_type")
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
        else:
            raise invalid(f"{p}.type", f"content block type {b['type']!r} is not supported in an assistant turn",
                          "unsupported_value")
    if texts:
        msg["content"] = [{"type": "text", "text": t} for t in texts]
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "'messages' must be a non-empty array", "invalid_type")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{p}.role", f"'{p}.role' must be 'user' or 'assistant'")
        if "content" not in m:
            raise invalid(f"{p}.content", f"'{p}.content' is required", "missing_required_parameter")
        out.extend(_user_messages(m["content"], f"{p}.content") if m["role"] == "user"
                   else [_assistant_message(m["content"], f"{p}.content")])
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", "'tools' must be an array", "invalid_type")
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise invalid(f"tools[{i}]", f"'tools[{i}]' must be an object", "invalid_type")
        out["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("input_schema", {"type": "object"})}} for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        modes = {"auto": "auto", "any": "required", "none": "none"}
        if kind in modes:
            out["tool_choice"] = modes[kind]
        elif kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        else:
            raise invalid("tool_choice", "'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'")
    return out


def _thinking(body: dict[str, Any]) -> dict[str, Any]:
    th = body.get("thinking")
    if th is None:
        return {}
    if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled"):
        raise invalid("thinking", "'thinking' must be {'type': 'enabled' | 'disabled'}")
    return {"chat_template_kwargs": {"thinking": th["type"] == "enabled"}}


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body equivalent to an Anthropic Messages body."""
    if "max_tokens" not in body:
        raise invalid("max_tokens", "'max_tokens' is required", "missing_required_parameter")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body), "max_tokens": body["max_tokens"],
                            "stream": body.get("stream", False), **_tools(body), **_thinking(body)}
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                     ("stop_sequences", "stop"), ("logit_bias", "logit_bias"), ("seed", "seed")):
        if body.get(src) is not None:  # logit_bias and seed: the OpenAI API's, taken here too (extra_body)
            chat[dst] = body[src]
    return chat


# ---------------------------------------------------------------------------------------------- response

def _stop(call: ChatCall) -> tuple[str, str | None]:
    c = call.choices[0]
    if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return _STOP_REASONS.get(c.finish_reason or "abort", "end_turn"), None


def _usage(call: ChatCall) -> dict[str, int]:
    return {"input_tokens": len(call.prompt_ids), "output_tokens": call.completion_tokens}


def _content(call: ChatCall) -> list[dict[str, Any]]:
    reasoning, content, tool_calls = call.choices[0].parser.result()
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    for tc in tool_calls:
        try:
            args = json.loads(tc["function"]["arguments"] or "{}")
        except ValueError:
            args = {"arguments": tc["function"]["arguments"]}
        blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": args})
    return blocks


def _message(call: ChatCall, content: list[dict[str, Any]]) -> dict[str, Any]:
    stop_reason, stop_sequence = _stop(call) if call.choices[0].done else (None, None)
    return {"id": call.rid, "type": "message", "role": "assistant", "model": call.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(call)}


class _Blocks:
    """Turns parser deltas into Anthropic content-block events, opening a new block when the kind changes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.tool: int | None = None

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return events + [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                             "content_block_start")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":  # clients expect a signature to close a thinking block
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.kind = None
        return events + [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def feed(self, delta: Any) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for tc in delta.tool_calls:
            if "id" in tc:
                self.tool = tc["index"]
                events += self._open("tool_use", {"type": "tool_use", "id": tc["id"],
                                                  "name": tc["function"]["name"], "input": {}})
            args = tc["function"].get("arguments")
            if args:
                events.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return events


async def _events(call: ChatCall) -> AsyncIterator[str]:
    yield sse({"type": "message_start", "message": {**_message(call, []), "usage": {
        "input_tokens": len(call.prompt_ids), "output_tokens": 0}}}, "message_start")
    blocks = _Blocks()
    async for _, out in merged_outputs([call.stream]):
        for co in out.outputs:
            delta, _, _ = call.absorb(co)
            if delta is not None:
                for event in blocks.feed(delta):
                    yield event
    for event in blocks.close():
        yield event
    if not call.choices[0].done and call.srv.draining:
        yield sse({"type": "error", "error": {"type": "overloaded_error", "message": "the server shut down "
                                              "before the message finished"}}, "error")
        return
    call.choices[0].done = True
    call.choices[0].finish_reason = call.choices[0].finish_reason or "abort"
    stop_reason, stop_sequence = _stop(call)
    yield sse({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": {"output_tokens": call.completion_tokens}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


def _error_event(e: Exception) -> str:  # as Anthropic sends it; this API has no [DONE] sentinel
    return sse({"type": "error", "error": {"type": "api_error", "message": f"generation failed: {e}"}}, "error")


async def _start(srv: Any, body: dict[str, Any], t0: float) -> ChatCall:
    if body.get("n") not in (None, 1):
        raise invalid("n", "the Messages API returns one message")
    call = await start_chat(srv, to_chat_body(body), t0)
    call.rid = f"msg_{uuid.uuid4().hex[:24]}"
    return call


async def messages(request: Request):
    return await serve_call(request, "messages", _start, _events, lambda call: _message(call, _content(call)),
                            _error_event, done=None)


async def count_tokens(request: Request):
    check_auth(request)
    srv = server_of(request)
    body = await read_json(request)
    req = parse_chat_request(to_chat_body({"max_tokens": 1, **body, "stream": False}), vocab_size=srv.vocab_size)
    srv.check_model(req.model)
    text, _ = srv.encode_chat(req)
    ids = await srv.tokenize(text)
    refs = [ref for m in req.messages for ref in m.get("images", ())]
    if refs:  # an image counts its whole span, as the request itself would be billed
        ids = srv.expanded_ids(ids, await srv.prepare_images(refs))
    return {"input_tokens": len(ids)}


def register(app: FastAPI) -> None:
    app.add_api_route("/v1/messages", messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
