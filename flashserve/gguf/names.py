"""GGUF tensor names of llama.cpp's ``deepseek4`` layout -> DeepSeek's released checkpoint names.

The inverse of llama.cpp's converter (``convert_hf_to_gguf.py``, ``DeepseekV4Model._map_dsv4_tensor_name``, with the
names of ``gguf-py``'s ``TENSOR_NAMES``). What the converter changes besides names:

* the routed experts of a layer are stacked into one tensor a projection (``blk.N.ffn_{gate,down,up}_exps``, shape
  ``[experts, out, in]``), MXFP4 blocks repacked (see :mod:`.weights`);
* the hash layers' ``tid2eid`` is stored as I32 and their unused ``gate.bias`` is dropped (flashserve's hash layers
  have none either);
* the MTP blocks are left out (a separate ``mtp-*.gguf``), and so are the vision tower and its router biases.
Torch-free.
"""

from __future__ import annotations

import re

GLOBAL = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_scale.weight": "hc_head_scale",
}

LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn_fn.weight": "hc_attn_fn",
    "hc_attn_base.weight": "hc_attn_base",
    "hc_attn_scale.weight": "hc_attn_scale",
    "hc_ffn_fn.weight": "hc_ffn_fn",
    "hc_ffn_base.weight": "hc_ffn_base",
    "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
}

EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2", "ffn_up_exps.weight": "w3"}

# in a deepseek4 GGUF, not used by the text model flashserve builds from it: the image routers' biases (the vision
# tower is a separate mmproj file) and the MTP drafter's blocks when a file carries them
SKIPPED_LAYER = ("exp_probs_b_vl.bias",)

_LAYER_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<rest>.+)$")


def released_name(name: str, n_layers: int) -> tuple[str | None, str | None, str]:
    """``(released name, expert projection, kind)`` of a GGUF tensor name: kind ``"tensor"`` (one released tensor),
    ``"experts"`` (a stacked tensor: the released name is the layer's ``...ffn.experts`` prefix and the
    projection ``w1``/``w2``/``w3``), ``"skipped"`` (known, not loaded: drafter blocks, image routing) or
    ``"unknown"``."""
    if name in GLOBAL:
        return GLOBAL[name], None, "tensor"
    m = _LAYER_NAME.match(name)
    if m is None:
        return None, None, "unknown"
    layer, rest = int(m["layer"]), m["rest"]
    if layer >= n_layers or rest.startswith("nextn.") or rest in SKIPPED_LAYER:
        return None, None, "skipped"
    if rest in EXPERTS:
        return f"layers.{layer}.ffn.experts", EXPERTS[rest], "experts"
    if rest in LAYER:
        return f"layers.{layer}.{LAYER[rest]}", None, "tensor"
    return None, None, "unknown"
