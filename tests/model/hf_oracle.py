"""Build tiny random transformers ``DeepseekV4ForCausalLM`` checkpoints (the independent V4 oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashserve.bench.hf_reference import randomize_hf_v4


def tiny_hf_v4(path: Path, *, hidden: int, heads: int, head_dim: int, rope: int, layer_types: list[str],
               n_hash: int, o_groups: int, window: int, csa: int = 4, hca: int = 16, experts: int = 8,
               top_k: int = 2, index_topk: int = 8, yarn: bool = False, seed: int = 0):
    """Save a randomly initialised tiny HF V4 model with ``save_pretrained``; return the HF model."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    rope_parameters = None
    if yarn:
        rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "beta_fast": 32.0, "beta_slow": 1.0}
    cfg = DeepseekV4Config(
        vocab_size=256, hidden_size=hidden, moe_intermediate_size=48, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, head_dim=head_dim, partial_rotary_factor=rope / head_dim, q_lora_rank=32,
        num_experts_per_tok=top_k, n_routed_experts=experts, n_shared_experts=1, layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (len(layer_types) - n_hash),
        sliding_window=window, o_groups=o_groups, o_lora_rank=16, index_n_heads=8, index_head_dim=32,
        index_topk=index_topk, max_position_embeddings=4096, rope_parameters=rope_parameters,
        num_nextn_predict_layers=0, pad_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize_hf_v4(DeepseekV4ForCausalLM(cfg).eval(), seed)
    model.save_pretrained(path)
    return model
