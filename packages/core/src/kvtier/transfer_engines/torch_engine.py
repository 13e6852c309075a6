"""`torch`: the portable transfer engine, built from torch's own copies of bytes.

Works for the CPU and for any torch accelerator with streams and events (CUDA, ROCm, and
devices such as Ascend's whose torch module mirrors ``torch.cuda``). It moves bytes, never
typed elements, so every dtype (fp8 included) and every device layout moves the same way: each
layer of a page is the device pool's byte chunks (``pool.chunks``) in order, copied as 1-, 2-,
4- or 8-byte integers (host scatters as 16-byte words where aligned: ``complex128`` moved by
assignment, bit for bit).

Per group of layers, in batches of pages, through a device staging buffer of page-major rows.
Where the device pool's layers sit at one stride (one allocation, as ``DeviceKVPool.empty``
makes them) a group is as many layers as one staging buffer holds for the
transfer's pages, so each index op moves up to ``staging_bytes`` (a transfer of 59 pages of
61 layers of 72 KiB is 9 ops a side, not 61); otherwise, or with ``group_layers=1``, a group is
one layer:

* **zero copy** (CUDA, host pool pinned or registered): the host pool is seen from the device
  at its own address (unified addressing), and torch's index kernels gather host rows into the
  staging rows and scatter them into the device chunks (backups: the reverse). No CPU copies.
* **staged** (pageable host pools, other devices): torch's CPU index ops (on its own CPU
  threads) gather the host rows into a pinned staging buffer, one contiguous copy moves it,
  and ``index_copy_`` scatters it on the device; backups the reverse.
  Two staging pairs are allocated when the engine is built, so the CPU fills one while the
  other is on the link.

On an accelerator each call becomes one job on the engine's worker thread (jobs run in
submission order). On the CPU (``worker_thread="auto"``) a call copies on the caller's thread
and returns a finished handle: a second thread copying beside the engine's compute on the same
cores costs the compute more than the copy (vLLM on CPU: 15% of its throughput one request at
a time, against 4-10% copied by the caller, `records/vllm-cpu-serve.md`). On an
accelerator the copies run on a side stream ordered after the caller's stream at call time;
each group's layers signal as soon as the group is queued (staged backups: once its rows are
in the host pool), and ``wait_layer(i)`` then makes the caller's stream wait on the event of
layer ``i``'s group: the caller's thread waits at most for the CPU side of that group, never for
the device.

A load of a range of layers (``load(..., layers=(lo, hi))``, ``layer_ranges``) runs the same
groups over layers ``lo .. hi-1`` only, from ``lo``: the device pages' other layers are not
touched, and its handle answers ``wait_layer`` for those layers alone.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..errors import ConfigError, InvalidArgumentError, LayoutError, TransferError
from ..interfaces import (INTERFACE_VERSION, Availability, Capabilities, TransferEngine,
                          TransferHandle)
from ..layout import PAGE_FIRST
from . import check_handle_layer, check_layer_range, completed_handle

#: Element widths tried for the byte rows (wider elements: fewer, larger copies).
_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

#: torch's CPU ``index_select`` copies rows of fewer elements than its grain (32768) with
#: memcpy over all its threads (61-84 GB/s on the H200's 16-core host), but larger rows one
#: after another, each over at most a few threads (8-19 GB/s for 504 KiB rows). Longer rows are
#: therefore cut into parts under the grain, one ``index_select`` each (61-96 GB/s on the
#: engine's views, ``bench/torch_staged_ops.py``), where there is a row per thread; with fewer
#: rows, torch's advanced-index kernel splits every element over the threads (24-54 GB/s). With
#: few threads (a 2-core box) one ``index_select`` stays the fastest at every row size.
_CPU_SELECT_ROW_LIMIT = 32768
_threads = torch.get_num_threads

#: Batch shapes whose views an engine keeps (see ``TorchTransferEngine._plan``).
_PLANS = 256



class LayerwiseHandle(TransferHandle):
    """Per-layer completion signalled by a worker thread (plus device events off the CPU).
    Layers land in order, a group of them at a time: one wake-up per group for a waiting
    caller, since each wake-up makes the caller and the worker take turns at the
    interpreter. A load of layers ``lo .. hi-1`` only (``layers``) lands those, from ``lo``,
    and answers ``wait_layer`` for them alone."""

    def __init__(self, num_layers: int, backend: str, device_module: Any = None,
                 layers: tuple[int, int] | None = None):
        self.num_layers = num_layers
        self.backend = backend
        self._dm = device_module
        self.layers = layers or (0, num_layers)
        self._cond = threading.Condition()
        self._upto = self.layers[0]          # layers lo .. _upto-1 have landed
        self._events: list[Any] = [None] * num_layers
        self._error: BaseException | None = None
        self._busy: float | None = None      # host copies: seconds the worker copied
        self._waited: tuple[Any, Any] = (None, None)    # the stream and event waited last
        self._t0: float | None = None

    # worker side
    def _begin(self) -> None:
        """Host copies start now (their layers are then signalled in order)."""
        self._t0 = time.perf_counter()

    def _land(self, a: int, g: int, event: Any = None) -> None:
        """Layers ``a .. a+g-1`` (the next in order) have landed, behind ``event``."""
        if a != self._upto:
            raise RuntimeError(f"{self.backend}: layer {a} landed before layer {self._upto}")
        if self._t0 is not None and a + g == self.layers[1]:
            self._busy = time.perf_counter() - self._t0     # set before anyone sees it done
        self._events[a:a + g] = [event] * g
        with self._cond:
            self._upto = a + g
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    # caller side
    def wait_layer(self, layer: int) -> None:
        check_handle_layer(layer, *self.layers)
        self._until(layer)
        if self._error is not None:
            raise TransferError(f"{self.backend}: transfer failed: {self._error}",
                                backend=self.backend) from self._error
        ev = self._events[layer]
        if ev is not None:
            stream = self._dm.current_stream()
            if ev is not self._waited[1] or stream != self._waited[0]:
                stream.wait_event(ev)          # a group's layers share one event: wait once
                self._waited = (stream, ev)

    def wait(self) -> None:
        lo, hi = self.layers
        self._until(hi - 1)                  # one wake-up, then each group's event once
        for layer in range(lo, hi):
            self.wait_layer(layer)

    def _until(self, layer: int) -> None:
        if self._upto <= layer and self._error is None:
            with self._cond:
                self._cond.wait_for(lambda: self._upto > layer or self._error is not None)

    def done(self) -> bool:
        if self._error is None and self._upto < self.layers[1]:
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


@dataclass
class _Batch:
    """A batch's views: device pieces and the staging columns they fill or empty, host rows
    seen from the device and theirs (zero copy), the gather steps and scatter pairs between
    the host runs and the pinned staging rows (staged), and the staging bytes the link
    moves."""

    dev: list[tuple[torch.Tensor, torch.Tensor]]
    alias: list[tuple[torch.Tensor, torch.Tensor]]
    dev_flat: torch.Tensor
    host_flat: torch.Tensor
    gather: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    scatter: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


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
        #: capped at what one op can move: a group of layers of the whole device pool).
        staging_bytes: int = 32 << 20
        #: CUDA with a pinned host pool: the device's index kernels read and write the host
        #: pool in place (no CPU copies, no pinned staging); False: always stage.
        zero_copy: bool = True
        #: Most layers one index op moves (0: as many as a staging buffer holds for the
        #: transfer's pages; 1: one layer per op). Groups need the device pool's layers at one
        #: stride; ``wait_layer(i)`` waits for ``i``'s whole group.
        group_layers: int = 0
        #: Where copies run: ``auto`` on the engine's worker thread with an accelerator and
        #: on the caller's thread on the CPU; ``always``: on the worker thread everywhere.
        worker_thread: str = "auto"

    @classmethod
    def probe(cls) -> Availability:
        a = torch.arange(8, dtype=torch.int64)
        if int(a.index_select(0, torch.tensor([3])).item()) != 3:
            return Availability.unavailable("torch index_select returned a wrong value")
        return Availability.available(f"torch {torch.__version__}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(device_types=("cpu", "cuda", "any torch device"), auto_priority=0,
                            layer_ranges=True)

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        c = self.config
        v = c.staging_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{self.name}: staging_bytes must be a positive integer, got "
                              f"{v!r}", key="staging_bytes", value=v)
        g = c.group_layers
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ConfigError(f"{self.name}: group_layers must be an integer >= 0, got {g!r}",
                              key="group_layers", value=g)
        if c.worker_thread not in ("auto", "always"):
            raise ConfigError(f"{self.name}: worker_thread must be 'auto' or 'always', got "
                              f"{c.worker_thread!r}", key="worker_thread",
                              value=c.worker_thread)
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
        self._strides = self._layer_strides()
        self._views: dict[tuple[int, int], tuple[list, list]] = {}
        self._plans: dict[tuple[int, int, int, int], _Batch] = {}
        self._slots: list[_Slot] = []
        self._stream = None
        self.staging_size = 0
        if self._dm is not None:
            groups = self.max_group
            whole = self.layer_bytes * max(device_pool.num_pages, 1) * groups
            size = max(self.layer_bytes, min(c.staging_bytes, whole))
            self.staging_size = size
            self.batch_pages = size // self.layer_bytes
            with self._dm.device(self.device):
                self._slots = [_Slot(size, self.device,
                                     self.device.type != "cpu", host=not self.zero_copy)
                               for _ in range(1 if self.zero_copy else 2)]
                self._stream = self._dm.Stream(self.device) if c.side_stream else None
        self._next = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        #: Copies run on the caller's thread (the CPU, ``worker_thread="auto"``).
        self.on_caller = self._dm is None and c.worker_thread == "auto"
        self._inline = threading.Lock()     # one caller's copies at a time, in call order
        self._worker: threading.Thread | None = None
        if not self.on_caller:
            self._worker = threading.Thread(target=self._run, name="kvtier-torch-engine",
                                            daemon=True)
            self._worker.start()

    # ----- public API -----------------------------------------------------------------------
    def load(self, host_pages, device_pages, layers: tuple[int, int] | None = None
             ) -> TransferHandle:
        span = check_layer_range(layers, self.spec.num_layers, self.name)
        h_idx, d_idx = self._indices(host_pages, device_pages)
        return self._submit(self._load_group, h_idx, d_idx, span)

    def backup(self, device_pages, host_pages) -> TransferHandle:
        h_idx, d_idx = self._indices(host_pages, device_pages)
        return self._submit(self._backup_group, h_idx, d_idx)

    def describe(self) -> dict[str, Any]:
        """What the benchmark records beside a result."""
        return {"zero_copy": self.zero_copy,
                "staging_bytes": self.staging_size,
                "max_group_layers": self.max_group,
                "element_bytes": sorted(set(self._width)),
                "pieces_per_layer": len(self._pieces[0]),
                "host_runs_per_layer": len(self._runs[0])}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._worker is not None:
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
        if self.device.type == "cpu":           # device rows are plain memory: piece by piece
            runs = [_Run(off, stride, col, int(d.shape[1]), host_view(off, stride,
                         int(d.shape[1])), p.dev) for p, (d, col, off, stride) in zip(pieces, cuts)]
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

    # ----- layer groups -----------------------------------------------------------------------
    @property
    def max_group(self) -> int:
        """Most layers one op moves: 1 where the device pool's layers are not at one stride."""
        if self._strides is None:
            return 1
        g = self.config.group_layers
        return self.spec.num_layers if g == 0 else min(g, self.spec.num_layers)

    def _layer_strides(self) -> tuple[list[int], list[int]] | None:
        """Elements from one layer to the next for each device piece and each host run (CPU
        device pools: run ``k``'s device rows are piece ``k``'s): None where some layer is not
        at that stride of the same allocation, with the same shape, strides and element
        width."""
        L = self.spec.num_layers
        if L < 2 or len(set(self._width)) != 1:
            return None
        w = self._width[0]

        def steps(per_layer: list[list[torch.Tensor]]) -> list[int] | None:
            out = []
            for col in zip(*per_layer):
                a = col[0]
                step = col[1].data_ptr() - a.data_ptr()
                if step <= 0 or step % w or any(
                        t.shape != a.shape or t.stride() != a.stride()
                        or t.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                        or t.data_ptr() - a.data_ptr() != i * step for i, t in enumerate(col)):
                    return None
                out.append(step // w)
            return out
        dev = steps([[p.dev for p in ps] for ps in self._pieces])
        host = steps([[r.host_view for r in rs] for rs in self._runs])
        return None if dev is None or host is None else (dev, host)

    def _group_size(self, pages: int) -> int:
        """Layers per op for a transfer of ``pages`` pages: as many as one op's bytes hold."""
        per_layer = pages * self.layer_bytes
        cap = self.staging_size or self.config.staging_bytes
        return max(1, min(self.max_group, cap // per_layer))

    def _group(self, a: int, g: int) -> tuple[list[tuple], list[tuple]]:
        """Views over layers ``a .. a+g-1`` (``[pages, g, elements]``): per device piece
        (rows, first staging column, columns) and per host run (host rows, the same rows seen
        from the device or None, CPU device rows or None, first staging column, columns)."""
        got = self._views.get((a, g))
        if got is not None:
            return got
        w = self._width[a]
        dev, host = self._strides if g > 1 else (None, None)  # type: ignore[misc]

        def widen(t: torch.Tensor | None, steps: list[int] | None, k: int) -> Any:
            if t is None or steps is None:
                return None if t is None else t.unsqueeze(1)
            return t.as_strided((t.shape[0], g, t.shape[1]),
                                (t.stride(0), steps[k], t.stride(1)), t.storage_offset())
        pieces = [(widen(p.dev, dev, k), p.col0, p.cols) for k, p in enumerate(self._pieces[a])]
        runs = [(widen(r.host_view, host, k), widen(r.alias, host, k),
                 widen(r.dev_view, dev, k), r.col // w, r.nbytes // w)
                for k, r in enumerate(self._runs[a])]
        self._views[(a, g)] = (pieces, runs)
        return pieces, runs

    def _rows(self, flat: torch.Tensor, nb: int, a: int, g: int) -> torch.Tensor:
        """The first ``nb`` page-major staging rows of layers ``a .. a+g-1``: ``[nb, g, e]``."""
        w = self._width[a]
        return flat[:nb * g * self.layer_bytes].view(self._pieces[a][0].dev.dtype).view(
            nb, g, self.layer_bytes // w)

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

    def _submit(self, per_group: Callable, h_idx: torch.Tensor, d_idx: torch.Tensor,
                layers: tuple[int, int] | None = None) -> TransferHandle:
        if h_idx.numel() == 0:
            return completed_handle(self.spec.num_layers, layers)
        handle = LayerwiseHandle(self.spec.num_layers, self.name, self._dm, layers)
        start = None
        if self._dm is not None:   # order the side stream after the caller's work so far
            start = self._dm.Event()
            start.record(self._dm.current_stream(self.device))
        job = (per_group, h_idx, d_idx, handle, start)
        if self.on_caller:
            with self._inline:
                self._job(*job)
        else:
            self._jobs.put(job)
        return handle

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._job(*job)

    def _job(self, per_group: Callable, h_idx: torch.Tensor, d_idx: torch.Tensor,
             handle: "LayerwiseHandle", start: Any) -> None:
        pending: list[tuple] = []
        lo, hi = handle.layers             # every layer, or the range a load asked for
        g = self._group_size(len(h_idx))
        try:
            h_np = h_idx if self.zero_copy else h_idx.cpu().numpy()
            if self._dm is None:        # host copies: their own time is measured
                handle._begin()
                for a in range(lo, hi, g):
                    per_group(a, min(g, hi - a), h_np, d_idx, handle, pending)
            else:
                dm = self._dm
                stream = self._stream or dm.current_stream(self.device)
                with dm.device(self.device), dm.stream(stream):
                    stream.wait_event(start)
                    for t in (h_np, d_idx):
                        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                            t.record_stream(stream)
                    for a in range(lo, hi, g):
                        per_group(a, min(g, hi - a), h_np, d_idx, handle, pending)
                    while pending:
                        self._finish_backup(pending.pop(0), handle)
        except BaseException as exc:  # surfaced to the caller by the handle
            handle._fail(exc)
            if self.on_caller and not isinstance(exc, Exception):
                raise                     # an interrupt of the caller's own thread

    def _batches(self, n: int, g: int):
        step = n if self._dm is None else max(1, self.staging_size // (g * self.layer_bytes))
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

    def _plan(self, slot: _Slot, nb: int, a: int, g: int) -> "_Batch":
        """The views a batch of ``nb`` pages of layers ``a .. a+g-1`` through ``slot`` uses,
        built once per shape (a transfer's batches repeat a few shapes, and so do transfers)."""
        key = (id(slot), nb, a, g)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        if len(self._plans) >= _PLANS:
            self._plans.clear()
        pieces, runs = self._group(a, g)
        drows = self._rows(slot.dev, nb, a, g)
        nbytes = nb * g * self.layer_bytes
        plan = _Batch(dev=[(d, drows[:, :, col:col + n]) for d, col, n in pieces],
                      alias=[(al, drows[:, :, col:col + n]) for _, al, _, col, n in runs
                             if al is not None],
                      dev_flat=slot.dev[:nbytes], host_flat=slot.host[:nbytes])
        if slot.host.numel():
            hrows = self._rows(slot.host, nb, a, g)
            for host, _, _, col, n in runs:
                cols = hrows[:, :, col:col + n]
                plan.gather += _gather_steps(host, cols, nb)
                plan.scatter.append(_scatter_pair(host, cols))
        self._plans[key] = plan
        return plan

    def _load_group(self, a: int, g: int, h_idx: np.ndarray, d_idx: torch.Tensor,
                    handle: LayerwiseHandle, pending: list) -> None:
        if self._dm is None:               # CPU device pool: host rows straight to its rows
            self._direct(a, g, h_idx, d_idx.numpy(), to_device=True)
            handle._land(a, g)
            return
        ev = None
        for s, e in self._batches(len(h_idx), g):
            slot = self._slot()
            plan = self._plan(slot, e - s, a, g)
            if self.zero_copy:               # the device reads the host rows itself
                for alias, cols in plan.alias:
                    torch.index_select(alias, 0, h_idx[s:e], out=cols)  # type: ignore
            else:
                self._host_rows(plan, h_idx[s:e], gather=True)
                plan.dev_flat.copy_(plan.host_flat, non_blocking=True)
            d = d_idx[s:e]
            for dev, cols in plan.dev:
                dev.index_copy_(0, d, cols)
            if not self.zero_copy:         # this batch's layers are in; its slot is free
                ev = slot.free = self._record()
        handle._land(a, g, ev if ev is not None else self._record())

    def _backup_group(self, a: int, g: int, h_idx: np.ndarray, d_idx: torch.Tensor,
                      handle: LayerwiseHandle, pending: list) -> None:
        if self._dm is None:
            self._direct(a, g, h_idx, d_idx.numpy(), to_device=False)
            handle._land(a, g)
            return
        batches = list(self._batches(len(h_idx), g))
        for s, e in batches:
            while len(pending) >= len(self._slots):   # its slot's bytes are still unread
                self._finish_backup(pending.pop(0), handle)
            slot = self._slot()
            plan = self._plan(slot, e - s, a, g)
            d = d_idx[s:e]
            for dev, cols in plan.dev:
                torch.index_select(dev, 0, d, out=cols)
            if self.zero_copy:               # the device writes the host rows itself
                for alias, cols in plan.alias:
                    alias.index_copy_(0, h_idx[s:e], cols)  # type: ignore[arg-type]
                if e == len(h_idx):
                    handle._land(a, g, self._record())
                continue
            plan.host_flat.copy_(plan.dev_flat, non_blocking=True)
            slot.free = self._record()
            pending.append((a, g, plan, slot.free, h_idx[s:e], e == len(h_idx)))

    def _finish_backup(self, item: tuple, handle: LayerwiseHandle) -> None:
        a, g, plan, ev, h_part, last = item
        ev.synchronize()                   # the worker waits, never the caller
        self._host_rows(plan, h_part, gather=False)
        if last:
            handle._land(a, g)

    # ----- host-side copies -------------------------------------------------------------------
    def _host_rows(self, plan: "_Batch", h: np.ndarray, gather: bool) -> None:
        """Gather a batch's host rows (pages ``h``) into its pinned staging rows, or scatter
        them back: torch index ops per host run, which torch runs on its CPU threads (long
        rows cut into parts, see ``_cpu_gather``)."""
        idx = torch.from_numpy(h)
        if gather:
            _run_gather(plan.gather, idx)
        else:
            for host, cols in plan.scatter:
                host.index_copy_(0, idx, cols)

    def _direct(self, a: int, g: int, h: np.ndarray, d: np.ndarray, to_device: bool) -> None:
        """CPU device pools: each run straight between the two pools."""
        hi, di = torch.from_numpy(h), torch.from_numpy(d)
        for host, _, dev, _, _ in self._group(a, g)[1]:
            if to_device:
                _cpu_scatter(dev, di, _cpu_gather(host, hi))
            else:
                _cpu_scatter(host, hi, _cpu_gather(dev, di))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[rows, g, e]`` as ``[rows, g * e]`` (a view) where each row's elements are one
    contiguous run (a group of layers of a page_first host pool, page-major staging rows);
    else ``t`` itself."""
    if t.dim() == 3 and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]):
        return t.as_strided((t.shape[0], t.shape[1] * t.shape[2]), (t.stride(0), 1),
                            t.storage_offset())
    return t


def _row_parts(src: torch.Tensor, out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``src`` and ``out`` as pairs of ``[rows, cols]`` views with rows of fewer elements than
    torch's CPU select grain (each row contiguous where ``src``'s and ``out``'s are)."""
    s, o = _flat(src), _flat(out)
    if s.dim() == 2 and o.dim() == 2:
        pairs = [(s, o)]
    else:
        pairs = [(src[:, j], out[:, j]) for j in range(src.shape[1])]
    parts = []
    for a, b in pairs:
        n = a.shape[1]
        step = -(-n // -(-n // (_CPU_SELECT_ROW_LIMIT - 1)))   # equal parts under the grain
        parts += [(a[:, c:c + step], b[:, c:c + step]) for c in range(0, n, step)]
    return parts


def _scatter_pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` as 2-D views where both sides have them (torch's index-copy kernel
    then walks one dimension less per element), and in 16-byte elements where both sides'
    sizes, strides and addresses allow (it copies element by element: 80-92 GB/s in 16-byte
    elements on the H200's host against 56-65 in 8-byte ones). The 16-byte element is
    ``complex128``, copied by assignment: a move of its bits, no arithmetic."""
    d, s = _flat(dst), _flat(src)
    if d.dim() != 2 or s.dim() != 2:
        d, s = dst, src
    wd, ws = _wide(d), _wide(s)
    return (wd, ws) if wd is not None and ws is not None else (d, s)


def _wide(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` seen in 16-byte elements (same bytes), or None where its layout does not allow it."""
    w = t.element_size()
    if w >= 16 or t.dim() == 0 or t.stride(-1) != 1 or t.data_ptr() % 16 \
            or (t.storage_offset() * w) % 16 or (t.shape[-1] * w) % 16 \
            or any((st * w) % 16 for st in t.stride()[:-1]):
        return None
    return t.view(torch.complex128)


def _cpu_scatter(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[idx] = src`` along dim 0 on the CPU."""
    d, s = _scatter_pair(dst, src)
    d.index_copy_(0, idx, s)


def _gather_steps(src: torch.Tensor, out: torch.Tensor, rows: int
                  ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The ops that gather ``rows`` rows of ``src`` into ``out`` (see ``_cpu_gather``)."""
    op = _gather_op(math.prod(src.shape[1:]), rows)
    if op == "parts":
        return [("select", a, b) for a, b in _row_parts(src, out)]
    return [(op, src, out)]


def _run_gather(steps: list[tuple[str, torch.Tensor, torch.Tensor]], idx: torch.Tensor) -> None:
    for op, src, out in steps:
        if op == "select":
            torch.index_select(src, 0, idx, out=out)
        else:
            torch.ops.aten.index.Tensor_out(src, [idx], out=out)


def _cpu_gather(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``src[idx]`` along dim 0 on the CPU (into ``out`` when given). Rows under torch's grain
    go through one ``index_select`` (it copies them with memcpy over every thread), as do rows
    whose own copy already spreads over every thread; longer rows, with at least a row per
    thread, are cut into parts under the grain, one ``index_select`` each; with fewer rows,
    torch's advanced-index kernel (see ``_CPU_SELECT_ROW_LIMIT``)."""
    if out is None:
        out = src.new_empty((idx.numel(), *src.shape[1:]))
    _run_gather(_gather_steps(src, out, idx.numel()), idx)
    return out


def _gather_op(row: int, rows: int) -> str:
    """How ``_cpu_gather`` copies ``rows`` rows of ``row`` elements: ``select`` (one
    ``index_select``), ``parts`` (one per part of the rows under the grain) or ``index``
    (torch's advanced-index kernel)."""
    threads = _threads()
    if row < _CPU_SELECT_ROW_LIMIT or threads <= -(-row // _CPU_SELECT_ROW_LIMIT):
        return "select"
    return "parts" if rows >= threads else "index"
