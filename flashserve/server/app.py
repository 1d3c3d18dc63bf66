"""The OpenAI-compatible FastAPI app: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/health``, ``/metrics``.

One process: uvicorn's event loop serves HTTP, :class:`EngineLoop` runs the engine in a thread beside it.
User input never reaches the engine unchecked (:mod:`protocol`), and every error leaves as OpenAI error JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import chat_encoding
from .engine_loop import EngineDeadError, EngineLoop, RequestStream
from .metrics import ServerMetrics
from .protocol import (DEFAULT_MAX_REQUEST_BYTES, APIError, ChatRequest, SamplingFields, decode_json_body, error_body,
                       invalid, parse_chat_request, parse_completion_request)
from .tool_parser import ChatOutputParser

log = logging.getLogger("flashserve.server")

# Special tokens that carry meaning for the chat parsers and therefore stay in chat text.
_KEEP_IN_CHAT = {chat_encoding.THINK_START, chat_encoding.THINK_END, chat_encoding.DSML, chat_encoding.SYSTEM}


@dataclass
class ServerConfig:
    model_name: str
    served_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    default_thinking: bool = True
    chat_template: str = "auto"  # auto | v41 | plain
    completion_default_max_tokens: int = 16
    max_model_len: int | None = None

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.model_name,) + tuple(self.served_names)))


def _engine_import():
    from flashserve.engine import QueueFullError, RequestError, SamplingParams

    return QueueFullError, RequestError, SamplingParams


# ---------------------------------------------------------------------------------------------------------
# per-choice streaming state
# ---------------------------------------------------------------------------------------------------------

@dataclass
class _Choice:
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


def _absorb_delta(choice: _Choice, co: Any) -> tuple[str, list[int], list | None]:
    """Take one "delta" CompletionOutput into its choice: (new text, new token ids, new logprobs or None).
    The engine sends only what is new, so a step's work does not grow with the completion's length."""
    choice.pieces.append(co.text)  # not ``text +=``: that copies the whole text on every delta
    choice.token_ids.extend(co.token_ids)
    return co.text, list(co.token_ids), co.logprobs


class Server:
    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.cfg = config
        self.tokenizer = engine.tokenizer
        self.vocab_size = int(self.tokenizer.vocab_size)
        mc = getattr(engine, "model_config", None)
        self.is_v41 = bool(getattr(mc, "is_v41", False))
        mml = config.max_model_len or getattr(engine, "max_model_len", None)
        self.max_model_len = int(mml) if mml else 4096
        if config.chat_template == "v41":
            self.use_v41 = True
        elif config.chat_template == "plain":
            self.use_v41 = False
        else:
            self.use_v41 = self.is_v41 and self._has_v41_tokens()
        self.metrics = ServerMetrics(config.model_name)
        self.loop = EngineLoop(engine, on_stats=self.metrics.update_engine)
        self.created = int(time.time())
        self._tok_str_cache: dict[int, str] = {}
        specials = dict(getattr(self.tokenizer, "special_tokens", {}) or {})
        is_special = getattr(self.tokenizer, "is_special", None)
        self._strip = sorted((s for s, i in specials.items()
                              if s not in _KEEP_IN_CHAT and (is_special is None or is_special(i))),
                             key=len, reverse=True)
        self.bos_text = next((s for s, i in specials.items()
                              if i == getattr(self.tokenizer, "bos_token_id", -1)), None)

    def _has_v41_tokens(self) -> bool:
        tok = self.tokenizer
        need = [chat_encoding.BOS, chat_encoding.USER, chat_encoding.ASSISTANT, chat_encoding.THINK_END]
        try:
            return all(tok.token_to_id(t) is not None for t in need)
        except Exception:
            return False

    # -- helpers -------------------------------------------------------------------------------------------
    def token_str(self, tid: int) -> str:
        s = self._tok_str_cache.get(tid)
        if s is None:
            try:
                s = self.tokenizer.decode([tid], skip_special_tokens=False)
            except Exception:
                s = ""
            if len(self._tok_str_cache) < 300_000:
                self._tok_str_cache[tid] = s
        return s

    def strip_specials(self, text: str) -> str:
        if not text:
            return text
        for s in self._strip:
            if s in text:
                text = text.replace(s, "")
        return text

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.cfg.model_name
        if model not in self.cfg.names():
            raise APIError(f"The model '{model}' does not exist; this server serves {list(self.cfg.names())}",
                           param="model", code="model_not_found")
        return model

    def encode_chat(self, req: ChatRequest) -> tuple[str, bool]:
        if self.use_v41:
            try:
                thinking, effort = chat_encoding.resolve_mode(req.thinking, req.reasoning_effort,
                                                              self.cfg.default_thinking)
            except ValueError as e:
                raise invalid("reasoning_effort", str(e)) from None
            tools = req.tools if req.tool_choice != "none" else None
            text = chat_encoding.encode_v41(req.messages, thinking=thinking, reasoning_effort=effort, tools=tools,
                                            drop_thinking=req.drop_thinking,
                                            add_generation_prompt=req.add_generation_prompt)
            return text, thinking
        tools = req.tools if req.tool_choice != "none" else None
        return chat_encoding.encode_plain(req.messages, tools=tools, bos=self.bos_text,
                                          add_generation_prompt=req.add_generation_prompt), False

    async def tokenize(self, text: str) -> list[int]:
        if len(text) > 50_000:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        return self.tokenizer.encode(text)

    def check_length(self, n_prompt: int, max_tokens: int | None, param: str, default: int | None) -> int:
        L = self.max_model_len
        if n_prompt >= L:
            raise APIError(f"This model's maximum context length is {L} tokens; the prompt has {n_prompt} tokens "
                           "(no room left to generate)", param=param, code="context_length_exceeded")
        room = L - n_prompt
        if max_tokens is None:
            return room if default is None else min(default, room)
        if n_prompt + max_tokens > L:
            raise APIError(f"This model's maximum context length is {L} tokens; the prompt has {n_prompt} tokens "
                           f"and max_tokens asks for {max_tokens} more", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, s: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, skip_special: bool) -> Any:
        _, RequestError, SamplingParams = _engine_import()
        seed = None if s.seed is None else s.seed % (2 ** 63)
        params = SamplingParams(n=s.n, max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p,
                                top_k=s.top_k, min_p=s.min_p, seed=seed, presence_penalty=s.presence_penalty,
                                frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
                                stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                skip_special_tokens=skip_special, output_kind="delta")
        try:
            params.validate(self.vocab_size)
        except RequestError as e:
            msg = str(e)
            raise invalid(msg.split(":", 1)[0].strip() or None, msg) from None
        return params

    async def submit(self, rid: str, prompt_ids: list[int], params: Any) -> RequestStream:
        QueueFullError, RequestError, _ = _engine_import()
        try:
            return await self.loop.add(rid, prompt_ids, params)
        except QueueFullError as e:
            raise APIError(f"The server is busy (waiting queue full): {e}; retry later", status=429,
                           type="rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"}) from None
        except RequestError as e:
            msg = str(e)
            code = "context_length_exceeded" if "long" in msg or "context" in msg else "invalid_value"
            raise APIError(msg, param=None, code=code) from None
        except EngineDeadError as e:
            raise APIError(f"The engine is not running: {e}", status=503, type="server_error",
                           code="engine_unavailable") from None

    async def outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
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

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.loop.abort(s.request_id)

    # -- logprobs ------------------------------------------------------------------------------------------
    @staticmethod
    def _top(d: dict[int, float] | None, k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely entries of a logprob dict (which holds the sampled token plus the top-k)."""
        if not d or k <= 0:
            return []
        return sorted(d.items(), key=lambda kv: -kv[1])[:k]

    @staticmethod
    def _lp(v: float | None) -> float:
        if v is None or not math.isfinite(v):
            return -9999.0
        return float(v)

    def chat_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], k: int) -> list[dict[str, Any]]:
        out = []
        for tid, d in zip(token_ids, lps):
            s = self.token_str(tid)
            tops = []
            for t, v in self._top(d, k):
                ts = self.token_str(t)
                tops.append({"token": ts, "logprob": self._lp(v), "bytes": list(ts.encode("utf-8", "replace"))})
            out.append({"token": s, "logprob": self._lp((d or {}).get(tid)),
                        "bytes": list(s.encode("utf-8", "replace")), "top_logprobs": tops})
        return out

    def completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float] | None], k: int,
                            offset: int, first_is_prompt_start: bool = False) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for j, (tid, d) in enumerate(zip(token_ids, lps)):
            s = self.token_str(tid)
            tokens.append(s)
            offsets.append(pos)
            pos += len(s)
            if d is None or (first_is_prompt_start and j == 0):
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(self._lp(d.get(tid)))
            top = {}
            for t, v in self._top(d, k):
                top.setdefault(self.token_str(t), self._lp(v))
            if k == 0 or (tid in d and self.token_str(tid) not in top):
                top.setdefault(s, self._lp(d.get(tid)))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# ---------------------------------------------------------------------------------------------------------
# SSE helpers
# ---------------------------------------------------------------------------------------------------------

def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


_DONE = "data: [DONE]\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------------------------------
# app
# ---------------------------------------------------------------------------------------------------------

def create_app(engine: Any, config: ServerConfig | None = None, **kwargs: Any) -> FastAPI:
    cfg = config or ServerConfig(**kwargs)
    srv = Server(engine, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            srv.loop.stop()

    app = FastAPI(title="flashserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    # -- errors ----------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        typ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"Not found: {request.method} {request.url.path}"
        return JSONResponse(error_body(msg, typ, None, str(exc.status_code)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(str(exc), "invalid_request_error", None, "invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", "server_error", None,
                                       "internal_error"), status_code=500)

    # -- request plumbing ------------------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if not cfg.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != cfg.api_key:
            raise APIError("Invalid or missing API key; send 'Authorization: Bearer <key>'", status=401,
                           type="authentication_error", code="invalid_api_key")

    async def read_json(request: Request) -> dict[str, Any]:
        limit = cfg.max_request_bytes
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise APIError("invalid Content-Length header", code="invalid_value") from None
            if n > limit:
                raise APIError(f"request body of {n} bytes exceeds the limit of {limit} bytes", status=413,
                               code="request_too_large")
        ctype = request.headers.get("content-type", "application/json")
        if "json" not in ctype.lower() and "text/plain" not in ctype.lower():
            raise APIError(f"unsupported Content-Type {ctype!r}; send application/json", status=400,
                           code="invalid_content_type")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(f"request body exceeds the limit of {limit} bytes", status=413,
                                   code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise APIError("client closed the connection while sending the request", status=499,
                           code="client_disconnected") from None
        return decode_json_body(b"".join(chunks))

    def count(endpoint: str, status: int) -> None:
        srv.metrics.observe_request(endpoint, status)

    # -- plain endpoints -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not srv.loop.alive:
            return JSONResponse({"status": "error", "detail": "engine loop not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=srv.metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        data = [{"id": name, "object": "model", "created": srv.created, "owned_by": "flashserve",
                 "root": cfg.model_name, "max_model_len": srv.max_model_len} for name in cfg.names()]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request):
        check_auth(request)
        if model_id not in cfg.names():
            raise APIError(f"The model '{model_id}' does not exist", status=404, param="model",
                           code="model_not_found")
        return {"id": model_id, "object": "model", "created": srv.created, "owned_by": "flashserve",
                "root": cfg.model_name, "max_model_len": srv.max_model_len}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        check_auth(request)
        body = await read_json(request)
        if "messages" in body:
            req = parse_chat_request(body, vocab_size=srv.vocab_size)
            srv.check_model(req.model)
            text, _ = srv.encode_chat(req)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise invalid("prompt", "'prompt' must be a string", "invalid_type")
        ids = await srv.tokenize(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": srv.max_model_len, "prompt": text}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_auth(request)
        body = await read_json(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                            or not 0 <= t < srv.vocab_size for t in ids):
            raise invalid("tokens", f"'tokens' must be an array of token ids in [0, {srv.vocab_size})")
        return {"prompt": srv.tokenizer.decode(ids, skip_special_tokens=False)}

    # -- chat --------------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        try:
            check_auth(request)
            body = await read_json(request)
            req = parse_chat_request(body, vocab_size=srv.vocab_size)
            model = srv.check_model(req.model)
            prompt_text, thinking = srv.encode_chat(req)
            prompt_ids = await srv.tokenize(prompt_text)
            max_tokens = srv.check_length(len(prompt_ids), req.sampling.max_tokens, "messages", None)
            user_skip = req.sampling.skip_special_tokens
            params = srv.sampling_params(req.sampling, max_tokens,
                                         (req.top_logprobs if req.logprobs else None), None, skip_special=False)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            stream = await srv.submit(rid, prompt_ids, params)
        except APIError as e:
            count("chat", e.status)
            raise
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        strip = user_skip is not False
        choices = [_Choice(i, parser=ChatOutputParser(thinking, parse_tools)) for i in range(req.sampling.n)]
        created = int(time.time())
        ctx = {"ttft": None}

        def finish_metrics() -> None:
            gen = sum(len(c.token_ids) for c in choices)
            srv.metrics.observe_completion(prompt_tokens=len(prompt_ids), generation_tokens=gen,
                                           ttft=ctx["ttft"], e2e=time.perf_counter() - t0,
                                           finish_reasons=[c.finish_reason for c in choices],
                                           decode_tokens=max((len(c.token_ids) for c in choices), default=0))

        def absorb(co: Any) -> tuple[Any, list[dict], str | None]:
            """Feed one CompletionOutput into its choice: (parser delta, new logprob entries, finish)."""
            c = choices[co.index]
            if c.done:
                return None, [], None
            new, new_ids, new_lps = _absorb_delta(c, co)
            if strip:
                new = srv.strip_specials(new)
            delta = c.parser.feed(new)
            if c.token_ids and ctx["ttft"] is None:
                ctx["ttft"] = time.perf_counter() - t0
            lp_entries: list[dict] = []
            if req.logprobs and new_lps is not None:
                lp_entries = srv.chat_logprobs(new_ids, new_lps, req.top_logprobs)
                c.n_logprobs += len(new_lps)
                c.lp_entries.extend(lp_entries)
            finish = None
            if co.finish_reason is not None:
                tail = c.parser.finish()
                delta.reasoning += tail.reasoning
                delta.content += tail.content
                delta.tool_calls += tail.tool_calls
                c.done = True
                finish = co.finish_reason
                if finish == "stop" and c.parser.tool_calls:
                    finish = "tool_calls"
                c.finish_reason = finish
                c.stop_reason = co.stop_reason
            return delta, lp_entries, finish

        if req.stream:
            include_usage = req.include_usage

            async def gen(guard: _AbortGuard):
                status = 200
                try:
                    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
                    extra = {"usage": None} if include_usage else {}
                    for c in choices:
                        yield _sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant",
                                                                                    "content": ""},
                                                         "logprobs": None, "finish_reason": None}], **extra})
                    try:
                        async for _, out in srv.outputs([stream]):
                            for co in out.outputs:
                                if co.index >= len(choices):
                                    continue
                                delta, lps, finish = absorb(co)
                                if delta is None:
                                    continue
                                d: dict[str, Any] = {}
                                if delta.reasoning:
                                    d["reasoning_content"] = delta.reasoning
                                if delta.content:
                                    d["content"] = delta.content
                                if delta.tool_calls:
                                    d["tool_calls"] = delta.tool_calls
                                if d or lps:
                                    ch = {"index": co.index, "delta": d,
                                          "logprobs": {"content": lps} if req.logprobs else None,
                                          "finish_reason": None}
                                    chunk = {**base, "choices": [ch], **extra}
                                    if req.continuous_usage and include_usage:
                                        chunk["usage"] = _usage(len(prompt_ids),
                                                                sum(len(c.token_ids) for c in choices))
                                    yield _sse(chunk)
                                if finish is not None:
                                    yield _sse({**base, "choices": [{"index": co.index, "delta": {},
                                                                     "logprobs": None, "finish_reason": finish,
                                                                     "stop_reason": choices[co.index].stop_reason}],
                                                **extra})
                    except Exception as e:  # engine failure mid-stream: report it in-band
                        status = 500
                        log.exception("stream %s failed", rid)
                        yield _sse(error_body(f"generation failed: {e}", "server_error", None, "internal_error"))
                        yield _DONE
                        return
                    if include_usage:
                        yield _sse({**base, "choices": [],
                                    "usage": _usage(len(prompt_ids), sum(len(c.token_ids) for c in choices))})
                    yield _DONE
                except BaseException:  # the client went away (GeneratorExit / CancelledError)
                    status = 499
                    raise
                finally:
                    srv.abort_unfinished([stream])
                    count("chat", status)
                    finish_metrics()

            return StreamingResponse(gen(_AbortGuard(srv, [stream])), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        # non-streaming
        watcher = asyncio.create_task(_watch_disconnect(request, srv, [stream]))
        try:
            async for _, out in srv.outputs([stream]):
                for co in out.outputs:
                    if co.index < len(choices):
                        absorb(co)
        except Exception as e:
            count("chat", 500)
            raise APIError(f"generation failed: {e}", status=500, type="server_error", code="internal_error")
        finally:
            watcher.cancel()
            srv.abort_unfinished([stream])
        finish_metrics()
        result = []
        for c in choices:
            lp = {"content": c.lp_entries} if req.logprobs else None
            reasoning, content, tool_calls = c.parser.result()
            msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            result.append({"index": c.index, "message": msg, "logprobs": lp,
                           "finish_reason": c.finish_reason or "abort", "stop_reason": c.stop_reason})
        count("chat", 200 if all(c.finish_reason for c in choices) else 499)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": result,
                "usage": _usage(len(prompt_ids), sum(len(c.token_ids) for c in choices))}

    # -- completions -----------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        streams: list[RequestStream] = []
        try:
            check_auth(request)
            body = await read_json(request)
            req = parse_completion_request(body, vocab_size=srv.vocab_size)
            model = srv.check_model(req.model)
            prompt_ids_list: list[list[int]] = []
            prompt_texts: list[str] = []
            for i, p in enumerate(req.prompts):
                if isinstance(p, str):
                    ids = await srv.tokenize(p)
                    if not ids:
                        raise invalid("prompt", "the prompt encodes to no tokens")
                    prompt_texts.append(p)
                else:
                    ids = list(p)
                    prompt_texts.append(srv.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
                prompt_ids_list.append(ids)
            echo_only = req.sampling.max_tokens == 0
            max_tokens_list = []
            for i, ids in enumerate(prompt_ids_list):
                param = "prompt" if len(prompt_ids_list) == 1 else f"prompt[{i}]"
                mt = srv.check_length(len(ids), None if echo_only else req.sampling.max_tokens, param,
                                      cfg.completion_default_max_tokens)
                max_tokens_list.append(1 if echo_only else mt)
            k = req.logprobs
            skip = True if req.sampling.skip_special_tokens is None else req.sampling.skip_special_tokens
            params_list = [srv.sampling_params(req.sampling, mt, k, (k if req.echo and k is not None else None),
                                               skip) for mt in max_tokens_list]
            base_id = f"cmpl-{uuid.uuid4().hex}"
            for i, (ids, params) in enumerate(zip(prompt_ids_list, params_list)):
                rid = base_id if len(prompt_ids_list) == 1 else f"{base_id}-{i}"
                streams.append(await srv.submit(rid, ids, params))
        except APIError as e:
            srv.abort_unfinished(streams)
            count("completions", e.status)
            raise
        except BaseException:  # cancelled or failed after some prompts were queued: withdraw them
            srv.abort_unfinished(streams)
            raise
        n = req.sampling.n
        created = int(time.time())
        choices = {(p, j): _Choice(p * n + j) for p in range(len(streams)) for j in range(n)}
        prompt_lps: dict[int, list] = {}
        ctx = {"ttft": None}
        n_prompt_total = sum(len(x) for x in prompt_ids_list)

        def gen_tokens(c: _Choice) -> list[int]:
            return [] if echo_only else c.token_ids

        def finish_metrics() -> None:
            gen = sum(len(gen_tokens(c)) for c in choices.values())
            srv.metrics.observe_completion(prompt_tokens=n_prompt_total, generation_tokens=gen, ttft=ctx["ttft"],
                                           e2e=time.perf_counter() - t0,
                                           finish_reasons=[c.finish_reason for c in choices.values()],
                                           decode_tokens=max((len(gen_tokens(c)) for c in choices.values()),
                                                             default=0))

        def absorb(p: int, out: Any, co: Any) -> tuple[str, Any, str | None, bool]:
            """-> (new text, logprobs piece or None, finish_reason, first-output?)"""
            c = choices[(p, co.index)]
            if c.done:
                return "", None, None, False
            first = not c.started
            c.started = True
            if out.prompt_logprobs is not None and p not in prompt_lps:
                prompt_lps[p] = list(out.prompt_logprobs)
            new, new_ids, new_lps = _absorb_delta(c, co)
            if echo_only:
                new = ""
            if c.token_ids and ctx["ttft"] is None:
                ctx["ttft"] = time.perf_counter() - t0
            lp_piece = None
            if k is not None and new_lps is not None and not echo_only:
                offset = (len(prompt_texts[p]) if req.echo else 0) + c.lp_chars
                lp_piece = srv.completion_logprobs(new_ids, new_lps, k, offset)
                c.n_logprobs += len(new_lps)
                c.lp_chars += sum(len(srv.token_str(t)) for t in new_ids)
            finish = None
            if co.finish_reason is not None:
                c.done = True
                finish = co.finish_reason
                if echo_only:
                    finish = "length"
                c.finish_reason = finish
                c.stop_reason = co.stop_reason
            return new, lp_piece, finish, first

        def echo_piece(p: int) -> tuple[str, Any]:
            text = prompt_texts[p]
            lp = None
            if k is not None:
                plp = prompt_lps.get(p) or [None] * len(prompt_ids_list[p])
                plp = list(plp) + [None] * (len(prompt_ids_list[p]) - len(plp))
                lp = srv.completion_logprobs(prompt_ids_list[p], plp, k, 0, first_is_prompt_start=True)
            return text, lp

        def merge_lp(a: dict | None, b: dict | None) -> dict | None:
            if a is None:
                return b
            if b is None:
                return a
            return {key: a[key] + b[key] for key in a}

        if req.stream:
            include_usage = req.include_usage

            async def gen(guard: _AbortGuard):
                status = 200
                try:
                    base = {"id": base_id, "object": "text_completion", "created": created, "model": model}
                    extra = {"usage": None} if include_usage else {}
                    try:
                        async for p, out in srv.outputs(streams):
                            for co in out.outputs:
                                if co.index >= n:
                                    continue
                                text, lp, finish, first = absorb(p, out, co)
                                if first and req.echo:
                                    etext, elp = echo_piece(p)
                                    text = etext + text
                                    lp = merge_lp(elp, lp) if k is not None else None
                                if text or (lp and lp["tokens"]) or finish:
                                    yield _sse({**base, "choices": [{"index": p * n + co.index, "text": text,
                                                                     "logprobs": lp, "finish_reason": finish,
                                                                     "stop_reason": choices[(p, co.index)].stop_reason
                                                                     if finish else None}], **extra})
                    except Exception as e:
                        status = 500
                        log.exception("stream %s failed", base_id)
                        yield _sse(error_body(f"generation failed: {e}", "server_error", None, "internal_error"))
                        yield _DONE
                        return
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(
                            n_prompt_total, sum(len(gen_tokens(c)) for c in choices.values()))})
                    yield _DONE
                except BaseException:  # the client went away (GeneratorExit / CancelledError)
                    status = 499
                    raise
                finally:
                    srv.abort_unfinished(streams)
                    count("completions", status)
                    finish_metrics()

            return StreamingResponse(gen(_AbortGuard(srv, streams)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        watcher = asyncio.create_task(_watch_disconnect(request, srv, streams))
        texts: dict[tuple[int, int], str] = {key: "" for key in choices}
        lps: dict[tuple[int, int], Any] = {key: None for key in choices}
        try:
            async for p, out in srv.outputs(streams):
                for co in out.outputs:
                    if co.index >= n:
                        continue
                    text, lp, _, _ = absorb(p, out, co)
                    texts[(p, co.index)] += text
                    lps[(p, co.index)] = merge_lp(lps[(p, co.index)], lp)
        except Exception as e:
            count("completions", 500)
            raise APIError(f"generation failed: {e}", status=500, type="server_error", code="internal_error")
        finally:
            watcher.cancel()
            srv.abort_unfinished(streams)
        finish_metrics()
        result = []
        for (p, j), c in sorted(choices.items(), key=lambda kv: kv[1].index):
            text = c.text if not echo_only else ""
            lp = lps[(p, j)] if k is not None else None
            if req.echo:
                etext, elp = echo_piece(p)
                text = etext + text
                if k is not None:
                    lp = merge_lp(elp, lp) or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                "text_offset": []}
            elif k is not None and lp is None:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            result.append({"index": c.index, "text": text, "logprobs": lp,
                           "finish_reason": c.finish_reason or "abort", "stop_reason": c.stop_reason})
        count("completions", 200 if all(c.finish_reason for c in choices.values()) else 499)
        return {"id": base_id, "object": "text_completion", "created": created, "model": model,
                "choices": result,
                "usage": _usage(n_prompt_total, sum(len(gen_tokens(c)) for c in choices.values()))}

    return app


class _AbortGuard:
    """Aborts a streaming response's requests if its body generator is dropped without ever running (the
    client left before the first byte); a generator that ran aborts them in its ``finally``."""

    def __init__(self, srv: Server, streams: list[RequestStream]):
        self.srv, self.streams = srv, streams

    def __del__(self) -> None:
        try:
            self.srv.abort_unfinished(self.streams)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


async def _watch_disconnect(request: Request, srv: Server, streams: list[RequestStream]) -> None:
    """Abort the requests of a non-streaming call whose client went away."""
    try:
        while True:
            await asyncio.sleep(0.25)
            if await request.is_disconnected():
                srv.abort_unfinished(streams)
                return
    except asyncio.CancelledError:
        pass
