"""``nvidia-copy-engine``: KV pages moved by the GPU's DMA engines (`cuMemcpyBatchAsync`),
no SM held; the copy lists it queues."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

from kvtier import Availability
from kvtier.errors import TransferError
from kvtier.interfaces import TransferHandle
from kvtier.transfer_engines import completed_handle
from kvtier.transfer_engines.torch_engine import LayerwiseHandle

from ._engine import _check_bool, _check_int, _NvidiaEngine
from ._probe import probe_cuda
from ._runs import _merge_starts, chunk_runs, merge_runs

log = logging.getLogger(__name__)


class _Issuer:
    """One direction's stream and the thread that queues its copies, in submission order."""

    def __init__(self, engine: "CopyEngineTransferEngine", direction: str):
        import torch
        self.engine = engine
        self.stream = torch.cuda.Stream(engine.device)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"kvtier-copy-engine-{direction}")
        self.thread.start()

    def _run(self) -> None:
        import torch
        eng = self.engine
        torch.cuda.set_device(eng.device)           # the driver's calls need a context
        while True:
            job = self.jobs.get()
            if job is None:
                return
            h, d, d2h, layerwise, layers, handle, start = job
            try:
                eng._dev.make_current()
                self.stream.wait_event(start)         # after the caller's work at the call
                # each layer is handed over as soon as its copies are queued: a caller
                # launching layer by layer (a prefill waiting for layer i) goes on while the
                # later layers are queued here, in the driver, without the interpreter's lock
                eng._queue(h, d, d2h, layerwise, self.stream, layers, handle._land)
            except BaseException as exc:   # raised to the caller by the handle's waits
                handle._fail(exc)

    def stop(self, timeout: float = 10.0) -> None:
        self.jobs.put(None)
        self.thread.join(timeout)


class CopyEngineTransferEngine(_NvidiaEngine):
    """``nvidia-copy-engine``: the GPU's DMA engines through ``cuMemcpyBatchAsync`` (batches of
    ``max_batch`` copies; runs of chunks contiguous on both sides merged into one copy). Uses no
    SMs.
    Addresses are built on the host, so device-resident indices are copied to the host
    (a sync); pass Python lists or CPU tensors to avoid it. Any row size works. Called on the
    legacy default stream, the batch runs on an engine stream ordered after it (the batch API
    refuses the null stream); the handle's events order the caller after it as usual."""

    name = "nvidia-copy-engine"
    _min_cc = 0
    _needs_16b = False
    _no_null_stream = True
    _needs_layers = False           # moves pool.chunks: every device layout
    _auto_priority = 10

    @dataclass(frozen=True)
    class Config:
        layerwise_load: bool = True
        layerwise_backup: bool = False
        #: Copies per ``cuMemcpyBatchAsync`` call (0: a launch's copies in one batch). On the
        #: H200, batches of thousands of copies ran at 39-72% of the link where 256 ran at 87-96%
        #: (records/nvidia-h200-transfer.md).
        max_batch: int = 256
        #: Copies in a transfer's first ``cuMemcpyBatchAsync`` call, each next call 4x more up
        #: to ``max_batch``; the first pages' addresses are built and queued before the rest,
        #: so the DMA engines start after a few copies are queued, not after a whole batch
        #: (0: every call ``max_batch``). Off by default: on the H200, 16 did not help strided
        #: copies and cost one-copy-per-chunk transfers 1-7 points at 32 KiB
        #: (records/nvidia-h200-transfer-strided.md).
        first_batch: int = 0
        side_stream: bool = False
        debug: bool = False
        device: int | None = None
        #: Where the pool's layers sit at a constant stride (one allocation, as most engines
        #: make), move each run of a page over every layer of a transfer in one strided copy
        #: (``cuMemcpy3DBatchAsync``: a row per layer) instead of one copy per chunk and layer:
        #: 2 to 61 times fewer copies for the host to queue. Transfers of one layer (per-layer
        #: loads) are unchanged.
        strided: bool = True
        #: Queue each direction's copies from a thread of its own, on a stream of its own,
        #: ordered after the caller's work at the call: the caller returns at once and a load
        #: and a backup called together are queued side by side. On the H200, per-layer loads
        #: beside all-layer backups at 72-128 KiB ran at 75-83% of the ceiling with it and
        #: 55-63% without (a per-layer load holds the caller's thread for ~55% of its transfer
        #: time), but it cost one direction alone 0.5-6 points
        #: (records/nvidia-h200-transfer-both-default.md), so it is off by default. A
        #: per-layer load hands each layer over as soon as its copies are queued. Beside a
        #: prefill launched from Python it took the load's queueing off the serving thread
        #: (1.6 against 3.4 ms a request) but the prefill ran 6-8 ms longer
        #: (records/l3-staging.md, call 17). False: queued on the caller's thread.
        issue_thread: bool = False

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda(need_nvrtc=False)

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        import numpy as np
        from . import _driver
        for key in ("max_batch", "first_batch"):
            _check_int(self.name, key, getattr(self.config, key), 0)
        for key in ("strided", "issue_thread"):
            _check_bool(self.name, key, getattr(self.config, key))
        self._np = np
        self._copier = _driver.BatchCopier()
        self._runs = chunk_runs(device_pool, host_pool)
        self._runs_per_layer = np.bincount(self._runs["layer"], minlength=self.spec.num_layers)
        self._strided, self._strided_why = None, "off (strided=false)"
        if self.config.strided:
            self._strided, self._strided_why = self._strided_plan()
        self._issuers: dict[bool, _Issuer] = {}
        self._issuers_lock = threading.Lock()

    def _strided_plan(self) -> tuple[dict[str, Any] | None, str]:
        """The pool's runs as strided copies over layers, or None and why not (also where the
        driver refuses a strided copy when tried once, device to device)."""
        from . import _driver
        rows = strided_runs(self._runs, self.spec.num_layers)
        if rows is None:
            return None, "the pool's layers are not at one stride"
        copier = _driver.StridedCopier()
        if not copier.available:
            return None, copier.why
        limit = _driver.max_pitch(self._dev)
        if max(int(rows["dev_pitch"].max()), int(rows["host_pitch"].max())) > limit:
            return None, f"a layer stride is over the device's {limit}-byte pitch limit"
        try:
            strided_self_test(self._torch, self.device, self._dev, copier)
        except TransferError as exc:
            log.warning("%s: strided copies unavailable (%s): one copy per chunk", self.name,
                        exc)
            return None, str(exc)
        self._strided_copier = copier
        return rows, f"{len(rows['nbytes'])} strided copies per page"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "strided": self._strided is not None,
                "strided_why": self._strided_why}

    def _submit(self, h, d, *, d2h: bool, layerwise: bool,
                layers: tuple[int, int] | None = None) -> TransferHandle:
        if not self.config.issue_thread:
            return super()._submit(h, d, d2h=d2h, layerwise=layerwise, layers=layers)
        torch = self._torch
        L = self.spec.num_layers
        if h.numel() == 0:
            return completed_handle(L, layers)
        with self._issuers_lock:
            if self._closed:
                raise TransferError(f"{self.name}: engine is closed", backend=self.name)
            iss = self._issuers.get(d2h)
            if iss is None:
                iss = self._issuers[d2h] = _Issuer(self, "d2h" if d2h else "h2d")
        start = torch.cuda.Event()
        start.record(torch.cuda.current_stream(self.device))
        # layer i's event exists once its copies are queued: wait_layer(i) blocks the calling
        # thread only until then (not until landed), then orders the caller's stream after it
        handle = LayerwiseHandle(L, self.name, torch.cuda, layers)
        iss.jobs.put((h, d, d2h, layerwise, layers, handle, start))
        return handle

    def close(self) -> None:
        with self._issuers_lock:
            self._closed = True
            issuers, self._issuers = list(self._issuers.values()), {}
        for iss in issuers:
            iss.stop()

    def _index(self, pages, limit, what):
        torch = self._torch
        from kvtier.device_pool import check_page_indices
        if isinstance(pages, torch.Tensor) and pages.device.type != "cpu":
            pages = pages.to("cpu")          # a host sync: addresses are built on the host
        return check_page_indices(pages, limit, what)

    def _launch_per_layer(self, h, d, d2h: bool, stream,
                          land: Callable[[int, int, Any], None] | None = None
                          ) -> list[Any] | None:
        """Every layer's copies built in one NumPy pass, then one batch call and one event per
        layer: per-layer loads spend their host time queueing copies, not building them."""
        c = self.config
        lists = layer_copy_lists(self._runs, self._host_dptr, h.numpy(), d.numpy(), d2h,
                                 self.spec.num_layers)
        if lists is None:
            return None
        src, dst, sizes, bounds = lists
        Event = self._torch.cuda.Event
        events: list[Any] = []

        def after(layer: int) -> None:
            ev = Event()
            ev.record(stream)
            events.append(ev)
            if land is not None:
                land(layer, 1, ev)
        self._copier.queue_layers(dst, src, sizes, bounds.tolist(), stream.cuda_stream,
                                  c.max_batch, c.first_batch, after)
        return events

    def _launch(self, h, d, d2h, layer0, layers, stream) -> None:
        c = self.config
        hn, dn = h.numpy(), d.numpy()
        rows = self._strided if layers > 1 else None
        per_page = len(rows["nbytes"]) if rows is not None else \
            max(1, int(self._runs_per_layer[layer0:layer0 + layers].sum()))
        head = -(-c.first_batch // per_page) if c.first_batch else 0
        parts = [(0, head), (head, len(hn))] if 0 < head < len(hn) else [(0, len(hn))]
        for lo, hi in parts:   # the first pages' copies are queued before the rest are built
            first = c.first_batch if lo == 0 else 0
            if rows is not None:
                ops = strided_ops(rows, self._host_dptr, hn[lo:hi], dn[lo:hi], d2h,
                                  layer0, layers)
                self._strided_copier(ops, stream, c.max_batch, first)
            else:
                src, dst, sizes = copy_list(self._runs, self._host_dptr, hn[lo:hi], dn[lo:hi],
                                            d2h, layer0, layers)
                self._copier(dst, src, sizes, stream, c.max_batch, first)


def copy_list(runs: dict[str, Any], host_base: int, h, d, d2h: bool, layer0: int,
              layers: int):
    """(src, dst, sizes) of every copy of a transfer of pairs (h[i], d[i]) over the layers
    ``layer0 .. layer0 + layers``, page by page in page order, contiguous runs merged."""
    import numpy as np
    r = runs
    sel = (r["layer"] >= layer0) & (r["layer"] < layer0 + layers)
    hs = np.asarray(h).astype(np.uint64)[:, None]
    ds = np.asarray(d).astype(np.uint64)[:, None]
    host = np.uint64(host_base) + r["host_off"][sel] + hs * r["host_stride"][sel]
    dev = r["dev_base"][sel] + ds * r["dev_stride"][sel]
    sizes = np.broadcast_to(r["nbytes"][sel], host.shape).ravel()
    host, dev = host.ravel(), dev.ravel()
    src, dst = (dev, host) if d2h else (host, dev)
    return merge_runs(src, dst, sizes)


def layer_copy_lists(runs: dict[str, Any], host_base: int, h, d, d2h: bool, num_layers: int):
    """The copies of a per-layer transfer of pairs (h[i], d[i]), every layer at once: (src,
    dst, sizes, bounds), layer ``l``'s copies at ``bounds[l]:bounds[l + 1]``, each layer's as
    :func:`copy_list` makes them for that layer alone (page by page, contiguous runs merged,
    never across layers). None where layers differ in their number of runs."""
    import numpy as np
    R = runs_per_layer(runs, num_layers)
    if R == 0:
        return None

    def grid(key: str):
        return runs[key].astype(np.uint64).reshape(num_layers, 1, R)
    hs = np.asarray(h).astype(np.uint64).reshape(1, -1, 1)
    ds = np.asarray(d).astype(np.uint64).reshape(1, -1, 1)
    n = hs.size
    host = (np.uint64(host_base) + grid("host_off") + hs * grid("host_stride")).ravel()
    dev = (grid("dev_base") + ds * grid("dev_stride")).ravel()
    sizes = np.broadcast_to(grid("nbytes"), (num_layers, n, R)).ravel()
    src, dst = (dev, host) if d2h else (host, dev)
    per = n * R
    starts = _merge_starts(src, dst, sizes, every=per)    # never across a layer's end
    bounds = np.searchsorted(starts, np.arange(num_layers + 1) * per)
    return src[starts], dst[starts], np.add.reduceat(sizes, starts).astype(np.uint64), bounds


def runs_per_layer(runs: dict[str, Any], num_layers: int) -> int:
    """How many runs each layer has, where every layer has the same number and they come
    layer by layer in order; 0 otherwise."""
    import numpy as np
    layer = runs["layer"]
    R = len(layer) // max(num_layers, 1)
    if R == 0 or R * num_layers != len(layer) \
            or not np.array_equal(layer, np.repeat(np.arange(num_layers), R)):
        return 0
    return R


def strided_runs(runs: dict[str, Any], num_layers: int) -> dict[str, Any] | None:
    """Where every layer has the same runs (sizes and page strides) and run ``j`` of layer
    ``l`` sits ``l`` pitches from layer 0's on both sides, layer 0's runs with those pitches
    (int64, bytes): one strided copy then moves run ``j`` of a page over any range of layers.
    None otherwise, or for one layer (nothing to gain). Pitches are at least the run's size
    (rows of one copy never overlap) and positive."""
    import numpy as np
    R = runs_per_layer(runs, num_layers)
    if num_layers < 2 or R == 0:
        return None
    a = {k: runs[k].astype(np.int64).reshape(num_layers, R)
         for k in ("dev_base", "dev_stride", "host_off", "host_stride", "nbytes")}
    if any((a[k] != a[k][0]).any() for k in ("dev_stride", "host_stride", "nbytes")):
        return None
    steps = np.arange(num_layers, dtype=np.int64)[:, None]
    out = {k: a[k][0] for k in ("dev_base", "dev_stride", "host_off", "host_stride", "nbytes")}
    for side, off in (("dev", "dev_base"), ("host", "host_off")):
        pitch = a[off][1] - a[off][0]
        if (a[off] != a[off][0] + steps * pitch).any() or (pitch < out["nbytes"]).any():
            return None
        out[f"{side}_pitch"] = pitch
    return out


def strided_ops(rows: dict[str, Any], host_base: int, h, d, d2h: bool, layer0: int,
                layers: int):
    """The strided copies (:data:`_driver.OP3D`) of a transfer of pairs (h[i], d[i]) over the
    layers ``layer0 .. layer0 + layers``: per page, per run, ``layers`` rows of the run's
    bytes, a pitch apart on each side."""
    import numpy as np
    from ._driver import pointer_ops
    hs = np.asarray(h).astype(np.int64)[:, None]
    ds = np.asarray(d).astype(np.int64)[:, None]
    host = (int(host_base) + rows["host_off"] + layer0 * rows["host_pitch"]
            + hs * rows["host_stride"]).ravel()
    dev = (rows["dev_base"] + layer0 * rows["dev_pitch"] + ds * rows["dev_stride"]).ravel()
    pages = len(hs)
    hp, dp, width = (np.tile(rows[k], pages) for k in ("host_pitch", "dev_pitch", "nbytes"))
    if d2h:
        return pointer_ops(dev, host, dp, hp, width, layers)
    return pointer_ops(host, dev, hp, dp, width, layers)


def strided_self_test(torch, device, dev, copier) -> None:
    """One strided copy device to device (3 rows of 48 bytes, pitches 80 and 64), checked;
    TransferError where the driver refuses it or moves other bytes."""
    from ._driver import pointer_ops
    src = torch.randint(1, 255, (240,), dtype=torch.uint8, device=device)
    dst = torch.zeros(192, dtype=torch.uint8, device=device)
    op = pointer_ops([src.data_ptr()], [dst.data_ptr()], 80, 64, 48, 3)
    stream = torch.cuda.Stream(device)
    dev.make_current()
    copier(op, stream.cuda_stream)
    stream.synchronize()
    want = src.view(3, 80)[:, :48]
    if not (torch.equal(dst.view(3, 64)[:, :48], want) and not dst.view(3, 64)[:, 48:].any()):
        raise TransferError("nvidia-copy-engine: a strided copy moved other bytes than asked",
                            backend="nvidia-copy-engine")
