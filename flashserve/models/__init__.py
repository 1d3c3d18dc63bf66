"""Models shipped inside the package: the embedded default, a small V4.1 trained on the Python standard library
by ``flashserve train`` (docs/training.md). Used when no model is named (``LLM()``, ``flashserve generate
PROMPT``, ``flashserve serve``)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default"
DEFAULT_SERVED_NAME = "flashserve-default"  # the name ``flashserve serve`` answers to when no model is named


def default_model() -> str:
    """Path of the embedded default model folder (config.json, model.safetensors, tokenizer.json, report.json)."""
    return str(DEFAULT_MODEL_DIR)


def resolve_model(model: str | None) -> str:
    """``model``, or the embedded default's folder when None."""
    return default_model() if model is None else str(model)
