"""`ascendc`: page transfers on Memfabric's fused AscendC ``kv_exchange_copy`` kernel.

What SGLang's Ascend HiCache path does, over kvtier's pools: the kernel derives every
(page, layer) row address on the device from one int64 metadata block (see ``metadata``) and
device-resident token indices, so page indices never round-trip through the host and nothing
synchronises a stream.

Per call: the metadata of every launch is built once on the host; it and any host-side indices
go up through one pinned staging buffer with non-blocking copies on the engine's side stream,
and the staging buffer (plus the device buffer the kernel reads) is kept alive until an NPU
event recorded after the last launch has fired. Indices already on the NPU are expanded to
token indices there. The side stream first waits for the caller's stream (an event recorded at
call time), so the transfer sees all work issued before the call.

``load`` (H2D) launches once per layer and records an event per layer: ``wait_layer(i)`` makes
the caller's current stream wait for layer ``i`` only, and ``wait()`` for all of them, without
blocking the host; a load of a range of layers (``layers=(lo, hi)``) makes those layers'
launches only, and its handle answers for them alone. ``backup`` (D2H) covers all layers in
one launch (one per run of evenly spaced device layers when the engine's layer tensors are
scattered); its consumer is the host (L3 stores), so its ``wait()`` blocks the calling thread
until the host pages hold the data.
A non-zero return code from ``kv_exchange_copy`` raises ``TransferError`` carrying that code.

The host pool must live in Memfabric offload memory
(``HostKVPool(..., allocator=MemfabricHostAllocator(...))``): the kernel reads host memory
through its DVA, which torch's pinned memory does not have.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvtier import Availability, Capabilities, TransferEngine, TransferHandle
from kvtier.errors import (BackendUnavailableError, ConfigError, InvalidArgumentError,
                           LayoutError, PageIndexError, TransferError)
from kvtier.transfer_engines import check_handle_layer, check_layer_range, completed_handle

from . import KVTIER_INTERFACE_VERSION
from ._probe import (MEMFABRIC_HINT, TORCH_NPU_HINT, capture_log, import_failure, load_memfabric,
                     load_offload, load_torch_npu, probe_memfabric, probe_npu, quote_errors)
from .metadata import D2H, H2D, META_SIZE, ExchangePlan, token_indices

#: The kernel runs on the last 2 vector cores of its 48 (A3) / 64 (A5) blocks.
KERNEL_CORES = 2


class AscendCHandle(TransferHandle):
    """Completion of one call, as NPU events: one per launch, looked up per layer (of the
    layers ``lo .. hi-1`` a ranged load moved, ``layers``; ``num_layers`` is the pool's)."""

    def __init__(self, npu: Any, device_index: int, layer_events: list[Any], direction: int,
                 keep: tuple, backend: str, layers: tuple[int, int] | None = None,
                 num_layers: int | None = None):
        self._npu = npu
        self._device_index = device_index
        self._events = layer_events
        self._direction = direction
        self._keep = keep                     # buffers the kernels read, alive with the handle
        self.layers = layers or (0, len(layer_events))
        self.num_layers = len(layer_events) if num_layers is None else num_layers
        self.backend = backend

    def _check_layer(self, layer: int) -> Any:
        check_handle_layer(layer, *self.layers)
        return self._events[layer - self.layers[0]]

    def _wait_event(self, ev: Any) -> None:
        try:
            if self._direction == H2D:      # a device consumer: order its stream, no host sync
                self._npu.current_stream(self._device_index).wait_event(ev)
            else:                           # a host consumer: the host pages must hold the data
                ev.synchronize()
        except RuntimeError as exc:
            raise TransferError(f"{self.backend}: transfer failed on the NPU: {exc}",
                                backend=self.backend) from exc

    def wait_layer(self, layer: int) -> None:
        self._wait_event(self._check_layer(layer))

    def wait(self) -> None:
        self._wait_event(self._events[-1])   # one stream: the last event implies the others

    def done(self) -> bool:
        return all(ev.query() for ev in self._events)

    def synchronize(self) -> None:
        """Block the calling thread until every layer has landed."""
        try:
            self._events[-1].synchronize()
        except RuntimeError as exc:
            raise TransferError(f"{self.backend}: transfer failed on the NPU: {exc}",
                                backend=self.backend) from exc


class AscendCTransferEngine(TransferEngine):
    name = "ascendc"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Range-check index tensors that are already on the NPU. The check reads one min/max
        #: back to the host (a sync); turn it off only when the caller guarantees the range.
        validate_device_indices: bool = True

    @classmethod
    def probe(cls) -> Availability:
        npu = probe_npu()
        return npu if not npu.ok else probe_memfabric(launch_kernel=True)

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(device_types=("npu",), layer_ranges=True)

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        for module, hint in (("torch_npu", TORCH_NPU_HINT), ("memfabric_hybrid", MEMFABRIC_HINT)):
            try:
                if module == "torch_npu":
                    torch_npu = load_torch_npu()
                else:
                    self._mf, self._offload = load_memfabric(), load_offload()
            except (ImportError, OSError, RuntimeError) as exc:
                reason = import_failure(module, exc)
                raise BackendUnavailableError(f"{self.name}: {reason}", kind="transfer_engine",
                                              name=self.name, reason=reason, hint=hint) from exc
        npu = self._npu = torch_npu.npu
        dev = device_pool.device
        self._device_index = dev.index if dev.index is not None else int(npu.current_device())
        npu_type = npu.current_stream(self._device_index).device.type
        if dev.type != npu_type:
            raise LayoutError(f"{self.name}: the device pool is on {dev}; this engine moves "
                              f"pages of a pool on the NPU ({npu_type})")
        if host_pool.raw.device.type != "cpu":
            raise LayoutError(f"{self.name}: host pool must be in host memory, got "
                              f"{host_pool.raw.device}")
        self.device = dev
        self._kernel_device = torch.device(dev.type, self._device_index)
        self.plan = ExchangePlan(device_pool, host_pool, self._host_dva(host_pool))
        self._side = npu.Stream(self._device_index)
        self._arange = torch.arange(self.spec.page_size, dtype=torch.int64, device=dev)
        self._inflight: collections.deque = collections.deque()   # (event, kept buffers)
        self._lock = threading.Lock()
        self._closed = False

    # ----- public API -----------------------------------------------------------------------
    def load(self, host_pages, device_pages, layers: tuple[int, int] | None = None
             ) -> TransferHandle:
        span = check_layer_range(layers, self.spec.num_layers, self.name)
        return self._submit(H2D, *self._indices(host_pages, device_pages), layers=span)

    def backup(self, device_pages, host_pages) -> TransferHandle:
        return self._submit(D2H, *self._indices(host_pages, device_pages))

    def close(self) -> None:
        """Wait (host-side) for this engine's work, then drop its buffers; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._side.synchronize()
        except RuntimeError as exc:
            raise TransferError(f"{self.name}: transfer failed on the NPU: {exc}",
                                backend=self.name) from exc
        finally:
            self._inflight.clear()

    @property
    def inflight(self) -> int:
        """Calls whose staging buffers are still held (their last event has not fired)."""
        with self._lock:
            self._reap()
            return len(self._inflight)

    # ----- internals ------------------------------------------------------------------------
    def _host_dva(self, host_pool) -> int:
        """DVA of the host pool's first byte: from the memfabric allocator's buffer details,
        else asked of memfabric (0 means the memory is not in its offload pool)."""
        buf = host_pool.buffer
        dva = buf.details.get("dva") if isinstance(buf.details, dict) else None
        if not dva:
            with capture_log(self._mf):
                dva = int(self._offload.get_dva(buf.ptr))
        if not dva:
            raise ConfigError(
                f"{self.name}: the host pool's memory ({buf.backing}) is not in Memfabric's "
                "offload pool, so the NPU kernel cannot address it; build the HostKVPool with "
                "allocator='memfabric'", key="host_pool.allocator", value=buf.backing)
        return int(dva) + (host_pool.raw.data_ptr() - buf.ptr)

    def _check(self, pool, pages, what: str) -> torch.Tensor:
        if isinstance(pages, torch.Tensor) and pages.device.type != "cpu" \
                and not self.config.validate_device_indices:
            if pages.dtype.is_floating_point or pages.dtype == torch.bool or pages.dim() != 1:
                raise PageIndexError(f"{what} indices must be a 1-D integer tensor, got "
                                     f"{pages.dtype} {tuple(pages.shape)}")
            return pages.to(torch.int64)
        return pool.check_pages(pages, what)

    def _indices(self, host_pages, device_pages) -> tuple[tuple[torch.Tensor, bool], ...]:
        """Validated int64 indices, each with whether the caller passed it on the device
        (then it is expanded there; anything else goes up through the pinned staging)."""
        if self._closed:
            raise TransferError(f"{self.name}: engine is closed", backend=self.name)
        h_idx = self._check(self.host_pool, host_pages, "host page")
        d_idx = self._check(self.device_pool, device_pages, "device page")
        if h_idx.numel() != d_idx.numel():
            raise InvalidArgumentError(f"{self.name}: {h_idx.numel()} host pages but "
                                       f"{d_idx.numel()} device pages", argument="pages")
        on_dev = [isinstance(p, torch.Tensor) and p.device == self.device
                  for p in (host_pages, device_pages)]
        return (h_idx, on_dev[0]), (d_idx, on_dev[1])

    def _reap(self) -> None:
        while self._inflight and self._inflight[0][0].query():
            self._inflight.popleft()

    def _submit(self, direction: int, host: tuple[torch.Tensor, bool],
                dev: tuple[torch.Tensor, bool], *, layers: tuple[int, int] | None = None
                ) -> TransferHandle:
        """One call's launches: every layer's, or (``layers``: a ranged load) those of layers
        ``lo .. hi-1``, cut at the range's ends."""
        (h_idx, h_on_dev), (d_idx, d_on_dev) = host, dev
        n, S, M = h_idx.numel(), self.spec.page_size, META_SIZE
        if n == 0:
            return completed_handle(self.spec.num_layers, layers)
        npu, plan = self._npu, self.plan
        launches = plan.launches(direction, per_layer=direction == H2D)
        if layers is not None:
            lo, hi = layers
            launches = [(max(a, lo), min(b, hi)) for a, b in launches if a < hi and b > lo]
        R, tok = len(launches), n * S
        with self._lock:
            self._reap()
            start = npu.Event()
            start.record(npu.current_stream(self._device_index))
            side = self._side
            side.wait_event(start)
            with npu.stream(side):
                buf = torch.empty(R * M + 2 * tok, dtype=torch.int64, device=self.device)
                host_tok, dev_tok = buf[R * M:R * M + tok], buf[R * M + tok:]
                rows = plan.rows_tensor(direction, n, dev_tok.data_ptr(), host_tok.data_ptr(),
                                        launches)
                staged = [(idx, off) for idx, on_dev, off in
                          ((h_idx, h_on_dev, R * M), (d_idx, d_on_dev, R * M + tok))
                          if not on_dev]
                staging, ranges = self._stage(buf.numel(), rows, R * M, staged, tok)
                for lo, hi in ranges:
                    buf[lo:hi].copy_(staging[lo:hi], non_blocking=True)
                for idx, on_dev, dst in ((h_idx, h_on_dev, host_tok), (d_idx, d_on_dev, dev_tok)):
                    if on_dev:                           # device-resident: expand in place
                        torch.add(idx.unsqueeze(1) * S, self._arange, out=dst.view(n, S))
                keep = (staging, buf, h_idx, d_idx)
                events = self._launch(buf, launches, keep, direction)
        layer_events = [events[i] for i, (lo, hi) in enumerate(launches) for _ in range(lo, hi)]
        return AscendCHandle(npu, self._device_index, layer_events, direction, keep, self.name,
                             layers, self.spec.num_layers)

    def _stage(self, total: int, rows: torch.Tensor, meta_len: int,
               indices: Sequence[tuple[torch.Tensor, int]], tok: int
               ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One pinned host buffer laid out like the device buffer: the metadata, and the
        token indices of every index list that is not already on the device."""
        host = torch.empty(total, dtype=torch.int64)
        host[:meta_len].copy_(rows.view(-1))
        ranges = [(0, meta_len)]
        for idx, off in indices:
            host[off:off + tok].copy_(token_indices(idx.cpu(), self.spec.page_size))
            if ranges[-1][1] == off:
                ranges[-1] = (ranges[-1][0], off + tok)
            else:
                ranges.append((off, off + tok))
        return host.pin_memory(), ranges

    def _launch(self, buf: torch.Tensor, launches: list[tuple[int, int]], keep: tuple,
                direction: int) -> list[Any]:
        """One kv_exchange_copy per launch on the side stream (current here), an event after
        each; the staging is held until the last event fires, also when a launch fails."""
        npu, M, events = self._npu, META_SIZE, []
        try:
            with capture_log(self._mf) as lines:
                for i in range(len(launches)):
                    rc = int(self._offload.kv_exchange_copy(buf[i * M:(i + 1) * M],
                                                            self._kernel_device))
                    if rc != 0:
                        what = "H2D" if direction == H2D else "D2H"
                        raise TransferError(
                            f"{self.name}: kv_exchange_copy ({what}, layers "
                            f"{launches[i][0]}..{launches[i][1] - 1}) returned {rc}: "
                            f"{quote_errors(lines, self._mf)}", backend=self.name, code=rc)
                    ev = npu.Event()
                    ev.record(self._side)
                    events.append(ev)
        finally:
            if len(events) == len(launches):
                last = events[-1]
            else:                        # a launch failed; the earlier ones may still run
                last = npu.Event()
                last.record(self._side)
            self._inflight.append((last, keep))
        return events
