"""Ctrl-C while torch is being imported, held back until the import is done.

A KeyboardInterrupt raised inside a C extension's initialisation (numpy's, under ``import torch``) can surface
as an ImportError that torch treats as "numpy missing" and swallows: the interrupt is lost, or a later import
fails with a traceback. Imports take seconds; loading the weights (minutes) stays interruptible.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block with SIGINT recorded, not raised; raise KeyboardInterrupt after it if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: hits.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if hits:
        raise KeyboardInterrupt
