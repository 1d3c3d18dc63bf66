"""Compiling model code as the engine's decode step runs it: traced under the step's mode (flashserve/model/modes.py)."""

from __future__ import annotations

import torch

from flashserve.model import modes


def compile_as_step(fn, mode: modes.Mode = modes.COMPILED_CPU, **kwargs):
    """``torch.compile(fn, **kwargs)``, called in ``mode`` (a compiled CPU step's, by default)."""
    compiled = torch.compile(fn, **kwargs)

    def run(*args, **kw):
        with modes.running(mode):
            return compiled(*args, **kw)

    return run
