"""Parameter and KV-cache arithmetic from a :class:`ModelConfig` (docs/architecture.md#parameter-and-kv-arithmetic), by
the checkpoint inventory.

Counts come from :func:`checkpoint_layout`, the same tensor list the model builder is tested against,
so the figures describe the model we build. Conventions (docs/architecture.md#parameter-and-kv-arithmetic): a parameter
is one logical weight (an FP4 byte holds two); "active" means matmul weights touched per token, LM head included,
embedding rows and engram table rows excluded. Pure Python.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from .checkpoint_layout import INT, checkpoint_layout
from .model_config import ModelConfig


@dataclass(frozen=True)
class KVRecord:
    """Bytes of one packed cache row."""

    main: int  # compressed (global) KV row
    index: int  # index-key row
    window: int  # sliding-window row


def kv_record(cfg: ModelConfig) -> KVRecord:
    """Packed row sizes: V4.1 FP4 main (E4M3 scale / 16), FP4 index (UE8M0 / 32), FP8 window (UE8M0 / 32);
    V4 FP8 rows with bf16 RoPE dims (vLLM's record: nope FP8 + rope bf16 + one scale per 64, padded to 8)."""
    hd, ihd, rope = cfg.head_dim, cfg.index_head_dim, cfg.qk_rope_head_dim
    index = ihd // 2 + -(-ihd // 32)
    if cfg.is_v41:
        return KVRecord(main=hd // 2 + -(-hd // 16), index=index, window=hd + -(-hd // 32))
    v4 = (hd - rope) + 2 * rope + -(-(hd - rope) // 64)
    v4 = -(-v4 // 8) * 8
    return KVRecord(main=v4, index=index, window=v4)


@dataclass(frozen=True)
class ModelArithmetic:
    """Headline numbers of a model (see module docstring for conventions)."""

    params_total: int  # backbone: everything but engram tables, MTP/DSpark and vision
    params_all: int  # backbone + engram tables + MTP/DSpark + vision
    params_active_prefill: int  # per prompt token (V4.1: encoder-only prefill)
    params_active_decode: int  # per generated token
    kv_bytes_per_token: float  # global (compressed + index) cache, packed records
    window_bytes_per_sequence: int  # bounded window rings of every layer, packed
    by_part: dict[str, int] = field(default_factory=dict)
    routed_expert_params: int = 0  # one routed expert
    kv: KVRecord | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Global cache bytes per token: for each KV-owning layer (1/ratio) × (main row + index row if indexed)."""
    rec = kv_record(cfg)
    total = 0.0
    for layer, ratio in enumerate(cfg.compress_ratios):
        if ratio == 0 or cfg.kv_source(layer) != layer:
            continue
        indexed = cfg.is_v41 or ratio == cfg.compress_rate_csa
        total += (rec.main + (rec.index if indexed else 0)) / ratio
    return total


def model_arithmetic(cfg: ModelConfig) -> ModelArithmetic:
    """Count parameters by part and layer, and derive active-per-token figures and KV bytes."""
    layout = checkpoint_layout(cfg)
    by_part: dict[str, int] = defaultdict(int)
    per_layer: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for t in layout:
        if t.kind == INT:  # index tables (hash routing) are not weights
            continue
        by_part[t.part] += t.numel
        if t.layer is not None and t.kind != INT:
            per_layer[t.layer][t.part] += t.numel
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    extra = ("engram_table", "dspark", "mtp", "vision")
    backbone = sum(v for k, v in by_part.items() if k not in extra)

    def layer_active(layer: int) -> int:
        parts = per_layer[layer]
        dense = sum(v for k, v in parts.items() if k not in ("routed_expert", "engram_table"))
        return dense + cfg.num_experts_per_tok * expert

    decode = sum(layer_active(layer) for layer in range(cfg.num_hidden_layers)) + by_part["head"]
    if cfg.is_v41:
        start = cfg.decoder_start
        prefill = sum(layer_active(layer) for layer in range(start))
        if start < cfg.num_hidden_layers:  # the decoder's global-cache producer runs on every prompt row
            src = {t.name: t.numel for t in layout if t.layer == start}
            p = f"layers.{start}."
            prefill += sum(src.get(p + n, 0) for n in (
                "attn_norm.weight", "attn.compressor.wkv.weight", "attn.compressor.wgate.weight",
                "attn.compressor.norm.weight", "attn.indexer.wk.weight", "attn.indexer.k_norm.weight"))
    else:
        prefill = decode - by_part["head"]
    rec = kv_record(cfg)
    return ModelArithmetic(
        params_total=backbone,
        params_all=sum(by_part.values()),
        params_active_prefill=prefill,
        params_active_decode=decode,
        kv_bytes_per_token=kv_bytes_per_token(cfg),
        window_bytes_per_sequence=cfg.num_hidden_layers * cfg.sliding_window * rec.window,
        by_part=dict(by_part),
        routed_expert_params=expert,
        kv=rec,
    )
