"""`HostKVPool`: the L2 pool of KV pages in host memory, over a `HostBuffer`."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Sequence

import torch

from .device_pool import check_page_indices
from .errors import (InvalidArgumentError, LayoutError, PageIndexError, PagePinnedError,
                     PoolExhaustedError)
from .interfaces import HostAllocator, HostBuffer
from .layout import PAGE_FIRST, check_layout, host_nbytes, logical_view, page_ranges
from .spec import KVSpec


class HostKVPool:
    """Fixed-size pool of host KV pages with a free list and pin counts.

    ``view`` is the logical ``[page, layer, comp, token, head, dim]`` tensor over the buffer,
    whatever the physical layout. The memory is a buffer the pool allocates and owns from
    ``allocator`` (an instance: the caller picks the backend, by name through
    ``kvtier.create_host_allocator``), or a given ``buffer`` it does not own; exactly one of
    the two. With ``page_first`` (the default) each page is one contiguous byte range, which
    is what L3 stores read into and write from. All methods are thread-safe.
    """

    def __init__(self, spec: KVSpec, num_pages: int, *, allocator: HostAllocator | None = None,
                 layout: str = PAGE_FIRST, buffer: HostBuffer | None = None):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise LayoutError(f"num_pages must be a positive int, got {num_pages!r}")
        self.spec = spec
        self.num_pages = num_pages
        self.layout = check_layout(layout)
        need = host_nbytes(spec, num_pages)
        self._owns_buffer = buffer is None
        if buffer is None:
            if not isinstance(allocator, HostAllocator):
                got = "none given" if allocator is None else f"got {allocator!r}"
                raise InvalidArgumentError(
                    f"HostKVPool needs allocator=<HostAllocator instance> ({got}): get one "
                    "from kvtier.create_host_allocator(name, config), e.g. 'torch-pinned', "
                    "or pass an allocator instance or buffer=", argument="allocator",
                    value=allocator)
            buffer = allocator.allocate(need)
        elif allocator is not None:
            raise InvalidArgumentError("HostKVPool takes allocator= or buffer=, not both",
                                       argument="allocator", value=allocator)
        if buffer.nbytes < need:
            raise LayoutError(f"host buffer of {buffer.nbytes} bytes is smaller than the "
                              f"{need} bytes {num_pages} pages need")
        self.buffer = buffer
        self.raw = buffer.tensor[:need]
        self.view = logical_view(self.raw, spec, num_pages, layout)
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated = bytearray(num_pages)
        self._pins = [0] * num_pages

    # ----- allocation -----------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages; raises PoolExhaustedError (taking none) if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PageIndexError(f"page count must be an int >= 0, got {n!r}")
        with self._lock:
            if n > len(self._free):
                raise PoolExhaustedError(f"host pool has {len(self._free)} free pages, "
                                         f"{n} requested", requested=n, free=len(self._free))
            pages = [self._free.pop() for _ in range(n)]
            for p in pages:
                self._allocated[p] = 1
            return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the free list; a pinned or unallocated page is an error (none freed)."""
        idx = self._indices(pages)
        with self._lock:
            for p in idx:
                if not self._allocated[p]:
                    raise PageIndexError(f"host page {p} is not allocated", index=p,
                                         limit=self.num_pages)
                if self._pins[p]:
                    raise PagePinnedError(f"host page {p} is pinned ({self._pins[p]} users)")
            if len(set(idx)) != len(idx):
                raise PageIndexError("host pages to free contain duplicates")
            for p in idx:
                self._allocated[p] = 0
                self._free.append(p)

    def is_allocated(self, page: int) -> bool:
        (p,) = self._indices([page])
        return bool(self._allocated[p])

    # ----- pinning (pages in use may not be freed or evicted) ----------------------------------
    def pin(self, pages: Sequence[int]) -> None:
        """Mark pages in use (one pin per occurrence): a pinned page cannot be freed."""
        idx = self._indices(pages)
        with self._lock:
            for p in idx:
                if not self._allocated[p]:
                    raise PageIndexError(f"cannot pin unallocated host page {p}", index=p,
                                         limit=self.num_pages)
            for p in idx:
                self._pins[p] += 1

    def unpin(self, pages: Sequence[int]) -> None:
        """Drop one pin per occurrence; unpinning more than was pinned is an error (none
        dropped)."""
        idx = self._indices(pages)
        with self._lock:
            for p, times in Counter(idx).items():
                if self._pins[p] < times:
                    raise PageIndexError(f"host page {p} is pinned {self._pins[p]} times, "
                                         f"unpin asked {times}", index=p, limit=self.num_pages)
            for p in idx:
                self._pins[p] -= 1

    def pin_count(self, page: int) -> int:
        (p,) = self._indices([page])
        return self._pins[p]

    # ----- page access ------------------------------------------------------------------------
    def check_pages(self, pages: Sequence[int] | torch.Tensor, what: str = "host page"
                    ) -> torch.Tensor:
        return check_page_indices(pages, self.num_pages, what)

    def _indices(self, pages: Sequence[int] | torch.Tensor) -> list[int]:
        return self.check_pages(pages).tolist()

    def _one(self, page: int) -> int:
        """Cheap check of a single page index (hot path of stores: no tensor made)."""
        if isinstance(page, bool) or not hasattr(page, "__index__"):
            raise PageIndexError(f"host page index {page!r} is not an int", index=page,
                                 limit=self.num_pages)
        p = page.__index__()
        if not 0 <= p < self.num_pages:
            raise PageIndexError(f"host page index {p} out of range [0, {self.num_pages})",
                                 index=p, limit=self.num_pages)
        return p

    def page_segments(self, page: int) -> list[torch.Tensor]:
        """The uint8 views that together hold ``page``, in logical order (one for page_first)."""
        page = self._one(page)
        return [self.raw[off:off + n] for off, n in
                page_ranges(self.spec, self.num_pages, self.layout, page)]

    def page_bytes_view(self, page: int) -> torch.Tensor:
        """The contiguous uint8 view of one page; page_first pools only."""
        if self.layout != PAGE_FIRST:
            raise LayoutError("a layer_first host pool has no contiguous page view; "
                              "use page_segments()")
        page = self._one(page)
        b = self.spec.page_bytes
        return self.raw[page * b:(page + 1) * b]

    def page_ptr(self, page: int) -> int:
        """Address of one page (page_first pools only), for zero-copy stores."""
        return self.page_bytes_view(page).data_ptr()

    def get_page_buffer_meta(self, pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """(pointers, sizes) of whole pages; page_first pools only."""
        idx = self._indices(pages)
        if self.layout != PAGE_FIRST:
            raise LayoutError("page pointers need a page_first host pool")
        base, b = self.raw.data_ptr(), self.spec.page_bytes
        return [base + p * b for p in idx], [b] * len(idx)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def close(self) -> None:
        if self._owns_buffer:
            self.buffer.close()

    def __enter__(self) -> "HostKVPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
