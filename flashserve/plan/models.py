"""Resolve ``--model`` (a preset name or a config.json path) to :class:`ModelTerms`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .dtypes import KV_DTYPES
from .errors import PlanError
from .model_terms import ModelTerms
from .v3 import V3_PRESETS, v3_terms
from .v4_terms import v4_terms

NATIVE_KV = {"deepseek_v3": "bf16", "deepseek_v4": "fp8", "deepseek_v41": "fp4"}


def _read_json(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError("--model", f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError("--model", f"{file} is not a JSON object")
    return data


def _model_type(data: dict[str, Any]) -> str:
    text = data.get("text_config")
    return str(data.get("model_type") or (text or {}).get("model_type", ""))


def _check_kv(kv_dtype: str | None, family: str) -> str:
    kv = kv_dtype or NATIVE_KV[family]
    if kv not in KV_DTYPES:
        raise PlanError("--kv-dtype", f"unknown KV dtype {kv!r}; choose one of {', '.join(KV_DTYPES)}")
    return kv


def _v4_family(source: str | Path, kv_dtype: str | None) -> ModelTerms:
    try:
        from flashserve.config import ConfigError, load_config, model_arithmetic
    except ImportError as exc:  # the shared config package is part of flashserve; keep the message clear
        raise PlanError("--model", f"V4/V4.1 models need flashserve.config ({exc})") from None
    try:
        cfg = load_config(source)
    except ConfigError as exc:
        raise PlanError("--model", str(exc)) from None
    name = Path(str(source)).name if Path(str(source)).exists() else str(source)
    return v4_terms(cfg, model_arithmetic(cfg), name, _check_kv(kv_dtype, cfg.model_type))


def resolve_model(name_or_path: str, kv_dtype: str | None = None) -> ModelTerms:
    """Model terms for a preset (``deepseek-v41-flash``, ``deepseek-r1``, ...) or a config.json path/folder."""
    if name_or_path in V3_PRESETS:
        return v3_terms(V3_PRESETS[name_or_path], name_or_path, _check_kv(kv_dtype, "deepseek_v3"))
    path = Path(name_or_path)
    if path.exists():
        data = _read_json(path)
        kind = _model_type(data)
        if kind == "deepseek_v3":
            return v3_terms(data, path.name, _check_kv(kv_dtype, "deepseek_v3"))
        if kind.startswith("deepseek_v4"):
            return _v4_family(path, kv_dtype)
        raise PlanError("--model", f"{path}: model_type {kind!r} is not deepseek_v3, deepseek_v4 or deepseek_v41")
    return _v4_family(name_or_path, kv_dtype)
