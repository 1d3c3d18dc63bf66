"""flashserve: inference engine and server for the DeepSeek-V4 family."""

__version__ = "0.1.0"


def load_model(*args, **kwargs):
    """See :func:`flashserve.model.loader.load_model` (imported lazily so config tools stay torch-free)."""
    from .model.loader import load_model as _load

    return _load(*args, **kwargs)


def __getattr__(name: str):
    """Lazy exports of the engine API (``from flashserve import LLM, SamplingParams``) so that importing
    ``flashserve.config`` or ``flashserve.plan`` never pulls in torch."""
    if name == "LLM":
        from .entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "LLMEngine", "EngineConfig"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'flashserve' has no attribute {name!r}")
