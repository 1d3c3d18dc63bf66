"""The :class:`~flashserve.config.ModelConfig` of a ``deepseek4`` GGUF, from the metadata llama.cpp's converter writes.

Every structural number has its key (``deepseek4.attention.q_lora_rank``, ``deepseek4.attention.compress_ratios``,
``deepseek4.hyper_connection.count``, ...); the vocabulary size is the token embedding's row count and the special
token ids come from ``tokenizer.ggml.*_token_id``. GGUF stores floats as float32: each is read back as the shortest
decimal that float32 value prints as (``1e-06``, not ``9.99999997e-07``), which is what a config.json said.

What a GGUF does not carry: the MTP drafter (``num_nextn_predict_layers`` is 0), the released checkpoint's FP8
block size (``quantization_config``: nothing in a GGUF is block FP8), ``gate_temp`` (1.0 in every V4 release).
Like llama.cpp, a compression ratio of 4 is CSA and any other non-zero ratio HCA. Torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config.model_config import ConfigError, ModelConfig, config_from_dict
from .file import GGUFModel

_SQRTSOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
_CSA_RATIO = 4  # llama.cpp's deepseek4 builds a compressor with overlap and an indexer where the ratio is 4


def _f32(value: Any) -> float:
    """A GGUF float32 as the decimal it was written from."""
    return float(str(np.float32(value)))


def _uniform(model: GGUFModel, key: str, values: Any, n_layers: int) -> Any:
    """A per-layer array that flashserve holds as one number: every backbone layer's value must agree."""
    if not isinstance(values, list):
        return values
    layers = values[:n_layers]
    if not layers or any(v != layers[0] for v in layers):
        raise ConfigError(f"{model.path}: {model.architecture}.{key} differs between layers ({values}); flashserve "
                          "takes one value for every layer")
    return layers[0]


def config_from_gguf(model: GGUFModel) -> ModelConfig:
    """Build and validate the model config; a missing key or an unsupported value is a ConfigError naming it."""
    arch = model.architecture

    def need(key: str) -> Any:
        value = model.key(key)
        if value is None:
            raise ConfigError(f"{model.path}: GGUF metadata {arch}.{key} is missing (llama.cpp's {arch} loader needs "
                              "it too)")
        return value

    embed = model.tensors.get("token_embd.weight")
    if embed is None:
        raise ConfigError(f"{model.path}: the GGUF has no token_embd.weight (the vocabulary size is its row count)")
    nextn = int(model.key("nextn_predict_layers", 0) or 0)
    n_layers = int(need("block_count")) - nextn
    ratios = [int(r) for r in need("attention.compress_ratios")]
    if len(ratios) < n_layers:
        raise ConfigError(f"{model.path}: {arch}.attention.compress_ratios has {len(ratios)} entries for "
                          f"{n_layers} layers")
    ratios = ratios[:n_layers]
    heavy = sorted({r for r in ratios if r not in (0, _CSA_RATIO)})
    gating = int(need("expert_gating_func"))
    if gating != _SQRTSOFTPLUS:
        raise ConfigError(f"{model.path}: {arch}.expert_gating_func is {gating}; DeepSeek-V4 routes with "
                          f"sqrtsoftplus ({_SQRTSOFTPLUS})")
    limit = _uniform(model, "swiglu_clamp_exp", need("swiglu_clamp_exp"), n_layers)
    shared_limit = model.key("swiglu_clamp_shexp")
    if shared_limit is not None and _uniform(model, "swiglu_clamp_shexp", shared_limit, n_layers) != limit:
        raise ConfigError(f"{model.path}: {arch}.swiglu_clamp_shexp differs from swiglu_clamp_exp; flashserve clamps "
                          "shared and routed experts alike")
    raw: dict[str, Any] = {
        "model_type": "deepseek_v4",
        "vocab_size": embed.shape[0],
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(need("attention.head_count")),
        "head_dim": int(need("attention.key_length")),
        "qk_rope_head_dim": int(need("rope.dimension_count")),
        "q_lora_rank": int(need("attention.q_lora_rank")),
        "o_groups": int(need("attention.output_group_count")),
        "o_lora_rank": int(need("attention.output_lora_rank")),
        "sliding_window": int(need("attention.sliding_window")),
        "compress_ratios": ratios,
        "compress_rate_csa": _CSA_RATIO,
        "num_hash_layers": int(need("hash_layer_count")),
        "moe_intermediate_size": int(_uniform(model, "expert_feed_forward_length",
                                              need("expert_feed_forward_length"), n_layers)),
        "n_routed_experts": int(need("expert_count")),
        "n_shared_experts": int(need("expert_shared_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "index_n_heads": int(need("attention.indexer.head_count")),
        "index_head_dim": int(need("attention.indexer.key_length")),
        "index_topk": int(need("attention.indexer.top_k")),
        "rope_theta": _f32(need("rope.freq_base")),
        "compress_rope_theta": _f32(need("attention.compress_rope_freq_base")),
        "max_position_embeddings": int(need("context_length")),
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": bool(need("expert_weights_norm")),
        "routed_scaling_factor": _f32(need("expert_weights_scale")),
        "swiglu_limit": _f32(limit),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "hc_mult": int(need("hyper_connection.count")),
        "hc_sinkhorn_iters": int(need("hyper_connection.sinkhorn_iterations")),
        "hc_eps": _f32(need("hyper_connection.epsilon")),
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,  # llama.cpp's deepseek4 needs output.weight; so does flashserve
    }
    if len(heavy) > 1:
        raise ConfigError(f"{model.path}: {arch}.attention.compress_ratios has several heavy ratios {heavy}; "
                          f"DeepSeek-V4 has one besides the CSA ratio {_CSA_RATIO}")
    if heavy:
        raw["compress_rate_hca"] = heavy[0]
    scaling = model.key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "yarn":
            raise ConfigError(f"{model.path}: {arch}.rope.scaling.type {scaling!r} is not supported (only yarn)")
        raw["rope_scaling"] = {
            "rope_type": "yarn", "factor": _f32(need("rope.scaling.factor")),
            "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
            "beta_fast": _f32(model.key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": _f32(model.key("rope.scaling.yarn_beta_slow", 1.0)),
        }
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = model.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            raw[ours] = int(value)
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{model.path}: {exc}") from None
