"""Write a :class:`ModelConfig` back out as the released ``config.json`` (pure Python, no torch).

V4.1 gets the composite layout of docs/architecture.md#configuration (root ids + ``quantization_config`` +
``text_config`` +
``vision_config``); V4 gets the flat released V4 keys (legacy ``compress_ratios`` / ``num_hash_layers``) when
they can express the model, else transformers' ``layer_types`` / ``compress_rates`` / ``mlp_layer_types``.
``config_from_dict(config_to_json(cfg)) == cfg`` for every config the parser accepts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .model_config import V41, ModelConfig, QuantizationConfig, RopeScaling

_LEGACY_CSA, _LEGACY_HCA = 4, 128
_V4_TYPE_OF_ROLE = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
                    "hca": "heavily_compressed_attention"}


def _num(x: float) -> int | float:
    """Integral floats as ints (the released files write ``rope_theta: 10000``, ``factor: 16``)."""
    return int(x) if float(x).is_integer() and abs(x) < 2 ** 53 else x


def _rope_scaling(rs: RopeScaling | None) -> dict[str, Any] | None:
    if rs is None:
        return None
    return {"rope_type": "yarn", "factor": _num(rs.factor),
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": _num(rs.beta_fast), "beta_slow": _num(rs.beta_slow)}


def _quantization(q: QuantizationConfig, with_expert_dtype: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"activation_scheme": "dynamic"}
    if with_expert_dtype:
        out["expert_dtype"] = q.expert_dtype
    out.update({"quant_method": "fp8", "scale_fmt": q.scale_fmt,
                "weight_block_size": [q.weight_block_size, q.weight_block_size]})
    return out


def _common_text_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Keys shared by V4 and V4.1 text configs, in released order."""
    out: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "attention_bias": False, "attention_dropout": 0.0,
        "sliding_window": cfg.sliding_window,
    }
    return out


def _rope_and_moe_fields(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "rope_theta": _num(cfg.rope_theta), "compress_rope_theta": _num(cfg.compress_rope_theta),
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = _rope_scaling(cfg.rope_scaling)
    out.update({
        "moe_intermediate_size": cfg.moe_intermediate_size, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "scoring_func": cfg.scoring_func, "topk_method": "noaux_tc", "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "hidden_act": cfg.hidden_act,
    })
    if cfg.gate_temp != 1.0:  # not a released key; written only when it matters
        out["gate_temp"] = cfg.gate_temp
    out.update({"hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
                "rms_norm_eps": cfg.rms_norm_eps})
    return out


def _v41_text_config(cfg: ModelConfig) -> dict[str, Any]:
    text: dict[str, Any] = {"model_type": "deepseek_v41_text", **_common_text_fields(cfg)}
    text["compress_ratios"] = list(cfg.compress_ratios) + [0] * cfg.num_nextn_predict_layers
    text.update({
        "kv_source_layer_ids": list(cfg.kv_source_layer_ids),
        "index_source_layer_ids": list(cfg.index_source_layer_ids),
        "candidate_source_layer_id": cfg.candidate_source_layer_id,
        "candidate_topk_blocks": cfg.candidate_topk_blocks, "candidate_block_size": cfg.candidate_block_size,
    })
    text.update(_rope_and_moe_fields(cfg))
    text.update({
        "engram_layer_ids": list(cfg.engram_layer_ids), "engram_num_embeddings": list(cfg.engram_num_embeddings),
        "engram_max_ngram_size": cfg.engram_max_ngram_size, "engram_n_heads": cfg.engram_n_heads,
        "engram_head_dim": cfg.engram_head_dim, "engram_vocab_size": cfg.engram_vocab_size,
        "engram_compressed_vocab_size": cfg.engram_compressed_vocab_size,
        "engram_pad_token_id": cfg.engram_pad_token_id,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers, "dspark_block_size": cfg.dspark_block_size,
        "dspark_noise_token_id": cfg.dspark_noise_token_id,
        "dspark_target_layer_ids": list(cfg.dspark_target_layer_ids), "dspark_markov_rank": cfg.dspark_markov_rank,
        "dspark_n_routed_experts": cfg.dspark_n_routed_experts,
        "dspark_num_experts_per_tok": cfg.dspark_num_experts_per_tok,
        "initializer_range": 0.02, "tie_word_embeddings": cfg.tie_word_embeddings, "use_cache": True,
    })
    return text


def _vision_config(cfg: ModelConfig) -> dict[str, Any] | None:
    if cfg.vision is None:
        return None
    return {"model_type": "deepseek_v41_vision", **dataclasses.asdict(cfg.vision), "max_wh_ratio": None}


def _v41_config(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": V41,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
    }
    if cfg.image_token_id is not None:
        out["image_token_id"] = cfg.image_token_id
    out["dtype"] = "bfloat16"
    out["quantization_config"] = _quantization(cfg.quantization, with_expert_dtype=True)
    out["text_config"] = _v41_text_config(cfg)
    vision = _vision_config(cfg)
    if vision is not None:
        out["vision_config"] = vision
    return out


def _legacy_v4_layout_ok(cfg: ModelConfig) -> bool:
    """Released V4 keys can express the model: CSA/HCA at 4/128 and hash layers a prefix."""
    hash_prefix = cfg.hash_layer_ids == tuple(range(len(cfg.hash_layer_ids)))
    return hash_prefix and (cfg.compress_rate_csa, cfg.compress_rate_hca) == (_LEGACY_CSA, _LEGACY_HCA)


def _v4_attention_fields(cfg: ModelConfig) -> dict[str, Any]:
    if _legacy_v4_layout_ok(cfg):
        return {"compress_ratios": list(cfg.compress_ratios), "num_hash_layers": len(cfg.hash_layer_ids)}
    hashed = set(cfg.hash_layer_ids)
    return {
        "layer_types": [_V4_TYPE_OF_ROLE[cfg.layer_role(i)] for i in range(cfg.num_hidden_layers)],
        "compress_rates": {"compressed_sparse_attention": cfg.compress_rate_csa,
                           "heavily_compressed_attention": cfg.compress_rate_hca},
        "mlp_layer_types": ["hash_moe" if i in hashed else "moe" for i in range(cfg.num_hidden_layers)],
    }


def _v4_config(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": cfg.model_type}
    out.update(_common_text_fields(cfg))
    out.update(_v4_attention_fields(cfg))
    out.update(_rope_and_moe_fields(cfg))
    out.update({
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "initializer_range": 0.02, "use_cache": True, "dtype": "bfloat16",
        # released V4 files carry no expert_dtype (fp4 is implied); write it only when it differs
        "quantization_config": _quantization(cfg.quantization, cfg.quantization.expert_dtype != "fp4"),
    })
    return out


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """The released ``config.json`` dict of ``cfg`` (V4.1 composite or V4 flat); JSON-serialisable."""
    return _v41_config(cfg) if cfg.is_v41 else _v4_config(cfg)


__all__ = ["config_to_json"]
