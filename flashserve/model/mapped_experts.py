"""Routed experts used where they lie in the memory-mapped checkpoint (``load_model(mmap=True)``, the default).

A checkpoint stores each expert's projections as tensors of their own; the stacked experts of
:class:`~flashserve.model.packed.PackedExperts` (one ``[E, N, K/2]`` tensor a projection and layer) must copy them.
:class:`MappedExperts` instead holds one MXFP4 matrix and scale an expert and projection, each a view of the mapped
file, and runs each expert the step routes to through the MXFP4 kernel on its own (``cpu_kernels.mxfp4_gate_up``
and ``mxfp4_pairs`` over a one-expert stack: no copy). Its products are the stacked experts' to the bit (the
kernel's sums of a row do not depend on the other rows of its call); what it costs is a host sync on the routing
and two kernel calls an expert the step uses, small against an expert of the real model's size (18.8 MB) and not
against a small checkpoint's: experts smaller than :data:`MIN_EXPERT_BYTES` are stacked as before. A decode step
over such experts runs eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from . import cpu_kernels, quant
from .expert_cache import expert_caches
from .moe import clamped_swiglu
from .norms import fp32
from .packed import _STORED_FP4, MXFP4, PackedExperts, PackedSlot, encode, packed_shapes

# an expert's three matrices, packed, from this many bytes are used where they lie (smaller ones are stacked)
MIN_EXPERT_BYTES = 4 << 20
NAMES = ("w1", "w2", "w3")


class MappedExperts(nn.Module):
    """Routed MXFP4 experts held one matrix an expert and projection (views of the mapped checkpoint)."""

    int8_activations = False  # as PackedExperts': products on activations quantized to 8 bits (w4a8)

    def __init__(self, src: PackedExperts):
        super().__init__()
        self.n_experts, self.dim, self.inter, self.limit, self.first = (src.n_experts, src.dim, src.inter, src.limit,
                                                                         src.first)
        self.fmt = src.w1_packed.fmt
        self.shapes = {name: getattr(src, f"{name}_packed").shape[1:] for name in NAMES}
        # projection -> [(qweight, scale) of each expert]: filled by the loader (checkpoint names experts.{e}.w*)
        self.matrices: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {
            name: [None] * self.n_experts for name in NAMES}

    def slot(self, e: int, name: str) -> "ExpertMatrix":
        return ExpertMatrix(self, e, name)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ_k w[t,k] · expert_{idx[t,k]}(x_t), each expert hit run on its rows."""
        T, k = idx.shape
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()  # host sync: this module is eager-only
        y = torch.empty(T * k, self.dim, dtype=x.dtype, device=x.device)
        zeros = torch.zeros(T * k, dtype=torch.long)  # each call's expert indices: its one-expert stack's 0
        pos = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[pos:pos + n]
            pos += n
            one = zeros[:n]
            (q1, s1), (q2, s2), (q3, s3) = (self.matrices[name][e] for name in NAMES)
            gate_up = cpu_kernels.mxfp4_gate_up(x[pairs // k], one, q1[None], s1[None], q3[None], s3[None],
                                                self.int8_activations).to(x.dtype)
            act = clamped_swiglu(gate_up[0], gate_up[1], self.limit)
            y[pairs] = cpu_kernels.mxfp4_pairs(act, one, q2[None], s2[None], self.int8_activations).to(x.dtype)
        return (fp32(y).view(T, k, -1) * w[..., None]).sum(1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.n_experts} MXFP4 experts of {self.inter}x{self.dim}, mapped"


class ExpertMatrix(PackedSlot):
    """The loader's destination for one projection of one expert of :class:`MappedExperts`: the stored bytes held
    where they lie (:meth:`adopt`), else a copy of them, or float weights packed."""

    def __init__(self, experts: MappedExperts, e: int, name: str):
        self.experts, self.e, self.name = experts, e, name
        self.weights, self.index = None, e
        self.shape = experts.shapes[name]
        self.dtype = torch.float32
        self.packed_shapes = packed_shapes(self.shape, experts.fmt)

    def accepts(self, stored_dtype: str, row_block: int, col_block: int) -> bool:
        fmt = self.experts.fmt
        return stored_dtype in _STORED_FP4 and (row_block, col_block) == (fmt.row_block, fmt.col_block)

    def _hold(self, q: torch.Tensor, s: torch.Tensor) -> bool:
        if (tuple(q.shape), tuple(s.shape)) != self.packed_shapes or q.element_size() != 1 or s.element_size() != 1:
            return False
        self.experts.matrices[self.name][self.e] = (q.view(torch.uint8), s.view(torch.uint8))
        return True

    def adopt(self, q: torch.Tensor, s: torch.Tensor) -> bool:
        return self._hold(q, s)

    def set_stored(self, q: torch.Tensor, s: torch.Tensor) -> bool:  # the loader's copies, held as they are
        return self._hold(q, s)

    def set_float(self, w: torch.Tensor) -> None:
        q, s = encode(w, self.experts.fmt)
        self._hold(q, s)

    def nbytes(self) -> int:
        (qr, qc), (sr, sc) = self.packed_shapes
        return qr * qc + sr * sc


def use_in_place(model: nn.Module) -> int:
    """On the still-empty ``meta`` model: give every layer of MXFP4 experts whose three matrices take at least
    :data:`MIN_EXPERT_BYTES` an expert :class:`MappedExperts` instead of stacked ones (where this CPU has the MXFP4
    kernel). Returns how many layers."""
    done = 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, PackedExperts) or module.w1_packed.fmt.name != MXFP4:
            continue
        if module.dim % quant.MX_BLOCK or module.inter % quant.MX_BLOCK:
            continue
        per_expert = sum(getattr(module, f"{n}_packed").qweight[0].numel() * 17 // 16 for n in NAMES)
        if per_expert < MIN_EXPERT_BYTES or not cpu_kernels.mxfp4_pairs_available():
            continue
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, MappedExperts(module))
        done += 1
    return done


def eager_only(model: nn.Module) -> str | None:
    """Why ``model``'s layers need an eager step (their routing read on the host), or None."""
    if any(isinstance(m, MappedExperts) for m in model.modules()):
        return "routed experts used where they lie in the mapped checkpoint"
    if expert_caches(model):
        return "routed experts streamed under weight_memory"
    if getattr(model, "streamed_rows", None):
        return "engram rows streamed under weight_memory"
    from .hybrid import hybrid_layers

    if hybrid_layers(model):
        return "routed experts split between the GPU and the host (gpu_experts)"
    return None
