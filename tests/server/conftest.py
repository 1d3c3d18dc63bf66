"""Fixtures shared by the server tests (the process helpers live in serverproc.py)."""

from __future__ import annotations

import pytest

from serverproc import MODEL


@pytest.fixture(scope="session")
def tokenizer():
    from flashserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(MODEL, 512)
