"""How a forward runs, chosen by its caller once, and the functions that have one implementation per way.

A forward runs in one of three modes: **eager** (torch op by op: prompts, the reference forward, an eager decode
step), **compiled** (traced by ``torch.compile`` into a fixed-shape decode step: no host sync, no value read
back) and **compiled on the CPU** (the same, where inductor's own C++ kernels make the products). The engine's
execution plan picks the decode step's mode at start-up (:func:`for_step`) and the step runs its forward under
it (:func:`running`); everything else runs eagerly.

The model's code does not ask which mode it is in. A function or method whose work differs by mode is declared
with :func:`per_mode` over its eager implementation, and the other modes' implementations are registered on it
(``@f.variant(COMPILED)``); calling it runs the implementation of the active mode, and a mode with no
implementation of its own falls back along :data:`FALLBACK` (compiled on the CPU → compiled → eager). The same
pattern as vLLM's ``CustomOp`` (``forward_native`` / ``forward_cuda``), bound per mode instead of per platform;
a traced forward resolves it while tracing, so a compiled step pays nothing for it.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from enum import IntEnum
from typing import Callable, Iterator, TypeVar


class Mode(IntEnum):
    EAGER = 0
    COMPILED = 1  # traced into a fixed-shape step (any device)
    COMPILED_CPU = 2  # traced into a fixed-shape step whose kernels inductor writes in C++


EAGER, COMPILED, COMPILED_CPU = Mode.EAGER, Mode.COMPILED, Mode.COMPILED_CPU
# the implementations a mode takes, best first
FALLBACK: dict[Mode, tuple[Mode, ...]] = {EAGER: (EAGER,), COMPILED: (COMPILED, EAGER),
                                          COMPILED_CPU: (COMPILED_CPU, COMPILED, EAGER)}


class _Active(threading.local):
    """The mode forwards run in now, per thread (a decode step may compile in the background while requests are
    served eagerly), as a plain int: dynamo reads it as a constant while tracing, without a guard, so a compiled
    region is only ever called under the mode it was traced in (the decode step sees to that)."""

    mode = int(EAGER)


_ACTIVE = _Active()


def active() -> Mode:
    """The mode forwards run in now (:func:`running` sets it; eager otherwise)."""
    return Mode(_ACTIVE.mode)


@contextmanager
def running(mode: Mode) -> Iterator[None]:
    """Run this thread's forwards inside this block in ``mode`` (and the mode before it afterwards)."""
    before = _ACTIVE.mode
    _ACTIVE.mode = int(Mode(mode))
    try:
        yield
    finally:
        _ACTIVE.mode = before


def for_step(device_type: str, compiled: bool) -> Mode:
    """The mode of a decode step on ``device_type`` ("cpu", "cuda"), compiled or eager."""
    if not compiled:
        return EAGER
    return COMPILED_CPU if device_type == "cpu" else COMPILED


F = TypeVar("F", bound=Callable)


def per_mode(eager: F) -> F:
    """``eager`` as the implementation of every mode until others are registered with ``.variant(*modes)``; the
    returned function (a method too, when defined in a class) calls the active mode's implementation."""
    own: dict[Mode, Callable] = {EAGER: eager}
    table: list[Callable] = [eager] * len(Mode)

    @functools.wraps(eager)
    def dispatch(*args, **kwargs):
        return table[_ACTIVE.mode](*args, **kwargs)

    def variant(*modes: Mode) -> Callable[[F], F]:
        def register(fn: F) -> F:
            for m in modes:
                own[Mode(m)] = fn
            for m in Mode:
                table[int(m)] = next(own[c] for c in FALLBACK[m] if c in own)
            return fn
        return register

    dispatch.variant = variant
    dispatch.eager = eager  # the eager implementation itself, for a variant that takes it for some inputs
    dispatch.implementation = lambda mode: table[mode]  # the implementation ``mode`` runs (tests, docs)
    return dispatch  # type: ignore[return-value]
