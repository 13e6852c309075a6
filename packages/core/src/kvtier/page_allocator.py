"""`PageAllocator`: a free list of device pages, the engine side of the L1 contract."""

from __future__ import annotations

import threading
from typing import Iterable

from .errors import InvalidArgumentError


class PageAllocator:
    """A free list of device pages: the engine side of the L1 contract (tests, simulator,
    demos). ``alloc(n)`` is all-or-nothing and returns None when fewer than n are free."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidArgumentError(f"num_pages must be a positive int, got {num_pages!r}",
                                       argument="num_pages", value=num_pages)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used = bytearray(num_pages)
        self._lock = threading.Lock()

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        with self._lock:
            if n > len(self._free):
                return None
            out = [self._free.pop() for _ in range(n)]
            for p in out:
                self._used[p] = 1
            return out

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        with self._lock:
            for p in pages:
                if not 0 <= p < self.num_pages or not self._used[p]:
                    raise InvalidArgumentError(f"page {p} is not allocated (double free?)",
                                               argument="pages", value=p)
            if len(set(pages)) != len(pages):
                raise InvalidArgumentError("pages to free contain duplicates",
                                           argument="pages")
            for p in pages:
                self._used[p] = 0
                self._free.append(p)
