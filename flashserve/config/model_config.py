"""Typed model configuration for the DeepSeek-V4 family, read from a checkpoint's ``config.json``.

One frozen dataclass, :class:`ModelConfig`, covers DeepSeek-V4 (``model_type`` ``deepseek_v4``) and
DeepSeek-V4.1 (``deepseek_v41``). Field names follow the released ``config.json`` keys so a reader can
match them line by line against docs/architecture.md#configuration. The parser accepts V4.1's composite file
(``text_config`` +
``vision_config``), V4's legacy ``compress_ratios`` / ``num_hash_layers`` and transformers'
``layer_types`` / ``compress_rates`` / ``mlp_layer_types`` / ``rope_parameters``. Structural mistakes raise
:class:`ConfigError` naming the field. Pure Python: no torch here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import UserError
from .engram_primes import engram_table_rows

V4 = "deepseek_v4"
V41 = "deepseek_v41"
MODEL_TYPES = (V4, V41)

# transformers' attention layer types for V4, and their default compression rates.
_V4_LAYER_TYPE_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}

# Keys that carry no structure (bookkeeping, training, generation defaults); ignored when present.
_IGNORED_KEYS = frozenset(
    {
        "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "initializer_range",
        "use_cache", "attention_dropout", "attention_bias", "mlp_bias", "output_router_logits",
        "router_aux_loss_coef", "router_jitter_noise", "aux_loss_alpha", "seq_aux", "ep_size",
        "topk_method", "n_group", "topk_group", "num_key_value_heads", "_name_or_path", "name_or_path",
        "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder", "chunk_size_feed_forward",
        "is_encoder_decoder", "problem_type", "id2label", "label2id", "model_max_length", "pretraining_tp",
        "_attn_implementation", "_attn_implementation_autoset", "generation_config", "use_return_dict",
        "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
        "finetuning_task", "cross_attention_hidden_size", "add_cross_attention", "is_decoder", "pruned_heads",
        "torchscript", "tf_legacy_loss", "use_bfloat16", "chat_template", "intermediate_size",
        "default_theta", "ignore_keys_at_rope_validation", "num_local_experts", "partial_rotary_factor",
    }
)


class ConfigError(UserError):
    """A config.json or preset that cannot describe a model we can build; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters applied to compressed layers' RoPE (no magnitude scale: attention_factor = 1)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantizationConfig:
    """Released checkpoint storage: FP8-E4M3 dense weights in square blocks, experts FP4 or FP8."""

    weight_block_size: int = 128
    expert_dtype: str = "fp4"
    scale_fmt: str = "ue8m0"


@dataclass(frozen=True)
class VisionConfig:
    """The V4.1 vision tower (parsed for arithmetic and planning; not instantiated yet)."""

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936


@dataclass(frozen=True)
class ModelConfig:
    """Every structural number of a V4 / V4.1 model. Built by :func:`config_from_dict` or a preset."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per backbone layer; 0 = window only
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 1048576
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    rms_norm_eps: float = 1e-6
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    # --- V4 only ---
    hash_layer_ids: tuple[int, ...] = ()
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    # --- V4.1 only (CSA2 roles, engram, DSpark, vision) ---
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 0
    engram_pad_token_id: int = 2
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    image_token_id: int | None = None
    vision: VisionConfig | None = None

    # ------------------------------------------------------------------ derived structure
    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    @property
    def shifted_collapse(self) -> bool:
        """V4.1: a block collapses its streams for attention with the ``pre`` weights its predecessor's FFN site
        made, and for its FFN with its own attention site's (the model carries ``pre`` from block to block, and
        the head collapses with the last one); V4 collapses each site with its own weights and ends in a
        hyper-connection head."""
        return self.is_v41

    @property
    def encoder_decoder(self) -> bool:
        """V4.1's causal encoder-decoder: a prompt's layers before :attr:`decoder_start` can run alone, the
        decoder on a bounded replay of the last window (encoder-only prefill)."""
        return self.is_v41 and self.decoder_start < self.num_hidden_layers

    @property
    def image_input(self) -> bool:
        """Whether prompts may hold image positions (V4.1 with an ``image_token_id``)."""
        return self.is_v41 and self.image_token_id is not None

    @property
    def query_head_norm(self) -> bool:
        """V4: each attention head's query is RMS-normalised after ``wq_b`` (V4.1 normalises the latent only)."""
        return not self.is_v41

    @property
    def num_mtp_layers(self) -> int:
        """V4: classic MTP blocks; V4.1: DSpark stages."""
        return self.num_nextn_predict_layers

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressed KV ``layer`` attends to (itself for V4), None for window-only layers."""
        if self.compress_ratios[layer] == 0:
            return None
        if not self.is_v41:
            return layer
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k selection ``layer`` reuses (V4: CSA layers index for themselves)."""
        ratio = self.compress_ratios[layer]
        if ratio == 0:
            return None
        if not self.is_v41:
            return layer if ratio == self.compress_rate_csa else None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def indexed_ratios(self) -> tuple[int, ...]:
        """Compression ratios of the caches an indexer picks top-k entries from (its layer's KV source's),
        ascending; V4's HCA caches (every entry attended) are not among them."""
        L = self.num_hidden_layers
        return tuple(sorted({self.compress_ratios[self.kv_source(i)] for i in range(L) if self.index_source(i) == i}))

    def layer_role(self, layer: int) -> str:
        """``swa``, ``full``, ``reindex`` or ``reuse`` for V4.1; ``swa``, ``csa`` or ``hca`` for V4."""
        ratio = self.compress_ratios[layer]
        if ratio == 0:
            return "swa"
        if not self.is_v41:
            return "csa" if ratio == self.compress_rate_csa else "hca"
        if layer in self.kv_source_layer_ids:
            return "full"
        return "reindex" if layer in self.index_source_layer_ids else "reuse"

    @property
    def decoder_start(self) -> int:
        """First decoder layer of V4.1's causal encoder-decoder (the ratio-1 KV source); L for V4."""
        if not self.is_v41:
            return self.num_hidden_layers
        ones = [s for s in self.kv_source_layer_ids if self.compress_ratios[s] == 1]
        return min(ones) if ones else self.num_hidden_layers

    def to_dict(self) -> dict[str, Any]:
        """A flat dict (V4.1 composite layout is produced by the checkpoint writer)."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- parsing


def _take(raw: dict[str, Any], key: str, default: Any = dataclasses.MISSING) -> Any:
    if key in raw:
        return raw.pop(key)
    if default is dataclasses.MISSING:
        raise ConfigError(f"config field {key!r} is required but missing")
    return default


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"config field {name!r} must be >= {minimum}, got {value}")
    return value


def _int_list(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config field {name!r} must be a list of integers, got {value!r}")
    return tuple(_int(v, f"{name}[{i}]") for i, v in enumerate(value))


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field {name!r} must be a number, got {value!r}")
    return float(value)


def _rope_scaling(value: Any, name: str = "rope_scaling") -> RopeScaling | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"config field {name!r} must be an object or null, got {value!r}")
    kind = value.get("rope_type", value.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise ConfigError(f"config field {name}.rope_type={kind!r} is not supported (only 'yarn')")
    try:
        return RopeScaling(
            factor=_float(value["factor"], f"{name}.factor"),
            original_max_position_embeddings=_int(
                value["original_max_position_embeddings"], f"{name}.original_max_position_embeddings", 1
            ),
            beta_fast=_float(value.get("beta_fast", 32.0), f"{name}.beta_fast"),
            beta_slow=_float(value.get("beta_slow", 1.0), f"{name}.beta_slow"),
        )
    except KeyError as exc:
        raise ConfigError(f"config field {name!r} lacks {exc.args[0]!r}") from None


def _quantization(value: Any) -> QuantizationConfig:
    if not value:
        return QuantizationConfig()
    if not isinstance(value, Mapping):
        raise ConfigError(f"config field 'quantization_config' must be an object, got {value!r}")
    block = value.get("weight_block_size", [128, 128])
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and block[0] == block[1]):
        raise ConfigError(f"config field 'quantization_config.weight_block_size' must be [b, b], got {block!r}")
    expert = value.get("expert_dtype", "fp4")
    if expert not in ("fp4", "fp8"):
        raise ConfigError(f"config field 'quantization_config.expert_dtype' must be 'fp4' or 'fp8', got {expert!r}")
    return QuantizationConfig(weight_block_size=_int(block[0], "quantization_config.weight_block_size", 1),
                              expert_dtype=expert, scale_fmt=str(value.get("scale_fmt", "ue8m0")))


def _vision(value: Any) -> VisionConfig | None:
    if not value:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"config field 'vision_config' must be an object, got {value!r}")
    known = {f.name for f in dataclasses.fields(VisionConfig)}
    kwargs = {}
    for key, val in value.items():
        if key in known:
            kwargs[key] = val
        elif key not in ("model_type", "max_wh_ratio") and key not in _IGNORED_KEYS:
            raise ConfigError(f"unknown field 'vision_config.{key}'")
    return VisionConfig(**kwargs)


def _v4_attention_layout(
    raw: dict[str, Any], n_layers: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]:
    """Compression ratio per layer and hash-routed layers from V4's legacy or transformers-style fields."""
    rates = dict(_V4_LAYER_TYPE_RATIO)
    compress_rates = raw.pop("compress_rates", None)
    if compress_rates:
        for kind, rate in compress_rates.items():
            if kind not in rates or kind == "sliding_attention":
                raise ConfigError(f"unknown layer type {kind!r} in config field 'compress_rates'")
            rates[kind] = _int(rate, f"compress_rates.{kind}", 1)
    for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):
        if legacy in raw:
            rates[kind] = _int(raw.pop(legacy), legacy, 1)
    layer_types = raw.pop("layer_types", None)
    ratios = raw.pop("compress_ratios", None)
    if layer_types is not None:
        bad = [t for t in layer_types if t not in rates]
        if bad:
            raise ConfigError(f"config field 'layer_types' has unknown entries {bad}")
        ratios = tuple(rates[t] for t in layer_types)
    elif ratios is not None:
        ratios = _int_list(ratios, "compress_ratios")
    else:
        raise ConfigError("config needs 'compress_ratios' or 'layer_types' to place the attention types")
    if rates["compressed_sparse_attention"] == rates["heavily_compressed_attention"]:
        raise ConfigError("config field 'compress_rates' gives CSA and HCA the same rate")
    csa, hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
    bad = [r for r in ratios if r not in (0, csa, hca)]
    if bad:
        raise ConfigError(f"config field 'compress_ratios' has ratios {sorted(set(bad))}; V4 allows 0, {csa}, {hca}")
    mlp_types = raw.pop("mlp_layer_types", None)
    n_hash = raw.pop("num_hash_layers", None)
    if mlp_types is not None:
        bad = [t for t in mlp_types if t not in ("hash_moe", "moe")]
        if bad:
            raise ConfigError(f"config field 'mlp_layer_types' has unknown entries {bad}")
        if len(mlp_types) < n_layers:
            raise ConfigError(f"config field 'mlp_layer_types' has {len(mlp_types)} entries for {n_layers} layers")
        hash_ids = tuple(i for i, t in enumerate(mlp_types[:n_layers]) if t == "hash_moe")
    else:
        n_hash = 3 if n_hash is None else _int(n_hash, "num_hash_layers")
        hash_ids = tuple(range(min(n_hash, n_layers)))
    return tuple(ratios), hash_ids, (csa, hca)


def config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    """Parse a ``config.json`` dict (V4 or V4.1, released or transformers-style) into a :class:`ModelConfig`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    raw = dict(data)
    model_type = raw.pop("model_type", None)
    vision = None
    quant = _quantization(raw.pop("quantization_config", None))
    if "text_config" in raw:
        text = raw.pop("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("config field 'text_config' must be an object")
        vision = _vision(raw.pop("vision_config", None))
        outer = raw
        raw = dict(text)
        raw.pop("model_type", None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "tie_word_embeddings"):
            if key in outer and key not in raw:
                raw[key] = outer.pop(key)
            else:
                outer.pop(key, None)
        unknown = sorted(set(outer) - _IGNORED_KEYS)
        if unknown:
            raise ConfigError(f"unknown top-level config fields {unknown}")
    else:
        vision = _vision(raw.pop("vision_config", None))
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"config field 'model_type' must be one of {MODEL_TYPES}, got {model_type!r}")
    is_v41 = model_type == V41

    n_layers = _int(_take(raw, "num_hidden_layers"), "num_hidden_layers", 1)
    head_dim = _int(_take(raw, "head_dim", 512), "head_dim", 2)
    # rope dims: released configs say qk_rope_head_dim; transformers says partial_rotary_factor
    prf = raw.pop("partial_rotary_factor", None)
    rope_dim = raw.pop("qk_rope_head_dim", None)
    if rope_dim is None:
        rope_dim = round(head_dim * prf) if prf is not None else 64
    rope_dim = _int(rope_dim, "qk_rope_head_dim", 2)

    rope_theta = raw.pop("rope_theta", 10000.0)
    compress_rope_theta = raw.pop("compress_rope_theta", 160000.0)
    rope_scaling = _rope_scaling(raw.pop("rope_scaling", None))
    rope_parameters = raw.pop("rope_parameters", None)
    if isinstance(rope_parameters, Mapping) and rope_parameters:
        if isinstance(rope_parameters.get("main"), Mapping):
            rope_theta = rope_parameters["main"].get("rope_theta", rope_theta)
            comp = rope_parameters.get("compress") or {}
            compress_rope_theta = comp.get("rope_theta", compress_rope_theta)
            rope_scaling = _rope_scaling(comp, "rope_parameters.compress")
        else:
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            rope_scaling = _rope_scaling(rope_parameters, "rope_parameters") or rope_scaling

    n_mtp = _int(raw.pop("num_nextn_predict_layers", 0), "num_nextn_predict_layers")
    kwargs: dict[str, Any] = {}
    if is_v41:
        ratios = _int_list(_take(raw, "compress_ratios"), "compress_ratios")
        if len(ratios) not in (n_layers, n_layers + n_mtp):
            raise ConfigError(
                f"config field 'compress_ratios' has {len(ratios)} entries; expected {n_layers} "
                f"(num_hidden_layers) or {n_layers + n_mtp} (+ num_nextn_predict_layers)")
        if any(r != 0 for r in ratios[n_layers:]):
            raise ConfigError("config field 'compress_ratios': DSpark stage entries must be 0 (window only)")
        ratios = ratios[:n_layers]
        bad = sorted({r for r in ratios if r not in (0, 1, 2)})
        if bad:
            raise ConfigError(f"config field 'compress_ratios' has ratios {bad}; V4.1 allows 0, 1, 2")
        if "engram_pad_id" in raw:  # mlx-lm / transformers spelling of the released key
            raw.setdefault("engram_pad_token_id", raw.pop("engram_pad_id"))
        for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "engram_num_embeddings",
                    "dspark_target_layer_ids"):
            kwargs[key] = _int_list(raw.pop(key, ()), key)
        for key in ("candidate_source_layer_id",):
            kwargs[key] = _int(raw.pop(key, -1), key, -1)
        for key in ("candidate_topk_blocks", "candidate_block_size", "engram_max_ngram_size", "engram_n_heads",
                    "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size", "engram_pad_token_id",
                    "dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank", "dspark_n_routed_experts",
                    "dspark_num_experts_per_tok"):
            if key in raw:
                kwargs[key] = _int(raw.pop(key), key)
        if "image_token_id" in raw:
            kwargs["image_token_id"] = raw.pop("image_token_id")
        if "num_hash_layers" in raw and raw.pop("num_hash_layers"):
            raise ConfigError("config field 'num_hash_layers' must be 0 for deepseek_v41 (no hash-routed layers)")
    else:
        ratios, hash_ids, (kwargs["compress_rate_csa"], kwargs["compress_rate_hca"]) = _v4_attention_layout(
            raw, n_layers)
        if len(ratios) not in (n_layers, n_layers + n_mtp) and len(ratios) < n_layers:
            raise ConfigError(f"config field 'compress_ratios' has {len(ratios)} entries for {n_layers} layers")
        if any(r != 0 for r in ratios[n_layers:]):
            raise ConfigError("config field 'compress_ratios': MTP stage entries must be 0")
        ratios = ratios[:n_layers]
        if len(ratios) != n_layers:
            raise ConfigError(f"config field 'compress_ratios' has {len(ratios)} entries for {n_layers} layers")
        kwargs["hash_layer_ids"] = hash_ids

    eos = raw.pop("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0] if eos else 1
    cfg_kwargs = dict(
        model_type=model_type,
        vocab_size=_int(_take(raw, "vocab_size"), "vocab_size", 1),
        hidden_size=_int(_take(raw, "hidden_size"), "hidden_size", 1),
        num_hidden_layers=n_layers,
        num_attention_heads=_int(_take(raw, "num_attention_heads"), "num_attention_heads", 1),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=_int(_take(raw, "q_lora_rank"), "q_lora_rank", 1),
        o_groups=_int(_take(raw, "o_groups"), "o_groups", 1),
        o_lora_rank=_int(_take(raw, "o_lora_rank"), "o_lora_rank", 1),
        sliding_window=_int(_take(raw, "sliding_window", 128), "sliding_window", 1),
        compress_ratios=ratios,
        moe_intermediate_size=_int(_take(raw, "moe_intermediate_size"), "moe_intermediate_size", 1),
        n_routed_experts=_int(_take(raw, "n_routed_experts"), "n_routed_experts", 1),
        n_shared_experts=_int(raw.pop("n_shared_experts", 1), "n_shared_experts"),
        num_experts_per_tok=_int(_take(raw, "num_experts_per_tok"), "num_experts_per_tok", 1),
        index_n_heads=_int(raw.pop("index_n_heads", 64), "index_n_heads", 1),
        index_head_dim=_int(raw.pop("index_head_dim", 128), "index_head_dim", 2),
        index_topk=_int(raw.pop("index_topk", 512), "index_topk", 1),
        rope_theta=_float(rope_theta, "rope_theta"),
        compress_rope_theta=_float(compress_rope_theta, "compress_rope_theta"),
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(raw.pop("max_position_embeddings", 1048576), "max_position_embeddings", 1),
        scoring_func=raw.pop("scoring_func", "sqrtsoftplus"),
        norm_topk_prob=bool(raw.pop("norm_topk_prob", True)),
        routed_scaling_factor=_float(raw.pop("routed_scaling_factor", 1.5), "routed_scaling_factor"),
        swiglu_limit=_float(raw.pop("swiglu_limit", 10.0), "swiglu_limit"),
        gate_temp=_float(raw.pop("gate_temp", 1.0), "gate_temp"),
        rms_norm_eps=_float(raw.pop("rms_norm_eps", 1e-20 if is_v41 else 1e-6), "rms_norm_eps"),
        hc_mult=_int(raw.pop("hc_mult", 4), "hc_mult", 1),
        hc_sinkhorn_iters=_int(raw.pop("hc_sinkhorn_iters", 20), "hc_sinkhorn_iters", 1),
        hc_eps=_float(raw.pop("hc_eps", 1e-6), "hc_eps"),
        hidden_act=raw.pop("hidden_act", "silu"),
        tie_word_embeddings=bool(raw.pop("tie_word_embeddings", False)),
        bos_token_id=_int(raw.pop("bos_token_id", 0) or 0, "bos_token_id"),
        eos_token_id=_int(eos, "eos_token_id"),
        pad_token_id=raw.pop("pad_token_id", None),
        num_nextn_predict_layers=n_mtp,
        quantization=quant,
        vision=vision,
        **kwargs,
    )
    unknown = sorted(set(raw) - _IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"unknown config fields {unknown} for model_type {model_type!r}")
    cfg = ModelConfig(**cfg_kwargs)
    validate(cfg)
    return cfg


def validate(cfg: ModelConfig) -> None:
    """Check cross-field consistency; raise :class:`ConfigError` naming the offending field."""
    L = cfg.num_hidden_layers

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(cfg.scoring_func == "sqrtsoftplus", f"config field 'scoring_func' must be 'sqrtsoftplus', got {cfg.scoring_func!r}")
    need(cfg.hidden_act == "silu", f"config field 'hidden_act' must be 'silu', got {cfg.hidden_act!r}")
    need(cfg.qk_rope_head_dim % 2 == 0 and cfg.qk_rope_head_dim <= cfg.head_dim,
         f"config field 'qk_rope_head_dim' ({cfg.qk_rope_head_dim}) must be even and <= head_dim ({cfg.head_dim})")
    need(cfg.qk_rope_head_dim <= cfg.index_head_dim,
         f"config field 'index_head_dim' ({cfg.index_head_dim}) must be >= qk_rope_head_dim ({cfg.qk_rope_head_dim})")
    need(cfg.num_attention_heads % cfg.o_groups == 0,
         f"config field 'o_groups' ({cfg.o_groups}) must divide num_attention_heads ({cfg.num_attention_heads})")
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts,
         f"config field 'num_experts_per_tok' ({cfg.num_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    need(len(cfg.compress_ratios) == L, f"config field 'compress_ratios' must have {L} backbone entries")
    for name in ("hash_layer_ids", "engram_layer_ids", "dspark_target_layer_ids", "kv_source_layer_ids",
                 "index_source_layer_ids"):
        ids = getattr(cfg, name)
        need(all(0 <= i < L for i in ids), f"config field {name!r} has layer ids outside 0..{L - 1}: {list(ids)}")
        need(list(ids) == sorted(set(ids)), f"config field {name!r} must be strictly increasing: {list(ids)}")
    if not cfg.is_v41:
        return
    ratios = cfg.compress_ratios
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            need(layer not in cfg.kv_source_layer_ids and layer not in cfg.index_source_layer_ids,
                 f"config field 'kv_source_layer_ids'/'index_source_layer_ids': layer {layer} is window-only")
            continue
        srcs = [s for s in cfg.kv_source_layer_ids if s <= layer]
        need(bool(srcs), f"config field 'kv_source_layer_ids': compressed layer {layer} has no KV source at or before it")
        need(ratios[srcs[-1]] == ratio,
             f"config field 'kv_source_layer_ids': layer {layer} (ratio {ratio}) reads source {srcs[-1]} of ratio {ratios[srcs[-1]]}")
        idx = [s for s in cfg.index_source_layer_ids if s <= layer]
        need(bool(idx), f"config field 'index_source_layer_ids': compressed layer {layer} has no index source before it")
        # The config format lets a layer take the top-k of an index source that belongs to another KV source of the
        # same ratio (entry j covers the same tokens in both); the released model never does, and supporting
        # it would give a KV-source layer an indexer role the checkpoint layout does not have. Refuse clearly.
        need(cfg.kv_source(idx[-1]) == srcs[-1],
             f"config field 'index_source_layer_ids': layer {layer} reads the compressed KV of layer {srcs[-1]} "
             f"but the top-k of index source {idx[-1]}, which scores layer {cfg.kv_source(idx[-1])}'s entries; "
             f"flashserve needs each KV source to be its own index source (make layer {srcs[-1]} an index "
             f"source), as in every released checkpoint")
    if cfg.candidate_source_layer_id >= 0:
        need(cfg.candidate_source_layer_id in cfg.index_source_layer_ids,
             "config field 'candidate_source_layer_id' must be one of index_source_layer_ids")
        need(cfg.candidate_block_size >= 1 and cfg.candidate_topk_blocks >= 1,
             "config fields 'candidate_block_size'/'candidate_topk_blocks' must be >= 1")
    need(not cfg.tie_word_embeddings, "config field 'tie_word_embeddings' = true is not supported (the V4 family "
         "ships an untied head)")
    for name in ("image_token_id", "engram_pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, name)
        need(value is None or 0 <= value < cfg.vocab_size,
             f"config field {name!r} ({value}) is outside the vocabulary (0..{cfg.vocab_size - 1})")
    start = cfg.decoder_start
    need(all(s == start for s in cfg.kv_source_layer_ids if s >= start),
         f"config field 'kv_source_layer_ids': decoder layers (>= {start}) must all read layer {start}'s KV")
    need(all(i < start for i in cfg.engram_layer_ids),
         f"config field 'engram_layer_ids' must lie in the encoder (layers < {start})")
    need(len(cfg.engram_num_embeddings) == len(cfg.engram_layer_ids),
         f"config field 'engram_num_embeddings' has {len(cfg.engram_num_embeddings)} entries for "
         f"{len(cfg.engram_layer_ids)} engram layers")
    if cfg.engram_layer_ids:
        need(cfg.engram_max_ngram_size >= 2, "config field 'engram_max_ngram_size' must be >= 2")
        need(cfg.engram_compressed_vocab_size >= 1, "config field 'engram_compressed_vocab_size' must be >= 1")
        rows = engram_table_rows(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                 cfg.engram_vocab_size)
        need(list(cfg.engram_num_embeddings) == rows,
             f"config field 'engram_num_embeddings' {list(cfg.engram_num_embeddings)} does not match the hash "
             f"bucket primes of engram_vocab_size={cfg.engram_vocab_size} (expected {rows})")
    if cfg.num_nextn_predict_layers:
        need(len(cfg.dspark_target_layer_ids) >= 1,
             "config field 'dspark_target_layer_ids' must name the target layers feeding the DSpark stages")
        need(1 <= cfg.dspark_num_experts_per_tok <= cfg.dspark_n_routed_experts,
             "config fields 'dspark_num_experts_per_tok'/'dspark_n_routed_experts' are inconsistent")
        need(0 <= cfg.dspark_noise_token_id < cfg.vocab_size, "config field 'dspark_noise_token_id' is outside the vocabulary")
        need(cfg.dspark_block_size >= 1, "config field 'dspark_block_size' must be >= 1")
        need(cfg.dspark_markov_rank >= 1, "config field 'dspark_markov_rank' must be >= 1")


def read_config_json(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (or a folder holding it); errors name the file and the field."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    """A validated copy of ``cfg`` with some fields changed."""
    new = dataclasses.replace(cfg, **changes)
    validate(new)
    return new
