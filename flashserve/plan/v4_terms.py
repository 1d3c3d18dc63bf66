"""DeepSeek-V4 and V4.1 configurations (from ``flashserve.config``) reduced to :class:`ModelTerms`.

Parameter counts come from the shared checkpoint arithmetic; this module adds what the roofline needs on top:
which cache rows each layer reads per step (window + top-k selected entries + the indexer's scan), the
prefill path (V4.1 runs only the encoder per prompt token) and the drafter.
"""

from __future__ import annotations

from typing import Any

from .errors import PlanError
from .model_terms import DraftTerms, LayerAttention, ModelTerms

# How unevenly V4-Flash's router uses its experts, as a Zipf exponent (model_terms.expert_popularity). Measured
# by JustVugg/colibri issue 864 (gcap0n1, 2026-08-18) from V4-Flash routing counts (43 layers x 256 experts,
# 31,841 selections of chat and benchmark runs): the most used 8 / 16 / 32 / 64 experts of a layer take
# 35.6% / 46.5% / 58.5% / 71.2% of its selections; s = 0.88 gives 35.6 / 46.2 / 57.9 / 70.7% (least squares on
# the log shares). nibor1896/Crow issue 89 measured the same order for the V4-Flash preview (half the
# selections on 8.8% of the experts; s = 0.88 puts half on 8.2%). V4.1 (384 experts) has no published
# curve: it is planned with V4-Flash's exponent, which gives its 10 most used experts of 384 a 35% share, where
# the 0xSero/dsv41-flash-offload README measures 42% for a 10-per-layer GPU cache (recency helps a cache too).
ROUTING_SKEW = 0.88
ROUTING_SKEW_SOURCE = ("V4-Flash's measured routing counts (colibri issue 864): the most used 8/16/32/64 of 256 "
                       "experts take 36/46/59/71% of the selections, a Zipf law of exponent 0.88")


def cache_rows(cfg: Any, kv_dtype: str, native: Any) -> tuple[float, float, float]:
    """(main, index, window) bytes of one cache row in ``kv_dtype``; ``native`` is the checkpoint's record."""
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    if kv_dtype == "bf16":
        return 2.0 * hd, 2.0 * ihd, 2.0 * hd
    if kv_dtype == "fp8":
        # SM100 record: FP8 values + UE8M0 scale per 32; FP8 index row + fp32 scale (docs/architecture.md#kv-cache)
        if cfg.is_v41:
            return hd + hd / 32, ihd + 4.0, float(native.window)
        return float(native.main), float(native.index), float(native.window)
    # fp4: E2M1 + E4M3 scale per 16 for the main row; the window ring stays FP8
    return hd / 2 + hd / 16, float(native.index), float(native.window)


def _layers(cfg: Any, main: float, index: float, window: float, last: int) -> tuple[LayerAttention, ...]:
    """Attention reads of layers ``0..last-1``."""
    idx_flops = 2.0 * cfg.index_n_heads * cfg.index_head_dim
    pool_cap = cfg.candidate_topk_blocks * cfg.candidate_block_size if cfg.is_v41 else 0
    out = []
    for layer in range(last):
        ratio = cfg.compress_ratios[layer]
        src, isrc = cfg.kv_source(layer), cfg.index_source(layer)
        src_ratio = cfg.compress_ratios[src] if src is not None else 0
        scans = isrc == layer  # this layer runs an indexer (V4: every CSA layer; V4.1: index sources)
        capped = cfg.is_v41 and 0 <= cfg.candidate_source_layer_id < layer
        out.append(LayerAttention(
            window=cfg.sliding_window, window_row_bytes=window, ratio=src_ratio,
            topk=cfg.index_topk if isrc is not None else 0, main_row_bytes=main if ratio else 0.0,
            heads=cfg.num_attention_heads, qk_dim=cfg.head_dim, v_dim=cfg.head_dim,
            scan_ratio=src_ratio if scans else 0, scan_cap=pool_cap if (scans and capped) else 0,
            index_row_bytes=index if scans else 0.0, index_flops_per_row=idx_flops if scans else 0.0))
    return tuple(out)


def _kv_per_token(cfg: Any, main: float, index: float) -> float:
    """Persistent bytes per token: each KV-owning layer stores (main + index if indexed) / ratio."""
    total = 0.0
    for layer, ratio in enumerate(cfg.compress_ratios):
        if ratio == 0 or cfg.kv_source(layer) != layer:
            continue
        indexed = cfg.is_v41 or ratio == cfg.compress_rate_csa
        total += (main + (index if indexed else 0.0)) / ratio
    return total


def _draft(cfg: Any, arith: Any, expert: int, head: int, window: float) -> DraftTerms:
    swa = LayerAttention(window=cfg.sliding_window, window_row_bytes=window, ratio=0, topk=0, main_row_bytes=0.0,
                         heads=cfg.num_attention_heads, qk_dim=cfg.head_dim, v_dim=cfg.head_dim)  # window-only stages
    parts = arith.by_part
    if cfg.is_v41 and cfg.num_nextn_predict_layers:
        stages, e, k = cfg.num_nextn_predict_layers, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok
        dense = parts.get("dspark", 0) - stages * e * expert + head
        return DraftTerms(kind="dspark", layers=stages, dense_params=dense, n_experts=e, top_k=k,
                          expert_params=expert, parallel=True, block=cfg.dspark_block_size, attention=swa)
    if parts.get("mtp", 0):
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        n = max(cfg.num_nextn_predict_layers, 1)
        dense = parts["mtp"] // n - e * expert + head
        return DraftTerms(kind="mtp", layers=1, dense_params=dense, n_experts=e, top_k=k,
                          expert_params=expert, parallel=False, block=n, attention=swa)
    return DraftTerms(kind="none", layers=0, dense_params=0, n_experts=1, top_k=0, expert_params=0,
                      parallel=False, block=0)


def v4_terms(cfg: Any, arith: Any, name: str, kv_dtype: str) -> ModelTerms:
    """Reduce a V4 / V4.1 :class:`ModelConfig` and its :class:`ModelArithmetic` to :class:`ModelTerms`."""
    if cfg.model_type not in ("deepseek_v4", "deepseek_v41"):
        raise PlanError("--model", f"model_type {cfg.model_type!r} is not a DeepSeek-V4 family config")
    main, index, window = cache_rows(cfg, kv_dtype, arith.kv)
    n = cfg.num_hidden_layers
    expert = arith.routed_expert_params
    routed_active = n * cfg.num_experts_per_tok * expert
    dense_decode = arith.params_active_decode - routed_active
    head = arith.by_part.get("head", 0)
    prefill_layers = cfg.decoder_start if cfg.is_v41 else n
    dense_prefill = arith.params_active_prefill - prefill_layers * cfg.num_experts_per_tok * expert
    dense_total = arith.params_total - n * cfg.n_routed_experts * expert
    engram_rows = engram_reads = 0.0
    if cfg.engram_layer_ids:
        lookups = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        engram_reads = float(len(cfg.engram_layer_ids) * lookups)
        engram_rows = engram_reads * (cfg.engram_head_dim + cfg.engram_head_dim / 32)
    state = n * cfg.sliding_window * window
    if cfg.is_v41:
        state += cfg.num_nextn_predict_layers * cfg.sliding_window * window  # DSpark stage windows
    notes = ["sparse selection: window rows + top-k global entries per layer, plus the indexer's scan of index rows"]
    if cfg.is_v41:
        notes.append(f"prefill runs only encoder layers 0-{prefill_layers - 1} per prompt token (decoder bounded replay)")
        notes.append("engram tables in host memory; rows gathered per token")
    return ModelTerms(
        name=name, family=cfg.model_type, hidden_size=cfg.hidden_size, n_layers=n, n_moe_layers=n,
        n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, expert_params=expert,
        dense_params_decode=dense_decode, dense_params_total=dense_total,
        prefill_layers=prefill_layers, prefill_moe_layers=prefill_layers, dense_params_prefill=dense_prefill,
        params_total=arith.params_total, host_params=arith.by_part.get("engram_table", 0),
        host_row_bytes_per_token=engram_rows, host_reads_per_token=engram_reads,
        head_params=head, embed_params=arith.by_part.get("embed", 0),
        attention=_layers(cfg, main, index, window, n),
        prefill_attention=_layers(cfg, main, index, window, prefill_layers),
        kv_bytes_per_token=_kv_per_token(cfg, main, index), state_bytes_per_sequence=float(state),
        kv_dtype=kv_dtype, draft=_draft(cfg, arith, expert, head, window), notes=tuple(notes),
        routing_skew=ROUTING_SKEW,
    )
