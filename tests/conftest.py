"""Shared pytest setup: tests import helper modules from their own folder; one torch thread per test
process (pytest-xdist runs one worker per core, and two busy workers with two threads each spin-wait)."""

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # subprocesses (CLI, servers) too
torch.set_num_threads(1)

for sub in ("model", "engine", "server", "config", "plan"):
    path = Path(__file__).parent / sub
    if path.is_dir() and str(path) not in sys.path:
        sys.path.insert(0, str(path))
