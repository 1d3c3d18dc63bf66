"""DeepSeek-V3 / R1 (``model_type: deepseek_v3``) for planning only: MLA attention, dense first layers, MoE.

Most published serving measurements are of V3/R1 671B, so the planner reads their config.json (or the
built-in ``deepseek-v3`` / ``deepseek-r1`` preset, the released 671B dimensions) into :class:`ModelTerms`.
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import PlanError
from .model_terms import DraftTerms, LayerAttention, ModelTerms

# Released DeepSeek-V3 / R1 config.json values (the two share one architecture).
V3_671B: dict[str, Any] = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "num_attention_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "num_nextn_predict_layers": 1, "n_group": 8, "topk_group": 4,
}
V3_PRESETS = {"deepseek-v3": V3_671B, "deepseek-r1": V3_671B}

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
             "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def mla_row_bytes(kv_lora: int, rope: int, kv_dtype: str) -> float:
    """One token's MLA latent in one layer: bf16 (576 × 2); FP8 as FlashMLA's record (latent FP8, 4 fp32
    scales, RoPE part bf16: 656 B); FP4 as 4-bit latent with an E4M3 scale per 16 and a bf16 RoPE part."""
    if kv_dtype == "bf16":
        return 2.0 * (kv_lora + rope)
    if kv_dtype == "fp8":
        return kv_lora + 4 * (kv_lora // 128) + 2 * rope
    return kv_lora / 2 + kv_lora / 16 + 2 * rope


def _get(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"config.{key}", f"must be a positive integer, got {value!r}")
    return value


def v3_terms(cfg: Mapping[str, Any], name: str, kv_dtype: str = "bf16") -> ModelTerms:
    """Reduce a deepseek_v3 config dict to :class:`ModelTerms`."""
    for key in _REQUIRED:
        _get(cfg, key)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, rope, nope, v = cfg["num_attention_heads"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv_lora = cfg["kv_lora_rank"]
    q_lora = cfg.get("q_lora_rank") or 0
    n_dense = int(cfg.get("first_k_dense_replace", 0))
    if not 0 <= n_dense <= n_layers:
        raise PlanError("config.first_k_dense_replace", f"must be within 0..{n_layers}, got {n_dense}")
    n_moe = n_layers - n_dense
    e, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    shared = int(cfg.get("n_shared_experts", 0))
    q_proj = (h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
    attn = q_proj + h * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * h
    expert = 3 * h * inter
    router = e * h
    dense_ffn = 3 * h * cfg["intermediate_size"]
    embed = cfg["vocab_size"] * h
    dense_decode = n_layers * attn + n_dense * dense_ffn + n_moe * (shared * expert + router) + embed  # + head
    dense_total = dense_decode + embed  # embedding table held too
    row = mla_row_bytes(kv_lora, rope, kv_dtype)
    # Absorbed MLA at decode: scores over the 576-wide latent, values over the 512-wide latent, all heads.
    layer = LayerAttention(window=0, window_row_bytes=0.0, ratio=1, topk=0, main_row_bytes=row,
                           heads=heads, qk_dim=kv_lora + rope, v_dim=kv_lora)
    # Prefill runs MLA un-absorbed: per head q·k over nope+rope dims and values of v_head_dim.
    prefill_layer = LayerAttention(window=0, window_row_bytes=0.0, ratio=1, topk=0, main_row_bytes=row,
                                   heads=heads, qk_dim=nope + rope, v_dim=v)
    n_mtp = int(cfg.get("num_nextn_predict_layers", 0))
    draft = DraftTerms(kind="mtp", layers=1, dense_params=attn + shared * expert + router + 2 * h * h + embed,
                       n_experts=e, top_k=k, expert_params=expert, parallel=False, block=max(n_mtp, 1), attention=layer)
    return ModelTerms(
        name=name, family="deepseek_v3", hidden_size=h, n_layers=n_layers, n_moe_layers=n_moe,
        n_experts=e, top_k=k, expert_params=expert,
        dense_params_decode=dense_decode, dense_params_total=dense_total,
        prefill_layers=n_layers, prefill_moe_layers=n_moe, dense_params_prefill=dense_decode - embed,
        params_total=dense_total + n_moe * e * expert, host_params=0, host_row_bytes_per_token=0.0,
        attention=(layer,) * n_layers, prefill_attention=(prefill_layer,) * n_layers,
        kv_bytes_per_token=n_layers * row, state_bytes_per_sequence=0.0, kv_dtype=kv_dtype, draft=draft,
        route_groups=int(cfg.get("n_group") or 1), route_topk_groups=int(cfg.get("topk_group") or 1),
        notes=("MLA latent cache read in full every step (no sparse selection)",
               f"MTP drafter: {n_mtp} released module(s), one sequential pass per drafted token"),
    )
