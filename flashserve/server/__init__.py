"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`flashserve.engine.LLMEngine`.

``create_app`` / ``ServerConfig`` are imported lazily so that building the ``flashserve`` CLI stays light.
"""

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name):
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
