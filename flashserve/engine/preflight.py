"""Checks of an :class:`EngineConfig` that need no weights, run before loading so that a bad option fails
in a second with its numbers, instead of after minutes of loading (or never, as a server that holds no prompt).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError, ModelConfig, load_config
from ..config.checkpoint_layout import QUANTIZATIONS
from ..config.arithmetic import kv_record
from ..config.sizes import parse_size
from .engine_config import INT8_KERNELS

if TYPE_CHECKING:
    from .engine_config import EngineConfig

_ELEMENT_BYTES = {"float32": 4, "fp32": 4, "float64": 8, "fp64": 8, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_POSITIVE = ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size")


@dataclass(frozen=True)
class Preflight:
    """What the checked options resolve to."""

    model_config: ModelConfig
    max_model_len: int
    kv_bytes: int
    weight_bytes: int | None  # the weights' resident budget (weight_memory), None: every weight held
    page_tokens: int
    page_bytes: int
    num_pages: int


def check(c: EngineConfig, model_config: ModelConfig | None = None) -> Preflight:
    """Every option of ``c`` checked against the model's config (read, not loaded); ConfigError names the option."""
    _check_scalars(c)
    try:
        kv_bytes = parse_size(c.kv_memory)
    except ValueError as e:
        raise ConfigError(f"kv_memory: {e}") from None
    try:
        weight_bytes = None if c.weight_memory is None else parse_size(c.weight_memory)
    except ValueError as e:
        raise ConfigError(f"weight_memory: {e}") from None
    if c.expert_cache_policy not in ("lru", "lfu"):
        raise ConfigError(f"expert_cache_policy: must be lru or lfu, got {c.expert_cache_policy!r}")
    if c.gpu_experts is not None:
        if isinstance(c.gpu_experts, bool) or not isinstance(c.gpu_experts, int) or c.gpu_experts < 1:
            raise ConfigError(f"gpu_experts: must be an integer >= 1, got {c.gpu_experts!r}")
        if weight_bytes is not None:
            raise ConfigError("gpu_experts: cannot be combined with weight_memory (the host holds every expert)")
        if c.tensor_parallel_size * c.data_parallel_size > 1:
            raise ConfigError("gpu_experts: splits the experts of one process, not of a sharded engine")
        if c.device == "cpu" or (c.device == "auto" and not _cuda()):
            raise ConfigError("gpu_experts: needs a CUDA device (on a CPU every expert is on the CPU already)")
    if weight_bytes is not None:
        from ..config.presets import PRESET_JSON

        if str(c.model) in PRESET_JSON:
            raise ConfigError(f"weight_memory: streams the routed experts from a checkpoint folder; {c.model!r} is a "
                              "preset (its weights are drawn in memory)")
        if c.tensor_parallel_size * c.data_parallel_size > 1:
            raise ConfigError("weight_memory: streams the routed experts in one process, not in a sharded engine")
        if c.device.startswith("cuda"):
            raise ConfigError("weight_memory: streams the routed experts into host memory for CPU steps; on a CUDA "
                              "device hold the experts that fit there with gpu_experts (the others run on the host), "
                              "or run on the CPU with device=cpu")
    if c.tokenizer is not None and not (Path(c.tokenizer) / "tokenizer.json").is_file():
        raise ConfigError(f"tokenizer: {c.tokenizer!r} is not a folder holding a tokenizer.json")
    if c.compile_cache is not None:
        _check_cache_folder(Path(c.compile_cache))
    cfg = model_config or load_config(c.model)
    _check_layout(c, cfg)
    limit = cfg.max_position_embeddings
    if c.max_model_len is not None and not 2 <= c.max_model_len <= limit:
        raise ConfigError(f"max_model_len: {c.max_model_len} is outside [2, {limit}], {limit} being the model's "
                          "limit (max_position_embeddings)")
    max_model_len = c.max_model_len or limit
    page_tokens, page_bytes = _page_size(cfg, c)
    num_pages = c.num_pages or max(1, kv_bytes // page_bytes)
    pre = Preflight(cfg, max_model_len, kv_bytes, weight_bytes, page_tokens, page_bytes, num_pages)
    if c.num_pages is None:  # an explicit page count is a test's deliberately small cache
        _check_fits(pre)
    return pre


def _check_cache_folder(path: Path) -> None:
    """A folder, or a path one can be made at: its nearest existing parent is a writable folder."""
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"compile_cache: {str(path)!r} is not a folder")
        return
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"compile_cache: {str(path)!r} does not exist and cannot be made in {str(parent)!r}")


def _check_layout(c: EngineConfig, cfg: ModelConfig) -> None:
    """The parallel layout's sizes divide what they split (flashserve.config.ranks)."""
    from ..config.ranks import layout_of

    layout_of(c).check(cfg)
    if c.quantization == "w8a8" and c.tensor_parallel_size > 1:
        # a rank holding some input columns would quantize its slice of each token on its own absmax
        raise ConfigError("quantization: w8a8 quantizes each token's whole activation row, which tensor "
                          "parallelism splits; use --tensor-parallel-size 1 or --quantization int8")
    for name in ("worker_timeout", "startup_timeout"):
        v = getattr(c, name)
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and v > 0):
            raise ConfigError(f"{name}: must be a number of seconds > 0, got {v!r}")


def _check_scalars(c: EngineConfig) -> None:
    for name in _POSITIVE:
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}: must be an integer >= 1, got {v!r}")
    if c.threads is not None and (isinstance(c.threads, bool) or not isinstance(c.threads, int) or c.threads < 1):
        raise ConfigError(f"threads: must be an integer >= 1, got {c.threads!r}")
    if c.prefill_chunk is not None and (not isinstance(c.prefill_chunk, int) or c.prefill_chunk < 1):
        raise ConfigError(f"prefill_chunk: must be an integer >= 1, got {c.prefill_chunk!r}")
    for name, allowed in (("cache_dtype", ("packed", "float")), ("prefix_replay", ("exact", "window")),
                          ("quantization", QUANTIZATIONS), ("int8_kernel", INT8_KERNELS)):
        v = getattr(c, name)
        if v is not None and v not in allowed:
            raise ConfigError(f"{name}: must be one of {', '.join(allowed)}, got {v!r}")


def _page_size(cfg: ModelConfig, c: EngineConfig) -> tuple[int, int]:
    """(tokens, bytes) of one KV page as :class:`KVCache` lays it out (a test holds the two equal), computed
    without torch so that this check answers before torch is even imported."""
    packed = (c.cache_dtype or ("packed" if cfg.is_v41 else "float")) == "packed"
    ratios = [r for r in cfg.compress_ratios[:cfg.num_hidden_layers] if r > 0] or [1]
    lcm = math.lcm(*ratios)
    tokens = lcm * max(1, -(-c.block_size // lcm))
    if packed:
        rec = kv_record(cfg)
        main, index = rec.main, rec.index
    else:
        elt = _ELEMENT_BYTES.get(str(c.dtype).removeprefix("torch."), 4)
        main, index = cfg.head_dim * elt, cfg.index_head_dim * elt
    total = 0
    for layer, ratio in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]):
        if ratio == 0 or cfg.kv_source(layer) != layer:
            continue
        indexed = cfg.is_v41 or ratio == cfg.compress_rate_csa
        total += (tokens // ratio) * (main + (index if indexed else 0))
    return tokens, max(1, total)


def _check_fits(p: Preflight) -> None:
    need = -(-p.max_model_len // p.page_tokens)
    if need <= p.num_pages:
        return
    fits = p.num_pages * p.page_tokens
    raise ConfigError(
        f"kv_memory: {p.kv_bytes} bytes hold {p.num_pages} pages of {p.page_tokens} tokens ({fits} tokens), "
        f"less than one max_model_len sequence of {p.max_model_len} tokens needs ({need} pages of {p.page_bytes} "
        f"bytes = {need * p.page_bytes} bytes); raise --kv-memory to at least {need * p.page_bytes} or lower "
        f"--max-model-len to at most {fits}")


def _cuda() -> bool:
    """Whether CUDA is there (imports torch: asked only when an option needs a GPU)."""
    import torch

    return torch.cuda.is_available()
