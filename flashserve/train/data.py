"""The training text: the running interpreter's standard library sources (``Lib/``), split by file into
train and held-out parts deterministically."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# tests, IDLE and lib2to3's fixtures are large and unlike ordinary code; leave them out
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo", "ensurepip"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None, limit: int | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of the ``.py`` files under the stdlib, sorted by path; ``limit`` keeps the first
    that many (the fast mode)."""
    root = root or stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel.as_posix(), text))
            if limit and len(out) >= limit:
                break
    return out


def is_heldout(rel: str, fraction: float) -> bool:
    """Whether a file belongs to the held-out split: a hash of its path, so the split is stable."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little")
    return (h % 10_000) < fraction * 10_000


def split_files(files: list[tuple[str, str]], fraction: float) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    train = [f for f in files if not is_heldout(f[0], fraction)]
    held = [f for f in files if is_heldout(f[0], fraction)]
    if not held:  # tiny corpora (the fast mode): hold out the last file
        train, held = train[:-1], train[-1:]
    return train, held
