"""`torch`: the portable transfer engine, built from torch's own copies of bytes.

Works for the CPU and for any torch accelerator with streams and events (CUDA, ROCm, and
devices such as Ascend's whose torch module mirrors ``torch.cuda``). It moves bytes, never
typed elements, so every dtype (fp8 included) and every device layout moves the same way: each
layer of a page is the device pool's byte chunks (``pool.chunks``) in order.

Per layer, in batches of pages, through a device staging buffer of page-major rows:

* **zero copy** (CUDA, host pool pinned or registered): the host pool is seen from the device
  at its own address (unified addressing), and torch's index kernels gather host rows into the
  staging rows and scatter them into the device chunks (backups: the reverse). No CPU copies.
* **staged** (pageable host pools, other devices): torch's CPU index ops (on its own CPU
  threads) gather the host rows into a pinned staging buffer, one contiguous copy moves it,
  and ``index_copy_`` scatters it on the device; backups the reverse.
  Two staging pairs are allocated when the engine is built, so the CPU fills one while the
  other is on the link.

Each call becomes one job on the engine's worker thread (jobs run in submission order). On an
accelerator the copies run on a side stream ordered after the caller's stream at call time;
each layer signals as soon as it is queued (staged backups: once its rows are in the host
pool), and ``wait_layer(i)`` then makes the caller's stream wait on layer ``i``'s event: the
caller's thread waits at most for the CPU side of that layer, never for the device.
"""

from __future__ import annotations

import queue
import threading
import time
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



class LayerwiseHandle(TransferHandle):
    """Per-layer completion signalled by a worker thread (plus device events off the CPU)."""

    def __init__(self, num_layers: int, backend: str, device_module: Any = None):
        self.num_layers = num_layers
        self.backend = backend
        self._dm = device_module
        self._landed = [threading.Event() for _ in range(num_layers)]
        self._events: list[Any] = [None] * num_layers
        self._error: BaseException | None = None
        self._busy: float | None = None      # host copies: seconds the worker copied
        self._t0: float | None = None

    # worker side
    def _begin(self) -> None:
        """Host copies start now (their layers are then signalled in order)."""
        self._t0 = time.perf_counter()

    def _signal(self, layer: int, event: Any = None) -> None:
        if self._t0 is not None and layer == self.num_layers - 1:
            self._busy = time.perf_counter() - self._t0     # set before anyone sees it done
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

    def busy_seconds(self) -> float | None:
        return self._busy

    def synchronize(self) -> None:
        """Block the calling thread until every layer has landed (host-side)."""
        self.wait()
        for ev in self._events:
            if ev is not None:
                ev.synchronize()


@dataclass
class _Piece:
    """One device chunk (or part of one) of a layer and its columns in a staging row."""

    dev: torch.Tensor        # [device pages, cols] in elements of the layer's width, a view
    col0: int                # first column inside the layer's staging rows (same elements)
    cols: int


@dataclass
class _Run:
    """A contiguous byte run of a page-layer on the host side and, for CPU device pools, on
    the device side: host rows at ``host_off + page * host_stride`` (bytes into the pool)."""

    host_off: int
    host_stride: int
    col: int                 # byte offset inside the staging row
    nbytes: int
    host_view: torch.Tensor  # [host pages, nbytes // w] typed view (small-row path)
    dev_view: torch.Tensor | None = None    # CPU device pools: the device rows of the run
    alias: torch.Tensor | None = None   # the same rows seen from the device (zero copy)


class _Slot:
    """One staging pair: pinned host memory and device memory of the same size."""

    def __init__(self, nbytes: int, device: torch.device, pinned: bool, host: bool = True):
        self.host = torch.empty(nbytes if host else 0, dtype=torch.uint8, pin_memory=pinned)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.free: Any = None     # event after which the pinned half may be rewritten


class TorchTransferEngine(TransferEngine):
    name = "torch"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Run copies on a dedicated stream (accelerators only).
        side_stream: bool = True
        #: Bytes of each staging buffer (device memory, plus pinned host memory when staged;
        #: capped at one layer of the whole device pool).
        staging_bytes: int = 32 << 20
        #: CUDA with a pinned host pool: the device's index kernels read and write the host
        #: pool in place (no CPU copies, no pinned staging); False: always stage.
        zero_copy: bool = True

    @classmethod
    def probe(cls) -> Availability:
        a = torch.arange(8, dtype=torch.int64)
        if int(a.index_select(0, torch.tensor([3])).item()) != 3:
            return Availability.unavailable("torch index_select returned a wrong value")
        return Availability.available(f"torch {torch.__version__}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(device_types=("cpu", "cuda", "any torch device"), auto_priority=0)

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        c = self.config
        v = c.staging_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{self.name}: staging_bytes must be a positive integer, got "
                              f"{v!r}", key="staging_bytes", value=v)
        if host_pool.raw.device.type != "cpu":
            raise LayoutError(f"{self.name}: host pool must be in host memory, got "
                              f"{host_pool.raw.device}")
        self.device = device_pool.device
        self._dm = self._device_module(self.device)
        self.layer_bytes = self.spec.page_bytes // self.spec.num_layers
        self._alias = self._host_alias() if c.zero_copy else None
        self.zero_copy = self._alias is not None
        plans = [self._layer_plan(layer) for layer in range(self.spec.num_layers)]
        self._pieces = [p[0] for p in plans]
        self._runs = [p[1] for p in plans]
        self._width = [p[2] for p in plans]
        self._slots: list[_Slot] = []
        self._stream = None
        if self._dm is not None:
            whole = self.layer_bytes * max(device_pool.num_pages, 1)
            size = max(self.layer_bytes, min(c.staging_bytes, whole))
            self.batch_pages = size // self.layer_bytes
            with self._dm.device(self.device):
                self._slots = [_Slot(self.batch_pages * self.layer_bytes, self.device,
                                     self.device.type != "cpu", host=not self.zero_copy)
                               for _ in range(1 if self.zero_copy else 2)]
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
        return {"zero_copy": self.zero_copy,
                "staging_bytes": len(self._slots) and self._slots[0].dev.numel(),
                "element_bytes": sorted(set(self._width)),
                "pieces_per_layer": len(self._pieces[0]),
                "host_runs_per_layer": len(self._runs[0])}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._worker.join(timeout=30)

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

    def _host_alias(self) -> torch.Tensor | None:
        """The host pool as a CUDA tensor (same address: CUDA's unified addressing maps pinned
        and registered host memory into the device's), or None where that does not hold: not
        CUDA (ROCm and other devices stage), or a host pool that is not pinned."""
        raw = self.host_pool.raw
        if self.device.type != "cuda" or not torch.version.cuda or not raw.is_pinned():
            return None

        class _Iface:
            __cuda_array_interface__ = {"shape": (raw.numel(),), "typestr": "|u1",
                                        "data": (raw.data_ptr(), False), "version": 2}
        alias = torch.as_tensor(_Iface(), device=self.device)
        if alias.data_ptr() != raw.data_ptr():
            return None
        return alias

    # ----- layout ---------------------------------------------------------------------------
    def _layer_plan(self, layer: int) -> tuple[list[_Piece], list[_Run], int]:
        """A layer's device chunks as columns of a staging row (one row per page, the page's
        bytes of this layer in host order), and the host runs those rows come from: one per
        page for page_first host pools; one per chunk (cut at component boundaries) for
        layer_first ones. Copies use the widest element (8, 4, 2 or 1 bytes) the sizes,
        strides and addresses allow."""
        spec, hp = self.spec, self.host_pool
        raw, P = hp.raw, hp.num_pages
        C, cb = spec.num_components, spec.chunk_bytes
        lb = self.layer_bytes
        cuts = []                   # (device view uint8 [pages, n], byte column, host off, stride)
        at = 0
        for chunk in self.device_pool.chunks[layer]:
            n = int(chunk.shape[1])
            o = 0
            while o < n:
                if hp.layout == PAGE_FIRST:
                    take, hoff, hstride = n - o, layer * lb + at + o, spec.page_bytes
                else:
                    comp, within = divmod(at + o, cb)
                    take = min(n - o, cb - within)
                    hoff, hstride = (layer * C + comp) * P * cb + within, cb
                cuts.append((chunk[:, o:o + take], at + o, hoff, hstride))
                o += take
            at += n
        if at != lb:
            raise LayoutError(f"{self.name}: device chunks of layer {layer} hold {at} bytes, "
                              f"a page-layer is {lb}")
        base = raw.data_ptr()
        w, dt = next((w, dt) for w, dt in _WIDTHS if not lb % w and all(
            not (int(d.shape[1]) % w or col % w or off % w or stride % w or (base + off) % w
                 or d.stride(0) % w or d.data_ptr() % w) for d, col, off, stride in cuts))
        pieces = [_Piece(dev=d.view(dt), col0=col // w, cols=int(d.shape[1]) // w)
                  for d, col, _, _ in cuts]

        def host_view(off: int, stride: int, n: int, of: torch.Tensor = raw) -> torch.Tensor:
            return of.as_strided((P, n), (stride, 1), of.storage_offset() + off).view(dt)
        if self.device.type == "cpu":           # device rows are plain memory: run by run
            runs = [_Run(off, stride, col, int(d.shape[1]), host_view(off, stride,
                         int(d.shape[1])), d.view(dt)) for d, col, off, stride in cuts]
        elif hp.layout == PAGE_FIRST:
            runs = [_Run(layer * lb, spec.page_bytes, 0, lb,
                         host_view(layer * lb, spec.page_bytes, lb))]
        else:
            runs = [_Run(off, stride, col, int(d.shape[1]), host_view(off, stride,
                         int(d.shape[1]))) for d, col, off, stride in cuts]
        if self._alias is not None:
            for r in runs:
                r.alias = host_view(r.host_off, r.host_stride, r.nbytes, self._alias)
        return pieces, runs, w

    # ----- internals ------------------------------------------------------------------------
    def _indices(self, host_pages, device_pages) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed:
            raise TransferError(f"{self.name}: engine is closed", backend=self.name)
        h_idx = self.host_pool.check_pages(host_pages)
        d_idx = self.device_pool.check_pages(device_pages)
        if h_idx.numel() != d_idx.numel():
            raise InvalidArgumentError(f"{self.name}: {h_idx.numel()} host pages but "
                                       f"{d_idx.numel()} device pages", argument="pages")
        if self.zero_copy:
            h_idx = self._to_device(h_idx)
        return h_idx, self._to_device(d_idx)

    def _to_device(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices on the engine's device; from the CPU through (cached) pinned memory, so the
        copy is queued on the caller's stream instead of synchronising it."""
        if idx.device == self.device:
            return idx
        if self._dm is None or idx.device.type != "cpu":
            return idx.to(self.device)
        pinned = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
        pinned.copy_(idx)
        return pinned.to(self.device, non_blocking=True)

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
                h_np = h_idx if self.zero_copy else h_idx.cpu().numpy()
                if self._dm is None:        # host copies: their own time is measured
                    handle._begin()
                    for layer in range(self.spec.num_layers):
                        per_layer(layer, h_np, d_idx, handle, pending)
                else:
                    dm = self._dm
                    stream = self._stream or dm.current_stream(self.device)
                    with dm.device(self.device), dm.stream(stream):
                        stream.wait_event(start)
                        for t in (h_np, d_idx):
                            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                                t.record_stream(stream)
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
        if self._dm is None:               # CPU device pool: host rows straight to its rows
            self._direct(layer, h_idx, d_idx.numpy(), to_device=True)
            handle._signal(layer)
            return
        lb, w = self.layer_bytes, self._width[layer]
        for s, e in self._batches(len(h_idx)):
            nb = e - s
            slot = self._slot()
            if self.zero_copy:               # the device reads the host rows itself
                rows = _staged(slot.dev, nb, lb, w, self._pieces[layer][0].dev.dtype)
                for r in self._runs[layer]:
                    torch.index_select(r.alias, 0, h_idx[s:e],  # type: ignore[arg-type]
                                       out=rows[:, r.col // w:(r.col + r.nbytes) // w])
            else:
                self._host_rows(layer, slot.host, h_idx[s:e], gather=True)
                slot.dev[:nb * lb].copy_(slot.host[:nb * lb], non_blocking=True)
                slot.free = self._record()
            rows = _staged(slot.dev, nb, lb, w, self._pieces[layer][0].dev.dtype)
            for p in self._pieces[layer]:
                p.dev.index_copy_(0, d_idx[s:e], rows[:, p.col0:p.col0 + p.cols])
        handle._signal(layer, self._record())

    def _backup_layer(self, layer: int, h_idx: np.ndarray, d_idx: torch.Tensor,
                      handle: LayerwiseHandle, pending: list) -> None:
        if self._dm is None:
            self._direct(layer, h_idx, d_idx.numpy(), to_device=False)
            handle._signal(layer)
            return
        lb, w = self.layer_bytes, self._width[layer]
        batches = list(self._batches(len(h_idx)))
        for s, e in batches:
            while len(pending) >= len(self._slots):   # its slot's bytes are still unread
                self._finish_backup(pending.pop(0), handle)
            nb = e - s
            slot = self._slot()
            rows = _staged(slot.dev, nb, lb, w, self._pieces[layer][0].dev.dtype)
            for p in self._pieces[layer]:
                torch.index_select(p.dev, 0, d_idx[s:e], out=rows[:, p.col0:p.col0 + p.cols])
            if self.zero_copy:               # the device writes the host rows itself
                for r in self._runs[layer]:
                    r.alias.index_copy_(0, h_idx[s:e],  # type: ignore[union-attr,arg-type]
                                        rows[:, r.col // w:(r.col + r.nbytes) // w])
                if e == len(h_idx):
                    handle._signal(layer, self._record())
                continue
            slot.host[:nb * lb].copy_(slot.dev[:nb * lb], non_blocking=True)
            slot.free = self._record()
            pending.append((layer, slot, slot.free, h_idx[s:e], e == len(h_idx)))

    def _finish_backup(self, item: tuple, handle: LayerwiseHandle) -> None:
        layer, slot, ev, h_part, last = item
        ev.synchronize()                   # the worker waits, never the caller
        self._host_rows(layer, slot.host, h_part, gather=False)
        if last:
            handle._signal(layer)

    # ----- host-side copies -------------------------------------------------------------------
    def _host_rows(self, layer: int, staging: torch.Tensor, h: np.ndarray, gather: bool
                   ) -> None:
        """Gather the layer's host rows of pages ``h`` into ``staging`` (page-major rows of
        layer_bytes), or scatter them back: one torch index op per host run, which torch runs
        on its CPU threads (on the H200's 16-core host: 41-45 GB/s for 128 KiB rows, where a
        Python loop of memmoves over 16 threads made 13)."""
        lb, w = self.layer_bytes, self._width[layer]
        rows = _staged(staging, len(h), lb, w, self._runs[layer][0].host_view.dtype)
        idx = torch.from_numpy(h)
        for r in self._runs[layer]:
            cols = rows[:, r.col // w:(r.col + r.nbytes) // w]
            if gather:
                torch.index_select(r.host_view, 0, idx, out=cols)
            else:
                r.host_view.index_copy_(0, idx, cols)

    def _direct(self, layer: int, h: np.ndarray, d: np.ndarray, to_device: bool) -> None:
        """CPU device pools: each run straight between the two pools."""
        hi, di = torch.from_numpy(h), torch.from_numpy(d)
        for r in self._runs[layer]:
            if to_device:
                r.dev_view.index_copy_(0, di, r.host_view.index_select(0, hi))  # type: ignore[union-attr]
            else:
                r.host_view.index_copy_(0, hi, r.dev_view.index_select(0, di))  # type: ignore[union-attr]


def _staged(flat: torch.Tensor, nb: int, lb: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``nb`` page-major rows of a staging buffer, in elements of ``w`` bytes."""
    return flat[:nb * lb].view(dtype).view(nb, lb // w)
