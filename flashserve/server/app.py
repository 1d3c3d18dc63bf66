"""The FastAPI app: OpenAI's ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``; Anthropic's
``/v1/messages``; ``/tokenize``, ``/detokenize``, ``/health``, ``/metrics``.

One process: uvicorn's event loop serves HTTP, :class:`EngineLoop` runs the engine in a thread beside it.
User input never reaches the engine unchecked (:mod:`protocol`), and every error leaves as error JSON. Each
endpoint lives in its own module; this one wires them together.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from . import anthropic_api, basic_routes, chat, completions
from .http import install_error_handlers
from .service import Server, ServerConfig

if TYPE_CHECKING:
    from ..engine.interface import Engine

__all__ = ["ServerConfig", "Server", "create_app"]


def create_app(engine: Engine, config: ServerConfig | None = None, **kwargs: Any) -> FastAPI:
    srv = Server(engine, config or ServerConfig(**kwargs))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            srv.loop.stop()

    app = FastAPI(title="flashserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    install_error_handlers(app)
    for module in (basic_routes, chat, completions, anthropic_api):
        module.register(app)
    return app
