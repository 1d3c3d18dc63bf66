"""What the server, ``LLM`` and the benchmarks may use of an engine: :class:`Engine`. ``LLMEngine`` (one
process) and ``ShardedEngine`` (rank 0 of several, :mod:`flashserve.parallel.executor`) both satisfy it, and
nothing above the engine reaches past it (``tests/engine/test_interface.py`` checks both)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..config.model_config import ModelConfig
    from .images import ImageLimits
    from .sampling_params import SamplingParams
    from .sequence import RequestOutput
    from .tokenizer import Tokenizer


@runtime_checkable
class Engine(Protocol):
    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int  # the longest sequence (prompt + output) a request may reach
    image_limits: ImageLimits  # per-request image limits; assigning them sets them on every rank
    reads_images: bool  # the model has a vision tower
    failure: BaseException | None  # why a sharded engine stopped (a worker died); None while it runs
    exit_on_failure: bool  # a server sets it: a failed engine ends the process with status 1

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    images: list | None = None) -> None:
        """Queue a request (a bad one raises RequestError or QueueFullError: the caller's, the engine goes on)."""

    def abort_request(self, request_id: str) -> None:
        """Drop a request now; no further outputs."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One schedule, forward and sampling over every running request: the outputs that moved."""

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for a decode step compiling in the background; whether it is
        compiled (an eager step: False at once)."""

    def stats(self) -> dict:
        """Counters for /metrics and the periodic log (running, waiting, pages, tokens, speculation)."""

    def shutdown(self) -> None:
        """Release what the engine holds beyond this process's memory (a sharded engine's workers)."""
