"""The parallel layout of one deployment, named as vLLM names it: ``tensor_parallel_size`` (TP),
``enable_expert_parallel`` (EP) and ``data_parallel_size`` (attention data parallel, DP).

* world = TP × DP processes (ranks); rank ``r`` is DP rank ``r // TP``, TP rank ``r % TP``.
* Attention, the shared expert, the embedding and the LM head are split over the TP ranks of a DP group
  (query heads / output groups, the shared expert's intermediate width, the vocabulary); everything small
  (mHC, router, norms, compressors, indexer, ``wq_a``, ``wkv``) is replicated.
* Routed experts: with EP, partitioned over every rank (EP size = world, as vLLM's ``--enable-expert-parallel``);
  without it, each expert's intermediate width is split over the TP ranks (TP-MoE).
* DP > 1 (the DeepSeek / SGLang layout): each DP rank holds whole requests and its own cache; only the MoE
  crosses ranks, so it needs EP. With TP > 1 too, each DP group's TP ranks split its attention as above, and
  the group's tokens are dispatched once, by its first TP rank.

Torch-free: validated before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: bool = False
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def ep_size(self) -> int:
        """Ranks the routed experts are partitioned over (1: every rank holds every expert, maybe TP-split)."""
        return self.world if self.ep else 1

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def describe(self) -> str:
        parts = [f"TP={self.tp}"]
        if self.ep:
            parts.append(f"EP={self.ep_size}")
        if self.dp > 1:
            parts.append(f"DP-attention={self.dp}")
        return " ".join(parts) + f" ({self.world} rank{'s' if self.world != 1 else ''})"

    # ------------------------------------------------------------------ validation
    @classmethod
    def from_options(cls, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                     data_parallel_size: int = 1) -> "Layout":
        for name, v in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if data_parallel_size > 1 and not enable_expert_parallel:
            raise ConfigError("data_parallel_size > 1 (attention data parallel) needs enable_expert_parallel: "
                              "only the MoE crosses ranks in that layout")
        return cls(tensor_parallel_size, bool(enable_expert_parallel), data_parallel_size)

    def check(self, cfg) -> None:
        """Every size divides what it splits; a clear error naming both otherwise."""
        tp = self.tp

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"{self.describe()}: {msg}")

        need(cfg.num_attention_heads % tp == 0,
             f"tensor_parallel_size {tp} must divide num_attention_heads ({cfg.num_attention_heads})")
        need(cfg.o_groups % tp == 0, f"tensor_parallel_size {tp} must divide o_groups ({cfg.o_groups})")
        need(cfg.vocab_size % tp == 0, f"tensor_parallel_size {tp} must divide vocab_size ({cfg.vocab_size})")
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        need(shared % tp == 0, f"tensor_parallel_size {tp} must divide the shared expert's width ({shared})")
        if self.ep:
            need(cfg.n_routed_experts % self.ep_size == 0,
                 f"the expert-parallel size {self.ep_size} must divide n_routed_experts ({cfg.n_routed_experts})")
        else:
            need(cfg.moe_intermediate_size % tp == 0,
                 f"tensor_parallel_size {tp} must divide moe_intermediate_size ({cfg.moe_intermediate_size}) "
                 "(or pass enable_expert_parallel to partition whole experts)")


def layout_of(config) -> Layout:
    """The layout an :class:`~flashserve.engine.engine_config.EngineConfig` asks for."""
    return Layout.from_options(getattr(config, "tensor_parallel_size", 1),
                               getattr(config, "enable_expert_parallel", False),
                               getattr(config, "data_parallel_size", 1))


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part ``index`` of ``n`` split evenly in ``parts``."""
    size = n // parts
    return index * size, (index + 1) * size
