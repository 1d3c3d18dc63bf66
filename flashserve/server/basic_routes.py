"""The small endpoints: ``/health``, ``/metrics``, ``/v1/models``, ``/tokenize``, ``/detokenize``,
``/tokenizer_info``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .http import check_auth, read_json, server_of
from .protocol import APIError, invalid, parse_chat_request


async def health(request: Request):
    srv = server_of(request)
    failure = getattr(srv.loop.engine, "failure", None)  # a sharded engine that lost a worker
    if failure is not None:
        return JSONResponse({"status": "error", "detail": str(failure)}, status_code=503)
    if not srv.loop.alive:
        fatal = getattr(srv.loop, "fatal", None)
        detail = "engine loop not running" + (f": {fatal}" if fatal is not None else "")
        return JSONResponse({"status": "error", "detail": detail}, status_code=503)
    if srv.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


async def metrics(request: Request):
    m = server_of(request).metrics
    return Response(m.render(), media_type=m.content_type)


def _model_card(srv: Any, name: str) -> dict[str, Any]:
    """vLLM's card: ``root`` is what was loaded (a preset name or the checkpoint folder's absolute path), so a
    client on the same machine (``flashserve bench``) finds the tokenizer."""
    return {"id": name, "object": "model", "created": srv.created, "owned_by": "flashserve",
            "root": srv.cfg.model_root or srv.cfg.model_name, "max_model_len": srv.max_model_len}


async def models(request: Request):
    check_auth(request)
    srv = server_of(request)
    return {"object": "list", "data": [_model_card(srv, name) for name in srv.cfg.names()]}


async def model_info(model_id: str, request: Request):
    check_auth(request)
    srv = server_of(request)
    if model_id not in srv.cfg.names():
        raise APIError(f"The model '{model_id}' does not exist", status=404, param="model", code="model_not_found")
    return _model_card(srv, model_id)


async def tokenize(request: Request):
    check_auth(request)
    srv = server_of(request)
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


async def detokenize(request: Request):
    check_auth(request)
    srv = server_of(request)
    body = await read_json(request)
    ids = body.get("tokens")
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                        or not 0 <= t < srv.vocab_size for t in ids):
        raise invalid("tokens", f"'tokens' must be an array of token ids in [0, {srv.vocab_size})")
    return {"prompt": srv.tokenizer.decode(ids, skip_special_tokens=False)}


async def tokenizer_info(request: Request):
    """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration in ``tokenizer_config.json``'s fields, as
    lm-eval's remote tokenizer (``tokenizer_backend=remote``) reads it before it uses /tokenize and /detokenize.
    ``add_bos_token``/``add_eos_token`` say what /tokenize and /v1/completions do: add no special tokens."""
    check_auth(request)
    srv = server_of(request)
    return srv.tokenizer_info()


def register(app: FastAPI) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model_info, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
