"""The scheduler side's L2 index: which page key sits in which host page, LRU order, pins.

Plain data only (no tensors, no transfers): it lives in vLLM's scheduler process and tells the
worker, through the connector metadata, which host page to copy from or into. The worker keeps
its own record of what each host page really holds and refuses a load whose key does not match
(that block is reported as a load error and vLLM recomputes it), so a stale decision here costs
a miss, never wrong KV.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable, Sequence

from ...errors import InvalidArgumentError


class HostPageIndex:
    """``num_pages`` host pages; each is free, or holds one key (evictable in LRU order unless
    pinned), or is reserved (allocated for an L3 read that has not landed yet)."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise InvalidArgumentError(f"num_pages must be a positive int, got {num_pages!r}",
                                       argument="num_pages", value=num_pages)
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._lru: OrderedDict[bytes, int] = OrderedDict()     # key -> page, oldest first
        self._key_of: dict[int, bytes] = {}
        self._pins: Counter[int] = Counter()
        self._orphans: set[int] = set()      # dropped while pinned: freed on the last unpin
        self.evictions = 0

    # ----- queries ------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def page_of(self, key: bytes) -> int | None:
        return self._lru.get(key)

    def leading_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    @property
    def free_count(self) -> int:
        return len(self._free)

    # ----- updates ------------------------------------------------------------------------
    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if k in self._lru:
                self._lru.move_to_end(k)

    def allocate(self, n: int) -> list[int]:
        """Up to ``n`` pages (fewer when every held page is pinned), evicting the least
        recently used unpinned keys. The pages are reserved until `insert` or `free`."""
        out: list[int] = []
        while len(out) < n and self._free:
            out.append(self._free.pop())
        if len(out) < n:
            for key in list(self._lru):
                page = self._lru[key]
                if self._pins[page]:
                    continue
                del self._lru[key]
                del self._key_of[page]
                self.evictions += 1
                out.append(page)
                if len(out) == n:
                    break
        return out

    def insert(self, key: bytes, page: int) -> None:
        """Record that reserved ``page`` holds ``key`` (most recently used)."""
        if key in self._lru or page in self._key_of:
            raise InvalidArgumentError("key or page already indexed", argument="page",
                                       value=page)
        self._lru[key] = page
        self._key_of[page] = key

    def free(self, pages: Iterable[int]) -> None:
        """Give reserved pages back."""
        for p in pages:
            if p in self._key_of:
                raise InvalidArgumentError(f"host page {p} holds a key; use drop()",
                                           argument="pages", value=p)
            self._free.append(p)

    def drop(self, key: bytes) -> None:
        """Forget ``key`` (the worker found its page does not hold it); the page is freed."""
        page = self._lru.pop(key, None)
        if page is not None:
            del self._key_of[page]
            if not self._pins[page]:
                self._free.append(page)
            else:
                self._orphans.add(page)

    def pin(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._pins[p] += 1

    def unpin(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._pins[p] -= 1
            if self._pins[p] <= 0:
                del self._pins[p]
                if p in self._orphans:
                    self._orphans.discard(p)
                    self._free.append(p)
