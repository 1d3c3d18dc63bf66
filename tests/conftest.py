"""Shared pytest setup: tests import helper modules from their own folder."""

import sys
from pathlib import Path

for sub in ("model", "engine", "server", "config", "plan"):
    path = Path(__file__).parent / sub
    if path.is_dir() and str(path) not in sys.path:
        sys.path.insert(0, str(path))
