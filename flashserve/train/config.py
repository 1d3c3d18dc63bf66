"""The embedded default model's config: the tiny-v41 layer pattern (every V4.1 layer role) at a larger size."""

from __future__ import annotations

from typing import Any

from ..config.engram_primes import engram_table_rows
from ..config.presets import preset_json
from .tokenizer import IMAGE_TOKEN_ID, NOISE_TOKEN_ID


def default_config_json(vocab_size: int, compressed_vocab: int, *, hidden: int = 128,
                        window: int = 64) -> dict[str, Any]:
    """config.json dict of the default model.

    Layers as ``tiny-v41``: 0-1 window-only, 2-5 ratio-2 (KV sources 2, 4; index sources 2, 4), 6-9 ratio-1
    decoder (KV source 6 with the candidate pool, index sources 6, 8; 7 and 9 read); engram at 1 and 4; MoE
    with a shared expert everywhere; three DSpark stages reading layers 7, 8, 9. No vision tower.
    """
    cfg = preset_json("tiny-v41")
    cfg.pop("vision_config")
    cfg["image_token_id"] = IMAGE_TOKEN_ID
    engram = {"engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32, "engram_vocab_size": 1024}
    t = cfg["text_config"]
    t.update({
        "vocab_size": vocab_size, "hidden_size": hidden, "num_attention_heads": 4, "head_dim": 64,
        "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64, "sliding_window": window,
        "candidate_topk_blocks": 8, "candidate_block_size": 8, "index_n_heads": 4, "index_head_dim": 32,
        "index_topk": 16, "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        "moe_intermediate_size": 2 * hidden, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        **engram,
        "engram_num_embeddings": engram_table_rows(2, engram["engram_max_ngram_size"], engram["engram_n_heads"],
                                                   engram["engram_vocab_size"]),
        "engram_compressed_vocab_size": compressed_vocab, "engram_pad_token_id": 2,
        "dspark_noise_token_id": NOISE_TOKEN_ID, "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
    })
    return cfg


def v4_config_json(vocab_size: int, *, hidden: int = 128, window: int = 64) -> dict[str, Any]:
    """config.json dict of a small DeepSeek-V4 (non-.1) with one MTP block: the ``tiny-v4`` pattern (window,
    CSA ratio 4, HCA ratio 128, two hash-routed layers) at ``hidden`` wide."""
    cfg = preset_json("tiny-v4")
    cfg.update({
        "vocab_size": vocab_size, "hidden_size": hidden, "num_attention_heads": 4, "head_dim": 64,
        "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64, "sliding_window": window,
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16, "moe_intermediate_size": 2 * hidden,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,
    })
    return cfg
