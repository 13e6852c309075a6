"""`memory`: an in-process L3 store, capacity-bounded, LRU-evicted. A reference and a test aid."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..interfaces import INTERFACE_VERSION, Availability, L3Store


class MemoryStore(L3Store):
    name = "memory"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        capacity_bytes: int = 1 << 30

    def __init__(self, config: Any = None, *, spec):
        super().__init__(config, spec=spec)
        if self.config.capacity_bytes < spec.page_bytes:
            from ..errors import ConfigError
            raise ConfigError(f"memory.capacity_bytes={self.config.capacity_bytes} holds no "
                              f"page of {spec.page_bytes} bytes", key="memory.capacity_bytes",
                              value=self.config.capacity_bytes)
        self._objects: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self._closed = False
        n = min(8, spec.num_layers)
        self._groups = tuple((g * spec.num_layers // n, (g + 1) * spec.num_layers // n)
                             for g in range(n))
        #: each stored object's version (a number never reused), for ranged reads
        self._version: dict[bytes, int] = {}
        self._next_version = 0
        #: host page -> (key, group, object version) while a page is read group by group
        self._reading: dict[int, tuple[bytes, int, int]] = {}

    @classmethod
    def probe(cls) -> Availability:
        return Availability.available("in-process")

    def _live(self) -> None:
        if self._closed:
            from ..errors import StoreError
            raise StoreError("memory: the store is closed", backend=self.name)

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        self._live()
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._objects:
                    break
                n += 1
        return n

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        self._live()
        out = []
        for k, p in zip(keys, pages):
            with self._lock:
                obj = self._objects.get(k)
                if obj is not None:
                    self._objects.move_to_end(k)
            if obj is None:
                out.append(False)
                continue
            self._copy_into_page(p, obj)
            out.append(True)
        hits = sum(out)
        self._count(gets=len(keys), get_hits=hits, bytes_read=hits * self.spec.page_bytes)
        return out

    def read_groups(self) -> tuple[tuple[int, int], ...]:
        """``min(8, num_layers)`` layer groups, group ``g`` = layers
        ``[g*L//G, (g+1)*L//G)`` (as the ``file`` store's). A subclass that overrides
        ``batch_get`` and not ``batch_get_layers`` (a test double failing or delaying whole
        reads) reads whole pages only: streamed reads must not go around its ``batch_get``."""
        cls = type(self)
        if cls.batch_get is not MemoryStore.batch_get \
                and cls.batch_get_layers is MemoryStore.batch_get_layers:
            return ()
        return self._groups

    def batch_get_layers(self, keys: Sequence[bytes], host_pages: Sequence[int],
                         group: int, through: int | None = None) -> list[bool]:
        """Copy layer groups ``group`` through ``through`` (default: ``group`` alone) of each
        key into its host page (the page's other bytes untouched). Objects are held in this
        process and never change once stored, so no checksum is needed; a page read group by
        group is one version of the key: a range continuing a page whose earlier groups came
        from an object since replaced is a miss (counted ``ranged_version_changes``)."""
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        groups = self.read_groups()
        through = self._check_span(group, through, len(groups))
        self._live()
        per_layer = self.spec.page_bytes // self.spec.num_layers
        a, b = groups[group][0] * per_layer, groups[through][1] * per_layer
        last = through == len(groups) - 1
        out = []
        changed = 0
        for k, p in zip(keys, pages):
            with self._lock:
                obj = self._objects.get(k)
                version = self._version.get(k, -1)
                prev = self._reading.pop(p, None)
                if obj is not None and group and prev is not None and prev[:2] == (k, group - 1) \
                        and prev[2] != version:
                    obj = None
                    changed += 1
                if obj is not None:
                    if last:
                        self._objects.move_to_end(k)
                    else:
                        self._reading[p] = (k, through, version)
            if obj is None:
                out.append(False)
                continue
            self._copy_range_into_page(p, obj, a, b)
            out.append(True)
        hits = sum(out)
        # a page read group by group is one get (at its first group), one hit (at its last)
        self._count(bytes_read=hits * (b - a), gets=0 if group else len(keys),
                    get_hits=hits if last else 0)
        with self._stats_lock:
            extra = self._stats.extra
            for name, n in (("ranged_reads", len(keys)), ("ranged_hits", hits),
                            ("ranged_version_changes", changed)):
                extra[name] = extra.get(name, 0) + n
        return out

    def _copy_range_into_page(self, page: int, data: torch.Tensor, a: int, b: int) -> None:
        """Copy bytes ``[a, b)`` of ``data`` (a page's bytes in logical order) into the same
        bytes of host page ``page``, whatever the pool's layout."""
        assert self.host_pool is not None
        off = 0
        for seg in self.host_pool.page_segments(page):
            n = seg.numel()
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                seg[lo - off:hi - off].copy_(data[lo:hi])
            off += n
            if off >= b:
                break

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages)
        self._live()
        evicted = 0
        for k, p in zip(keys, pages):
            obj = torch.cat(self.host_pool.page_segments(p))   # a copy, whatever the layout
            with self._lock:
                old = self._objects.pop(k, None)
                if old is not None:
                    self._bytes -= old.numel()
                while self._objects and self._bytes + obj.numel() > self.config.capacity_bytes:
                    gone, victim = self._objects.popitem(last=False)
                    self._version.pop(gone, None)
                    self._bytes -= victim.numel()
                    evicted += 1
                self._objects[k] = obj
                self._version[k] = self._next_version
                self._next_version += 1
                self._bytes += obj.numel()
        self._count(sets=len(keys), set_ok=len(keys), evictions=evicted,
                    bytes_written=len(keys) * self.spec.page_bytes)
        return [True] * len(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        self._live()
        n = 0
        with self._lock:
            for k in keys:
                obj = self._objects.pop(k, None)
                self._version.pop(k, None)
                if obj is not None:
                    self._bytes -= obj.numel()
                    n += 1
        return n

    def clear(self) -> None:
        self._live()
        with self._lock:
            self._objects.clear()
            self._version.clear()
            self._bytes = 0

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        with self._lock:
            d.update(objects=len(self._objects), bytes_stored=self._bytes)
        for k in ("ranged_reads", "ranged_hits", "ranged_version_changes"):
            d.setdefault(k, 0)
        return d

    def close(self) -> None:
        """Give the pages' memory back; every later call is a StoreError. Idempotent."""
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._version.clear()
            self._reading.clear()
            self._bytes = 0
