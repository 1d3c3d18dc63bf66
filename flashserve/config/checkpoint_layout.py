"""The released checkpoint's tensor inventory, derived from a :class:`ModelConfig`
(docs/architecture.md#checkpoint-names).

Every tensor of a released-format checkpoint, with its logical (dequantised) shape, its storage kind and
the part of the model it belongs to. This one list is the contract shared by the model builder (a test
checks the built module has exactly these parameters), the checkpoint reader and writer (expected names,
shapes and formats) and the parameter arithmetic. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .model_config import ModelConfig

# storage kinds
BF16, FP32, FP8, FP4, FP8_TABLE, INT = "bf16", "fp32", "fp8", "fp4", "fp8_table", "int"

# What ``--quantization`` accepts (declared once, here, where no torch is imported): a method that packs float
# weights at load, or ``float`` to unpack a packed checkpoint (flashserve.model.packed.plan says what each packs).
QUANTIZATIONS = ("int8", "w8a8", "fp8", "mxfp4", "w4a8", "float")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: released name, logical shape, storage kind, part of the model, owning layer."""

    name: str
    shape: tuple[int, ...]
    kind: str
    part: str
    layer: int | None = None  # backbone layer index; None for global, MTP/DSpark and vision tensors

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _attention(cfg: ModelConfig, p: str, layer: int | None, ratio: int, role: str) -> Iterator[TensorSpec]:
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    G, r_o, r_q = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    yield TensorSpec(f"{p}attn.attn_sink", (H,), FP32, "attention", layer)
    yield TensorSpec(f"{p}attn.q_norm.weight", (r_q,), BF16, "attention", layer)
    yield TensorSpec(f"{p}attn.kv_norm.weight", (hd,), BF16, "attention", layer)
    yield TensorSpec(f"{p}attn.wq_a.weight", (r_q, D), FP8, "attention", layer)
    yield TensorSpec(f"{p}attn.wq_b.weight", (H * hd, r_q), FP8, "attention", layer)
    yield TensorSpec(f"{p}attn.wkv.weight", (hd, D), FP8, "attention", layer)
    yield TensorSpec(f"{p}attn.wo_a.weight", (G * r_o, H * hd // G), FP8, "attention", layer)
    yield TensorSpec(f"{p}attn.wo_b.weight", (D, G * r_o), FP8, "attention", layer)
    if ratio == 0:
        return
    ihd, nih = cfg.index_head_dim, cfg.index_n_heads
    if cfg.is_v41:
        if role == "full":
            yield TensorSpec(f"{p}attn.compressor.wkv.weight", (hd, D), BF16, "compressor", layer)
            if ratio > 1:
                yield TensorSpec(f"{p}attn.compressor.wgate.weight", (hd, D), BF16, "compressor", layer)
            yield TensorSpec(f"{p}attn.compressor.norm.weight", (hd,), BF16, "compressor", layer)
            yield TensorSpec(f"{p}attn.indexer.wk.weight", (ihd, hd), BF16, "compressor", layer)
            yield TensorSpec(f"{p}attn.indexer.k_norm.weight", (ihd,), BF16, "compressor", layer)
        if role in ("full", "reindex"):
            yield TensorSpec(f"{p}attn.indexer.wq_b.weight", (nih * ihd, r_q), FP8, "indexer", layer)
            yield TensorSpec(f"{p}attn.indexer.weights_proj.weight", (nih, D), BF16, "indexer", layer)
        return
    overlap = 2 if ratio == cfg.compress_rate_csa else 1
    yield TensorSpec(f"{p}attn.compressor.wkv.weight", (overlap * hd, D), BF16, "compressor", layer)
    yield TensorSpec(f"{p}attn.compressor.wgate.weight", (overlap * hd, D), BF16, "compressor", layer)
    yield TensorSpec(f"{p}attn.compressor.ape", (ratio, overlap * hd), FP32, "compressor", layer)
    yield TensorSpec(f"{p}attn.compressor.norm.weight", (hd,), BF16, "compressor", layer)
    if role == "csa":
        yield TensorSpec(f"{p}attn.indexer.compressor.wkv.weight", (2 * ihd, D), BF16, "indexer", layer)
        yield TensorSpec(f"{p}attn.indexer.compressor.wgate.weight", (2 * ihd, D), BF16, "indexer", layer)
        yield TensorSpec(f"{p}attn.indexer.compressor.ape", (ratio, 2 * ihd), FP32, "indexer", layer)
        yield TensorSpec(f"{p}attn.indexer.compressor.norm.weight", (ihd,), BF16, "indexer", layer)
        yield TensorSpec(f"{p}attn.indexer.wq_b.weight", (nih * ihd, r_q), FP8, "indexer", layer)
        yield TensorSpec(f"{p}attn.indexer.weights_proj.weight", (nih, D), BF16, "indexer", layer)


def _moe(cfg: ModelConfig, p: str, layer: int | None, n_experts: int, hash_routed: bool) -> Iterator[TensorSpec]:
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    expert_kind = FP4 if cfg.quantization.expert_dtype == "fp4" else FP8
    yield TensorSpec(f"{p}ffn.gate.weight", (n_experts, D), BF16, "router", layer)
    if hash_routed:
        yield TensorSpec(f"{p}ffn.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), INT, "router", layer)
    else:
        yield TensorSpec(f"{p}ffn.gate.bias", (n_experts,), FP32, "router", layer)
        if cfg.is_v41:
            yield TensorSpec(f"{p}ffn.gate.bias_vl", (n_experts,), FP32, "router", layer)
    for e in range(n_experts):
        yield TensorSpec(f"{p}ffn.experts.{e}.w1.weight", (I, D), expert_kind, "routed_expert", layer)
        yield TensorSpec(f"{p}ffn.experts.{e}.w2.weight", (D, I), expert_kind, "routed_expert", layer)
        yield TensorSpec(f"{p}ffn.experts.{e}.w3.weight", (I, D), expert_kind, "routed_expert", layer)
    Is = I * cfg.n_shared_experts
    if Is:
        yield TensorSpec(f"{p}ffn.shared_experts.w1.weight", (Is, D), FP8, "shared_expert", layer)
        yield TensorSpec(f"{p}ffn.shared_experts.w2.weight", (D, Is), FP8, "shared_expert", layer)
        yield TensorSpec(f"{p}ffn.shared_experts.w3.weight", (Is, D), FP8, "shared_expert", layer)


def _mhc(cfg: ModelConfig, p: str, layer: int | None) -> Iterator[TensorSpec]:
    n, D = cfg.hc_mult, cfg.hidden_size
    for site in ("attn", "ffn"):
        yield TensorSpec(f"{p}hc_{site}_fn", ((2 + n) * n, n * D), FP32, "mhc", layer)
        yield TensorSpec(f"{p}hc_{site}_base", ((2 + n) * n,), FP32, "mhc", layer)
        yield TensorSpec(f"{p}hc_{site}_scale", (3,), FP32, "mhc", layer)


def _hc_head(cfg: ModelConfig, p: str, part: str) -> Iterator[TensorSpec]:
    n, D = cfg.hc_mult, cfg.hidden_size
    yield TensorSpec(f"{p}hc_head_fn", (n, n * D), FP32, part)
    yield TensorSpec(f"{p}hc_head_base", (n,), FP32, part)
    yield TensorSpec(f"{p}hc_head_scale", (1,), FP32, part)


def _block(cfg: ModelConfig, p: str, layer: int | None, ratio: int, role: str, n_experts: int,
           hash_routed: bool) -> Iterator[TensorSpec]:
    D = cfg.hidden_size
    yield TensorSpec(f"{p}attn_norm.weight", (D,), BF16, "norm", layer)
    yield TensorSpec(f"{p}ffn_norm.weight", (D,), BF16, "norm", layer)
    yield from _attention(cfg, p, layer, ratio, role)
    yield from _moe(cfg, p, layer, n_experts, hash_routed)
    yield from _mhc(cfg, p, layer)


def _engram(cfg: ModelConfig, p: str, layer: int, rows: int) -> Iterator[TensorSpec]:
    n, D, ehd = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
    lookups = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    yield TensorSpec(f"{p}engram.embed.weight", (rows, ehd), FP8_TABLE, "engram_table", layer)
    yield TensorSpec(f"{p}engram.wkv.weight", ((n + 1) * D, lookups * ehd), FP8, "engram_dense", layer)
    yield TensorSpec(f"{p}engram.q_weight", (n, D), BF16, "engram_dense", layer)
    yield TensorSpec(f"{p}engram.k_weight", (n, D), BF16, "engram_dense", layer)


def _mtp(cfg: ModelConfig) -> Iterator[TensorSpec]:
    D, V = cfg.hidden_size, cfg.vocab_size
    if cfg.is_v41:
        last = cfg.num_nextn_predict_layers - 1
        for s in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{s}."
            for t in _block(cfg, p, None, 0, "swa", cfg.dspark_n_routed_experts, False):
                yield TensorSpec(t.name, t.shape, t.kind, "dspark")
            if s == 0:
                n_t = len(cfg.dspark_target_layer_ids)
                yield TensorSpec(f"{p}main_proj.weight", (D, n_t * D), FP8, "dspark")
                yield TensorSpec(f"{p}main_norm.weight", (D,), BF16, "dspark")
            if s == last:
                r = cfg.dspark_markov_rank
                yield TensorSpec(f"{p}norm.weight", (D,), BF16, "dspark")
                yield TensorSpec(f"{p}markov_head.embed.weight", (V, r), BF16, "dspark")
                yield TensorSpec(f"{p}markov_head.head.weight", (V, r), BF16, "dspark")
                yield TensorSpec(f"{p}confidence_head.proj.weight", (1, D + r), BF16, "dspark")
        return
    for s in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{s}."
        for t in _block(cfg, p, None, 0, "swa", cfg.n_routed_experts, False):
            yield TensorSpec(t.name, t.shape, t.kind, "mtp")
        yield TensorSpec(f"{p}e_proj.weight", (D, D), FP8, "mtp")
        yield TensorSpec(f"{p}h_proj.weight", (D, D), FP8, "mtp")
        yield TensorSpec(f"{p}enorm.weight", (D,), BF16, "mtp")
        yield TensorSpec(f"{p}hnorm.weight", (D,), BF16, "mtp")
        yield TensorSpec(f"{p}norm.weight", (D,), BF16, "mtp")
        yield from _hc_head(cfg, p, "mtp")


def _vision(cfg: ModelConfig) -> Iterator[TensorSpec]:
    v, D = cfg.vision, cfg.hidden_size
    assert v is not None
    w, patch = v.hidden_size, 3 * v.patch_size * v.patch_size
    k = v.downsample_ratio ** 2
    yield TensorSpec("vision.patch_embed.proj.weight", (w, patch), BF16, "vision")
    yield TensorSpec("vision.patch_embed.proj.bias", (w,), BF16, "vision")
    for b in range(v.num_hidden_layers):
        p = f"vision.blocks.{b}."
        yield TensorSpec(f"{p}attn.wqkv.weight", (3 * w, w), BF16, "vision")
        yield TensorSpec(f"{p}attn.wqkv.bias", (3 * w,), BF16, "vision")
        yield TensorSpec(f"{p}attn.wo.weight", (w, w), BF16, "vision")
        yield TensorSpec(f"{p}attn.wo.bias", (w,), BF16, "vision")
        yield TensorSpec(f"{p}mlp.w1.weight", (2 * v.intermediate_size, w), BF16, "vision")
        yield TensorSpec(f"{p}mlp.w2.weight", (w, v.intermediate_size), BF16, "vision")
        yield TensorSpec(f"{p}norm1.weight", (w,), BF16, "vision")
        yield TensorSpec(f"{p}norm2.weight", (w,), BF16, "vision")
    yield TensorSpec("vision.norm.weight", (w,), BF16, "vision")
    yield TensorSpec("aligner.w1.weight", (D, k * w), BF16, "vision")
    yield TensorSpec("aligner.w1.bias", (D,), BF16, "vision")
    yield TensorSpec("aligner.w2.weight", (D, D), BF16, "vision")
    yield TensorSpec("aligner.w2.bias", (D,), BF16, "vision")
    for name in ("image_start", "image_newline", "image_end"):
        yield TensorSpec(name, (D,), BF16, "vision")


def checkpoint_layout(cfg: ModelConfig, *, mtp: bool = True, vision: bool = True) -> list[TensorSpec]:
    """All tensors of a released-format checkpoint for ``cfg`` (MTP/DSpark and vision optional)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out = [TensorSpec("embed.weight", (V, D), BF16, "embed")]
    engram_rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        out.extend(_block(cfg, p, layer, cfg.compress_ratios[layer], cfg.layer_role(layer), cfg.n_routed_experts,
                          layer in cfg.hash_layer_ids))
        if layer in engram_rows:
            out.extend(_engram(cfg, p, layer, engram_rows[layer]))
    out.append(TensorSpec("norm.weight", (D,), BF16, "norm"))
    out.append(TensorSpec("head.weight", (V, D), BF16, "head"))
    if not cfg.is_v41:
        out.extend(_hc_head(cfg, "", "mhc"))
    if mtp:
        out.extend(_mtp(cfg))
    if vision and cfg.vision is not None:
        out.extend(_vision(cfg))
    return out
