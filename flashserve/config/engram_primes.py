"""Engram bucket primes and table offsets (docs/architecture.md#engram-hash-ids, step 2); pure Python, shared by config
and model."""

from __future__ import annotations


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(n_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> list[list[int]]:
    """Per engram layer, the ``(max_ngram - 1) * n_heads`` primes in (order, head) order.

    For each order the search restarts just below ``vocab_size`` and takes the next primes not used
    before by any layer or order, so every bucket of every layer has a distinct prime size.
    """
    used: set[int] = set()
    out: list[list[int]] = []
    for _ in range(n_layers):
        layer: list[int] = []
        for _order in range(2, max_ngram + 1):
            candidate = vocab_size - 1
            for _head in range(n_heads):
                candidate += 1
                while not _is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                layer.append(candidate)
        out.append(layer)
    return out


def engram_table_rows(n_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> list[int]:
    """Rows of each engram layer's table: the sum of its primes (``engram_num_embeddings``)."""
    return [sum(p) for p in engram_primes(n_layers, max_ngram, n_heads, vocab_size)]
