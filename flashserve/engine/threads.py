"""Torch's intra-op threads for the engine (``LLM(..., threads=N)``, ``--threads N``). Torch-free to import,
so the CLI can show the default without loading torch."""

from __future__ import annotations

# One thread: on a shared machine a second thread mostly waits (every parallel region waits for its slowest
# thread, and a descheduled one stalls the whole step; 3-60x slower beside another job on a 2-core machine). A
# machine of one's own can ask for its cores with --threads. Figures: docs/engine-speed.md#threads.
DEFAULT_THREADS = 1


def set_threads(threads: object) -> None:
    """Validate ``threads`` (an integer >= 1) and set torch's intra-op thread count, process-wide (numpy's
    OpenBLAS: one thread, see :func:`flashserve.model.blas.limit_threads`)."""
    from ..config import ConfigError

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads: must be an integer >= 1, got {threads!r}")
    import torch

    from ..model import blas

    torch.set_num_threads(threads)
    blas.limit_threads()  # the single-row products' OpenBLAS (numpy's) runs on one
