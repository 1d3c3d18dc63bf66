"""What loading a checkpoint folder (:mod:`flashserve.model.loader`) and loading a GGUF
(:mod:`flashserve.model.gguf_weights`) share: the compute dtype's name, the always-fp32 parameters, the tensors a
float32 model holds as stored, 8-bit activations for MXFP4 experts, and the split of routed experts with a GPU."""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError
from . import cpu_kernels
from .packed import MXFP4
from .transformer import Transformer

log = logging.getLogger("flashserve.model.loader")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` from ``"float32"``/``"fp32"``/``torch.float32``; a clear error otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# Parameters the checkpoint stores in fp32 and the model applies in fp32 whatever the compute dtype
# (docs/architecture.md#numerics-and-quantisation-points): mHC coefficients, attention sinks, router biases, V4
# compressor position biases.
_FP32_LEAVES = ("_fn", "_base", "_scale", "attn_sink", "bias", "bias_vl", "ape")


def keep_fp32(model: torch.nn.Module) -> None:
    """Return the always-fp32 parameters to fp32 after a cast of the whole model."""
    for name, p in model.named_parameters():
        if name.startswith(("vision.", "aligner.")):  # the vision path is BF16 throughout, biases included
            continue
        if name.rsplit(".", 1)[-1].endswith(_FP32_LEAVES) and p.dtype != torch.float64:
            p.data = p.data.float()


# Float tensors a float32 model on the CPU holds in bfloat16 where a checkpoint stores them so (mapped where they lie,
# or copied as they are): the token embeddings (rows converted as they are gathered) and the LM head (read through
# its bfloat16 panels, blas.make_bf16_panels, by eager and compiled steps alike). Only large ones, which the engine
# gives panels: V4.1-Flash's are 1.3 GB each in bfloat16, and their float32 copies took most of a mapped load.
KEEP_STORED = frozenset({"embed.weight", "head.weight"})
KEEP_STORED_MIN_ELEMENTS = 1 << 24  # blas.BF16_PANEL_MIN_ELEMENTS


def activations_in_8_bits(model: Transformer) -> int:
    """``--quantization w4a8``: every MXFP4 routed-expert module multiplies activations quantized to 8 bits a
    32-block (llama.cpp's Q8_0 rounding) through the CPU kernel; returns how many. Not exact: the products differ
    from the stored weights' by the activations' rounding (about 0.5% of a product's size)."""
    from .mapped_experts import MappedExperts
    from .packed import PackedExperts

    modules = [m for m in model.modules() if isinstance(m, MappedExperts)
               or (isinstance(m, PackedExperts) and m.w1_packed.fmt.name == MXFP4)]
    for m in modules:
        m.int8_activations = True
    if modules and not cpu_kernels.mxfp4_pairs_available():
        log.warning("--quantization w4a8: the CPU kernels are unavailable here, so the experts' products run exact "
                    "(torch's code)")
    return len(modules)


def _hybrid(model: Transformer, gpu_experts: int, device: str) -> Transformer:
    """``model`` (in host memory) with its routed experts split (:func:`flashserve.model.hybrid.hybridize`), its
    engram tables kept in host memory, and the rest on ``device``."""
    from .engram_host import host_engram_tables
    from .hybrid import hybridize

    layers = hybridize(model, gpu_experts)
    tables = host_engram_tables(model)
    with torch.no_grad():  # the device holds its copies in the compute dtype, not as the files store them
        for mod in (model.embed, model.head):
            mod.weight.data = mod.weight.data.to(model.dtype)
    model = model.to(device)
    log.info("routed experts split: %d of %d a layer held on %s in %d MoE layers, the others computed on the host; "
             "engram tables (%.2f GB) in host memory", gpu_experts, model.cfg.n_routed_experts, device, layers,
             tables / 1e9)
    return model
