"""``load_model``: a preset with seeded random weights, or a checkpoint folder in either naming scheme."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig, load_config
from ..config.presets import PRESET_JSON, RUNNABLE_PRESETS
from .init import random_init
from .transformer import Transformer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` from ``"float32"``/``"fp32"``/``torch.float32``; a clear error otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# Parameters the checkpoint stores in fp32 and the model applies in fp32 whatever the compute dtype
# (docs/architecture.md#numerics-and-quantisation-points): mHC coefficients, attention sinks, router biases, V4
# compressor position biases.
_FP32_LEAVES = ("_fn", "_base", "_scale", "attn_sink", "bias", "bias_vl", "ape")


def keep_fp32(model: torch.nn.Module) -> None:
    """Return the always-fp32 parameters to fp32 after a cast of the whole model."""
    for name, p in model.named_parameters():
        if name.startswith(("vision.", "aligner.")):  # the vision path is BF16 throughout, biases included
            continue
        if name.rsplit(".", 1)[-1].endswith(_FP32_LEAVES) and p.dtype != torch.float64:
            p.data = p.data.float()


def _slotted_experts(model: Transformer, budget: int) -> int | None:
    """Slots per layer for the routed experts under a resident budget of ``budget`` bytes for the weights (the
    other weights held whole), None when every expert fits; on the still-empty ``meta`` model, whose experts are
    cut to that many slots. Raises ConfigError when not even the router's top-k fit."""
    from .moe import MoE
    from .packed import PackedExperts, PackedWeights

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return None
    ex = layers[0].experts
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    every = sum(t.numel() * t.element_size() for t in tensors.values())
    per_expert = sum(t.numel() * t.element_size() for m in layers for t in
                     list(m.experts.parameters()) + list(m.experts.buffers()) if t.dim() >= 3) // ex.n_experts
    other = every - per_expert * ex.n_experts
    top_k = max(m.gate.top_k for m in layers)
    slots = (budget - other) // per_expert if budget > other else 0
    if slots < top_k:
        need = other + per_expert * top_k
        raise ConfigError(f"weight memory {budget} bytes cannot hold this model: its weights other than the routed "
                          f"experts take {other} bytes, and each of its {len(layers)} MoE layers needs at least "
                          f"{top_k} experts' slots ({per_expert // len(layers)} bytes an expert); give at least "
                          f"{need} bytes ({need / 2**30:.2f} GiB)")
    if slots >= ex.n_experts:
        return None
    with torch.device("meta"):
        for m in layers:
            e = m.experts
            if isinstance(e, PackedExperts):
                for name in ("w1", "w2", "w3"):
                    p = getattr(e, f"{name}_packed")
                    setattr(e, f"{name}_packed", PackedWeights((slots, *p.shape[1:]), p.fmt))
            else:
                for name in ("w1", "w2", "w3"):
                    w = getattr(e, name)
                    setattr(e, name, torch.nn.Parameter(torch.empty(slots, *w.shape[1:], dtype=w.dtype)))
            e.n_experts = slots
    return slots


def _attach_expert_caches(model: Transformer, stream: dict, policy: str) -> None:
    """Give every MoE layer of ``model`` (its experts in slots) the cache that streams the others from ``stream``
    (released name -> reader, :func:`flashserve.model.checkpoint.load_checkpoint`)."""
    from .checkpoint import routed_expert
    from .expert_cache import ExpertCache
    from .moe import MoE

    readers: dict[str, dict[int, dict[str, object]]] = {}
    for name, read in stream.items():
        module, expert, proj = routed_expert(name)
        readers.setdefault(module, {}).setdefault(expert, {})[proj] = read
    for path, m in model.named_modules():
        if isinstance(m, MoE):
            n = m.gate.weight.shape[0]
            m.expert_cache = ExpertCache(m.experts, n, readers[f"{path}.experts"], list(range(m.experts.n_experts)),
                                         policy)


def _load_weights(model: Transformer, path: Path, cfg: ModelConfig, strict: bool, mmap: bool,
                  stream: dict | None = None) -> None:
    """Load a checkpoint folder into ``model`` (mapping what it can with ``mmap``; the report is
    ``model.load_report``); drop the drafters and zero ``bias_vl`` where the folder leaves them out (each said
    once in the log)."""
    from .checkpoint import BIAS_VL, DRAFTERS, VISION, LoadReport, load_checkpoint
    from .mapped import MappedFiles

    dest = model.checkpoint_tensors()
    maps = MappedFiles() if mmap else None
    model.load_report = LoadReport()
    omitted = load_checkpoint(dest, path, cfg, strict=strict, maps=maps, report=model.load_report, stream=stream)
    if maps is not None and maps.maps:
        model._mapped_files = maps  # the maps live as long as the model
    if DRAFTERS in omitted:
        model.mtp = None
        log.info("%s has no MTP/DSpark weights: the drafters are disabled", path)
    if VISION in omitted:
        model.drop_vision()
        log.info("%s has no vision tower: it serves text, and requests with images are refused", path)
    if BIAS_VL in omitted:
        with torch.no_grad():
            for name in omitted[BIAS_VL]:
                dest[name].zero_()
        log.info("%s has no router bias_vl: set to zero (only image positions use it)", path)


def _engram_map_from_folder(model: Transformer, path: Path) -> None:
    """Set the engram class map from the folder's tokenizer, so the reference forward hashes as the engine."""
    hasher = model.engram_hasher
    if hasher is not None and hasher.needs_token_map:
        tokenizer_file = path / "tokenizer.json"
        if tokenizer_file.exists():
            from tokenizers import Tokenizer as HFTokenizer

            from .engram import compressed_token_map

            hasher.set_token_map(*compressed_token_map(HFTokenizer.from_file(str(tokenizer_file))))
        else:
            log.warning("%s has no tokenizer.json: engram hashes raw token ids until a tokenizer's class map "
                        "is set (the engine sets it from the tokenizer it loads)", path)


def _formats(path_or_preset: str | Path, is_preset: bool, quantization: str | None, cfg: ModelConfig) -> dict:
    """Module path -> packed format: the asked method's plan, else the checkpoint's tensors as they are stored
    (presets are float)."""
    from .packed import QUANTIZATIONS, plan, plan_as_stored

    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)} "
                              "(or leave it unset to keep a checkpoint's weights as stored)")
        return plan(cfg, quantization)
    if is_preset:
        return {}
    from .checkpoint import packed_dtypes

    return plan_as_stored(cfg, packed_dtypes(path_or_preset))


def load_model(path_or_preset: str | Path, *, dtype: str | torch.dtype = torch.float32, device: str = "cpu",
               fake_quant: bool | None = None, seed: int = 0, with_mtp: bool = True,
               quantization: str | None = None, prepare=None, mmap: bool = True, mlock: bool = False,
               weight_memory: int | None = None, expert_cache_policy: str = "lru") -> Transformer:
    """Build the model for a preset (seeded random weights) or a checkpoint folder (weights loaded).

    ``fake_quant`` switches the QAT quantisation points on (default: on for V4.1, off for V4): V4.1's FP8
    window rows and FP4 main/index rows (docs/architecture.md#numerics-and-quantisation-points); V4's FP8 KV on non-RoPE
    dims and Hadamard+FP4 indexer (spec Appendix A).
    ``quantization``: unset keeps a checkpoint's weights as stored (FP8 blocks and MXFP4 experts stay packed;
    float checkpoints and presets stay float); ``"int8"``, ``"w8a8"``, ``"fp8"`` or ``"mxfp4"`` packs float
    weights at load (see :func:`flashserve.model.packed.plan`); ``"float"`` unpacks everything (the reference
    path).
    Shards are streamed into the model's parameters one tensor at a time; packed weights never exist as floats.
    ``prepare(model)`` (checkpoint folders only) runs on the still-empty ``meta`` model before anything is
    allocated or read: an expert-parallel rank keeps its experts there (``Experts.first``), so only their
    tensors are read from the files (the others are skipped).
    ``mmap`` (checkpoint folders on the CPU; llama.cpp's default, ``--no-mmap`` there and here turns it off): the
    safetensors files are memory-mapped and every tensor whose stored bytes are what the model holds (FP8 blocks
    kept packed, float tensors of the compute dtype, engram tables) is used where it lies, read from the disk when
    first touched, and so are large MXFP4 experts, one matrix an expert (:mod:`flashserve.model.mapped_experts`);
    the rest (decoded or quantized weights, small experts stacked per layer) is copied.
    ``mlock``: the weights' pages are read in and locked in RAM (llama.cpp's ``--mlock``); a failure (the
    ``RLIMIT_MEMLOCK`` limit) is logged and loading goes on. ``model.load_report`` says what was mapped and copied.
    ``weight_memory`` (bytes; checkpoint folders): the weights' resident budget. The weights other than the routed
    experts are held whole; each MoE layer holds as many experts as the rest allows, in slots, and reads the others
    from the files when the router picks them (:mod:`flashserve.model.expert_cache`, evicting by
    ``expert_cache_policy``: "lru" or "lfu"). A budget below the other weights plus top-k experts a layer is
    refused, with the least that would do.
    """
    from .packed import pack_model

    name = str(path_or_preset)
    cfg: ModelConfig = load_config(path_or_preset)
    is_preset = name in PRESET_JSON
    if is_preset and name not in RUNNABLE_PRESETS:
        raise ConfigError(f"preset {name!r} has the real model's dimensions and is for arithmetic and planning "
                         f"only; runnable presets: {', '.join(RUNNABLE_PRESETS)}")
    torch_dtype = resolve_dtype(dtype)
    formats = _formats(path_or_preset, is_preset, quantization, cfg)
    with torch.device("meta"):
        model = Transformer(cfg, with_mtp=with_mtp)
    model.to(torch_dtype)
    keep_fp32(model)  # before any weight is written, so the fp32 leaves are never rounded to ``dtype``
    if weight_memory is not None and is_preset:
        raise ConfigError("weight_memory streams routed experts from a checkpoint folder; a preset has none (its "
                          "weights are drawn in memory)")
    slots = None
    if not is_preset:
        pack_model(model, formats, quantize=False, compute_dtype=torch_dtype)  # still on meta: no float copy
        if prepare is not None:
            prepare(model)
        if weight_memory is not None:
            slots = _slotted_experts(model, weight_memory)
        elif mmap and prepare is None and torch.device(device).type == "cpu":
            from .mapped_experts import use_in_place

            use_in_place(model)  # large MXFP4 experts used where they lie, one matrix an expert
    model = model.to_empty(device=device)
    for module in model.modules():  # buffers computed, never loaded (rope, engram hashing, packed tables)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    if is_preset:
        random_init(model, seed)
        pack_model(model, formats, quantize=True, compute_dtype=torch_dtype)
    else:
        stream = {} if slots is not None else None
        _load_weights(model, Path(path_or_preset), cfg, strict=with_mtp and prepare is None,
                      mmap=mmap and torch.device(device).type == "cpu", stream=stream)
        if stream is not None:
            _attach_expert_caches(model, stream, expert_cache_policy)
            log.info("routed experts streamed from %s: %d of %d experts a layer held (weight memory %.2f GiB), "
                     "evicting the %s", path_or_preset, slots, cfg.n_routed_experts, weight_memory / 2**30,
                     "least recently used" if expert_cache_policy == "lru" else "least used")
        _engram_map_from_folder(model, Path(path_or_preset))
    model.fake_quant = cfg.is_v41 if fake_quant is None else bool(fake_quant)
    if mlock:
        from .mapped import lock_weights

        locked, failed = lock_weights(model)
        if failed:
            log.warning("--mlock: %s; %d bytes locked, the rest may be paged out", failed, locked)
        if hasattr(model, "load_report"):
            model.load_report.locked = locked
    if hasattr(model, "load_report"):
        log.info("%s: %s", name, model.load_report.describe())
    return model.eval()
