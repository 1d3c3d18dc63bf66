"""The one place that decides between an engine in this process and one sharded over several."""

from __future__ import annotations

from ..config.ranks import layout_of
from ..engine.interface import Engine


def create_engine(config) -> Engine:
    """The engine ``config`` describes: :class:`~flashserve.engine.llm_engine.LLMEngine` for one rank,
    :class:`~flashserve.parallel.executor.ShardedEngine` on rank 0 of a sharded layout. A torchrun process of
    rank > 0 serves as a worker and exits when rank 0 stops it. Torch is imported here, not before."""
    if not layout_of(config).sharded:
        from ..engine.llm_engine import LLMEngine

        return LLMEngine(config)
    from ..parallel.executor import ShardedEngine, run_torchrun_worker, torchrun_env

    env = torchrun_env()
    if env is not None and env["rank"] != 0:
        raise SystemExit(run_torchrun_worker(config))
    return ShardedEngine(config)
