"""Torch's intra-op threads for the engine (``LLM(..., threads=N)``, ``--threads N``). Torch-free to import,
so the CLI can show the default without loading torch.

The default is what llama.cpp and torch users expect: ``$OMP_NUM_THREADS`` when it is set, else one thread per
physical core this process may run on (its CPU affinity, hyper-threads counted once: a second thread on a core
mostly waits). A sharded engine divides them among the ranks on the machine. A shared machine can ask for fewer
with ``--threads`` (docs/engine-speed.md#threads)."""

from __future__ import annotations

import os
from pathlib import Path


SYSFS_CPUS = Path("/sys/devices/system/cpu")


def physical_cores(cpus: set[int] | None = None, sysfs: Path = SYSFS_CPUS) -> int:
    """Physical cores among ``cpus`` (default: this process's CPU affinity): CPUs that share a core (SMT
    siblings) count once, by ``cpuN/topology`` under ``sysfs``; where that is missing, each CPU."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def default_threads(ranks: int = 1) -> int:
    """``$OMP_NUM_THREADS`` if it is a positive integer, else :func:`physical_cores`, shared by ``ranks``
    processes on this machine."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, physical_cores() // max(1, ranks))


def set_threads(threads: object, ranks: int = 1) -> int:
    """Validate ``threads`` (an integer >= 1, or None: :func:`default_threads`) and set torch's intra-op thread
    count, process-wide (numpy's OpenBLAS: one thread, see :func:`flashserve.model.blas.limit_threads`).
    Returns the count set."""
    from ..config import ConfigError

    if threads is None:
        threads = default_threads(ranks)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads: must be an integer >= 1, got {threads!r}")
    import torch

    from ..model import blas

    torch.set_num_threads(threads)
    blas.limit_threads()  # the single-row products' OpenBLAS (numpy's) runs on one
    return threads
