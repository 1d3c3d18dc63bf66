"""Named model presets: the real V4 / V4.1 dimensions (for arithmetic and planning) and runnable tiny ones.

Presets are written as ``config.json`` dicts and go through the same parser as checkpoints, so a preset
can never hold a configuration a checkpoint could not. The tiny presets keep every structural feature
of their family (every layer role, hash layers for V4; engram, DSpark, candidate pool for V4.1) at a
size that runs in milliseconds on a CPU.
"""

from __future__ import annotations

from typing import Any

from .engram_primes import engram_table_rows
from .model_config import ModelConfig, config_from_dict

_V41_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
    "quantization_config": {"activation_scheme": "dynamic", "expert_dtype": "fp4", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu",
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": 16000000, "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
        "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True,
    },
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
                      "intermediate_size": 2816, "num_attention_heads": 16, "patch_size": 14,
                      "downsample_ratio": 3, "rope_theta": 10000, "max_image_tokens": 1024,
                      "min_pixels": 295936, "max_wh_ratio": None},
}

_V4_COMMON: dict[str, Any] = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "num_attention_heads": 64, "head_dim": 512,
    "qk_rope_head_dim": 64, "sliding_window": 128, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "num_hash_layers": 3,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
}

_V4_FLASH: dict[str, Any] = {
    **_V4_COMMON, "hidden_size": 4096, "num_hidden_layers": 43, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4],
}

# V4-Pro: dimensions from public model cards (61 layers, 7168 wide, 128 heads, 16 output groups,
# 384 experts of 3072, top-1024 indexer). The exact CSA/HCA order of layers 2-60 is not pinned here;
# we use the V4-Flash pattern (HCA bootstrap, then CSA/HCA alternating), which fixes the KV arithmetic
# to within one layer.
_V4_PRO: dict[str, Any] = {
    **_V4_COMMON, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "o_groups": 16, "o_lora_rank": 1024, "moe_intermediate_size": 3072,
    "n_routed_experts": 384, "index_topk": 1024,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4],
}

_TINY_V41_ENGRAM = {"engram_max_ngram_size": 4, "engram_n_heads": 2, "engram_head_dim": 16,
                    "engram_vocab_size": 1000}

_TINY_V41: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 511,
    "quantization_config": {"activation_scheme": "dynamic", "expert_dtype": "fp4", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
    "text_config": {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 10,
        "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32, "sliding_window": 16,
        # encoder: 2 window-only + 2 ratio-2 groups of 2; decoder: 2 ratio-1 groups of 2 (+3 DSpark zeros)
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8],
        "candidate_source_layer_id": 6, "candidate_topk_blocks": 4, "candidate_block_size": 4,
        "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8,
        "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 4],
        "engram_num_embeddings": engram_table_rows(2, **{
            "max_ngram": 4, "n_heads": 2, "vocab_size": 1000}),
        **_TINY_V41_ENGRAM,
        "engram_compressed_vocab_size": 512, "engram_pad_token_id": 2,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 3,
        "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
    },
    # a two-block tower 32 wide with the released image geometry (14-pixel patches, 3x3 cells, the same
    # min_pixels and span budget), so span lengths are the real model's and a ViT pass stays cheap on a CPU
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 32,
                      "intermediate_size": 48, "num_attention_heads": 2, "patch_size": 14,
                      "downsample_ratio": 3, "rope_theta": 10000, "max_image_tokens": 1024,
                      "min_pixels": 295936, "max_wh_ratio": None},
}

_TINY_V4: dict[str, Any] = {
    "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 8,
    "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32,
    "o_groups": 2, "o_lora_rank": 32, "sliding_window": 16,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0],
    "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "num_hash_layers": 2, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 4096,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "quantization_config": {"activation_scheme": "dynamic", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [32, 32]},
}

PRESET_JSON: dict[str, dict[str, Any]] = {
    "deepseek-v41-flash": _V41_FLASH,
    "deepseek-v4-flash": _V4_FLASH,
    "deepseek-v4-pro": _V4_PRO,
    "tiny-v41": _TINY_V41,
    "tiny-v4": _TINY_V4,
}
RUNNABLE_PRESETS = ("tiny-v4", "tiny-v41")


def preset_json(name: str) -> dict[str, Any]:
    """A fresh copy of a preset's config.json dict."""
    import copy

    if name not in PRESET_JSON:
        raise KeyError(name)
    return copy.deepcopy(PRESET_JSON[name])


def preset_config(name: str) -> ModelConfig:
    """The parsed :class:`ModelConfig` of a named preset."""
    return config_from_dict(preset_json(name))


# what says which layer does what (V4.1): the fields :func:`with_layout` copies
LAYOUT_FIELDS = ("num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                 "candidate_source_layer_id", "engram_layer_ids")


def with_layout(name: str, layout_of: str) -> dict[str, Any]:
    """Preset ``name``'s config.json dict with the layers of preset ``layout_of`` (how many, and each one's role):
    ``with_layout("tiny-v41", "deepseek-v41-flash")`` is ``tiny-v41``'s sizes in the real model's 40 layers. Both
    must be V4.1 presets with as many engram layers (their table sizes stay ``name``'s)."""
    raw, src = preset_json(name), preset_json(layout_of)
    text, layout = raw["text_config"], src["text_config"]
    if len(text["engram_layer_ids"]) != len(layout["engram_layer_ids"]):
        raise ValueError(f"{name} and {layout_of} have different numbers of engram layers")
    text.update({k: layout[k] for k in LAYOUT_FIELDS})
    return raw
