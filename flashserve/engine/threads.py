"""Torch's intra-op threads for the engine (``LLM(..., threads=N)``, ``--threads N``). Torch-free to import,
so the CLI can show the default without loading torch."""

from __future__ import annotations

# One thread: on a shared machine a second thread mostly waits. tiny-v41 decode tok/s, batch 1 / batch 16, on
# this 2-core machine (2026-12-01, one process per figure; method in docs/engine-speed.md, "Threads"):
#   nothing else running       1 thread 22.2 / 271    2 threads 18.8 / 239
#   a busy loop on one core    1 thread 17.4-21.4 / 223-267    2 threads 5.2-5.7 / 53-79   (3-5x slower)
#   another session's job      1 thread 17.7-19.2 / 215-294    2 threads 0.7 / 4.9-6.5     (25-60x slower)
# Every parallel region waits for its slowest thread, and a descheduled one stalls the whole step; a machine
# of one's own can ask for all its cores with --threads.
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
