"""HTTP plumbing shared by the endpoints: API keys, bounded JSON bodies, and errors in the OpenAI shape."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .protocol import APIError, anthropic_error, decode_json_body, error_body

log = logging.getLogger("flashserve.server")


def server_of(request: Request) -> Any:
    """The app's :class:`~flashserve.server.service.Server`."""
    return request.app.state.server


def check_auth(request: Request) -> None:
    """``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY`` (Anthropic clients)."""
    key = server_of(request).cfg.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip() == key:
        return
    if request.headers.get("x-api-key", "").strip() == key:
        return
    raise APIError("Invalid or missing API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                   status=401, type="authentication_error", code="invalid_api_key")


def _check_content_length(request: Request, limit: int) -> None:
    cl = request.headers.get("content-length")
    if cl is None:
        return
    try:
        n = int(cl)
    except ValueError:
        raise APIError("invalid Content-Length header", code="invalid_value") from None
    if n > limit:
        raise APIError(f"request body of {n} bytes exceeds the limit of {limit} bytes", status=413,
                       code="request_too_large")


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object, read at most ``max_request_bytes`` far (413 beyond)."""
    limit = server_of(request).cfg.max_request_bytes
    _check_content_length(request, limit)
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


def count(request: Request, endpoint: str, status: int) -> None:
    """Count a finished request; refusals for load or size are logged as warnings (operators act on them)."""
    server_of(request).metrics.observe_request(endpoint, status)
    if status in (413, 429, 503):
        log.warning("%s %s refused with %d", request.method, request.url.path, status)


def _shape(request: Request, body: dict[str, Any], status: int) -> dict[str, Any]:
    """The error body in the API's shape: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if request.url.path.startswith("/v1/messages"):
        return anthropic_error(body, status)
    return body


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(_shape(request, exc.body(), exc.status), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        typ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"Not found: {request.method} {request.url.path}"
        return JSONResponse(_shape(request, error_body(msg, typ, None, str(exc.status_code)), exc.status_code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        body = error_body(str(exc), "invalid_request_error", None, "invalid_value")
        return JSONResponse(_shape(request, body, 400), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        body = error_body(f"internal server error: {type(exc).__name__}", "server_error", None, "internal_error")
        return JSONResponse(_shape(request, body, 500), status_code=500)
