"""Host bookkeeping of the cache's pages, owned by the scheduler: reference counts, the free list, and the prefix
hash chain (one hash per page of tokens, chained from the first page) that lets sequences share full pages."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict


class PagePool:
    """Reference-counted pages; freed pages that hold a hashed full page stay findable until reused (LRU)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.hash_of: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def allocate(self) -> int:
        page, _ = self.free.popitem(last=False)
        h = self.hash_of[page]
        if h is not None:
            if self.cached.get(h) == page:
                del self.cached[h]
            self.hash_of[page] = None
        self.ref[page] = 1
        return page

    def touch(self, page: int) -> None:
        if self.ref[page] == 0:
            del self.free[page]
        self.ref[page] += 1

    def release(self, page: int) -> None:
        self.ref[page] -= 1
        assert self.ref[page] >= 0, page
        if self.ref[page] == 0:
            self.free[page] = None
            if self.hash_of[page] is None:  # nothing worth keeping: reuse first
                self.free.move_to_end(page, last=False)

    def register(self, page: int, h: bytes) -> None:
        if h in self.cached or self.hash_of[page] is not None:
            return
        self.hash_of[page] = h
        self.cached[h] = page

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)


def chain_hash(parent: bytes | None, tokens: list[int], salt: bytes = b"") -> bytes:
    """Hash of a page of ``tokens`` after the page hashed ``parent``; ``salt``: what else decides the page's
    rows (the digests of images whose spans it overlaps)."""
    m = hashlib.blake2b(digest_size=16)
    m.update(parent or b"root")
    m.update(struct.pack(f"<{len(tokens)}q", *tokens))
    m.update(salt)
    return m.digest()
