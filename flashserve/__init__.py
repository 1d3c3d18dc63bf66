"""flashserve: inference engine and server for the DeepSeek-V4 family."""

__version__ = "0.1.0"


def load_model(*args, **kwargs):
    """See :func:`flashserve.model.loader.load_model` (imported lazily so config tools stay torch-free)."""
    from .model.loader import load_model as _load

    return _load(*args, **kwargs)
