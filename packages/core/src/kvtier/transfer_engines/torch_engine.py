"""`torch`: the portable transfer engine, built from torch and NumPy copies of bytes.

Works for the CPU and for any torch accelerator with streams and events (CUDA, ROCm, and
devices such as Ascend's whose torch module mirrors ``torch.cuda``). It moves bytes, never
typed elements, so every dtype (fp8 included) and every device layout moves the same way: each
layer of a page is the device pool's byte chunks (``pool.chunks``) in order.

Loads (host -> device), per layer: the host rows of the pages are gathered by a few CPU threads
into a pinned staging buffer, copied to the device in one contiguous copy, and scattered into
the device chunks there (one ``index_copy_`` per chunk). Backups run the same steps backwards
(device gather, one copy to pinned staging, CPU scatter). Staging buffers are allocated once,
when the engine is built (two of each, so the CPU fills one while the other is on the link),
and a layer larger than a buffer goes in batches of pages.

Each call becomes one job on the engine's worker thread (jobs run in submission order). On an
accelerator the copies run on a side stream ordered after the caller's stream at call time;
each layer signals as soon as it is queued, and ``wait_layer(i)`` then makes the caller's stream
wait on layer ``i``'s event: the caller's thread waits at most for the CPU gather of that
layer, never for the device. A backup's layer lands when the CPU scatter of its rows is done.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..errors import ConfigError, InvalidArgumentError, LayoutError, TransferError
from ..interfaces import (INTERFACE_VERSION, Availability, Capabilities, CompletedHandle,
                          TransferEngine, TransferHandle)
from ..layout import PAGE_FIRST

#: Element widths tried for the byte rows (wider elements: fewer, larger copies).
_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
#: A thread's share of a CPU gather or scatter is at least this many bytes.
_MIN_PART = 512 << 10


class LayerwiseHandle(TransferHandle):
    """Per-layer completion signalled by a worker thread (plus device events off the CPU)."""

    def __init__(self, num_layers: int, backend: str, device_module: Any = None):
        self.num_layers = num_layers
        self.backend = backend
        self._dm = device_module
        self._landed = [threading.Event() for _ in range(num_layers)]
        self._events: list[Any] = [None] * num_layers
        self._error: BaseException | None = None

    # worker side
    def _signal(self, layer: int, event: Any = None) -> None:
        self._events[layer] = event
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
        ev = self._events[layer]
        if ev is not None:
            self._dm.current_stream().wait_event(ev)

    def wait(self) -> None:
        for layer in range(self.num_layers):
            self.wait_layer(layer)

    def done(self) -> bool:
        if not all(ev.is_set() for ev in self._landed):
            return False
        return all(ev is None or ev.query() for ev in self._events)

    def synchronize(self) -> None:
        """Block the calling thread until every layer has landed (host-side)."""
        self.wait()
        for ev in self._events:
            if ev is not None:
                ev.synchronize()


@dataclass
class _Piece:
    """One contiguous byte run of a page-layer: where it is on the device and on the host."""

    dev: torch.Tensor        # [device pages, cols] (elements of ``width`` bytes), a view
    host: np.ndarray         # [host pages, cols], a view of the host pool
    col0: int                # first column inside the layer's staging rows
    cols: int


class _Slot:
    """One staging pair: pinned host memory and device memory of the same size."""

    def __init__(self, nbytes: int, device: torch.device, pinned: bool):
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.free: Any = None     # event after which the pinned half may be rewritten


class TorchTransferEngine(TransferEngine):
    name = "torch"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Run copies on a dedicated stream (accelerators only).
        side_stream: bool = True
        #: Bytes of each staging buffer (two pinned + two device buffers; capped at what one
        #: layer of the whole device pool needs).
        staging_bytes: int = 32 << 20
        #: CPU threads that gather and scatter host rows (0: min(8, CPUs)).
        host_threads: int = 0

    @classmethod
    def probe(cls) -> Availability:
        a = torch.arange(8, dtype=torch.int64)
        if int(a.index_select(0, torch.tensor([3])).item()) != 3:
            return Availability.unavailable("torch index_select returned a wrong value")
        return Availability.available(f"torch {torch.__version__}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(directions=("h2d", "d2h"), layerwise=True,
                            device_types=("cpu", "cuda", "any torch device"), auto_priority=0)

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        c = self.config
        for key in ("staging_bytes", "host_threads"):
            v = getattr(c, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (key == "staging_bytes"):
                raise ConfigError(f"{self.name}: {key} must be a positive integer"
                                  f"{'' if key == 'staging_bytes' else ' or 0'}, got {v!r}",
                                  key=key, value=v)
        if host_pool.raw.device.type != "cpu":
            raise LayoutError(f"{self.name}: host pool must be in host memory, got "
                              f"{host_pool.raw.device}")
        self.device = device_pool.device
        self._dm = self._device_module(self.device)
        self._pieces = [self._layer_pieces(layer) for layer in range(self.spec.num_layers)]
        self.layer_bytes = self.spec.page_bytes // self.spec.num_layers
        cpus = os.cpu_count() or 1
        self.host_threads = c.host_threads or max(1, min(8, cpus))
        self._pool = (ThreadPoolExecutor(self.host_threads - 1, thread_name_prefix="kvtier-cpy")
                      if self.host_threads > 1 else None)
        self._slots: list[_Slot] = []
        self._stream = None
        if self._dm is not None:
            whole = self.layer_bytes * max(device_pool.num_pages, 1)
            size = max(self.layer_bytes, min(c.staging_bytes, whole))
            self.batch_pages = size // self.layer_bytes
            with self._dm.device(self.device):
                self._slots = [_Slot(self.batch_pages * self.layer_bytes, self.device,
                                     self.device.type != "cpu") for _ in range(2)]
                self._stream = self._dm.Stream(self.device) if c.side_stream else None
        self._next = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="kvtier-torch-engine",
                                        daemon=True)
        self._worker.start()

    # ----- public API -----------------------------------------------------------------------
    def load(self, host_pages, device_pages) -> TransferHandle:
        h_idx, d_idx = self._indices(host_pages, device_pages)
        return self._submit(self._load_layer, h_idx, d_idx)

    def backup(self, device_pages, host_pages) -> TransferHandle:
        h_idx, d_idx = self._indices(host_pages, device_pages)
        return self._submit(self._backup_layer, h_idx, d_idx)

    def describe(self) -> dict[str, Any]:
        """What the benchmark records beside a result."""
        return {"host_threads": self.host_threads,
                "staging_bytes": len(self._slots) and self._slots[0].host.numel(),
                "element_bytes": sorted({p.dev.element_size() for ps in self._pieces
                                         for p in ps}),
                "pieces_per_layer": len(self._pieces[0])}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._worker.join(timeout=30)
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _device_module(self, device: torch.device) -> Any:
        """torch's module for ``device`` (``torch.cuda``, ...), None for the CPU; a device
        type without streams and events is refused."""
        if device.type == "cpu":
            return None
        dm = getattr(torch, device.type, None)
        if dm is None or not all(hasattr(dm, a) for a in
                                 ("Stream", "Event", "stream", "current_stream", "device")):
            raise LayoutError(f"{self.name}: torch has no streams and events for device type "
                              f"{device.type!r}; it cannot move pages there")
        return dm

    # ----- layout ---------------------------------------------------------------------------
    def _layer_pieces(self, layer: int) -> list[_Piece]:
        """The layer's device chunks as byte runs, each paired with its host rows; a chunk
        that spans host components (layer_first host pools) is cut at their boundaries."""
        spec, hp = self.spec, self.host_pool
        raw, P = hp.raw, hp.num_pages
        C, cb = spec.num_components, spec.chunk_bytes
        lb = spec.page_bytes // spec.num_layers
        runs = []                   # (device view uint8 [pages, n], host offset, host stride)
        at = 0
        for chunk in self.device_pool.chunks[layer]:
            n = int(chunk.shape[1])
            o = 0
            while o < n:
                if hp.layout == PAGE_FIRST:
                    take = n - o
                    runs.append((chunk[:, o:o + take], layer * lb + at + o, spec.page_bytes))
                else:
                    comp, within = divmod(at + o, cb)
                    take = min(n - o, cb - within)
                    runs.append((chunk[:, o:o + take], (layer * C + comp) * P * cb + within, cb))
                o += take
            at += n
        if at != lb:
            raise LayoutError(f"{self.name}: device chunks of layer {layer} hold {at} bytes, "
                              f"a page-layer is {lb}")
        base = raw.data_ptr()
        pieces, col = [], 0
        for dev, off, stride in runs:
            n = int(dev.shape[1])
            w, dt = next((w, dt) for w, dt in _WIDTHS
                         if not (n % w or off % w or stride % w or (base + off) % w
                                 or dev.stride(0) % w or dev.data_ptr() % w or col % w))
            host = raw.as_strided((P, n), (stride, 1), raw.storage_offset() + off)
            pieces.append(_Piece(dev=dev.view(dt), host=host.view(dt).numpy(), col0=col // w,
                                 cols=n // w))
            col += n
        return pieces

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
                ) -> TransferHandle:
        if h_idx.numel() == 0:
            return CompletedHandle(self.spec.num_layers)
        handle = LayerwiseHandle(self.spec.num_layers, self.name, self._dm)
        start = None
        if self._dm is not None:   # order the side stream after the caller's work so far
            start = self._dm.Event()
            start.record(self._dm.current_stream(self.device))
        self._jobs.put((per_layer, h_idx, d_idx, handle, start))
        return handle

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            per_layer, h_idx, d_idx, handle, start = job
            pending: list[tuple] = []
            try:
                h_np = h_idx.cpu().numpy()
                if self._dm is None:
                    for layer in range(self.spec.num_layers):
                        per_layer(layer, h_np, d_idx, handle, pending)
                else:
                    dm = self._dm
                    stream = self._stream or dm.current_stream(self.device)
                    with dm.device(self.device), dm.stream(stream):
                        stream.wait_event(start)
                        if d_idx.device.type != "cpu":
                            d_idx.record_stream(stream)
                        for layer in range(self.spec.num_layers):
                            per_layer(layer, h_np, d_idx, handle, pending)
                        while pending:
                            self._finish_backup(pending.pop(0), handle)
            except BaseException as exc:  # surfaced to the caller by the handle
                handle._fail(exc)

    def _batches(self, n: int):
        step = n if self._dm is None else self.batch_pages
        for s in range(0, n, step):
            yield s, min(n, s + step)

    def _slot(self) -> _Slot:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.free is not None:          # the copy that last read/wrote it has run
            slot.free.synchronize()
            slot.free = None
        return slot

    def _record(self) -> Any:
        ev = self._dm.Event()
        ev.record()
        return ev

    def _load_layer(self, layer: int, h_idx: np.ndarray, d_idx: torch.Tensor,
                    handle: LayerwiseHandle, pending: list) -> None:
        pieces = self._pieces[layer]
        if self._dm is None:               # CPU device pool: host rows straight to its rows
            d_np = d_idx.numpy()
            pairs = [(p.dev.numpy(), p.host) for p in pieces]

            def copy(a: int, b: int) -> None:
                for dst, src in pairs:
                    dst[d_np[a:b]] = np.take(src, h_idx[a:b], axis=0, mode="clip")
            self._split_rows(len(h_idx), copy)
            handle._signal(layer)
            return
        lb = self.layer_bytes
        for s, e in self._batches(len(h_idx)):
            nb = e - s
            slot = self._slot()
            outs = [(_rows(slot.host, nb, lb, p, p.dev.dtype).numpy(), p.host) for p in pieces]
            part = h_idx[s:e]

            def gather(a: int, b: int, outs=outs, part=part) -> None:
                for out, src in outs:        # indices were checked when the call was made
                    np.take(src, part[a:b], axis=0, out=out[a:b], mode="clip")
            self._split_rows(nb, gather)
            slot.dev[:nb * lb].copy_(slot.host[:nb * lb], non_blocking=True)
            slot.free = self._record()
            for p in pieces:
                p.dev.index_copy_(0, d_idx[s:e], _rows(slot.dev, nb, lb, p, p.dev.dtype))
        handle._signal(layer, self._record())

    def _backup_layer(self, layer: int, h_idx: np.ndarray, d_idx: torch.Tensor,
                      handle: LayerwiseHandle, pending: list) -> None:
        pieces = self._pieces[layer]
        if self._dm is None:
            d_np = d_idx.numpy()
            pairs = [(p.host, p.dev.numpy()) for p in pieces]

            def copy(a: int, b: int) -> None:
                for dst, src in pairs:
                    dst[h_idx[a:b]] = np.take(src, d_np[a:b], axis=0, mode="clip")
            self._split_rows(len(h_idx), copy)
            handle._signal(layer)
            return
        lb = self.layer_bytes
        batches = list(self._batches(len(h_idx)))
        for s, e in batches:
            while len(pending) >= len(self._slots):   # its slot's bytes are still unread
                self._finish_backup(pending.pop(0), handle)
            nb = e - s
            slot = self._slot()
            for p in pieces:
                torch.index_select(p.dev, 0, d_idx[s:e], out=_rows(slot.dev, nb, lb, p,
                                                                   p.dev.dtype))
            slot.host[:nb * lb].copy_(slot.dev[:nb * lb], non_blocking=True)
            slot.free = self._record()
            pending.append((layer, slot, slot.free, h_idx[s:e], e == len(h_idx)))

    def _finish_backup(self, item: tuple, handle: LayerwiseHandle) -> None:
        layer, slot, ev, h_part, last = item
        ev.synchronize()                   # the worker waits, never the caller
        nb = len(h_part)
        ins = [(p.host, _rows(slot.host, nb, self.layer_bytes, p, p.dev.dtype).numpy())
               for p in self._pieces[layer]]

        def scatter(a: int, b: int) -> None:
            for dst, src in ins:
                dst[h_part[a:b]] = src[a:b]
        self._split_rows(nb, scatter)
        if last:
            handle._signal(layer)

    def _split_rows(self, n: int, work: Callable[[int, int], None]) -> None:
        """Run ``work(a, b)`` over rows ``0..n`` split among the CPU threads (this thread
        takes the last part; small copies stay on it)."""
        parts = min(self.host_threads, max(1, n * self.layer_bytes // _MIN_PART), n)
        if parts <= 1 or self._pool is None:
            work(0, n)
            return
        bounds = [n * i // parts for i in range(parts + 1)]
        futs = [self._pool.submit(work, a, b) for a, b in zip(bounds[:-2], bounds[1:-1])]
        work(bounds[-2], bounds[-1])
        for f in futs:
            f.result()


def _rows(flat: torch.Tensor, nb: int, lb: int, p: _Piece, dtype: torch.dtype) -> torch.Tensor:
    """The ``[nb, cols]`` piece-major block of a staging buffer holding piece ``p``."""
    w = torch.empty((), dtype=dtype).element_size()
    start = nb * p.col0 * w
    return flat[start:start + nb * p.cols * w].view(dtype).view(nb, p.cols)
