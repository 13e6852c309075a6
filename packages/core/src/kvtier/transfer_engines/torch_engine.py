"""`torch`: the reference transfer engine, built from torch indexing ops.

Works for any torch device. Each call becomes one job on the engine's worker thread, which
moves the pages layer by layer and signals each layer as it lands, so ``wait_layer(i)`` lets
layer ``i`` start while later layers are still in flight. On CUDA the copies run on a side
stream ordered after the caller's stream at call time; ``wait_layer`` makes the caller's stream
wait on that layer's CUDA event (no host synchronisation). Host indices are used on the CPU, so
device-resident host indices are copied to the host by the worker, never by the caller.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import InvalidArgumentError, LayoutError, TransferError
from ..interfaces import (INTERFACE_VERSION, Availability, Capabilities, TransferEngine,
                          TransferHandle)


class LayerwiseHandle(TransferHandle):
    """Per-layer completion signalled by a worker thread (plus CUDA events on CUDA)."""

    def __init__(self, num_layers: int, backend: str):
        self.num_layers = num_layers
        self.backend = backend
        self._landed = [threading.Event() for _ in range(num_layers)]
        self._cuda_events: list[Any] = [None] * num_layers
        self._error: BaseException | None = None
        self._keep: list[Any] = []      # staging buffers kept alive until the copy is done

    # worker side
    def _signal(self, layer: int, cuda_event: Any = None) -> None:
        self._cuda_events[layer] = cuda_event
        self._landed[layer].set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        for ev in self._landed:
            ev.set()

    # caller side
    def wait_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer!r} out of range [0, {self.num_layers})")
        self._landed[layer].wait()
        if self._error is not None:
            raise TransferError(f"{self.backend}: transfer failed: {self._error}",
                                backend=self.backend) from self._error
        ev = self._cuda_events[layer]
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def wait(self) -> None:
        for layer in range(self.num_layers):
            self.wait_layer(layer)

    def done(self) -> bool:
        if not all(ev.is_set() for ev in self._landed):
            return False
        return all(ev is None or ev.query() for ev in self._cuda_events)

    def synchronize(self) -> None:
        """Block the calling thread until every layer has landed (host-side)."""
        self.wait()
        for ev in self._cuda_events:
            if ev is not None:
                ev.synchronize()


class TorchTransferEngine(TransferEngine):
    name = "torch"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Run copies on a dedicated CUDA stream (CUDA devices only).
        side_stream: bool = True

    @classmethod
    def probe(cls) -> Availability:
        a = torch.arange(8, dtype=torch.int64)
        if int(a.index_select(0, torch.tensor([3])).item()) != 3:
            return Availability.unavailable("torch index_select returned a wrong value")
        return Availability.available(f"torch {torch.__version__}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(directions=("h2d", "d2h"), layerwise=True,
                            device_types=("cpu", "cuda", "any torch device"))

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        device_pool.require_layers(self.name)
        if host_pool.raw.device.type != "cpu":
            raise LayoutError(f"host pool must be in host memory, got {host_pool.raw.device}")
        self.device = device_pool.device
        self._cuda = self.device.type == "cuda"
        self._stream = (torch.cuda.Stream(self.device)
                        if self._cuda and self.config.side_stream else None)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="kvtier-torch-engine",
                                        daemon=True)
        self._worker.start()

    # ----- public API -----------------------------------------------------------------------
    def load(self, host_pages, device_pages) -> LayerwiseHandle:
        h_idx, d_idx = self._indices(host_pages, device_pages)
        return self._submit(self._load_layer, h_idx, d_idx)

    def backup(self, device_pages, host_pages) -> LayerwiseHandle:
        h_idx, d_idx = self._indices(host_pages, device_pages)
        return self._submit(self._backup_layer, h_idx, d_idx)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._worker.join(timeout=30)

    # ----- internals ------------------------------------------------------------------------
    def _indices(self, host_pages, device_pages) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed:
            raise TransferError(f"{self.name}: engine is closed", backend=self.name)
        h_idx = self.host_pool.check_pages(host_pages)
        d_idx = self.device_pool.check_pages(device_pages)
        if h_idx.numel() != d_idx.numel():
            raise InvalidArgumentError(f"{self.name}: {h_idx.numel()} host pages but "
                                       f"{d_idx.numel()} device pages", argument="pages")
        return h_idx, d_idx.to(self.device, non_blocking=True)

    def _submit(self, per_layer: Callable, h_idx: torch.Tensor, d_idx: torch.Tensor
                ) -> LayerwiseHandle:
        handle = LayerwiseHandle(self.spec.num_layers, self.name)
        start = None
        if self._cuda:   # order the side stream after the caller's work issued so far
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(self.device))
        self._jobs.put((per_layer, h_idx, d_idx, handle, start))
        return handle

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            per_layer, h_idx, d_idx, handle, start = job
            try:
                h_cpu = h_idx.cpu()
                if self._cuda:
                    stream = self._stream or torch.cuda.current_stream(self.device)
                    with torch.cuda.device(self.device), torch.cuda.stream(stream):
                        stream.wait_event(start)
                        for layer in range(self.spec.num_layers):
                            per_layer(layer, h_cpu, d_idx, handle)
                else:
                    for layer in range(self.spec.num_layers):
                        per_layer(layer, h_cpu, d_idx, handle)
            except BaseException as exc:  # surfaced to the caller by the handle
                handle._fail(exc)

    def _load_layer(self, layer: int, h_idx: torch.Tensor, d_idx: torch.Tensor,
                    handle: LayerwiseHandle) -> None:
        for c in range(self.spec.num_components):
            src = self.host_pool.view[:, layer, c].index_select(0, h_idx)
            if self._cuda:
                staging = src.pin_memory()
                handle._keep.append(staging)
                src = staging.to(self.device, non_blocking=True)
            self.device_pool.pages_view(c, layer).index_copy_(0, d_idx, src)
        handle._signal(layer, self._record() if self._cuda else None)

    def _backup_layer(self, layer: int, h_idx: torch.Tensor, d_idx: torch.Tensor,
                      handle: LayerwiseHandle) -> None:
        for c in range(self.spec.num_components):
            src = self.device_pool.pages_view(c, layer).index_select(0, d_idx)
            if self._cuda:
                staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                staging.copy_(src, non_blocking=True)
                ev = self._record()
                ev.synchronize()          # the worker waits, never the caller
                src = staging
            self.host_pool.view[:, layer, c].index_copy_(0, h_idx, src)
        handle._signal(layer, None)

    def _record(self):
        ev = torch.cuda.Event()
        ev.record()
        return ev
