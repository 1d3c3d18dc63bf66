"""Model configuration: parsing, presets, checkpoint inventory and arithmetic (pure Python, no torch)."""

from __future__ import annotations

from pathlib import Path

from .arithmetic import ModelArithmetic, model_arithmetic
from .model_config import V4, V41, ConfigError, ModelConfig, config_from_dict, read_config_json
from .presets import PRESET_JSON, RUNNABLE_PRESETS, preset_config, preset_json


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A preset name (``tiny-v41``, ``deepseek-v41-flash``, ...), a checkpoint folder / config.json path, or a
    DeepSeek-V4 GGUF file (its metadata: :mod:`flashserve.gguf.config`)."""
    if str(name_or_path) in PRESET_JSON:
        return preset_config(str(name_or_path))
    from ..gguf import is_gguf_path

    if is_gguf_path(name_or_path):
        from ..gguf.config import config_from_gguf
        from ..gguf.file import open_gguf

        return config_from_gguf(open_gguf(name_or_path))
    path = Path(name_or_path)
    if not path.exists():
        raise ConfigError(
            f"{name_or_path!r} is neither a preset ({', '.join(PRESET_JSON)}) nor an existing path")
    return read_config_json(path)


__all__ = [
    "V4", "V41", "ConfigError", "ModelConfig", "ModelArithmetic", "config_from_dict", "load_config",
    "model_arithmetic", "preset_config", "preset_json", "read_config_json", "PRESET_JSON", "RUNNABLE_PRESETS",
]
