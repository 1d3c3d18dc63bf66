"""``POST /v1/chat/completions``: prompt encoding, one engine request of ``n`` choices, and its answer as one
JSON body or as a stream of chunks (reasoning, content and tool calls split by :class:`ChatOutputParser`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from .engine_loop import RequestStream
from .logprobs import chat_logprobs
from .protocol import ChatRequest, parse_chat_request
from .streaming import Choice, merged_outputs, serve_call, sse, usage
from .tool_parser import ChatOutputParser, Delta


@dataclass
class ChatCall:
    """One chat request in flight: its engine stream and the state of each choice."""

    srv: Any
    req: ChatRequest
    model: str
    rid: str
    prompt_ids: list[int]
    thinking: bool
    stream: RequestStream
    t0: float
    choices: list[Choice] = field(default_factory=list)
    ttft: float | None = None

    def __post_init__(self) -> None:
        parse_tools = bool(self.req.tools) and self.req.tool_choice != "none"
        self.choices = [Choice(i, parser=ChatOutputParser(self.thinking, parse_tools))
                        for i in range(self.req.sampling.n)]

    @property
    def streams(self) -> list[RequestStream]:
        return [self.stream]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def finished(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    def absorb(self, co: Any) -> tuple[Delta | None, list[dict], str | None]:
        """Feed one CompletionOutput into its choice: (parser delta, new logprob entries, finish reason)."""
        if co.index >= len(self.choices) or self.choices[co.index].done:
            return None, [], None
        c = self.choices[co.index]
        new, new_ids, new_lps = c.absorb(co)
        if self.req.sampling.skip_special_tokens:
            new = self.srv.strip_specials(new)
        delta = c.parser.feed(new)
        if c.token_ids and self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        entries: list[dict] = []
        if self.req.logprobs and new_lps is not None:
            entries = chat_logprobs(self.srv.token_strings, new_ids, new_lps, self.req.top_logprobs)
            c.lp_entries.extend(entries)
        if co.finish_reason is None:
            return delta, entries, None
        tail = c.parser.finish(truncated=co.finish_reason != "stop")  # cut off: no half tag, no half call
        delta.reasoning += tail.reasoning
        delta.content += tail.content
        delta.tool_calls += tail.tool_calls
        c.done = True
        c.finish_reason = "tool_calls" if co.finish_reason == "stop" and c.parser.tool_calls else co.finish_reason
        c.stop_reason = co.stop_reason
        return delta, entries, c.finish_reason

    def absorb_output(self, _: int, out: Any) -> None:
        for co in out.outputs:
            self.absorb(co)

    def finish_metrics(self) -> None:
        self.srv.metrics.observe_completion(
            prompt_tokens=len(self.prompt_ids), generation_tokens=self.completion_tokens, ttft=self.ttft,
            e2e=time.perf_counter() - self.t0, finish_reasons=[c.finish_reason for c in self.choices],
            decode_tokens=max((len(c.token_ids) for c in self.choices), default=0))

    def message(self, c: Choice) -> dict[str, Any]:
        reasoning, content, tool_calls = c.parser.result()
        msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return msg


async def start_chat(srv: Any, body: dict[str, Any], t0: float) -> ChatCall:
    """Validate, encode and submit a chat request (raises APIError for anything the client must fix)."""
    srv.check_admitting()
    req = parse_chat_request(body, vocab_size=srv.vocab_size)
    model = srv.check_model(req.model)
    refs = [ref for m in req.messages for ref in m.get("images", ())]
    images = await srv.prepare_images(refs) if refs else []
    prompt_text, thinking = srv.encode_chat(req)
    prompt_ids = await srv.tokenize(prompt_text)
    run_ids = srv.expanded_ids(prompt_ids, images) if images else prompt_ids  # what the engine runs and bills
    max_tokens = srv.check_length(len(run_ids), req.max_tokens, "messages", None)
    # special tokens stay in the engine's text: absorb strips those that carry no meaning for the chat parsers
    params = srv.sampling_params(req.sampling, max_tokens=max_tokens,
                                 logprobs=req.top_logprobs if req.logprobs else None, skip_special_tokens=False,
                                 constraint=srv.chat_constraint(req, thinking))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await srv.submit(rid, prompt_ids, params, images)
    return ChatCall(srv, req, model, rid, run_ids, thinking, stream, t0)


def _delta_chunk(call: ChatCall, index: int, delta: Delta, entries: list[dict]) -> dict[str, Any] | None:
    d: dict[str, Any] = {}
    if delta.reasoning:
        d["reasoning_content"] = delta.reasoning
    if delta.content:
        d["content"] = delta.content
    if delta.tool_calls:
        d["tool_calls"] = delta.tool_calls
    if not d and not entries:
        return None
    return {"index": index, "delta": d, "logprobs": {"content": entries} if call.req.logprobs else None,
            "finish_reason": None}


def _finish_choice(call: ChatCall, index: int, finish: str, stop_reason: Any) -> dict[str, Any]:
    # the role chunk's content is null; an answer that is "" in the whole response says so here
    delta = {"content": ""} if call.choices[index].parser.result()[1] == "" else {}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}


async def _chat_chunks(call: ChatCall) -> AsyncIterator[str]:
    """The chunks of the whole stream, the unfinished choices ended with 'abort' (a shutdown or an abort)."""
    req = call.req
    base = {"id": call.rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": call.model}
    extra = {"usage": None} if req.include_usage else {}
    for c in call.choices:
        yield sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": None},
                                        "logprobs": None, "finish_reason": None}], **extra})
    async for _, out in merged_outputs([call.stream]):
        for co in out.outputs:
            delta, entries, finish = call.absorb(co)
            if delta is None:
                continue
            ch = _delta_chunk(call, co.index, delta, entries)
            if ch is not None:
                chunk = {**base, "choices": [ch], **extra}
                if req.continuous_usage and req.include_usage:
                    chunk["usage"] = usage(len(call.prompt_ids), call.completion_tokens)
                yield sse(chunk)
            if finish is not None:
                fin = _finish_choice(call, co.index, finish, call.choices[co.index].stop_reason)
                yield sse({**base, "choices": [fin], **extra})
    for c in call.choices:
        if not c.done:
            c.done, c.finish_reason = True, "abort"
            yield sse({**base, "choices": [_finish_choice(call, c.index, "abort", None)], **extra})
    if req.include_usage:
        yield sse({**base, "choices": [], "usage": usage(len(call.prompt_ids), call.completion_tokens)})


def _chat_answer(call: ChatCall) -> dict[str, Any]:
    choices = [{"index": c.index, "message": call.message(c),
                "logprobs": {"content": c.lp_entries} if call.req.logprobs else None,
                "finish_reason": c.finish_reason or "abort", "stop_reason": c.stop_reason} for c in call.choices]
    return {"id": call.rid, "object": "chat.completion", "created": int(time.time()), "model": call.model,
            "choices": choices, "usage": usage(len(call.prompt_ids), call.completion_tokens)}


async def chat_completions(request: Request):
    return await serve_call(request, "chat", start_chat, _chat_chunks, _chat_answer)


def register(app: FastAPI) -> None:
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
