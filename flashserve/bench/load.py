"""Request arrivals: all at once, or a gamma process with mean rate ``request_rate`` (burstiness 1 is
Poisson; lower is burstier, higher more regular), optionally capped at ``max_concurrency`` in flight."""

from __future__ import annotations

import asyncio
import math
from typing import Awaitable, Callable, Sequence, TypeVar

import numpy as np

from ..errors import UserError

T = TypeVar("T")
R = TypeVar("R")


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after each of ``n`` requests before the next (all 0 for an infinite rate)."""
    if not request_rate > 0:
        raise UserError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise UserError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    scale = 1.0 / (request_rate * burstiness)  # gamma mean = shape × scale = 1 / rate
    return np.random.default_rng(seed).gamma(burstiness, scale, size=n).tolist()


async def run_load(items: Sequence[T], send: Callable[[T], Awaitable[R]], gaps: Sequence[float],
                   max_concurrency: int | None, on_done: Callable[[R], None] | None = None) -> list[R]:
    """Send ``items`` in order, waiting ``gaps[i]`` after the i-th, with at most ``max_concurrency`` in flight;
    results come back in the order of ``items``."""
    if max_concurrency is not None and max_concurrency < 1:
        raise UserError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(item: T) -> R:
        if limit is None:
            result = await send(item)
        else:
            async with limit:
                result = await send(item)
        if on_done is not None:
            on_done(result)
        return result

    tasks = []
    for item, gap in zip(items, gaps):
        tasks.append(asyncio.create_task(one(item)))
        if gap > 0:
            await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))
