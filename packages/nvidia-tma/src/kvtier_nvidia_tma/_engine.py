"""What the NVIDIA engines share: config checks, CUDA-event handles, the per-layer signal
handle, the issuing thread and `_NvidiaEngine` (pools, registration, index checks)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvtier import Capabilities, TransferEngine
from kvtier.errors import (BackendUnavailableError, ConfigError, InvalidArgumentError,
                           LayoutError, PageIndexError, TransferError)
from kvtier.interfaces import TransferHandle
from kvtier.transfer_engines import check_handle_layer, check_layer_range, completed_handle

from . import KVTIER_INTERFACE_VERSION
from ._plan import Geometry, KvtParams, check_alignment, host_strides

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
    stream wait for layer ``i`` (no host sync); ``synchronize()`` blocks the host. A load of
    layers ``lo .. hi-1`` only (``layers``) has an event for each of those, in order, and
    answers ``wait_layer`` for them alone (``num_layers`` is then the pool's)."""

    def __init__(self, events: list[Any], device: Any, keep: tuple = (),
                 layers: tuple[int, int] | None = None, num_layers: int | None = None):
        self._events = events
        self.layers = layers or (0, len(events))
        self.num_layers = len(events) if num_layers is None else num_layers
        self.device = device
        self._keep = keep                 # index tensors in use until the launches ran

    def _check_layer(self, layer: int) -> None:
        check_handle_layer(layer, *self.layers)

    def wait_layer(self, layer: int) -> None:
        import torch
        self._check_layer(layer)
        torch.cuda.current_stream(self.device).wait_event(self._events[layer - self.layers[0]])

    def wait(self) -> None:
        import torch
        torch.cuda.current_stream(self.device).wait_event(self._events[-1])

    def done(self) -> bool:
        return bool(self._events[-1].query())

    def synchronize(self) -> None:
        self._events[-1].synchronize()


class LayerSignalHandle(CudaEventHandle):
    """Launches that move every layer and count each finished group of ``group`` layers in
    device memory (``nvidia-tma`` with ``layer_signals``): ``wait_layer(i)`` makes the
    caller's current stream wait (``cuStreamWaitValue32``, no host sync) until every pipeline
    has counted the group of layer ``i``; ``wait``/``done``/``synchronize`` use the event after
    the last launch. The counters are zeroed on the launch's stream (``zeroed``: the event
    after it): a stream waits for that first, or it could read what their memory held before
    (the count of an earlier launch) and go ahead of the copies."""

    def __init__(self, flags: Any, targets: list[int], group: int, num_layers: int, done: Any,
                 dev: Any, device: Any, keep: tuple = (), zeroed: Any = None):
        super().__init__([done] * num_layers, device, keep)
        self._flags, self._targets, self._group = flags, targets, group
        self._dev = dev
        self._zeroed = zeroed
        self._zero_waited: int | None = None   # the stream (handle) last ordered after it

    def wait_layer(self, layer: int) -> None:
        import torch
        from . import _driver
        self._check_layer(layer)
        g = layer // self._group
        cur = torch.cuda.current_stream(self.device)
        if self._zeroed is not None and cur.cuda_stream != self._zero_waited:
            cur.wait_event(self._zeroed)       # (a torch Stream is never != None: compare handles)
            self._zero_waited = cur.cuda_stream
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
                            host_indices=not cls._needs_layers, layer_ranges=True)

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
        assert base is not None          # offsets is never empty: the loop refused a None
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
    def load(self, host_pages, device_pages, layers: tuple[int, int] | None = None
             ) -> TransferHandle:
        span = check_layer_range(layers, self.spec.num_layers, self.name)
        if span == (0, self.spec.num_layers):
            span = None                     # every layer: the tuned paths, the same handle
        h, d = self._indices(host_pages, device_pages, dst_device=True)
        return self._submit(h, d, d2h=False, layerwise=self.config.layerwise_load,
                            layers=span)

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
    def _submit(self, h, d, *, d2h: bool, layerwise: bool,
                layers: tuple[int, int] | None = None) -> TransferHandle:
        """Queue a transfer of every layer, or of layers ``lo .. hi-1`` (``layers``: a
        ranged load, launch by launch over the range, an event per launch)."""
        torch = self._torch
        L = self.spec.num_layers
        if h.numel() == 0:
            return completed_handle(L, layers)
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
            if layers is None and layerwise and L > 1 and self._signals:
                return self._launch_signalled(h, d, d2h, stream)
            events = [ev for _, n, ev in self._queue(h, d, d2h, layerwise, stream, layers)
                      for _ in range(n)]
        return CudaEventHandle(events, self.device, keep=(h, d), layers=layers, num_layers=L)

    def _queue(self, h, d, d2h: bool, layerwise: bool, stream,
               layers: tuple[int, int] | None = None,
               land: Callable[[int, int, Any], None] | None = None
               ) -> list[tuple[int, int, Any]]:
        """Queue a transfer's copies on ``stream`` (from the caller's thread or an issue
        thread): (first layer, layers, the event after them) per launch, each also given to
        ``land`` as soon as it is queued. Per-layer transfers of every layer go in one go
        where the engine can (:meth:`_launch_per_layer`), else (and ranged loads:
        ``layers``) launch by launch."""
        if layers is None and layerwise and self.spec.num_layers > 1:
            per_layer = self._launch_per_layer(h, d, d2h, stream, land)
            if per_layer is not None:
                return [(layer, 1, ev) for layer, ev in enumerate(per_layer)]
        out = []
        for layer0, n in self._ranges(layerwise, layers):
            self._launch(h, d, d2h, layer0, n, stream.cuda_stream)
            ev = self._torch.cuda.Event()
            ev.record(stream)
            out.append((layer0, n, ev))
            if land is not None:
                land(layer0, n, ev)
        return out

    def _ranges(self, layerwise: bool, layers: tuple[int, int] | None = None
                ) -> list[tuple[int, int]]:
        """(first layer, layers) of each launch: one per layer, or one for all (of the range
        ``layers``, where given)."""
        lo, hi = layers or (0, self.spec.num_layers)
        return [(layer, 1) for layer in range(lo, hi)] if layerwise else [(lo, hi - lo)]

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

    def _launch_per_layer(self, h, d, d2h: bool, stream,
                          land: Callable[[int, int, Any], None] | None = None
                          ) -> list[Any] | None:
        """Queue a per-layer transfer in one go, an event per layer; None: launch by launch."""
        return None
