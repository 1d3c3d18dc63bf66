"""Per-rank resident bytes of a layout, without the hardware: the model is built on the ``meta`` device by the
same constructors that allocate it, packed as the loader packs it (:func:`flashserve.model.packed.pack_model`),
sharded by :func:`~.shard.shard_model` (rank 0's slices; every rank holds the same sizes), and every parameter
and buffer counted as held. The model is built as each rank's engine builds it
(:func:`~.executor.build_rank_engine`): with the vision tower when the config has one, and with the MTP /
DSpark drafter stack when speculative decoding uses it; both are replicated on every rank and counted on their
own lines, beside the text backbone (what ``flashserve plan`` models). The cache's sizes come from the
engine's own allocation code
(:func:`flashserve.engine.cache.page_size`, :meth:`CacheStorage.allocate` on ``meta``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..config import load_config
from ..config.ranks import Layout

# The vision tower and the drafter stack (replicated on every rank; counted apart from the text backbone)
VISION = ("vision.", "aligner.", "image_")
DRAFTER = ("mtp.",)

# Parameters a TP rank holds a slice of (the rest of the dense model is replicated)
_SPLIT = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".attn.attn_sink", ".shared_experts.")


def is_split(name: str) -> bool:
    """Whether a backbone parameter is split over the TP ranks (routed experts aside)."""
    return name == "embed.weight" or name.startswith("head.") or (
        name.startswith("layers.") and any(k in name for k in _SPLIT))


@dataclass(frozen=True)
class RankMemory:
    layout: str
    ranks: int
    weight_format: str
    routed_expert_bytes: int  # this rank's experts (EP: E / ranks whole experts; TP: every expert's width / TP)
    split_dense_bytes: int  # heads, output groups, shared expert, vocabulary: 1 / TP each
    replicated_dense_bytes: int  # mHC, router, norms, compressors, indexer, wq_a, wkv: whole on every rank
    weight_bytes: int  # the three above: the text backbone's weights on this rank (what the plan models)
    vision_bytes: int  # the vision tower (+ aligner, image marks), replicated: loaded whenever the config has one
    drafter_bytes: int  # the MTP / DSpark stack, replicated: loaded with speculative method "mtp" or "dspark"
    drafter_loaded: bool  # whether the speculative config given loads the drafter (counted in resident bytes)
    resident_weight_bytes: int  # what the rank holds: backbone + vision + (drafter if loaded)
    host_table_bytes: int  # engram tables, host memory, one copy per node (not per rank)
    kv_bytes_per_token: float  # global cache per token on a rank holding the sequence
    kv_replicas: int  # ranks holding each sequence's cache (TP: every rank of the group; V4.1 has one KV head)
    bounded_bytes_per_sequence: int  # window rings, compressor partial groups, engram look-back
    page_tokens: int
    page_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def _formats(model: str, cfg, quantization: str | None) -> tuple[str, dict]:
    from pathlib import Path

    from ..config.presets import PRESET_JSON, RUNNABLE_PRESETS
    from ..model import packed

    if quantization is None:
        if model in PRESET_JSON:  # runnable presets are float; the real-dimension ones describe the release
            quantization = "float" if model in RUNNABLE_PRESETS else "mxfp4"
        else:
            from ..gguf import is_gguf_path

            if is_gguf_path(model):  # a GGUF's MXFP4 experts stay packed, the rest is float
                from ..gguf.file import open_gguf
                from ..model.gguf_weights import stored_formats

                return "as stored", stored_formats(open_gguf(model), cfg)
            from ..model.checkpoint import packed_dtypes

            return "as stored", packed.plan_as_stored(cfg, packed_dtypes(Path(model)))
    return quantization, packed.plan(cfg, quantization)


def rank_memory(model: str, layout: Layout, *, dtype: str = "bfloat16", quantization: str | None = None,
                cache_dtype: str | None = None, block_size: int = 64,
                speculative_config=None) -> RankMemory:
    """``speculative_config`` as the engine's option: with method "mtp" or "dspark" the drafter stack is loaded on
    every rank and counted in ``resident_weight_bytes``; without, ``drafter_bytes`` still says what it would
    add."""
    from ..engine.cache import page_size
    from ..engine.spec_config import SpeculativeConfig
    from ..engine.storage import CacheStorage
    from ..model.loader import keep_fp32, resolve_dtype
    from ..model.packed import E2M1_TABLE, PackedLinear, pack_model
    from ..model.transformer import Transformer
    from .shard import shard_model

    cfg = load_config(model)
    layout.check(cfg)
    fmt_name, formats = _formats(model, cfg, quantization)
    torch_dtype = torch.float64 if dtype in ("float64", "fp64") else resolve_dtype(dtype)
    spec = SpeculativeConfig.parse(speculative_config, model)
    drafter_loaded = bool(spec is not None and spec.method in ("mtp", "dspark") and cfg.num_nextn_predict_layers)
    with torch.device("meta"):
        net = Transformer(cfg, with_mtp=True, with_vision=True)  # the drafter counted apart, loaded or not
    net.to(torch_dtype)
    keep_fp32(net)
    pack_model(net, formats, quantize=False, compute_dtype=torch_dtype)  # as the loader does, still on meta
    shard_model(net, layout, 0, comm=None)
    routed = split_d = repl = host = vision = drafter = 0
    for name, p in list(net.named_parameters()) + list(net.named_buffers()):
        if name.startswith(("rope.", "engram_hasher.")) or name.endswith(E2M1_TABLE):  # computed, 64 bytes each
            continue
        n = p.numel() * p.element_size()
        if name.startswith(VISION):
            vision += n
        elif name.startswith(DRAFTER):
            drafter += n
        elif ".experts.w" in name:
            routed += n
        elif ".engram.embed." in name:
            host += n
        elif is_split(name) and layout.tp > 1:
            split_d += n
        else:
            repl += n
    for name, m in net.named_modules():  # w8a8 on x86: fbgemm's copy of each dense int8 matrix (never split)
        n = m.kernel_bytes() if isinstance(m, PackedLinear) else 0
        if name.startswith(VISION):
            vision += n
        elif name.startswith(DRAFTER):
            drafter += n
        else:
            repl += n
    packed = (cache_dtype or ("packed" if cfg.is_v41 else "float")) == "packed"
    tokens, pbytes = page_size(cfg, block_size, packed, torch.empty((), dtype=torch_dtype).element_size())
    probe = CacheStorage.allocate(cfg, slots=1, num_pages=0, page_tokens=tokens, packed=packed, dtype=torch_dtype,
                                  device=torch.device("meta"))
    return RankMemory(layout=layout.describe(), ranks=layout.world, weight_format=fmt_name,
                      routed_expert_bytes=routed, split_dense_bytes=split_d, replicated_dense_bytes=repl,
                      weight_bytes=routed + split_d + repl, vision_bytes=vision, drafter_bytes=drafter,
                      drafter_loaded=drafter_loaded,
                      resident_weight_bytes=routed + split_d + repl + vision + (drafter if drafter_loaded else 0),
                      host_table_bytes=host,
                      kv_bytes_per_token=pbytes / tokens, kv_replicas=layout.tp,
                      bounded_bytes_per_sequence=probe.bounded_bytes(), page_tokens=tokens, page_bytes=pbytes)
