"""Command-line engine options, derived from :class:`EngineConfig`'s fields.

The fields (names, types, defaults) are declared once, in ``EngineConfig``, with vLLM's names where both have
the option; this module only adds help text and choices, so ``serve``, ``generate`` and ``bench`` show the
same flags with the same defaults (as nano-vllm derives its options from its config).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from ..config.checkpoint_layout import QUANTIZATIONS
from .engine_config import INT8_KERNELS, EngineConfig
from .threads import default_threads

# Fields that are not user options: the positional model, and knobs tests set directly.
HIDDEN = frozenset({"model", "num_pages", "fake_quant", "compile_backend"})

CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("float32", "bfloat16", "float16"),
    "device": ("auto", "cpu", "cuda"),
    "cache_dtype": ("packed", "float"),
    "prefix_replay": ("exact", "window"),
    "quantization": QUANTIZATIONS,
    "int8_kernel": INT8_KERNELS,
    "expert_cache_policy": ("lru", "lfu"),
}

HELP = {
    "tokenizer": "folder holding the tokenizer.json to use (default: the model's own)",
    "dtype": "compute dtype of weights and activations",
    "device": "auto picks CUDA when present, else the CPU",
    "max_num_seqs": "most sequences decoded together in one step",
    "max_num_batched_tokens": "most tokens (prompt chunks + decodes) in one step",
    "kv_memory": "memory for the global KV pages, e.g. 512MiB, 4GiB (must hold one --max-model-len sequence)",
    "cache_dtype": "KV cache layout (default: packed for V4.1, float for V4)",
    "exact_prefill": "run every layer on every prompt row (V4.1; default: encoder-only prefill)",
    "enable_prefix_caching": "reuse the KV pages of a shared prompt prefix",
    "max_model_len": "context limit, prompt + output tokens (default and maximum: the model's limit)",
    "max_waiting": "waiting-queue bound; requests beyond it are refused (HTTP 429)",
    "seed": "engine seed, for requests that carry none",
    "block_size": "tokens per KV page (rounded up to a multiple of every compression ratio)",
    "prefill_chunk": "largest prefill chunk (default: --max-num-batched-tokens)",
    "prefix_replay": "after a prefix-cache hit, rebuild window state exactly or by one window",
    "threads": f"torch intra-op threads (default: $OMP_NUM_THREADS, else one per physical core this process may "
               f"use: {default_threads()} here; a sharded engine divides them among its ranks)",
    "enforce_eager": "decode eagerly instead of through the torch.compile'd step (default: compiled; on the CPU "
                     "the eager step serves while the compiled one is made in the background)",
    "background_compile": "compile the decode step on a thread of its own while serving with the eager step, and "
                          "switch when it is done (default: on the CPU, where a first compile takes minutes; on "
                          "CUDA the step is compiled and its CUDA graphs recorded before serving)",
    "compile_child": "with a background compile, do its work in a child process that builds the same engine and "
                     "saves each compiled graph, which this process loads without tracing (default: when the engine "
                     "loads its own model, without --weight-memory, and compiles with inductor)",
    "compile_cache": "folder where the compiled decode step's kernels are kept for later starts (default: "
                     "$TORCHINDUCTOR_CACHE_DIR, else inductor's folder in the system's temporary one)",
    "cuda_graphs": "on CUDA, replay the compiled decode step as CUDA graphs (no effect on the CPU or with "
                   "--enforce-eager)",
    "tensor_parallel_size": "ranks that split attention heads, the shared expert and the vocabulary (one process "
                            "each; torchrun for several nodes)",
    "enable_expert_parallel": "partition the routed experts over the ranks (otherwise each expert is split by "
                              "width over the TP ranks)",
    "data_parallel_size": "attention data-parallel ranks, each holding whole requests and its own cache "
                          "(needs --enable-expert-parallel)",
    "int8_kernel": "eager int8 products: torch's int8 kernel (aten), float products a chunk of rows at a time "
                   "(chunked), or whichever was faster on this CPU when the engine started (auto)",
    "worker_timeout": "seconds a sharded engine waits on a worker before it stops with an error",
    "startup_timeout": "seconds a sharded engine waits at start-up for its workers to join and load their shards",
    "quantization": "pack float weights at load (int8, fp8, mxfp4; w8a8: int8 weights times activations "
                    "quantized per token) or unpack a packed checkpoint (float); w4a8: MXFP4 experts (as released, "
                    "else packed) times activations rounded to 8 bits a 32-block, llama.cpp's arithmetic, not "
                    "exact; default: as the checkpoint stores them",
    "mmap": "memory-map a checkpoint's safetensors files and use the tensors held as stored where they lie, read "
            "from the disk when first touched (llama.cpp's default); --no-mmap copies every tensor into memory",
    "mlock": "read the weights into RAM and lock them there (llama.cpp's --mlock; limited by ulimit -l)",
    "weight_memory": "resident memory for the weights, e.g. 8GiB: every byte the weights cost the process (mapped "
                     "or copied) and the copies the decode step reads (bf16 head panels; FP8 panels only where "
                     "they fit), KV cache and activations aside; the routed experts and engram rows that do not fit "
                     "stay on disk and are read when used, through a cache of expert slots per layer (each layer "
                     "the same share of its own experts, a drafter's included) and of rows per engram table (decode "
                     "runs eagerly; CPU only); default: every weight held",
    "gpu_experts": "routed experts a MoE layer holds on the GPU (the most used); the others stay in host memory and "
                   "run on the CPU (ktransformers' split; decode runs eagerly); default: every expert on the GPU",
    "expert_cache_policy": "which expert a full layer gives up under --weight-memory: the least recently used (lru) "
                           "or the least used (lfu)",
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "dspark", "num_speculative_tokens": 5}\' '
                          "(methods: ngram, mtp, dspark; see docs/speculative.md), off, or auto (the default: the "
                          "drafter the checkpoint ships, if any)",
}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512MB"``, ``"300k"`` or a byte count -> bytes; argparse reports a bad value by name."""
    from .preflight import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_speculative(text: str) -> dict:
    """``--speculative-config`` JSON -> the dict, checked now so a bad value is reported by name."""
    from ..config import ConfigError
    from .spec_config import AUTO, OFF, SpeculativeConfig

    if text in (AUTO, OFF):
        return text
    try:
        SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    import json

    return json.loads(text)


def _base_type(hint: Any) -> type:
    """``int | None`` -> ``int``; ``str | int`` (sizes) -> ``str``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return str if str in args else args[0]


def add_engine_args(parser: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()) -> None:
    """One flag per user-facing ``EngineConfig`` field, default and type taken from the field (a parser with
    :class:`flashserve.cli_help.HelpFormatter` shows each default once)."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in HIDDEN or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _base_type(hints[f.name])
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": HELP.get(f.name, f.name)}
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.name in ("kv_memory", "weight_memory"):
            kw["type"] = parse_size
        elif f.name == "speculative_config":
            kw["type"], kw["metavar"] = parse_speculative, "JSON"
        else:
            kw["type"] = typ
            if f.name in CHOICES:
                kw["choices"] = CHOICES[f.name]
        group.add_argument(flag, **kw)


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The ``EngineConfig`` the parsed flags describe (fields without a flag keep their defaults)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - HIDDEN
    kw = {n: getattr(args, n) for n in names if hasattr(args, n)}
    return EngineConfig(model=args.model, **{**kw, **overrides})
