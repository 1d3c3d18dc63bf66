"""Mixture of experts: sqrtsoftplus router (bias for selection only, ``bias_vl`` on image positions, or a
frozen hash table), clamped SwiGLU experts stacked per layer, and an always-on shared expert
(docs/architecture.md#moe)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.model_config import ModelConfig
from . import blas, modes, streamed_ops
from .modes import COMPILED, COMPILED_CPU
from .norms import fp32


# Gather experts' weights per (token, expert) pair while that copies at most this many bytes.
GATHER_BYTES = 1 << 20
# One grouped matmul while experts average at most this many rows; above it (prefill) a loop of plain
# matmuls is faster on the CPU (measured: 1.5x at 64 rows per expert, 0.56x at 2048).
GROUPED_MM_ROWS = 64
# Every expert on every row (:meth:`Experts._dense`) runs this many bytes of decoded weights at a time, so that a
# packed chunk's decoded copy is still in cache when its products read it (2-3x faster for one layer alone; inside
# a compiled step inductor fuses the chunks' decodes into one kernel and the gain goes). The chunks also bound the
# decoded temporaries whatever the number of experts.
DENSE_CHUNK_BYTES = 6 << 20


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class Gate(nn.Module):
    """Router. ``weight`` [E, D]; ``bias``/``bias_vl`` [E] shift selection only; hash layers use ``tid2eid``."""

    ROW_WEIGHTS = ("weight",)  # multiplied by blas.linear (panel copies: weight_layout)

    def __init__(self, cfg: ModelConfig, n_experts: int, top_k: int, hash_routed: bool):
        super().__init__()
        self.top_k, self.scale, self.temp = top_k, cfg.routed_scaling_factor, cfg.gate_temp
        self.normalize = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n_experts, cfg.hidden_size))
        self.hash_routed = hash_routed
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts))
            self.bias_vl = nn.Parameter(torch.zeros(n_experts)) if cfg.is_v41 else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, image: torch.Tensor | None,
                logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert indices [T, k] and weights [T, k] (fp32) for flat tokens ``x`` [T, D]; ``logits``: ``x`` times
        ``weight`` made already (by a joint product)."""
        if logits is None:
            logits = blas.linear(fp32(x), fp32(self.weight), blas.panels(self, "weight"))
        scores = torch.sqrt(F.softplus(logits / self.temp))
        if self.hash_routed:
            idx = self.tid2eid[ids]
        else:
            bias = fp32(self.bias)
            if self.bias_vl is not None and image is not None:
                bias = torch.where(image[:, None], fp32(self.bias_vl), bias)
            idx = (scores + bias).topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.normalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class Experts(nn.Module):
    """Routed experts stored stacked: ``w1``/``w3`` [E, I, D] (gate/up), ``w2`` [E, D, I] (down).

    Checkpoint names ``experts.{e}.w1.weight`` map to ``w1[e]`` (see :func:`checkpoint_tensors`).
    """

    def __init__(self, n: int, dim: int, inter: int, limit: float):
        super().__init__()
        self.n_experts, self.dim, self.inter, self.limit = n, dim, inter, limit
        self.first = 0  # checkpoint id of expert 0 here (expert parallel: a rank holds experts first..first+n-1)
        self.w1 = nn.Parameter(torch.zeros(n, inter, dim))
        self.w2 = nn.Parameter(torch.zeros(n, dim, inter))
        self.w3 = nn.Parameter(torch.zeros(n, inter, dim))

    def expert_weights(self, name: str, dtype: torch.dtype,
                       index: torch.Tensor | int | slice | None = None) -> torch.Tensor:
        """``w1``/``w2``/``w3`` of every expert, or of the experts ``index`` (packed experts dequantize here)."""
        weights = getattr(self, name)
        return weights if index is None else weights[index]

    def expert_mm(self, name: str, h: torch.Tensor, e: int) -> torch.Tensor:
        """``h @ w[e].T`` for one expert's projection ``name`` (packed experts multiply in their own format)."""
        return h @ self.expert_weights(name, h.dtype, e).t()

    def reads_in_place(self) -> bool:
        """Whether a compiled CPU step multiplies each (row, expert) pair with the expert's weights as stored
        (float here; packed formats say for themselves)."""
        return True

    @modes.per_mode
    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ_k w[t,k] · expert_{idx[t,k]}(x_t)."""
        pairs = idx.numel()
        # gathering pays when experts are rarely shared by several tokens and the copies stay small
        small = pairs * 3 * self.inter * self.dim * x.element_size() <= GATHER_BYTES
        if pairs <= self.n_experts and small:
            return self._gathered(x, idx, w)
        if pairs <= GROUPED_MM_ROWS * self.n_experts and self._grouped_mm_ok(x):
            return self._grouped_mm(x, idx, w)
        return self._grouped(x, idx, w)

    @forward.variant(COMPILED)
    def _forward_compiled(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # fixed shapes, no host sync; the alternative to gathering is every expert on every row (no _grouped_mm
        # traced): gathering is faster even when the copies are large (peers checkpoint, batch 1: 45.0 against
        # 32.6 tok/s)
        if idx.numel() <= self.n_experts:
            return self._gathered(x, idx, w)
        return self._dense(x, idx, w)

    @forward.variant(COMPILED_CPU)
    def _forward_compiled_on_cpu(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.reads_in_place():
            # each pair's product reads its expert in place (the gather fused into the read): rows x top-k
            # products instead of rows x experts. One layer of the peers checkpoint (16 experts, top-4) at 16 rows,
            # 2 threads, median ms: float 1.37 against 3.00 for every expert on every row, int8 0.55 against 1.68
            return self._gathered(x, idx, w)
        return self._forward_compiled(x, idx, w)

    def _dense(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the routing (zero where not picked): a compiled step's path
        off the CPU for batches past :meth:`_gathered` and eager packed experts at a few rows (a compiled CPU step
        gathers every pair instead: :meth:`forward`)."""
        E, dt = self.n_experts, x.dtype
        route = torch.zeros(x.shape[0], E, dtype=w.dtype, device=x.device).scatter_add_(1, idx, w)  # [T,E]
        per = max(1, DENSE_CHUNK_BYTES // (3 * self.inter * self.dim * x.element_size()))  # experts per chunk
        ys = []
        for a in range(0, E, per):
            chunk = slice(a, min(a + per, E))
            h = x.unsqueeze(0).expand(chunk.stop - a, -1, -1)  # [e,T,D]
            gate = torch.bmm(h, self.expert_weights("w1", dt, chunk).transpose(1, 2))
            up = torch.bmm(h, self.expert_weights("w3", dt, chunk).transpose(1, 2))
            down = self.expert_weights("w2", dt, chunk).transpose(1, 2)
            ys.append(torch.bmm(clamped_swiglu(gate, up, self.limit), down))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)  # [E,T,D]
        return torch.einsum("etd,te->td", fp32(y), route).to(x.dtype)

    def _grouped_mm_ok(self, x: torch.Tensor) -> bool:
        """``torch._grouped_mm`` takes fp32/bf16/fp16 on the CPU with 16-byte-aligned rows (CUDA: untested);
        its meta kernel accepts bf16 only, so a compiled forward never asks."""
        inter, dim = self.inter, self.dim
        return (x.device.type == "cpu" and hasattr(torch, "_grouped_mm")
                and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and (dim * x.element_size()) % 16 == 0 and (inter * x.element_size()) % 16 == 0)

    def _by_expert(self, idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, expert) pairs sorted by expert: (token of each pair, its weight, pairs per expert)."""
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        return order // idx.shape[1], w.flatten()[order], torch.bincount(flat, minlength=self.n_experts)

    def _grouped_mm(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Decode-sized batches: pairs sorted by expert, one grouped matmul per projection, no host sync."""
        tokens, weights, counts = self._by_expert(idx, w)
        offs = counts.cumsum(0).to(torch.int32)
        h, dt = x[tokens], x.dtype
        gate = torch._grouped_mm(h, self.expert_weights("w1", dt).transpose(1, 2), offs=offs)
        up = torch._grouped_mm(h, self.expert_weights("w3", dt).transpose(1, 2), offs=offs)
        y = torch._grouped_mm(clamped_swiglu(gate, up, self.limit), self.expert_weights("w2", dt).transpose(1, 2),
                              offs=offs)
        out = torch.zeros(x.shape, dtype=fp32(x[:0]).dtype, device=x.device)
        out.index_add_(0, tokens, fp32(y) * weights[:, None])
        return out.to(x.dtype)

    def _gathered(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Few (token, expert) pairs (decode): gather each pair's weights and batch-multiply, no host sync."""
        T, k = idx.shape
        flat = idx.flatten()
        gate, up = self.gate_up_products(x, idx)
        y = self.pair_products("w2", clamped_swiglu(gate, up, self.limit), flat)
        return (fp32(y).view(T, k, -1) * w[..., None]).sum(1).to(x.dtype)

    def gate_up_products(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ``t``'s row of ``x [T, D]`` by the gate and up projections of its experts ``idx[t]``: two
        [T * k, inter] (pair order: token-major)."""
        T, k = idx.shape
        flat = idx.flatten()
        h = x[:, None, :].expand(T, k, x.shape[-1]).reshape(T * k, x.shape[-1])  # [pairs, D]
        return self.pair_products("w1", h, flat), self.pair_products("w3", h, flat)

    def pair_products(self, name: str, h: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row ``p`` of ``h [pairs, in]`` by projection ``name`` of expert ``experts[p]``: [pairs, out]."""
        return blas.pairs_linear(h, self.expert_weights(name, h.dtype, experts))

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Many pairs (prefill): group tokens by expert and loop over the experts that were hit."""
        out = torch.zeros(x.shape, dtype=fp32(x[:0]).dtype, device=x.device)
        tokens, weights, counts = self._by_expert(idx, w)
        pos = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            t = tokens[pos:pos + n]
            h = x[t]
            y = self.expert_mm("w2", clamped_swiglu(self.expert_mm("w1", h, e), self.expert_mm("w3", h, e), self.limit), e)
            out.index_add_(0, t, fp32(y) * weights[pos:pos + n, None])
            pos += n
        return out.to(x.dtype)


class SharedExpert(nn.Module):
    """The always-on expert (``shared_experts.w1/w2/w3``), clamped like the routed ones."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1 = blas.Linear(dim, inter, bias=False)
        self.w2 = blas.Linear(inter, dim, bias=False)
        self.w3 = blas.Linear(dim, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None,
                up: torch.Tensor | None = None) -> torch.Tensor:
        """``gate``, ``up``: ``x`` times ``w1`` and ``w3`` made already (by a joint product)."""
        gate = self.w1(x) if gate is None else gate
        up = self.w3(x) if up is None else up
        return self.w2(clamped_swiglu(gate, up, self.limit))


class MoE(nn.Module):
    """``ffn``: router + routed experts + shared expert."""

    def __init__(self, cfg: ModelConfig, n_experts: int, top_k: int, hash_routed: bool = False):
        super().__init__()
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg, n_experts, top_k, hash_routed)
        self.experts = Experts(n_experts, D, I, cfg.swiglu_limit)
        self.shared_experts = SharedExpert(D, I * cfg.n_shared_experts, cfg.swiglu_limit) if cfg.n_shared_experts else None
        self.expert_cache = None  # an ExpertCache when the experts are streamed (flashserve/model/expert_cache.py)

    def joint_row_weights(self) -> dict[str, tuple[str, ...]]:
        """The router's and the shared expert's gate and up weights, all multiplied by the rows: one product in a
        compiled step of several rows (blas.joint_products)."""
        shared = ("shared_experts.w1.weight", "shared_experts.w3.weight") if self.shared_experts is not None else ()
        return {"x": ("gate.weight", *shared)}

    def forward(self, x: torch.Tensor, ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        made = blas.joint_products(flat, self, "x")  # the router's and shared gate/up products in one call
        image = None if image is None else image.reshape(-1)
        idx, w = self.gate(flat, ids.reshape(-1), image, made.get("gate.weight"))
        cache = self.expert_cache
        if cache is None:
            y = self.experts(flat, idx, w)
            if self.shared_experts is not None:
                y = y + self.shared_experts(flat, made.get("shared_experts.w1.weight"),
                                            made.get("shared_experts.w3.weight"))
            return y.view(shape)
        # streamed experts (a memory budget): the missing ones are read while the shared expert is computed, behind
        # custom operators a compiled step calls as it calls a kernel (flashserve/model/streamed_ops.py)
        token = streamed_ops.experts_start(idx, flat, ids.reshape(-1), self.cache_key)
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts(flat, made.get("shared_experts.w1.weight"),
                                         made.get("shared_experts.w3.weight"))
        y = streamed_ops.experts_run(flat, idx, w, token, self.cache_key)
        return (y if shared is None else y + shared).view(shape)
