"""``nvidia-tma``: TMA bulk copies of KV pages (sm_90+), one launch per layer or for all."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvtier import Availability
from kvtier.errors import TransferError
from kvtier.interfaces import TransferHandle

from ._engine import LayerSignalHandle, _check_int, _NvidiaEngine
from ._plan import layer_signal_target, plan_tma, tensor_map_geometry, uniform_strides
from ._probe import probe_cuda

log = logging.getLogger(__name__)


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
        zeroed = torch.cuda.Event()          # waits on the counters go after their zeroing
        zeroed.record(stream)
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
                                 keep=(h, d), zeroed=zeroed)
