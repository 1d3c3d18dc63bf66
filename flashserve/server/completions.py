"""``POST /v1/completions``: one engine request per prompt, ``n`` choices each, echo and logprobs as OpenAI's
legacy completions API returns them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from . import logprobs as lpmod
from .engine_loop import RequestStream
from .protocol import CompletionRequest, invalid, parse_completion_request
from .streaming import Choice, merged_outputs, serve_call, sse, usage


@dataclass
class CompletionCall:
    """The requests of one completions call (one per prompt) and the state of each of their choices."""

    srv: Any
    req: CompletionRequest
    model: str
    base_id: str
    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    t0: float
    streams: list[RequestStream] = field(default_factory=list)
    choices: dict[tuple[int, int], Choice] = field(default_factory=dict)
    prompt_lps: dict[int, list] = field(default_factory=dict)
    lps: dict[tuple[int, int], Any] = field(default_factory=dict)  # each choice's logprobs, for a one-body answer
    ttft: float | None = None

    @property
    def echo_only(self) -> bool:
        return self.req.max_tokens == 0

    def start_choices(self) -> None:
        n = self.req.sampling.n
        self.choices = {(p, j): Choice(p * n + j) for p in range(len(self.streams)) for j in range(n)}

    def gen_tokens(self, c: Choice) -> list[int]:
        return [] if self.echo_only else c.token_ids

    def completion_tokens(self) -> int:
        return sum(len(self.gen_tokens(c)) for c in self.choices.values())

    def prompt_tokens(self) -> int:
        return sum(len(x) for x in self.prompt_ids)

    def finished(self) -> bool:
        return all(c.finish_reason for c in self.choices.values())

    def finish_metrics(self) -> None:
        cs = self.choices.values()
        self.srv.metrics.observe_completion(
            prompt_tokens=self.prompt_tokens(), generation_tokens=self.completion_tokens(), ttft=self.ttft,
            e2e=time.perf_counter() - self.t0, finish_reasons=[c.finish_reason for c in cs],
            decode_tokens=max((len(self.gen_tokens(c)) for c in cs), default=0))

    def absorb(self, p: int, out: Any, co: Any) -> tuple[str, Any, str | None, bool]:
        """One CompletionOutput of prompt ``p``: (new text, logprobs piece or None, finish reason, first?)."""
        c = self.choices[(p, co.index)]
        if c.done:
            return "", None, None, False
        first, c.started = not c.started, True
        if out.prompt_logprobs is not None and p not in self.prompt_lps:
            self.prompt_lps[p] = list(out.prompt_logprobs)
        new, new_ids, new_lps = c.absorb(co)
        if self.echo_only:
            new = ""
        if c.token_ids and self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        piece = self._logprobs_piece(p, c, new_ids, new_lps)
        finish = None
        if co.finish_reason is not None:
            c.done = True
            finish = c.finish_reason = "length" if self.echo_only else co.finish_reason
            c.stop_reason = co.stop_reason
        return new, piece, finish, first

    def absorb_output(self, p: int, out: Any) -> None:
        for co in out.outputs:
            if co.index < self.req.sampling.n:
                _, lp, _, _ = self.absorb(p, out, co)
                self.lps[(p, co.index)] = lpmod.merge(self.lps.get((p, co.index)), lp)

    def _logprobs_piece(self, p: int, c: Choice, new_ids: list[int], new_lps: list | None) -> dict | None:
        k = self.req.logprobs
        if k is None or new_lps is None or self.echo_only:
            return None
        ts = self.srv.token_strings
        offset = (len(self.prompt_texts[p]) if self.req.echo else 0) + c.lp_chars
        c.lp_chars += sum(len(ts(t)) for t in new_ids)
        return lpmod.completion_logprobs(ts, new_ids, new_lps, k, offset)

    def echo_piece(self, p: int) -> tuple[str, dict | None]:
        """The prompt's text (and its logprobs) that ``echo`` puts before the completion."""
        k = self.req.logprobs
        if k is None:
            return self.prompt_texts[p], None
        n = len(self.prompt_ids[p])
        plp = list(self.prompt_lps.get(p) or [])[:n]
        plp += [None] * (n - len(plp))
        return self.prompt_texts[p], lpmod.completion_logprobs(self.srv.token_strings, self.prompt_ids[p], plp, k,
                                                               0, first_is_prompt_start=True)


async def _prompts(srv: Any, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    ids_list, texts = [], []
    for p in req.prompts:
        if isinstance(p, str):
            ids = await srv.tokenize(p)
            if not ids:
                raise invalid("prompt", "the prompt encodes to no tokens")
            texts.append(p)
        else:
            ids = list(p)
            texts.append(srv.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
        ids_list.append(ids)
    return ids_list, texts


async def start_completion(srv: Any, body: dict[str, Any], t0: float) -> CompletionCall:
    srv.check_admitting()
    req = parse_completion_request(body, vocab_size=srv.vocab_size)
    model = srv.check_model(req.model)
    ids_list, texts = await _prompts(srv, req)
    call = CompletionCall(srv, req, model, f"cmpl-{uuid.uuid4().hex}", ids_list, texts, t0)
    k = req.logprobs
    params_list = []
    for i, ids in enumerate(ids_list):
        param = "prompt" if len(ids_list) == 1 else f"prompt[{i}]"
        mt = srv.check_length(len(ids), None if call.echo_only else req.max_tokens, param,
                              srv.cfg.completion_default_max_tokens)
        params_list.append(srv.sampling_params(req.sampling, max_tokens=1 if call.echo_only else mt, logprobs=k,
                                               prompt_logprobs=k if req.echo and k is not None else None))
    try:
        for i, (ids, params) in enumerate(zip(ids_list, params_list)):
            rid = call.base_id if len(ids_list) == 1 else f"{call.base_id}-{i}"
            call.streams.append(await srv.submit(rid, ids, params))
    except BaseException:  # refused or cancelled after some prompts were queued: withdraw them
        srv.abort_unfinished(call.streams)
        raise
    call.start_choices()
    return call


async def _completion_chunks(call: CompletionCall) -> AsyncIterator[str]:
    req, n = call.req, call.req.sampling.n
    base = {"id": call.base_id, "object": "text_completion", "created": int(time.time()), "model": call.model}
    extra = {"usage": None} if req.include_usage else {}
    async for p, out in merged_outputs(call.streams):
        for co in out.outputs:
            if co.index >= n:
                continue
            text, lp, finish, first = call.absorb(p, out, co)
            if first and req.echo:
                etext, elp = call.echo_piece(p)
                text, lp = etext + text, lpmod.merge(elp, lp)
            if text or (lp and lp["tokens"]) or finish:
                c = call.choices[(p, co.index)]
                yield sse({**base, "choices": [{"index": c.index, "text": text, "logprobs": lp,
                                                "finish_reason": finish,
                                                "stop_reason": c.stop_reason if finish else None}], **extra})
    for c in call.choices.values():
        if not c.done:
            c.done, c.finish_reason = True, "abort"
            yield sse({**base, "choices": [{"index": c.index, "text": "", "logprobs": None,
                                            "finish_reason": "abort", "stop_reason": None}], **extra})
    if req.include_usage:
        yield sse({**base, "choices": [], "usage": usage(call.prompt_tokens(), call.completion_tokens())})


def _choice_body(call: CompletionCall, c: Choice, lp: dict | None, p: int) -> dict[str, Any]:
    k = call.req.logprobs
    text = "" if call.echo_only else c.text
    if call.req.echo:
        etext, elp = call.echo_piece(p)
        text, lp = etext + text, lpmod.merge(elp, lp)
    if k is not None and lp is None:
        lp = dict(lpmod.EMPTY)
    return {"index": c.index, "text": text, "logprobs": lp if k is not None else None,
            "finish_reason": c.finish_reason or "abort", "stop_reason": c.stop_reason}


def _completion_answer(call: CompletionCall) -> dict[str, Any]:
    ordered = sorted(call.choices.items(), key=lambda kv: kv[1].index)
    return {"id": call.base_id, "object": "text_completion", "created": int(time.time()), "model": call.model,
            "choices": [_choice_body(call, c, call.lps.get(key), key[0]) for key, c in ordered],
            "usage": usage(call.prompt_tokens(), call.completion_tokens())}


async def completions(request: Request):
    return await serve_call(request, "completions", start_completion, _completion_chunks, _completion_answer)


def register(app: FastAPI) -> None:
    app.add_api_route("/v1/completions", completions, methods=["POST"])
