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
                    _, victim = self._objects.popitem(last=False)
                    self._bytes -= victim.numel()
                    evicted += 1
                self._objects[k] = obj
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
                if obj is not None:
                    self._bytes -= obj.numel()
                    n += 1
        return n

    def clear(self) -> None:
        self._live()
        with self._lock:
            self._objects.clear()
            self._bytes = 0

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        with self._lock:
            d.update(objects=len(self._objects), bytes_stored=self._bytes)
        return d

    def close(self) -> None:
        """Give the pages' memory back; every later call is a StoreError. Idempotent."""
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._bytes = 0
