"""Routed experts used where they lie in the memory-mapped checkpoint (``load_model(mmap=True)``, the default).

A checkpoint stores each expert's projections as tensors of their own; the stacked experts of
:class:`~flashserve.model.packed.PackedExperts` (one ``[E, N, K/2]`` tensor a projection and layer) must copy them.
:class:`MappedExperts` instead holds one MXFP4 matrix and scale an expert and projection, each a view of the mapped
file, and a table of their addresses, which the MXFP4 kernel reads in place of a stacked tensor's rows
(``cpu_kernels.mxfp4_mapped``: the gate and up projections in one call, the down projection in another). Its
products are the stacked experts' to the bit (the same kernel, each row's sums taken in the same order), with no
host sync on the routing, so a compiled step runs them as it runs stacked ones. Experts smaller than
:data:`MIN_EXPERT_BYTES` are stacked as before (a copy of a small checkpoint costs little).
"""

from __future__ import annotations

import torch
from torch import nn

from . import cpu_kernels, quant
from .moe import clamped_swiglu
from .norms import fp32
from .packed import _STORED_FP4, MXFP4, PackedExperts, PackedSlot, decode, encode, packed_shapes

TABLES = ("experts.gate_up_table", "experts.down_table")  # names' ends of the address tables: not checkpoint tensors
# an expert's three matrices, packed, from this many bytes are used where they lie (smaller ones are stacked)
MIN_EXPERT_BYTES = 4 << 20
NAMES = ("w1", "w2", "w3")
# tokens a kernel call: a long prompt's pairs in pieces, so that their products ([2, pairs, inter] float32) stay
# tens of megabytes (each row's sums are the same whatever rows share its call)
PREFILL_TOKENS = 512


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
        # the kernel's tables: the addresses of each expert's bytes and scales, rows (w1 bytes, w1 scales, w3 bytes,
        # w3 scales) and (w2 bytes, w2 scales); 0 until the loader holds the matrix (the kernel refuses a 0)
        device = src.w1_packed.qweight.device
        self.register_buffer("gate_up_table", torch.zeros(4, self.n_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("down_table", torch.zeros(2, self.n_experts, dtype=torch.int64, device=device),
                             persistent=False)

    def reset_buffers(self) -> None:
        """The tables after ``to_empty`` (which leaves them uninitialised): the matrices held so far."""
        for table in (self.gate_up_table, self.down_table):
            if table.device.type != "meta":
                table.zero_()
        for name in NAMES:
            for e, held in enumerate(self.matrices[name]):
                if held is not None:
                    self.hold(e, name, *held)

    def hold(self, e: int, name: str, q: torch.Tensor, s: torch.Tensor) -> None:
        """Expert ``e``'s projection ``name`` is ``q`` (bytes) and ``s`` (scales), used where they lie."""
        self.matrices[name][e] = (q, s)
        table, row = (self.down_table, 0) if name == "w2" else (self.gate_up_table, 0 if name == "w1" else 2)
        if table.device.type != "meta":
            table[row, e], table[row + 1, e] = q.data_ptr(), s.data_ptr()

    def slot(self, e: int, name: str) -> "ExpertMatrix":
        return ExpertMatrix(self, e, name)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ_k w[t,k] · expert_{idx[t,k]}(x_t): two kernel calls over all the pairs, as the stacked experts make."""
        T, k = idx.shape
        if T > PREFILL_TOKENS:
            return torch.cat([self(x[i:i + PREFILL_TOKENS], idx[i:i + PREFILL_TOKENS], w[i:i + PREFILL_TOKENS])
                              for i in range(0, T, PREFILL_TOKENS)])
        if not cpu_kernels.mxfp4_pairs_available():  # refused on this CPU (engine.kernel_check): torch's products
            return self._decoded(x, idx, w)
        flat = idx.flatten()
        a8 = self.int8_activations
        gate_up = cpu_kernels.mxfp4_mapped(x, flat, self.gate_up_table, self.inter, a8).to(x.dtype)  # [2, T*k, inter]
        act = clamped_swiglu(gate_up[0], gate_up[1], self.limit)
        y = cpu_kernels.mxfp4_mapped(act, flat, self.down_table, self.dim, a8)[0].to(x.dtype)  # [T*k, dim]
        return (fp32(y).view(T, k, -1) * w[..., None]).sum(1).to(x.dtype)

    def _decoded(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The same sum over torch's products: each expert the tokens hit decoded (a host sync on the routing, so
        eager steps only: :func:`eager_only`); exact products, also under ``int8_activations``."""
        out = torch.zeros(x.shape[0], self.dim, dtype=torch.float32, device=x.device)
        for e in idx.unique().tolist():
            t, j = (idx == e).nonzero(as_tuple=True)
            w1, w2, w3 = (decode(*self.matrices[n][e], self.fmt, self.shapes[n][1], torch.float32) for n in NAMES)
            h = fp32(x[t])
            y = clamped_swiglu(h @ w1.t(), h @ w3.t(), self.limit) @ w2.t()
            out.index_add_(0, t, y * fp32(w[t, j])[:, None])
        return out.to(x.dtype)

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
        q, s = q.view(torch.uint8), s.view(torch.uint8)
        if not (q.is_contiguous() and s.is_contiguous()):  # the kernel reads each matrix's rows in order
            q, s = q.contiguous(), s.contiguous()
        self.experts.hold(self.e, self.name, q, s)
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
    """Why ``model``'s layers need an eager step (their routing read on the host), or None. Experts and engram
    rows streamed under a weight budget do not: their caches run behind custom operators
    (:mod:`flashserve.model.streamed_ops`) that a compiled step calls."""
    from .hybrid import hybrid_layers

    if hybrid_layers(model):
        return "routed experts split between the GPU and the host (gpu_experts)"
    if not cpu_kernels.mxfp4_pairs_available() and any(isinstance(m, MappedExperts) for m in model.modules()):
        return "mapped MXFP4 experts without their C++ kernel (refused on this CPU)"
    return None
