"""What every generation endpoint shares: the skeleton of a call (:func:`serve_call`), per-choice state,
merging the outputs of several engine requests, server-sent events, and ending the engine requests of a client
that went away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from .engine_loop import RequestStream
from .http import check_auth, count, read_json, server_of
from .protocol import APIError, error_body
from .tool_parser import ChatOutputParser

log = logging.getLogger("flashserve.server")

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return head + "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def openai_error_event(e: Exception) -> str:
    """An engine failure in the middle of an OpenAI stream (the status is already sent)."""
    return sse(error_body(f"generation failed: {e}", "server_error", None, "internal_error"))


class Call(Protocol):
    """One generation call in flight (its endpoint's state), as :func:`serve_call` drives it."""

    srv: Any  # the Server
    req: Any  # the parsed request: ``req.stream`` picks a streamed or a one-body answer

    @property
    def streams(self) -> list[RequestStream]: ...  # its engine requests

    def absorb_output(self, k: int, out: Any) -> None: ...  # a RequestOutput of request k (one-body answer)

    def finished(self) -> bool: ...  # every choice has finished

    def finish_metrics(self) -> None: ...


@dataclass
class Choice:
    """One choice's state while its engine outputs arrive."""

    index: int
    pieces: list[str] = field(default_factory=list)  # raw engine text seen so far (joined once, at the end)
    token_ids: list[int] = field(default_factory=list)
    n_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    done: bool = False
    parser: ChatOutputParser | None = None
    lp_entries: list[dict[str, Any]] = field(default_factory=list)
    started: bool = False
    lp_chars: int = 0  # characters of the token strings already given logprobs (completions' text_offset)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def absorb(self, co: Any) -> tuple[str, list[int], list | None]:
        """Take one "delta" CompletionOutput: (new text, new token ids, new logprobs or None). The engine sends
        only what is new, so a step's work does not grow with the completion's length."""
        self.pieces.append(co.text)  # not ``text +=``: that copies the whole text on every delta
        self.token_ids.extend(co.token_ids)
        return co.text, list(co.token_ids), co.logprobs


async def merged_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Merge request streams: yields (k, RequestOutput); raises a stream's error."""
    if len(streams) == 1:
        s = streams[0]
        while (o := await s.get()) is not None:
            yield 0, o
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, s: RequestStream) -> None:
        try:
            while (o := await s.get()) is not None:
                q.put_nowait((k, o))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            q.put_nowait((k, e))
        finally:
            q.put_nowait((k, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, o = await q.get()
            if o is None:
                left -= 1
            elif isinstance(o, BaseException):
                raise o
            else:
                yield k, o
    finally:
        for t in tasks:
            t.cancel()


class AbortGuard:
    """Aborts a streaming response's requests if its body generator is dropped without ever running (the
    client left before the first byte); a generator that ran aborts them in its ``finally``."""

    def __init__(self, srv: Any, streams: list[RequestStream]):
        self.srv, self.streams = srv, streams

    def __del__(self) -> None:
        try:
            self.srv.abort_unfinished(self.streams)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def event_stream(body: AsyncIterator[str], srv: Any, streams: list[RequestStream]) -> StreamingResponse:
    """An SSE response over ``body``; ``streams`` are aborted if the response is dropped before ``body`` runs."""
    response = StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    response.abort_guard = AbortGuard(srv, streams)  # dropped with the response
    return response


async def watch_disconnect(request: Request, srv: Any, streams: list[RequestStream]) -> None:
    """Abort the requests of a non-streaming call whose client went away."""
    try:
        while True:
            await asyncio.sleep(0.25)
            if await request.is_disconnected():
                srv.abort_unfinished(streams)
                return
    except asyncio.CancelledError:
        pass


async def collect(request: Request, srv: Any, streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """The merged outputs of a non-streaming call, its requests aborted if the client leaves or the call ends."""
    watcher = asyncio.create_task(watch_disconnect(request, srv, streams))
    try:
        async for item in merged_outputs(streams):
            yield item
    finally:
        watcher.cancel()
        srv.abort_unfinished(streams)


async def guarded_events(chunks: AsyncIterator[str], request: Request, endpoint: str, call: Call,
                         error_event: Callable[[Exception], str], done: str | None) -> AsyncIterator[str]:
    """``chunks`` as a streamed body: an engine failure mid-stream becomes ``error_event`` (in-band: the status
    is already sent), then ``done``; however it ends, unfinished requests are aborted, the outcome is counted
    (499: the client left) and ``call.finish_metrics()`` runs."""
    streams = call.streams
    status = 200
    try:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:
            status = 500
            log.exception("%s stream %s failed", endpoint, ", ".join(s.request_id for s in streams))
            yield error_event(e)
        if done:
            yield done
    except BaseException:  # the client went away (GeneratorExit / CancelledError)
        status = 499
        raise
    finally:
        call.srv.abort_unfinished(streams)
        count(request, endpoint, status)
        call.finish_metrics()


async def gather(request: Request, endpoint: str, call: Call) -> None:
    """Feed every output of a non-streaming call to ``call.absorb_output``; count the outcome. An engine failure
    is a 500, a shutdown that cut the call a 503 (retry elsewhere); a client that left counts as 499."""
    try:
        async for p, out in collect(request, call.srv, call.streams):
            call.absorb_output(p, out)
    except Exception as e:
        count(request, endpoint, 500)
        raise APIError(f"generation failed: {e}", status=500, type="server_error", code="internal_error")
    call.finish_metrics()
    done = call.finished()
    if not done and call.srv.draining:
        count(request, endpoint, 503)
        raise APIError("The server shut down before the request finished; retry", status=503,
                       type="server_error", code="shutting_down")
    count(request, endpoint, 200 if done else 499)


async def serve_call(request: Request, endpoint: str, start: Callable[[Any, dict[str, Any], float], Awaitable[Call]],
                     chunks: Callable[[Call], AsyncIterator[str]], answer: Callable[[Call], dict[str, Any]],
                     error_event: Callable[[Exception], str] = openai_error_event,
                     done: str | None = DONE) -> Any:
    """The skeleton of every generation endpoint: authenticate, read the body, ``start(server, body, t0)`` the
    call (parse, check the model, build the prompt, submit it to the engine loop; an :class:`APIError` is counted
    under ``endpoint`` and answered), then stream ``chunks(call)`` as server-sent events (see
    :func:`guarded_events`), or gather every output and answer ``answer(call)``."""
    t0 = time.perf_counter()
    try:
        check_auth(request)
        call = await start(server_of(request), await read_json(request), t0)
    except APIError as e:
        count(request, endpoint, e.status)
        raise
    if call.req.stream:
        events = guarded_events(chunks(call), request, endpoint, call, error_event, done)
        return event_stream(events, call.srv, call.streams)
    await gather(request, endpoint, call)
    return answer(call)
