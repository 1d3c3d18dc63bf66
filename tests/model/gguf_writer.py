"""Test GGUFs of a DeepSeek-V4 model, written with the ``gguf`` package's GGUFWriter as llama.cpp's converter
(``convert_hf_to_gguf.py``, ``DeepseekV4Model``, llama-cpp-python 0.3.36's vendored copy) writes them: the same
metadata keys and values, tensor names, shapes and types, the routed experts stacked a projection and packed in
ggml's MXFP4 blocks, the hash tables as I32 with the hash layers' ``gate.bias`` dropped, and the vocabulary taken
from ``tokenizer.json`` as its ``get_vocab_base`` takes it. ``scripts/check_gguf_converter.py`` compares a file
written here with the converter's own, tensor by tensor, where the converter is available.

The names and keys below are written out from the converter's source and its output, not taken from flashserve.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from flashserve.config.checkpoint_layout import BF16, FP8, checkpoint_layout

_GLOBAL = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "head.weight": "output.weight",
           "hc_head_fn": "output_hc_fn.weight", "hc_head_base": "output_hc_base.weight",
           "hc_head_scale": "output_hc_scale.weight"}
_LAYER = {
    "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight", "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight", "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight", "attn.wq_b.weight": "attn_q_b.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight", "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight", "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight", "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight", "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight", "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight", "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight", "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}
_EXPERT_PROJ = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}

_LOOKS_SPECIAL = (("<｜", "｜>"), ("<|", "|>"))  # the converter's does_token_look_special


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{_LAYER[rest]}"


def ggml_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The converter's ``repack_mxfp4_blocks``: DeepSeek's MXFP4 (uint8 [rows, cols/2], value 2i in the low nibble;
    E8M0 scale bytes [rows, cols/32]) -> ggml blocks [rows, blocks * 17] (the scale byte, then byte j = value j |
    value j + 16 << 4)."""
    rows, half = packed.shape
    blocks = half * 2 // 32
    src = packed.reshape(rows, blocks, 16)
    values = np.stack((src & 0x0F, src >> 4), axis=-1).reshape(rows, blocks, 32)
    codes = (values[:, :, :16] | (values[:, :, 16:] << 4)).astype(np.uint8)
    return np.concatenate((scale.reshape(rows, blocks, 1), codes), axis=-1).reshape(rows, blocks * 17)


def float_tensors(model) -> dict[str, torch.Tensor]:
    """Released name -> the values ``model`` computes with (packed weights decoded to float32)."""
    from flashserve.model.packed import dequantized_state

    out = {k: v.detach() for k, v in model.checkpoint_tensors().items() if isinstance(v, torch.Tensor)}
    out.update(dequantized_state(model))
    return out


def _vocab(folder: Path, vocab_size: int, gguf) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges as the converter's get_vocab_base / SpecialVocab read tokenizer.json."""
    data = json.loads((folder / "tokenizer.json").read_text())
    reverse = {i: t for t, i in data["model"]["vocab"].items()}
    added = {a["id"]: a for a in data["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            text = added[i]["content"]
            looks = any(text.startswith(a) and text.endswith(b) for a, b in _LOOKS_SPECIAL)
            types.append(gguf.TokenType.CONTROL if added[i]["special"] or looks else gguf.TokenType.USER_DEFINED)
            tokens.append(text)
        elif i in reverse:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def write_gguf(model, folder: Path, out: Path, *, dense: str = "F32", split_max_tensors: int = 0,
               arch: str = "deepseek4", pre: str = "gpt-2") -> list[Path]:
    """``model``'s weights as the converter's GGUF of the released checkpoint in ``folder`` (its tokenizer.json gives
    the vocabulary): float tensors F32 (``dense="Q8_0"``: the weights a released checkpoint stores in block FP8 as
    Q8_0 and its large BF16 matrices BF16, as the converter writes a released checkpoint), routed experts MXFP4.
    ``pre``: the pre-tokenizer's name (the converter's hash of the tokenizer picks it). Returns the files written
    (several with ``split_max_tensors``)."""
    import gguf

    from flashserve.model import quant
    from flashserve.model.packed import PackedSlot

    cfg = model.cfg
    L, a = cfg.num_hidden_layers, arch
    w = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    w.add_string("general.type", "model")
    w.add_string("general.name", folder.name)
    w.add_uint32(f"{a}.block_count", L)
    w.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{a}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", 1)
    if cfg.rope_scaling is not None:
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", cfg.rope_scaling.factor)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", cfg.rope_scaling.original_max_position_embeddings)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", cfg.rope_scaling.beta_fast)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", cfg.rope_scaling.beta_slow)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{a}.expert_count", cfg.n_routed_experts)
    w.add_uint32(f"{a}.expert_used_count", cfg.num_experts_per_tok)
    w.add_uint32(f"{a}.expert_gating_func", 4)  # sqrtsoftplus
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_uint32("general.file_type", 38)  # MOSTLY_MXFP4_MOE
    w.add_uint32(f"{a}.rope.dimension_count", cfg.qk_rope_head_dim)
    w.add_uint32(f"{a}.attention.q_lora_rank", cfg.q_lora_rank)
    w.add_uint32(f"{a}.attention.sliding_window", cfg.sliding_window)
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)
    w.add_uint32(f"{a}.expert_shared_count", cfg.n_shared_experts)
    w.add_float32(f"{a}.expert_weights_scale", cfg.routed_scaling_factor)
    w.add_bool(f"{a}.expert_weights_norm", cfg.norm_topk_prob)
    w.add_array(f"{a}.swiglu_clamp_exp", [float(cfg.swiglu_limit)] * L)
    w.add_array(f"{a}.swiglu_clamp_shexp", [float(cfg.swiglu_limit)] * L)
    w.add_uint32(f"{a}.attention.indexer.head_count", cfg.index_n_heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", cfg.index_head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", cfg.index_topk)
    w.add_uint32(f"{a}.attention.output_group_count", cfg.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", cfg.o_lora_rank)
    w.add_array(f"{a}.attention.compress_ratios", [int(r) for r in cfg.compress_ratios])
    w.add_float32(f"{a}.attention.compress_rope_freq_base", cfg.compress_rope_theta)
    w.add_uint32(f"{a}.hyper_connection.count", cfg.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", cfg.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", cfg.hc_eps)
    w.add_uint32(f"{a}.hash_layer_count", len(cfg.hash_layer_ids))
    w.add_uint32(f"{a}.embedding_length_out", cfg.hidden_size * cfg.hc_mult)
    w.add_uint32("general.quantization_version", 2)
    tokens, types, merges = _vocab(folder, cfg.vocab_size, gguf)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    w.add_uint32("tokenizer.ggml.padding_token_id", cfg.pad_token_id)

    src = float_tensors(model)
    slots = model.checkpoint_tensors()
    kinds = {s.name: s.kind for s in checkpoint_layout(cfg, mtp=False, vision=False)}
    # the converter writes the hash tables and the experts first (its generate_extra_tensors), then the rest
    for layer in cfg.hash_layer_ids:
        w.add_tensor(f"blk.{layer}.ffn_gate_tid2eid.weight",
                     src[f"layers.{layer}.ffn.gate.tid2eid"].to(torch.int32).numpy())
    for layer in range(L):
        for proj in ("w1", "w2", "w3"):
            blocks = []
            for e in range(cfg.n_routed_experts):
                name = f"layers.{layer}.ffn.experts.{e}.{proj}.weight"
                slot = slots[name]
                if isinstance(slot, PackedSlot) and slot.weights.fmt.name == "mxfp4":  # the bytes as stored
                    packed, scale = slot.weights.qweight[slot.index], slot.weights.scale[slot.index]
                else:
                    packed, scale = quant.quantize_mxfp4(src[name].float())
                blocks.append(ggml_mxfp4(packed.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy()))
            w.add_tensor(f"blk.{layer}.{_EXPERT_PROJ[proj]}", np.stack(blocks),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    for name, t in src.items():
        if ".experts." in name or name.endswith("tid2eid"):
            continue
        value = t.float().contiguous().numpy()
        qtype = _stored_type(kinds[name], t.dim(), dense, gguf)
        if qtype is None:
            w.add_tensor(gguf_name(name), value)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n = len(w.tensors)
    return [out] if n == 1 else [out.with_name(f"{out.stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _stored_type(kind: str, dims: int, dense: str, gguf):
    """What the converter stores a released tensor as (None: F32): with ``dense="Q8_0"``, block-FP8 weights as Q8_0
    and BF16 matrices as BF16 (BF16 vectors become F32)."""
    if dense != "Q8_0":
        return None
    if kind == FP8:
        return gguf.GGMLQuantizationType.Q8_0
    if kind == BF16 and dims >= 2:
        return gguf.GGMLQuantizationType.BF16
    return None


def rounded_like(model, dense: str = "Q8_0") -> dict[str, torch.Tensor]:
    """The float values a ``write_gguf(..., dense=dense)`` file holds for each tensor it does not store as F32 (the
    experts aside), by released name: each weight through the ggml format and back (the gguf package's code)."""
    import gguf

    kinds = {s.name: s.kind for s in checkpoint_layout(model.cfg, mtp=False, vision=False)}
    out = {}
    for name, t in float_tensors(model).items():
        if ".experts." in name or name.endswith("tid2eid"):
            continue
        qtype = _stored_type(kinds[name], t.dim(), dense, gguf)
        if qtype is not None:
            value = t.detach().float().contiguous().numpy()
            out[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).copy())
    return out


def write_tiny_gguf(root: Path):
    """tiny-v4 (seeded weights), its checkpoint folder under ``root`` (float32 dense weights, MXFP4 experts,
    tokenizer.json) and the GGUF the converter makes of that folder: (model, folder, GGUF path)."""
    from flashserve.bench.llamacpp import write_peer_checkpoint
    from flashserve.engine.tokenizer import tiny_tokenizer_json
    from flashserve.model.loader import load_model

    model = load_model("tiny-v4", with_mtp=False)
    folder = root / "ckpt"
    write_peer_checkpoint(model, folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    path = root / "tiny-v4.gguf"
    write_gguf(model, folder, path)
    return model, folder, path
