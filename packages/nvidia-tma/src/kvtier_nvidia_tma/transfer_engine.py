"""NVIDIA transfer engines: TMA bulk copies, register copies and the copy engine.

All three move KV pages between a CUDA ``DeviceKVPool`` (layer_first) and a ``HostKVPool``
(page_first or layer_first) in pinned/registered host memory, on the caller's current torch
stream (or a side stream ordered after it), with no host synchronisation: page indices are
int64 tensors read on the device. Loads run one launch per layer by default and record one CUDA
event per layer, so ``handle.wait_layer(i)`` makes the caller's stream wait for layer ``i``
only; backups run one launch for all layers.

Index checking: Python lists and CPU tensors are checked on the host (no cost to the device).
Device tensors are checked before launch only with ``debug=True`` (a check needs a host
sync); without it the kernels still skip out-of-range pairs, never writing through them, and
count them (``bad_pairs()``). Two pairs with the same destination page race (undefined which
lands); ``debug=True`` rejects them.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from kvtier import Availability, Capabilities, TransferEngine
from kvtier.errors import (BackendUnavailableError, ConfigError, InvalidArgumentError,
                           LayoutError, PageIndexError, TransferError)
from kvtier.interfaces import CompletedHandle, TransferHandle
from kvtier.transfer_engines.torch_engine import LayerwiseHandle

from . import KVTIER_INTERFACE_VERSION
from ._plan import (Geometry, KvtParams, check_alignment, host_strides, layer_signal_target,
                    plan_register, plan_tma, tensor_map_geometry, uniform_strides)
from ._probe import probe_cuda

log = logging.getLogger(__name__)

#: 1 GiB: how far apart the host pool's registration is sampled (cuMemHostRegister chunks).
_REG_SAMPLE = 1 << 30


def _check_bool(engine: str, key: str, value: Any) -> None:
    """A switch that must be True or False: ConfigError."""
    if not isinstance(value, bool):
        raise ConfigError(f"{engine}: {key} must be true or false, got {value!r}", key=key,
                          value=value)


def _check_int(engine: str, key: str, value: Any, lo: int) -> None:
    """A setting that must be an integer (not a bool) of at least ``lo``: ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{engine}: {key} must be an integer >= {lo}, got {value!r}",
                          key=key, value=value)


def _check_fraction(engine: str, key: str, value: Any) -> None:
    """A setting that must be a number (not a bool) in [0, 1): ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{engine}: {key} must be a number in [0, 1), got {value!r}",
                          key=key, value=value)


class CudaEventHandle(TransferHandle):
    """Per-layer CUDA events of one transfer. ``wait_layer(i)`` makes the caller's current
    stream wait for layer ``i`` (no host sync); ``synchronize()`` blocks the host."""

    def __init__(self, events: list[Any], device: Any, keep: tuple = ()):
        self._events = events
        self.num_layers = len(events)
        self.device = device
        self._keep = keep                 # index tensors in use until the launches ran

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer!r} out of range [0, {self.num_layers})")

    def wait_layer(self, layer: int) -> None:
        import torch
        self._check_layer(layer)
        torch.cuda.current_stream(self.device).wait_event(self._events[layer])

    def wait(self) -> None:
        import torch
        torch.cuda.current_stream(self.device).wait_event(self._events[-1])

    def done(self) -> bool:
        return bool(self._events[-1].query())

    def synchronize(self) -> None:
        self._events[-1].synchronize()


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
            h, d, d2h, layerwise, handle, start = job
            try:
                eng._dev.make_current()
                self.stream.wait_event(start)         # after the caller's work at the call
                events = eng._queue(h, d, d2h, layerwise, self.stream)
                # the caller wakes once, when the whole transfer is queued (a wake-up per
                # layer made it and this thread take turns at the interpreter); the device
                # still orders each layer's readers after that layer's copies only
                for layer0, layers, ev in events:
                    handle._land(layer0, layers, ev)
            except BaseException as exc:   # raised to the caller by the handle's waits
                handle._fail(exc)

    def stop(self, timeout: float = 10.0) -> None:
        self.jobs.put(None)
        self.thread.join(timeout)


class LayerSignalHandle(CudaEventHandle):
    """Launches that move every layer and count each finished group of ``group`` layers in
    device memory (``nvidia-tma`` with ``layer_signals``): ``wait_layer(i)`` makes the
    caller's current stream wait (``cuStreamWaitValue32``, no host sync) until every pipeline
    has counted the group of layer ``i``; ``wait``/``done``/``synchronize`` use the event after
    the last launch."""

    def __init__(self, flags: Any, targets: list[int], group: int, num_layers: int, done: Any,
                 dev: Any, device: Any, keep: tuple = ()):
        super().__init__([done] * num_layers, device, keep)
        self._flags, self._targets, self._group = flags, targets, group
        self._dev = dev

    def wait_layer(self, layer: int) -> None:
        import torch
        from . import _driver
        self._check_layer(layer)
        g = layer // self._group
        cur = torch.cuda.current_stream(self.device)
        self._flags.record_stream(cur)       # the counters outlive the wait, not just the handle
        self._dev.make_current()
        _driver.stream_wait_geq(cur.cuda_stream, self._flags.data_ptr() + 4 * g,
                                self._targets[g])


class _NvidiaEngine(TransferEngine):
    """What the three engines share: validation of the pools, indices, streams and events."""

    interface_version = KVTIER_INTERFACE_VERSION
    _min_cc = 0
    _needs_16b = True
    _no_null_stream = False
    #: The kernels address K/V as [slots, heads, dim] tensors (token_major / vllm_flash only).
    _needs_layers = True
    _auto_priority: int | None = None

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(device_types=("cuda",), host_layouts=("page_first", "layer_first"),
                            row_alignment=16 if cls._needs_16b else 1,
                            auto_priority=cls._auto_priority,
                            host_indices=not cls._needs_layers)

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        import torch
        from . import _driver
        self._torch = torch
        dev = device_pool.device
        if dev.type != "cuda":
            raise LayoutError(f"{self.name}: the device pool must be on a CUDA device, it is "
                              f"on {dev}")
        ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
        want = self.config.device
        if want is not None and want != ordinal:
            raise LayoutError(f"{self.name}: the device pool is on cuda:{ordinal} but the "
                              f"engine is configured for cuda:{want}")
        self.device = torch.device("cuda", ordinal)
        try:
            self._dev = _driver.device(ordinal)
        except TransferError as exc:
            raise BackendUnavailableError(f"{self.name}: {exc}", kind="transfer_engine",
                                          name=self.name, reason=str(exc)) from exc
        if self._dev.cc < self._min_cc:
            reason = (f"{self._dev.name} (cuda:{ordinal}) is sm_{self._dev.cc}; {self.name} "
                      f"needs sm_{self._min_cc}+")
            raise BackendUnavailableError(f"{self.name}: {reason}", kind="transfer_engine",
                                          name=self.name, reason=reason,
                                          hint="use nvidia-register or nvidia-copy-engine")
        spec = self.spec
        layers = device_pool.require_layers(self.name) if self._needs_layers else None
        if self._needs_16b:
            check_alignment(spec.chunk_bytes, spec.row_bytes, f"{self.name}: ")
        raw = host_pool.raw
        if raw.device.type != "cpu":
            raise LayoutError(f"{self.name}: the host pool must be in host memory, got "
                              f"{raw.device}")
        self._host_dptr = self._registered_base(raw.data_ptr(), raw.numel())
        C, L = spec.num_components, spec.num_layers
        table = ([layers[c][layer].data_ptr() for layer in range(L) for c in range(C)]
                 if layers is not None else [])
        for g, ptr in enumerate(table):
            if self._needs_16b and ptr % 16:
                raise LayoutError(f"{self.name}: device buffer (layer {g // C}, comp {g % C}) "
                                  f"at {ptr:#x} is not 16-byte aligned")
        self._table = table
        self._table_t = torch.tensor(table, dtype=torch.int64, device=self.device)
        hps, hcs = host_strides(spec.chunk_bytes, C, L, host_pool.num_pages, host_pool.layout)
        self._geo = Geometry(chunk_bytes=spec.chunk_bytes, comps=C, num_layers=L,
                             host_page_stride=hps, host_chunk_stride=hcs,
                             host_pages=host_pool.num_pages, dev_pages=device_pool.num_pages)
        self._err = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._side = torch.cuda.Stream(self.device) if self.config.side_stream else None
        self._signals = False           # per-layer signals from one launch (nvidia-tma)
        self._own = None
        self._closed = False

    def _own_stream(self):
        if self._own is None:
            self._own = self._torch.cuda.Stream(self.device)
        return self._own

    # ----- validation ---------------------------------------------------------------------
    def _registered_base(self, ptr: int, nbytes: int) -> int:
        """The device address of the host pool; every part of it must be registered with
        CUDA (pinned), at one contiguous device range."""
        from . import _driver
        self._dev.make_current()
        base = _driver.host_device_pointer(ptr)
        offsets = sorted(set(list(range(0, nbytes, _REG_SAMPLE)) + [nbytes - 1]))
        for off in offsets:
            dptr = _driver.host_device_pointer(ptr + off)
            if dptr is None or base is None:
                raise InvalidArgumentError(
                    f"{self.name}: host pool memory at offset {off} of {nbytes} B is not "
                    "registered with CUDA (pageable); allocate the host pool with "
                    "'cuda-host-register' or 'torch-pinned'", argument="host_pool")
            if dptr != base + off:
                raise InvalidArgumentError(
                    f"{self.name}: host pool is registered in pieces whose device addresses "
                    "are not contiguous", argument="host_pool")
        return base

    def _index(self, pages: Sequence[int] | Any, limit: int, what: str) -> Any:
        torch = self._torch
        from kvtier.device_pool import check_page_indices
        if isinstance(pages, torch.Tensor):
            if pages.dtype.is_floating_point or pages.dtype == torch.bool or pages.dim() != 1:
                raise PageIndexError(f"{what} indices must be a 1-D integer tensor, got "
                                     f"{pages.dtype} {tuple(pages.shape)}", limit=limit)
            if pages.device == self.device:
                t = pages.to(torch.int64)
                if self.config.debug:
                    check_page_indices(t, limit, what)
                return t
            t = check_page_indices(pages.to("cpu"), limit, what)
        else:
            t = check_page_indices(pages, limit, what)
        if t.numel() == 0:
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _indices(self, host_pages, device_pages, dst_device: bool) -> tuple[Any, Any]:
        if self._closed:
            raise TransferError(f"{self.name}: engine is closed", backend=self.name)
        h = self._index(host_pages, self.host_pool.num_pages, "host page")
        d = self._index(device_pages, self.device_pool.num_pages, "device page")
        if h.numel() != d.numel():
            raise InvalidArgumentError(f"{self.name}: {h.numel()} host pages but {d.numel()} "
                                       "device pages", argument="pages")
        if self.config.debug and h.numel():
            dst = d if dst_device else h
            if int(self._torch.unique(dst).numel()) != dst.numel():
                raise PageIndexError(f"{self.name}: destination pages repeat (two pairs would "
                                     "race for one page)")
        return h, d

    # ----- public API ---------------------------------------------------------------------
    def load(self, host_pages, device_pages) -> TransferHandle:
        h, d = self._indices(host_pages, device_pages, dst_device=True)
        return self._submit(h, d, d2h=False, layerwise=self.config.layerwise_load)

    def backup(self, device_pages, host_pages) -> TransferHandle:
        h, d = self._indices(host_pages, device_pages, dst_device=False)
        return self._submit(h, d, d2h=True, layerwise=self.config.layerwise_backup)

    def describe(self) -> dict[str, Any]:
        """What the benchmark records next to a result: kernel, registers, spills."""
        k = getattr(self, "_kernel", None)
        if k is None:
            return {"device": self._dev.name, "cc": self._dev.cc}
        return {"device": self._dev.name, "cc": self._dev.cc, "kernel": k.name, "arch": k.arch,
                "regs": k.num_regs, "local_bytes": k.local_bytes}

    def bad_pairs(self) -> int:
        """Pairs the kernels skipped as out of range since the engine was built (syncs)."""
        return int(self._err.item())

    def close(self) -> None:
        self._closed = True

    # ----- launches -----------------------------------------------------------------------
    def _submit(self, h, d, *, d2h: bool, layerwise: bool) -> TransferHandle:
        torch = self._torch
        L = self.spec.num_layers
        if h.numel() == 0:
            return CompletedHandle(L)
        caller = torch.cuda.current_stream(self.device)
        stream = caller
        side = self._side
        if side is None and self._no_null_stream and caller.cuda_stream == 0:
            side = self._own_stream()       # the batch API refuses the legacy default stream
        if side is not None:
            stream = side
            stream.wait_stream(caller)
            for t in (h, d):
                if t.is_cuda:
                    t.record_stream(stream)
        with torch.cuda.device(self.device):
            self._dev.make_current()
            if layerwise and L > 1 and self._signals:
                return self._launch_signalled(h, d, d2h, stream)
            events = [ev for _, layers, ev in self._queue(h, d, d2h, layerwise, stream)
                      for _ in range(layers)]
        return CudaEventHandle(events, self.device, keep=(h, d))

    def _queue(self, h, d, d2h: bool, layerwise: bool, stream) -> list[tuple[int, int, Any]]:
        """Queue a transfer's copies on ``stream`` (from the caller's thread or an issue
        thread): (first layer, layers, the event after them) per launch. Per-layer transfers
        go in one go where the engine can (:meth:`_launch_per_layer`), else launch by launch."""
        if layerwise and self.spec.num_layers > 1:
            per_layer = self._launch_per_layer(h, d, d2h, stream)
            if per_layer is not None:
                return [(layer, 1, ev) for layer, ev in enumerate(per_layer)]
        out = []
        for layer0, layers in self._ranges(layerwise):
            self._launch(h, d, d2h, layer0, layers, stream.cuda_stream)
            ev = self._torch.cuda.Event()
            ev.record(stream)
            out.append((layer0, layers, ev))
        return out

    def _ranges(self, layerwise: bool) -> list[tuple[int, int]]:
        """(first layer, layers) of each launch: one per layer, or one for all."""
        L = self.spec.num_layers
        return [(layer, 1) for layer in range(L)] if layerwise else [(0, L)]

    def _params(self, h, d, d2h: bool, layer0: int, layers: int) -> KvtParams:
        g = self._geo
        p = KvtParams()
        p.host_base, p.dev_table = self._host_dptr, self._table_t.data_ptr()
        p.host_idx, p.dev_idx, p.err = h.data_ptr(), d.data_ptr(), self._err.data_ptr()
        p.host_page_stride, p.host_chunk_stride = g.host_page_stride, g.host_chunk_stride
        p.chunk_bytes, p.host_pages, p.dev_pages = g.chunk_bytes, g.host_pages, g.dev_pages
        p.n, p.comps, p.layer0, p.layers, p.d2h = h.numel(), g.comps, layer0, layers, int(d2h)
        return p

    def _launch(self, h, d, d2h: bool, layer0: int, layers: int, stream: int) -> None:
        raise NotImplementedError

    def _launch_signalled(self, h, d, d2h: bool, stream) -> TransferHandle:
        raise NotImplementedError

    def _launch_per_layer(self, h, d, d2h: bool, stream) -> list[Any] | None:
        """Queue a per-layer transfer in one go, an event per layer; None: launch by launch."""
        return None


class TmaTransferEngine(_NvidiaEngine):
    """``nvidia-tma``: bulk copies (``cp.async.bulk``) through shared memory, mbarrier
    completion, bulk stores out; the device side of page_first transfers goes through a 4-D
    tensor map (one box = all layers of a page) when the device pool's layers sit at a
    constant stride and chunks are <= 2 KiB."""

    name = "nvidia-tma"
    _min_cc = 90
    _auto_priority = 20

    @dataclass(frozen=True)
    class Config:
        #: CTAs (SMs) the kernel occupies.
        ctas: int = 2
        #: CTAs for launches whose host-contiguous segments (the rows of a page one launch
        #: moves) are at most ``small_bytes``: each segment is two bulk operations, and 2 SMs
        #: do not issue them at the link's rate. 0 (the default): always ``ctas``. On the
        #: H200, per-layer transfers of 512-byte segments ran at 82% (loads) and 57% (backups)
        #: of the link on 2 CTAs and at 91-92% on 4, but a GEMM beside them slowed by 30-50%
        #: instead of 10-15%: worth it only where transfers, not compute, are the bottleneck.
        small_ctas: int = 0
        small_bytes: int = 1024
        #: Pipelines (warps) per CTA; each has its own shared-memory stages. Many small
        #: pipelines keep many bulk operations in flight (measured best on the H200). At most
        #: 31 with ``layer_signals``: a signalled launch adds a warp per CTA that publishes
        #: each finished layer group.
        warps: int = 16
        #: Shared-memory stages per pipeline.
        stages: int = 3
        #: Bytes per stage (a multiple of 128).
        stage_bytes: int = 4096
        #: Bulk-store groups a pipeline may leave reading a stage while it loads ahead (0..2;
        #: loads in flight per pipeline = stages - 1 - stores_in_flight).
        stores_in_flight: int = 0
        #: Use a tensor map for the device side where the pool allows one.
        tensor_map: bool = True
        #: Per-layer completion for loads / backups (``wait_layer``).
        layerwise_load: bool = True
        layerwise_backup: bool = False
        #: How per-layer transfers run: one launch for every layer that counts each finished
        #: layer in device memory, the caller's stream waiting on the count (True), or one
        #: launch and one CUDA event per layer (False; also used where the driver has no
        #: stream memory operations). The count is published by a warp of each CTA that
        #: copies nothing, so the copies never wait on it (records/nvidia-h200-layer-
        #: publisher.md).
        layer_signals: bool = True
        #: Layers counted together with ``layer_signals`` (each group's pieces are cut as a
        #: launch of that many layers would be: longer host runs per page, coarser waits).
        signal_layers: int = 1
        #: Run on an engine-owned stream ordered after the caller's (default: caller's stream).
        side_stream: bool = False
        #: Check device-resident indices (range, repeated destinations) before launch (syncs).
        debug: bool = False
        #: CUDA device the engine must run on (None: the device pool's).
        device: int | None = None

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda((9, 0), "TMA (cp.async.bulk)")

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        from . import _driver
        c = self.config
        self._uniform = uniform_strides(self._table, self._geo.comps, self._geo.num_layers)
        _check_int(self.name, "signal_layers", c.signal_layers, 1)
        self._signals = bool(c.layer_signals) and self._stream_waits_work()
        L = self._geo.num_layers
        # CTAs of this engine's loads (launches of a signal group, of one layer, or of all);
        # cutting one also checks the configuration (raises ConfigError naming the key)
        per_launch = (min(c.signal_layers, L) if self._signals else 1) \
            if c.layerwise_load else L
        signalled = self._signals and (c.layerwise_load or c.layerwise_backup) and L > 1
        self.ctas = self._cut(1, per_launch, tmap_ok=False, loops=L // per_launch,
                              signals=signalled).grid
        self._kernel = _driver.load_kernel(self._dev, "tma_copy.cu", "kvt_tma_copy",
                                           {"KVT_STORES_IN_FLIGHT": c.stores_in_flight})
        self._null_map = _driver.TensorMap()
        self._maps: dict[tuple[int, int, int], Any] = {}
        self._plans: dict[tuple, Any] = {}

    def _cut(self, n: int, layers: int, *, tmap_ok: bool, loops: int = 1,
             signals: bool = False):
        """``plan_tma`` with this engine's settings."""
        c = self.config
        return plan_tma(self._geo, n, layers, ctas=c.ctas, warps=c.warps, stages=c.stages,
                        stage_bytes=c.stage_bytes, tmap_ok=tmap_ok,
                        max_smem=self._dev.max_smem_optin, stores_in_flight=c.stores_in_flight,
                        small_ctas=c.small_ctas, small_bytes=c.small_bytes, loops=loops,
                        signals=signals)

    def _stream_waits_work(self) -> bool:
        """Whether this driver runs ``cuStreamWaitValue32`` on device memory (tried once on a
        counter that already satisfies it); without it per-layer transfers use events."""
        from . import _driver
        torch = self._torch
        flag = torch.ones(1, dtype=torch.int32, device=self.device)
        s = torch.cuda.Stream(self.device)
        try:
            self._dev.make_current()
            _driver.stream_wait_geq(s.cuda_stream, flag.data_ptr(), 1)
            s.synchronize()
            return True
        except TransferError as exc:
            log.warning("%s: stream memory waits unavailable (%s): per-layer transfers use "
                        "one launch per layer", self.name, exc)
            return False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "layer_signals": self._signals, "load_ctas": self.ctas}

    def plan(self, n: int, layer0: int, layers: int, map_layers: int = 0):
        """The launch plan and tensor map for ``n`` pairs over the given layers (the map
        spanning ``map_layers`` layers from ``layer0`` where given: one-layer pieces of a
        launch that loops over every layer)."""
        from . import _driver
        c = self.config
        loops = map_layers // layers if map_layers else 1
        signals = bool(map_layers)
        key = (n, layers, loops, signals)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._cut(n, layers, tmap_ok=c.tensor_map and self._uniform is not None,
                             loops=loops, signals=signals)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = plan
        tmap = self._null_map
        if plan.use_tmap:
            span = map_layers or layers
            mkey = (layer0, span, plan.box_layers)
            if mkey not in self._maps:
                # a box must stay within its launch's layers (its group's, when looping)
                geo = tensor_map_geometry(self._table, self._geo, layer0, span,
                                          plan.box_layers) \
                    if not map_layers or layers % plan.box_layers == 0 else None
                self._maps[mkey] = _driver.TensorMap(geo) if geo is not None else None
            tmap = self._maps[mkey]
            if tmap is None:
                plain = self._plans.get((n, layers, loops, signals, False))
                if plain is None:
                    plain = self._plans[(n, layers, loops, signals, False)] = self._cut(
                        n, layers, tmap_ok=False, loops=loops, signals=signals)
                plan, tmap = plain, self._null_map
        return plan, tmap

    def _launch(self, h, d, d2h, layer0, layers, stream) -> None:
        from . import _driver
        plan, tmap = self.plan(h.numel(), layer0, layers)
        p = plan.fill(self._params(h, d, d2h, layer0, layers))
        p.loops = 1
        _driver.set_dynamic_smem(self._kernel, plan.smem_bytes)
        _driver.launch(self._kernel, plan.grid, plan.threads, plan.smem_bytes, stream, p,
                       tmap.arg)

    def _launch_signalled(self, h, d, d2h, stream) -> TransferHandle:
        """Every layer in one launch of groups of ``signal_layers`` layers (a second launch
        for a last, shorter group), each group cut as a launch of it would be; a zeroed
        counter per group (allocated on ``stream``) that each pipeline with pieces bumps when
        its part of the group is written."""
        from . import _driver
        torch = self._torch
        L = self.spec.num_layers
        G = min(self.config.signal_layers, L)
        full, rest = divmod(L, G)
        with torch.cuda.stream(stream):
            flags = torch.zeros(full + (1 if rest else 0), dtype=torch.int32,
                                device=self.device)
        targets: list[int] = []
        for layer0, layers, loops in [(0, G, full)] + ([(full * G, rest, 1)] if rest else []):
            plan, tmap = self.plan(h.numel(), layer0, layers, map_layers=layers * loops)
            p = plan.fill(self._params(h, d, d2h, layer0, layers))
            p.layer_flags, p.loops = flags.data_ptr() + 4 * len(targets), loops
            _driver.set_dynamic_smem(self._kernel, plan.smem_bytes)
            _driver.launch(self._kernel, plan.grid, plan.threads, plan.smem_bytes,
                           stream.cuda_stream, p, tmap.arg)
            targets += [layer_signal_target(p, plan.pipes)] * loops
        done = torch.cuda.Event()
        done.record(stream)
        return LayerSignalHandle(flags, targets, G, L, done, self._dev, self.device,
                                 keep=(h, d))


class RegisterTransferEngine(_NvidiaEngine):
    """``nvidia-register``: 16-byte register copies by a small grid (any sm_70+ GPU; the
    baseline the TMA engine is measured against)."""

    name = "nvidia-register"
    _min_cc = 70
    _auto_priority = 5

    @dataclass(frozen=True)
    class Config:
        ctas: int = 2
        threads: int = 1024
        #: Independent 16-byte loads in flight per thread (2, 4 or 8).
        unroll: int = 8
        layerwise_load: bool = True
        layerwise_backup: bool = False
        side_stream: bool = False
        debug: bool = False
        device: int | None = None

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda((7, 0), "the register-copy kernel")

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        from . import _driver
        c = self.config
        plan = plan_register(self._geo, 1, 1, ctas=c.ctas, threads=c.threads, unroll=c.unroll)
        self._kernel = _driver.load_kernel(self._dev, "register_copy.cu", plan.kernel)
        self.ctas = c.ctas

    def _launch(self, h, d, d2h, layer0, layers, stream) -> None:
        from . import _driver
        c = self.config
        plan = plan_register(self._geo, h.numel(), layers, ctas=c.ctas, threads=c.threads,
                             unroll=c.unroll)
        for first, count in plan.batches:
            p = self._params(h, d, d2h, layer0, layers)
            p.host_idx += first * 8
            p.dev_idx += first * 8
            p.n = count
            _driver.launch(self._kernel, plan.grid, plan.threads, 0, stream, p)


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
        #: (records/nvidia-h200-transfer-both-default.md), so it is off by default. False:
        #: queued on the caller's thread.
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

    def _submit(self, h, d, *, d2h: bool, layerwise: bool) -> TransferHandle:
        if not self.config.issue_thread:
            return super()._submit(h, d, d2h=d2h, layerwise=layerwise)
        torch = self._torch
        L = self.spec.num_layers
        if h.numel() == 0:
            return CompletedHandle(L)
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
        handle = LayerwiseHandle(L, self.name, torch.cuda)
        iss.jobs.put((h, d, d2h, layerwise, handle, start))
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

    def _launch_per_layer(self, h, d, d2h: bool, stream) -> list[Any] | None:
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


def chunk_runs(device_pool, host_pool) -> dict[str, Any]:
    """Every contiguous byte run of a page, per layer in page order: where it starts on the
    device (base + page * stride) and on the host (offset + page * stride), as NumPy arrays.
    Device runs are ``pool.chunks`` (any device layout); a chunk that spans two host
    components of a layer_first host pool is cut at the boundary."""
    import numpy as np
    spec = device_pool.spec
    P, C, cb = host_pool.num_pages, spec.num_components, spec.chunk_bytes
    lb = spec.page_bytes // spec.num_layers
    rows = []
    for layer, chunks in enumerate(device_pool.chunks):
        at = 0
        for chunk in chunks:
            n, o = int(chunk.shape[1]), 0
            while o < n:
                if host_pool.layout == "page_first":
                    take, hoff, hstride = n - o, layer * lb + at + o, spec.page_bytes
                else:
                    comp, within = divmod(at + o, cb)
                    take = min(n - o, cb - within)
                    hoff, hstride = (layer * C + comp) * P * cb + within, cb
                rows.append((layer, chunk.data_ptr() + o, chunk.stride(0), hoff, hstride, take))
                o += take
            at += n
    a = np.asarray(rows, dtype=np.uint64).reshape(-1, 6)
    return {"layer": a[:, 0].astype(np.int64), "dev_base": a[:, 1], "dev_stride": a[:, 2],
            "host_off": a[:, 3], "host_stride": a[:, 4], "nbytes": a[:, 5]}


def merge_runs(src, dst, sizes):
    """Merge consecutive copies that continue each other on both sides (NumPy, no loop)."""
    import numpy as np
    if src.size <= 1:
        return src, dst, sizes
    starts = _merge_starts(src, dst, sizes)
    run_sizes = np.add.reduceat(sizes, starts)
    return src[starts], dst[starts], run_sizes.astype(np.uint64)


def _merge_starts(src, dst, sizes, every: int = 0):
    """Indices of the copies that begin a merged run: those that do not continue the previous
    copy on both sides (with ``every``, also each ``every``-th copy: runs end there)."""
    import numpy as np
    cont = (src[1:] == src[:-1] + sizes[:-1]) & (dst[1:] == dst[:-1] + sizes[:-1])
    if every:
        cont[every - 1::every] = False
    return np.flatnonzero(np.concatenate(([True], ~cont)))


# --------------------------------------------------------------------------------------------
class RoutedHandle(TransferHandle):
    """The handle of the sub-engine a transfer went to."""

    def __init__(self, inner: TransferHandle, path: str):
        self.inner, self.path = inner, path
        self.num_layers = getattr(inner, "num_layers", None)

    def wait(self) -> None:
        self.inner.wait()

    def wait_layer(self, layer: int) -> None:
        self.inner.wait_layer(layer)

    def done(self) -> bool:
        return self.inner.done()

    def synchronize(self) -> None:
        getattr(self.inner, "synchronize", self.inner.wait)()


#: Chunk sizes the calibration measures (bytes); the crossover is one of them.
CALIBRATION_CHUNKS = (1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
#: What a cached calibration holds; a cache of another version is measured again.
#: 2: each path timed from an idle GPU and behind GPU work, and the copy engine's call time.
CALIBRATION_VERSION = 2


class RoutedTransferEngine(TransferEngine):
    """``nvidia-routed``: each transfer goes to the copy engine where the pool's chunks are
    large enough for it to run at the link and to the SM kernel (``nvidia-tma`` on sm_90+,
    else ``nvidia-register``) where they are small. The crossover, per direction, is measured on
    this machine the first time (both paths timed over scratch pools at the chunk sizes of
    ``CALIBRATION_CHUNKS``) and cached in a file keyed by GPU, driver and settings, or set with
    ``crossover_bytes``. The copy engine takes the chunk sizes from which its device rate (timed
    behind GPU work) stays within ``prefer_copy_within`` of the SM path's and its rate from an
    idle GPU (the calls' host time counts) at most ``idle_shortfall`` under the SM path's. The
    cache holds the measured rates; the crossover is chosen from them with the engine's
    settings. ``stats()`` says which path moved how many bytes.

    A calibrated route to the copy engine is then checked in use: the first ``verify_count``
    transfers of at least ``verify_mib`` in a direction (with no transfer of the engine running
    the other way, from their start to their end) are timed with CUDA events, off the caller's
    streams; if their median falls below the copy engine's own calibrated rate from an idle GPU
    by more than ``verify_margin``, that direction moves to the SM kernel from then on, with a
    warning and ``stats()["rerouted"]``."""

    name = "nvidia-routed"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Chunk size (bytes) from which the copy engine takes a transfer, both directions
        #: (0: measured on this machine, per direction, and cached).
        crossover_bytes: int = 0
        #: Prefer the copy engine where its device rate (timed behind GPU work) is within this
        #: fraction of the SM path's (it leaves the SMs to the model: a GEMM beside it is not
        #: slowed). 0.05: on the H200, strided copies of 32 KiB chunks calibrated at 92% of the
        #: TMA kernel and ran at 80-84% of the link in use where the kernel ran at 90-91%; from
        #: 64 KiB they match it. On one machine whose DMA path ran slower (pinned memcpy at 52.5
        #: GB/s host to device), per-layer copy-engine loads ran at 0.90-0.94 of the kernel and
        #: went to it; 0.1 keeps them on the copy engine there.
        prefer_copy_within: float = 0.05
        #: ... and where, timed from an idle GPU (its calls' host time counts there; the best
        #: of the calibration's runs), it runs at most this fraction under the SM path: the SMs
        #: are left to the model at that cost to a transfer that finds the GPU idle. 0.5: on
        #: the H200, per-layer copy-engine loads of a 61-layer pool calibrated at 0.61-0.96 of
        #: the SM kernel from idle at 64 KiB chunks over four starts (the host's time per copy
        #: differs between starts; 1.01 behind GPU work on all), and at 0.21-0.59 at 16 KiB.
        #: Where 64 KiB went to the SM kernel, a GEMM beside the loads lost half its speed.
        idle_shortfall: float = 0.5
        #: Calibration cache file ("": ~/.cache/kvtier/nvidia-routed.json; "none": no cache).
        cache_file: str = ""
        #: MiB moved per calibration transfer (32 MiB transfers undersell the copy engine:
        #: 56-65% of the link at 64-256 KiB chunks where 256 MiB ones reach ~90%).
        calibrate_mib: int = 128
        #: CTAs of the SM kernel (where chunks are small), and of its launches whose host
        #: segments are at most ``small_bytes`` (see ``nvidia-tma``; 0: ``ctas``).
        ctas: int = 2
        small_ctas: int = 0
        small_bytes: int = 1024
        #: Copies per cuMemcpyBatchAsync call on the copy-engine path, and in a transfer's
        #: first call (see ``nvidia-copy-engine``).
        max_batch: int = 256
        first_batch: int = 0
        #: The copy-engine path queues its copies from a thread per direction (see
        #: ``nvidia-copy-engine``'s ``issue_thread``).
        issue_thread: bool = False
        #: Strided copies over a transfer's layers on the copy-engine path (see
        #: ``nvidia-copy-engine``).
        strided: bool = True
        layerwise_load: bool = True
        layerwise_backup: bool = False
        #: Per-layer transfers on the TMA kernel as one launch with per-layer signals (see
        #: ``nvidia-tma``'s ``layer_signals``).
        layer_signals: bool = True
        signal_layers: int = 1
        #: Transfers at least this large (MiB) check a calibrated copy-engine route in use
        #: (0: never checked).
        verify_mib: int = 32
        #: Transfers timed per direction before the check decides (their median).
        verify_count: int = 3
        #: How far under its own calibrated rate (timed from an idle GPU, as the slowest use
        #: sees it) the copy engine may run in use before the direction moves to the SM kernel.
        #: A calibrated rate is not a rate in use: on the H200 a check against the SM path's
        #: rate fired at 6% under with 128 KiB chunks, then the SM kernel moved those loads at
        #: 85.5% of the link where the copy engine moved them at 87.4%, and a GEMM beside them
        #: slowed by 47-51% instead of 0. Shortfalls it must catch were 17% and more (a copy
        #: engine at 35-48 GB/s against 49.9).
        verify_margin: float = 0.10
        debug: bool = False
        device: int | None = None

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda((7, 0), "the register-copy or TMA kernel and the copy engine")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(device_types=("cuda",), host_layouts=("page_first", "layer_first"),
                            row_alignment=16, auto_priority=30)

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        c = self.config
        for key, lo in (("crossover_bytes", 0), ("calibrate_mib", 1), ("ctas", 1),
                        ("max_batch", 0), ("first_batch", 0), ("verify_mib", 0),
                        ("verify_count", 1)):
            _check_int(self.name, key, getattr(c, key), lo)
        _check_fraction(self.name, "verify_margin", c.verify_margin)
        _check_fraction(self.name, "prefer_copy_within", c.prefer_copy_within)
        _check_fraction(self.name, "idle_shortfall", c.idle_shortfall)
        common = {"layerwise_load": c.layerwise_load, "layerwise_backup": c.layerwise_backup,
                  "debug": c.debug, "device": c.device}
        self.copy = CopyEngineTransferEngine(device_pool, host_pool,
                                             {**common, "max_batch": c.max_batch,
                                              "first_batch": c.first_batch,
                                              "strided": c.strided,
                                              "issue_thread": c.issue_thread})
        sm_cls = TmaTransferEngine if self.copy._dev.cc >= TmaTransferEngine._min_cc \
            else RegisterTransferEngine
        sm_cfg = {**common, "ctas": c.ctas}
        if sm_cls is TmaTransferEngine:
            sm_cfg.update(layer_signals=c.layer_signals, signal_layers=c.signal_layers,
                          small_ctas=c.small_ctas, small_bytes=c.small_bytes)
        self.sm = sm_cls(device_pool, host_pool, sm_cfg)
        self._sm_cfg = sm_cfg
        self.device = self.sm.device
        self.chunk_bytes = min(device_pool.chunk_nbytes)
        if c.crossover_bytes:
            self.crossover = {"h2d": c.crossover_bytes, "d2h": c.crossover_bytes}
            self.crossover_source = "configured"
            self.calibration: dict[str, Any] = {}
        else:
            self.calibration, self.crossover_source = self._calibration()
            self.crossover = {d: self.calibration[d]["crossover"] for d in ("h2d", "d2h")}
        self.route = {d: ("copy_engine" if self.crossover[d] is not None
                          and self.chunk_bytes >= self.crossover[d] else "sm")
                      for d in ("h2d", "d2h")}
        self.ctas = self.sm.ctas if "sm" in self.route.values() else 0
        self._bytes = {"copy_engine": 0, "sm": 0}
        self._transfers = {"copy_engine": 0, "sm": 0}
        # in-use check of calibrated copy-engine routes: directions still being checked,
        # their timed transfers (start, end, bytes) and measured GB/s, the last handle of each
        # direction (a transfer timed while the other way runs would read low)
        self._verify = {d for d in ("h2d", "d2h") if self.route[d] == "copy_engine"
                        and self.crossover_source != "configured" and c.verify_mib > 0}
        self._timed: dict[str, list[tuple[Any, Any, int]]] = {"h2d": [], "d2h": []}
        self._measured: dict[str, list[float]] = {"h2d": [], "d2h": []}
        self._last: dict[str, TransferHandle | None] = {"h2d": None, "d2h": None}
        self._timing_stream: Any = None
        self.rerouted: dict[str, dict[str, Any]] = {}
        log.info("%s: %d-byte chunks: loads -> %s, backups -> %s (crossover %s, %s)",
                 self.name, self.chunk_bytes, self.route["h2d"], self.route["d2h"],
                 self.crossover, self.crossover_source)

    # ----- public API ---------------------------------------------------------------------
    def load(self, host_pages, device_pages) -> TransferHandle:
        return self._go("h2d", lambda e: e.load(host_pages, device_pages), host_pages)

    def backup(self, device_pages, host_pages) -> TransferHandle:
        return self._go("d2h", lambda e: e.backup(device_pages, host_pages), host_pages)

    def indices_on_host(self, direction: str) -> bool:
        """Host indices where ``direction`` goes to the copy engine (it builds its copies'
        addresses on the host: device tensors cost it a sync per transfer), device indices
        where it goes to the SM kernel (it reads them on the device)."""
        super().indices_on_host(direction)
        return self.route[direction] == "copy_engine"

    def stats(self) -> dict[str, Any]:
        """Which path moved how many bytes (and transfers), the routes and the crossover."""
        for d in list(self._verify):
            self._check_route(d)
        return {"bytes": dict(self._bytes), "transfers": dict(self._transfers),
                "route": dict(self.route), "crossover_bytes": dict(self.crossover),
                "crossover_source": self.crossover_source, "sm_engine": self.sm.name,
                "copy_engine_gbps_in_use": {d: list(v) for d, v in self._measured.items()
                                            if v},
                "rerouted": {d: dict(v) for d, v in self.rerouted.items()}}

    def describe(self) -> dict[str, Any]:
        return {**self.stats(), "chunk_bytes": self.chunk_bytes,
                "copy_engine_strided": self.copy._strided_why,
                "calibration": self.calibration}

    def close(self) -> None:
        self.copy.close()
        self.sm.close()

    def _go(self, direction: str, call, host_pages) -> TransferHandle:
        if direction in self._verify:
            self._check_route(direction)
        path = self.route[direction]
        nbytes = len(host_pages) * self.spec.page_bytes
        back = "d2h" if direction == "h2d" else "h2d"
        if self._timed[back]:
            # a timed transfer the other way that may still run overlaps this one: it would
            # read low (the link is shared), so it does not count
            self._timed[back] = [t for t in self._timed[back] if t[1].query()]
        other = self._last[back]
        start = None
        if path == "copy_engine" and direction in self._verify \
                and nbytes >= self.config.verify_mib << 20 \
                and (other is None or other.done()):
            import torch
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
        handle = call(self.copy if path == "copy_engine" else self.sm)
        if start is not None:
            self._time(direction, start, handle, nbytes)
        self._bytes[path] += nbytes
        self._transfers[path] += 1
        self._last[direction] = handle
        return RoutedHandle(handle, path)

    # ----- in-use check of a calibrated copy-engine route -------------------------------------
    def _time(self, direction: str, start, handle: TransferHandle, nbytes: int) -> None:
        """End event on a stream of the engine's own that waits for the transfer (the
        caller's streams are not touched)."""
        import torch
        ts = self._timing_stream
        if ts is None:
            ts = self._timing_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(ts):
            handle.wait()
        end = torch.cuda.Event(enable_timing=True)
        end.record(ts)
        self._timed[direction].append((start, end, nbytes))

    def _check_route(self, direction: str) -> None:
        """Collect the timed transfers that have finished; once enough are measured, keep the
        copy engine or move the direction to the SM kernel."""
        from ._plan import calibrated_rate, copy_engine_falls_short
        pending = []
        for start, end, nbytes in self._timed[direction]:
            if end.query():
                ms = start.elapsed_time(end)
                if ms > 0:
                    self._measured[direction].append(nbytes / ms / 1e6)
            else:
                pending.append((start, end, nbytes))
        self._timed[direction] = pending
        table = {int(k): v for k, v in
                 self.calibration.get(direction, {}).get("table", {}).items()}
        expected = calibrated_rate(table, self.chunk_bytes, "copy")
        verdict = copy_engine_falls_short(self._measured[direction], expected,
                                          self.config.verify_margin,
                                          self.config.verify_count)
        if verdict is None:
            return
        self._verify.discard(direction)
        self._timed[direction] = []
        if verdict:
            got = sorted(self._measured[direction])[len(self._measured[direction]) // 2]
            self.route[direction] = "sm"
            if "sm" in self.route.values():
                self.ctas = self.sm.ctas
            self.rerouted[direction] = {
                "copy_engine_gbps": got, "copy_engine_calibrated_gbps": expected,
                "sm_calibrated_gbps": calibrated_rate(table, self.chunk_bytes, "sm"),
                "chunk_bytes": self.chunk_bytes}
            log.warning("%s: %s on the copy engine ran at %.1f GB/s in use, under its "
                        "calibrated %.1f GB/s by more than %.0f%% (%d-byte chunks): moved to %s",
                        self.name, direction, got, expected, 100 * self.config.verify_margin,
                        self.chunk_bytes, self.sm.name)

    # ----- calibration --------------------------------------------------------------------
    def _cache_key(self) -> str:
        import torch
        dev = self.sm._dev
        return "|".join(str(x) for x in (
            CALIBRATION_VERSION, dev.name, f"sm_{dev.cc}", _driver_version(),
            torch.version.cuda, self.sm.name, self.config.ctas, self.config.max_batch,
            self.config.calibrate_mib, self.host_pool.buffer.backing,
            f"L{self.spec.num_layers}", self._copy_cfg(), sorted(self._sm_cfg.items())))

    def _copy_cfg(self) -> dict[str, Any]:
        """The copy engine's settings for calibration: strided only where this pool allows it."""
        c = self.config
        return {"max_batch": c.max_batch, "first_batch": c.first_batch,
                "strided": self.copy._strided is not None,
                "layerwise_load": c.layerwise_load, "layerwise_backup": c.layerwise_backup}

    def _cache_path(self) -> str | None:
        import os
        f = self.config.cache_file
        if f == "none":
            return None
        if f:
            return f
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        return os.path.join(base, "kvtier", "nvidia-routed.json")

    def _calibration(self) -> tuple[dict[str, Any], str]:
        import json
        import os
        path, key = self._cache_path(), self._cache_key()
        cache: dict[str, Any] = {}
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    cache = json.load(f)
                if not isinstance(cache, dict):
                    raise ValueError("not a JSON object")
                if key in cache:
                    return self._from_cache(cache[key]), "cached"
            except (OSError, ValueError) as exc:
                log.warning("%s: calibration cache %s not used (%s): measuring again",
                            self.name, path, exc)
                cache = cache if isinstance(cache, dict) else {}
                cache.pop(key, None)
        result = calibrate(self.sm._dev.ordinal, type(self.sm), self.config,
                           sm_cfg={k: v for k, v in self._sm_cfg.items()
                                   if k not in ("debug", "device")},
                           copy_cfg=self._copy_cfg(), num_layers=self.spec.num_layers)
        if path:
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                cache[key] = result
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(cache, f, indent=1)
                os.replace(tmp, path)
            except OSError as exc:
                log.warning("%s: could not cache the calibration in %s: %s", self.name, path,
                            exc)
        return result, "calibrated"

    def _from_cache(self, entry: Any) -> dict[str, Any]:
        """A cached calibration, checked (every rate a positive finite number) and its
        crossover chosen again from its table with this engine's settings; ValueError when the
        entry is not one this version wrote."""
        import math
        from ._plan import PathRates
        out: dict[str, Any] = {}
        try:
            for d in ("h2d", "d2h"):
                table = {int(k): PathRates.of(v) for k, v in entry[d]["table"].items()}
                if not table or not all(math.isfinite(x) and x > 0 for r in table.values()
                                        for x in r):
                    raise ValueError(f"{d}: rates must be positive numbers")
                out[d] = calibration_entry(table, self.config)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a calibration: {exc!r}") from None
        return out


def _driver_version() -> str:
    try:
        from . import _driver
        return str(_driver.check(_driver.drv().cuDriverGetVersion(), "cuDriverGetVersion"))
    except Exception:   # the key only needs to change when the driver does
        return "?"


def calibrate(ordinal: int, sm_cls: type, config: Any, sm_cfg: dict[str, Any],
              copy_cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Time the SM kernel and the copy engine at each of ``CALIBRATION_CHUNKS`` over scratch
    pools of ``num_layers`` layers (random pages, medians of 3 after a warm-up), each engine
    with the settings it runs with (per-layer or all-layer transfers per direction, strided
    copies where the real pool allows them). Each transfer is timed from an idle GPU and
    queued behind GPU work (a spin kernel longer than the call), and the call's host time is
    taken; returns per direction the table ``{chunk: PathRates fields}`` and the crossover."""
    import torch
    from kvtier import DeviceKVPool, HostKVPool, KVSpec
    from kvtier.timing import timed_ms
    from kvtier.interfaces import HostBuffer
    from ._plan import PathRates
    nbytes = config.calibrate_mib << 20
    dev = torch.device("cuda", ordinal)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(1, 255)
    buf = HostBuffer(host.data_ptr(), nbytes, host, "cuda-pinned", device_addressable=True)
    tables: dict[str, dict[int, PathRates]] = {"h2d": {}, "d2h": {}}
    stream = torch.cuda.Stream(dev)
    g = torch.Generator().manual_seed(5)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        for chunk in CALIBRATION_CHUNKS:
            spec = KVSpec.mha(num_layers=num_layers, num_kv_heads=1, head_dim=128,
                              page_size=chunk // 256)
            pages = nbytes // spec.page_bytes
            if pages < 2:
                continue
            moved = pages * spec.page_bytes
            dpool = DeviceKVPool.empty(spec, pages, dev)
            hpool = HostKVPool(spec, pages, buffer=buf)
            perm_h = torch.randperm(pages, generator=g)
            perm_d = torch.randperm(pages, generator=g)
            engines = [sm_cls(dpool, hpool, sm_cfg),
                       CopyEngineTransferEngine(dpool, hpool, copy_cfg)]
            for d in ("h2d", "d2h"):
                row = []
                for eng in engines:
                    host_idx = eng.capabilities().host_indices
                    h = perm_h if host_idx else perm_h.to(dev)
                    dd = perm_d if host_idx else perm_d.to(dev)
                    fn = (lambda e=eng, h=h, dd=dd: e.load(h, dd).wait()) if d == "h2d" \
                        else (lambda e=eng, h=h, dd=dd: e.backup(dd, h).wait())
                    # the host's time varies between runs (up to 2x on the H200); what it
                    # adds only slows a run, so the idle rate and call time are the best runs'
                    idle_ms, call_ms = timed_ms(torch, fn, 3, best=True)
                    device_ms = timed_ms(torch, fn, 3, behind_ms=2 * call_ms + 1.0)[0]
                    idle_ms, device_ms = max(idle_ms, 1e-6), max(device_ms, 1e-6)
                    row.append((moved / idle_ms / 1e6, moved / device_ms / 1e6,
                                call_ms / device_ms))
                (sm, sm_dev, _), (ce, ce_dev, ce_share) = row
                tables[d][chunk] = PathRates(sm, ce, sm_dev, ce_dev, ce_share)
            for eng in engines:
                eng.close()
            del dpool, hpool
    torch.cuda.synchronize(dev)
    return {d: calibration_entry(table, config) for d, table in tables.items()}


def calibration_entry(table: dict[int, Any], config: Any) -> dict[str, Any]:
    """One direction of a calibration as it is kept and cached: the table of
    :class:`PathRates` by chunk size, and the crossover ``config``'s rule picks from it."""
    from ._plan import choose_crossover
    return {"table": {str(k): v._asdict() for k, v in table.items()},
            "crossover": choose_crossover(table, config.prefer_copy_within,
                                          config.idle_shortfall)}
