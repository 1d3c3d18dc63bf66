"""The flashserve engine: paged V4 / V4.1 state, continuous batching, chunked and encoder-only prefill,
prefix caching, sampling and the offline API."""

_EXPORTS = {
    "LLMEngine": "llm_engine", "EngineConfig": "llm_engine", "SamplingParams": "sampling_params",
    "QueueFullError": "sampling_params", "RequestError": "sampling_params", "RequestOutput": "sequence",
    "CompletionOutput": "sequence", "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Imported on first use, so the CLI can register ``generate`` without importing torch."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashserve.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
