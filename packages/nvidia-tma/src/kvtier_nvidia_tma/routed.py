"""``nvidia-routed``: each direction to the copy engine or to the SM kernel by chunk size, at a
calibrated, cached crossover, its routes checked in use."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvtier import Availability, Capabilities, TransferEngine
from kvtier.errors import ConfigError
from kvtier.interfaces import TransferHandle
from kvtier.transfer_engines import check_layer_range

from . import KVTIER_INTERFACE_VERSION
from ._engine import _check_fraction, _check_int
from ._probe import probe_cuda
from .copy_engine import CopyEngineTransferEngine
from .register import RegisterTransferEngine
from .tma import TmaTransferEngine

log = logging.getLogger(__name__)


class RoutedHandle(TransferHandle):
    """The handle of the sub-engine a transfer went to."""

    def __init__(self, inner: TransferHandle, path: str):
        self.inner, self.path = inner, path
        self.num_layers = getattr(inner, "num_layers", None)
        self.layers = getattr(inner, "layers", None)

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
    streams. If their median falls below the copy engine's own calibrated rate from an idle GPU
    by more than ``verify_margin``, the SM kernel is tried on the next ``verify_count`` such
    transfers, timed the same way: the direction moves to it from then on (with a warning and
    ``stats()["rerouted"]``) only if it runs faster in use than the copy engine did by more
    than ``verify_margin``; otherwise it goes back to the copy engine for good
    (``stats()["route_trials"]`` says both rates). A copy engine slowed by the host's own
    traffic is not traded for an SM kernel that is slowed as much and takes SMs from the model
    beside it."""

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
        #: Per-layer completion for loads / backups, whether for debugging, and the CUDA
        #: device: settings of the routed engine as a whole, given to both paths (so they
        #: are set here, not under ``copy_engine`` or ``sm``).
        layerwise_load: bool = True
        layerwise_backup: bool = False
        debug: bool = False
        device: int | None = None
        #: The copy-engine path's own settings (``nvidia-copy-engine``'s config: ``max_batch``,
        #: ``first_batch``, ``strided``, ``issue_thread``, ``side_stream``).
        copy_engine: CopyEngineTransferEngine.Config = field(
            default_factory=CopyEngineTransferEngine.Config)
        #: The SM kernel's own settings (``nvidia-tma``'s config: ``ctas``, ``small_ctas``,
        #: ``small_bytes``, ``layer_signals``, ``signal_layers``, ``warps``, ...); before
        #: sm_90 ``nvidia-register`` takes the ones it has (``ctas``, ``side_stream``).
        sm: TmaTransferEngine.Config = field(default_factory=TmaTransferEngine.Config)
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
        #: engine at 35-48 GB/s against 49.9). The SM kernel, tried after such a shortfall,
        #: is kept only if it beats the copy engine's rate in use by more than this too.
        verify_margin: float = 0.10

        def __post_init__(self) -> None:
            # the settings of the whole engine are the paths' too: each nested config says
            # what its engine is built with
            common = {k: getattr(self, k) for k in SHARED_KEYS}
            object.__setattr__(self, "copy_engine", dataclasses.replace(self.copy_engine,
                                                                        **common))
            object.__setattr__(self, "sm", dataclasses.replace(self.sm, **common))

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda((7, 0), "the register-copy or TMA kernel and the copy engine")

    @classmethod
    def capabilities(cls) -> Capabilities:
        # ranged loads where both paths take them (the SM path is nvidia-tma or nvidia-register)
        ranges = CopyEngineTransferEngine.capabilities().layer_ranges and all(
            c.capabilities().layer_ranges for c in (TmaTransferEngine, RegisterTransferEngine))
        return Capabilities(device_types=("cuda",), host_layouts=("page_first", "layer_first"),
                            row_alignment=16, auto_priority=30, layer_ranges=ranges)

    def __init__(self, device_pool, host_pool, config: Any = None):
        check_moved_keys(config)
        super().__init__(device_pool, host_pool, config)
        c = self.config
        for key, lo in (("crossover_bytes", 0), ("calibrate_mib", 1), ("verify_mib", 0),
                        ("verify_count", 1)):
            _check_int(self.name, key, getattr(c, key), lo)
        _check_fraction(self.name, "verify_margin", c.verify_margin)
        _check_fraction(self.name, "prefer_copy_within", c.prefer_copy_within)
        _check_fraction(self.name, "idle_shortfall", c.idle_shortfall)
        self.copy = CopyEngineTransferEngine(device_pool, host_pool, c.copy_engine)
        sm_cls = TmaTransferEngine if self.copy._dev.cc >= TmaTransferEngine._min_cc \
            else RegisterTransferEngine
        sm_cfg = sm_config(c, sm_cls)
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
        self._bytes = {"copy_engine": 0, "sm": 0}
        self._transfers = {"copy_engine": 0, "sm": 0}
        # in-use check of calibrated copy-engine routes: directions still being checked,
        # their timed transfers (start, end, bytes) and measured GB/s, the last handle of each
        # direction (a transfer timed while the other way runs would read low)
        self._verify = {d for d in ("h2d", "d2h") if self.route[d] == "copy_engine"
                        and self.crossover_source != "configured" and c.verify_mib > 0}
        self._timed: dict[str, list[tuple[Any, Any, int, str]]] = {"h2d": [], "d2h": []}
        self._measured: dict[str, list[float]] = {"h2d": [], "d2h": []}
        # the SM kernel's rates in use while it is tried after a copy-engine shortfall
        self._sm_measured: dict[str, list[float]] = {"h2d": [], "d2h": []}
        self.route_trials: dict[str, dict[str, Any]] = {}
        self._last: dict[str, TransferHandle | None] = {"h2d": None, "d2h": None}
        self._timing_stream: Any = None
        self.rerouted: dict[str, dict[str, Any]] = {}
        log.info("%s: %d-byte chunks: loads -> %s, backups -> %s (crossover %s, %s)",
                 self.name, self.chunk_bytes, self.route["h2d"], self.route["d2h"],
                 self.crossover, self.crossover_source)

    # ----- public API ---------------------------------------------------------------------
    def load(self, host_pages, device_pages, layers: tuple[int, int] | None = None
             ) -> TransferHandle:
        """To the route's engine, ``layers`` with it (checked here first: the bytes counted
        are those of the range)."""
        L = self.spec.num_layers
        lo, hi = check_layer_range(layers, L, self.name) or (0, L)
        return self._go("h2d", lambda e: e.load(host_pages, device_pages, layers), host_pages,
                        page_bytes=self.spec.page_bytes // L * (hi - lo))

    def backup(self, device_pages, host_pages) -> TransferHandle:
        return self._go("d2h", lambda e: e.backup(device_pages, host_pages), host_pages)

    @property
    def ctas(self) -> int:
        """CTAs of the SM kernel where a direction is routed to it, else 0 (follows the
        routes as the in-use check moves them)."""
        return self.sm.ctas if "sm" in self.route.values() else 0

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
                "sm_gbps_in_use": {d: list(v) for d, v in self._sm_measured.items() if v},
                "route_trials": {d: dict(v) for d, v in self.route_trials.items()},
                "rerouted": {d: dict(v) for d, v in self.rerouted.items()}}

    def describe(self) -> dict[str, Any]:
        return {**self.stats(), "chunk_bytes": self.chunk_bytes,
                "copy_engine_strided": self.copy._strided_why,
                "calibration": self.calibration}

    def close(self) -> None:
        self.copy.close()
        self.sm.close()

    def _go(self, direction: str, call, host_pages, page_bytes: int | None = None
            ) -> TransferHandle:
        """``call`` on the route's engine; ``page_bytes``: what it moves of a page (ranged
        loads), counted in ``stats()`` and the in-use check."""
        if direction in self._verify:
            self._check_route(direction)
        path = self.route[direction]
        nbytes = len(host_pages) * (self.spec.page_bytes if page_bytes is None else page_bytes)
        back = "d2h" if direction == "h2d" else "h2d"
        if self._timed[back]:
            # a timed transfer the other way that may still run overlaps this one: it would
            # read low (the link is shared), so it does not count
            self._timed[back] = [t for t in self._timed[back] if t[1].query()]
        other = self._last[back]
        start = None
        if direction in self._verify and nbytes >= self.config.verify_mib << 20 \
                and (other is None or other.done()):
            import torch
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
        handle = call(self.copy if path == "copy_engine" else self.sm)
        if start is not None:
            self._time(direction, start, handle, nbytes, path)
        self._bytes[path] += nbytes
        self._transfers[path] += 1
        self._last[direction] = handle
        return RoutedHandle(handle, path)

    # ----- in-use check of a calibrated copy-engine route -------------------------------------
    def _time(self, direction: str, start, handle: TransferHandle, nbytes: int,
              path: str) -> None:
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
        self._timed[direction].append((start, end, nbytes, path))

    def _check_route(self, direction: str) -> None:
        """Collect the timed transfers that have finished; once enough are measured, keep the
        copy engine, try the SM kernel, or (after the trial) keep whichever ran faster in use
        by the margin, the copy engine at equal rates."""
        from ._plan import (calibrated_rate, copy_engine_falls_short, median_rate,
                            sm_beats_copy_in_use)
        pending = []
        for start, end, nbytes, path in self._timed[direction]:
            if end.query():
                ms = start.elapsed_time(end)
                if ms > 0:
                    into = self._measured if path == "copy_engine" else self._sm_measured
                    into[direction].append(nbytes / ms / 1e6)
            else:
                pending.append((start, end, nbytes, path))
        self._timed[direction] = pending
        table = {int(k): v for k, v in
                 self.calibration.get(direction, {}).get("table", {}).items()}
        expected = calibrated_rate(table, self.chunk_bytes, "copy")
        margin, need = self.config.verify_margin, self.config.verify_count
        ce = self._measured[direction]
        if self.route[direction] == "copy_engine":
            verdict = copy_engine_falls_short(ce, expected, margin, need)
            if verdict is None:
                return
            if not verdict:
                self._verify.discard(direction)
                self._timed[direction] = []
                return
            # fell short: the SM kernel is timed on the next transfers, under the same load
            self.route[direction] = "sm"
            self._timed[direction] = []
            return
        better = sm_beats_copy_in_use(self._sm_measured[direction], ce, margin, need)
        if better is None:
            return
        self._verify.discard(direction)
        self._timed[direction] = []
        got, sm = median_rate(ce), median_rate(self._sm_measured[direction])
        self.route_trials[direction] = {"copy_engine_gbps": got, "sm_gbps": sm,
                                        "copy_engine_calibrated_gbps": expected,
                                        "chunk_bytes": self.chunk_bytes,
                                        "route": "sm" if better else "copy_engine"}
        if better:
            self.rerouted[direction] = {
                "copy_engine_gbps": got, "copy_engine_calibrated_gbps": expected,
                "sm_gbps": sm, "sm_calibrated_gbps": calibrated_rate(table, self.chunk_bytes,
                                                                     "sm"),
                "chunk_bytes": self.chunk_bytes}
            log.warning("%s: %s on the copy engine ran at %.1f GB/s in use, under its "
                        "calibrated %.1f GB/s by more than %.0f%%, and %s at %.1f GB/s "
                        "(%d-byte chunks): moved to %s", self.name, direction, got, expected,
                        100 * margin, self.sm.name, sm, self.chunk_bytes, self.sm.name)
        else:
            self.route[direction] = "copy_engine"
            log.info("%s: %s on the copy engine ran at %.1f GB/s in use (calibrated %.1f), "
                     "%s at %.1f GB/s under the same load (%d-byte chunks): kept on the copy "
                     "engine", self.name, direction, got, expected or 0.0, self.sm.name, sm,
                     self.chunk_bytes)

    # ----- calibration --------------------------------------------------------------------
    def _cache_key(self) -> str:
        import torch
        dev = self.sm._dev
        return "|".join(str(x) for x in (
            CALIBRATION_VERSION, dev.name, f"sm_{dev.cc}", _driver_version(),
            torch.version.cuda, self.sm.name, self.config.sm.ctas,
            self.config.copy_engine.max_batch,
            self.config.calibrate_mib, self.host_pool.buffer.backing,
            f"L{self.spec.num_layers}", self._copy_cfg(), sorted(self._sm_cfg.items())))

    def _copy_cfg(self) -> dict[str, Any]:
        """The copy engine's settings for calibration: strided only where this pool allows it."""
        c = self.config
        return {"max_batch": c.copy_engine.max_batch, "first_batch": c.copy_engine.first_batch,
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


#: Settings of the routed engine as a whole, given to both paths.
SHARED_KEYS = ("layerwise_load", "layerwise_backup", "debug", "device")
#: The nested configs: field name -> the config class it holds.
NESTED = {"copy_engine": CopyEngineTransferEngine.Config, "sm": TmaTransferEngine.Config}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def check_moved_keys(config: Any) -> None:
    """A ConfigError, before the config is built, for a key given where it no longer is: a
    path's setting at the top level (it moved under ``copy_engine`` or ``sm``) or a setting of
    the whole engine inside a path's config. A one-line message says where it goes."""
    if not isinstance(config, Mapping):
        return
    own = _fields(RoutedTransferEngine.Config)
    for key in config:
        if key in own:
            continue
        where = [name for name, cls in NESTED.items() if key in _fields(cls)]
        if where:
            at = " or ".join(f"{w}.{key}" for w in where)
            eg = f'{{"{where[0]}": {{"{key}": {config[key]!r}}}}}'
            raise ConfigError(f"nvidia-routed: {key!r} moved to {at} (each path's settings "
                              f"are nested): pass {eg}", key=f"nvidia-routed.{key}",
                              value=config[key])
    for name in NESTED:
        inner = config.get(name)
        if isinstance(inner, Mapping):
            for key in SHARED_KEYS:
                if key in inner:
                    raise ConfigError(f"nvidia-routed: {name}.{key} goes at the top level "
                                      f"({key!r}): it applies to both paths",
                                      key=f"nvidia-routed.{name}.{key}", value=inner[key])


def sm_config(config: Any, sm_cls: Any) -> dict[str, Any]:
    """What the SM kernel is built with: ``config.sm`` as a dict (the shared settings
    included), for ``nvidia-register`` only the keys its config has."""
    out = dataclasses.asdict(config.sm)
    keys = _fields(sm_cls.Config)
    return {k: v for k, v in out.items() if k in keys}


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
