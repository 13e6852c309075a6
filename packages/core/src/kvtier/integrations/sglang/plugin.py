"""kvtier's host allocator and transfer engine under SGLang HiCache: an ``sglang.srt.plugins``
entry point (written against SGLang 0.5.23, refused on other minors).

Switched on only by ``KVTIER_SGLANG_HICACHE``: inline JSON (``{...}``) or the path of a JSON
or TOML file holding a :class:`Config` (SGLang has no config channel for general plugins).
Unset or empty, :func:`register` returns at once: no hook, no import, no log line.

Configured, it registers ``AROUND`` hooks with SGLang's ``HookRegistry`` on exactly
``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` (``sglang.srt.mem_cache.pool_host.mha``
/ ``.mla``; their subclasses -- HiSparse, asymmetric, MXFP8 -- are passed through untouched):

* ``init_kv_buffer``: SGLang computes the buffer's shape as usual and asks its
  ``HostTensorAllocator`` for it; that allocator is kvtier's, built by name through
  :func:`kvtier.create_host_allocator` (``mmap``, ``torch-pinned``, or a vendor package's
  ``cuda-host-register``, ``umbp``, ``memfabric``). SGLang does not ``cudaHostRegister`` it
  again: the pool's ``pin_memory`` becomes what the buffer reports (``device_addressable``).
* ``__init__`` (after SGLang's): each KV component of the host buffer -- K and V for MHA, the
  latent for MLA -- is described in place as a kvtier ``HostKVPool`` (SGLang's ``layer_first``
  and ``page_first_direct`` are kvtier's ``layer_first`` / ``page_first`` with SGLang's page;
  its ``page_first`` is kvtier's ``page_first`` with one-token pages), the matching device
  tensors as a ``DeviceKVPool``, and a kvtier transfer engine is built over each pair.
* ``load_to_device_per_layer``: the first layer of a load starts the engine's whole load;
  every layer call returns once that layer has landed (``wait_layer``), so SGLang's per-layer
  events keep their meaning. ``backup_from_device_all_layer`` backs up and waits.
* ``destroy``: SGLang's, then the engines are closed.

Layouts other than those three, packed draft layers, DCP and layer-sharded MLA are refused
when the pool is built (a one-line ``LayoutError``): the configuration asked for kvtier, so it
never silently runs SGLang's kernels instead.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ... import registry
from ...config import build_config, parse_json, read_config_file
from ...device_pool import DeviceKVPool
from ...errors import ConfigError, LayoutError
from ...host_pool import HostKVPool
from ...interfaces import HOST_ALLOCATORS, TRANSFER_ENGINES, HostBuffer, TransferEngine
from ...layout import LAYER_FIRST, PAGE_FIRST
from ...spec import KVSpec

log = logging.getLogger(__name__)

#: The environment variable that switches the plugin on (JSON text or a JSON/TOML file).
ENV = "KVTIER_SGLANG_HICACHE"
#: The SGLang minor whose private host-pool names the hooks follow (tested with 0.5.23).
TESTED_MINOR = "0.5"
TESTED_SGLANG = "0.5.23"
#: SGLang's host pool modules and classes the hooks wrap (exact classes only).
POOL_CLASSES = (("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost"),
                ("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost"))
HOOKED = ("init_kv_buffer", "__init__", "load_to_device_per_layer",
          "backup_from_device_all_layer", "destroy")
#: SGLang host layout -> (kvtier host layout, whether a kvtier page is SGLang's page or one
#: token).
LAYOUTS = {"layer_first": (LAYER_FIRST, True), "page_first_direct": (PAGE_FIRST, True),
           "page_first": (PAGE_FIRST, False)}
#: Per-layer loads kept open at once per pool (a load SGLang stops before its last layer).
MAX_OPEN_LOADS = 16


@dataclass(frozen=True)
class Config:
    """What ``KVTIER_SGLANG_HICACHE`` holds; unknown keys are a ConfigError naming the key."""

    #: kvtier host allocator by registry name ("mmap", "torch-pinned", "cuda-host-register",
    #: "umbp", "memfabric", ...) for the host pool's buffer.
    host_allocator: str = "torch-pinned"
    #: That allocator's own config (its ``Config`` fields), checked at registration.
    host_allocator_config: dict = field(default_factory=dict)
    #: kvtier transfer engine by registry name ("torch", a vendor engine, or "auto").
    transfer_engine: str = "torch"
    #: That engine's own config, checked at registration (unless ``auto``).
    transfer_engine_config: dict = field(default_factory=dict)


def load_config(text: str) -> Config:
    """The plugin's :class:`Config` from the variable's value: ``{...}`` is JSON text, a path
    ending in ``.json`` a JSON file, any other path a TOML file. Every problem -- bad syntax,
    an unknown key, an unknown or unavailable backend, a bad backend setting -- is one typed
    kvtier error on one line."""
    text = text.strip()
    if text.startswith("{"):
        data = parse_json(text, ENV)
    elif text.lower().endswith(".json"):
        try:
            with open(text, encoding="utf-8") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ConfigError(f"{ENV}: config file {text} cannot be read: "
                              f"{exc.strerror or exc}", key=ENV, value=text) from None
        data = parse_json(raw, f"{ENV} ({text})")
    else:
        data = read_config_file(text)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{ENV} must hold an object, got {type(data).__name__}", key=ENV,
                          value=data)
    cfg = build_config(Config, dict(data), section="sglang_hicache")
    alloc = registry.get_backend_class(HOST_ALLOCATORS, cfg.host_allocator)
    build_config(alloc.Config, cfg.host_allocator_config, section=cfg.host_allocator)
    if cfg.transfer_engine != registry.AUTO:
        engine = registry.get_backend_class(TRANSFER_ENGINES, cfg.transfer_engine)
        build_config(engine.Config, cfg.transfer_engine_config, section=cfg.transfer_engine)
    return cfg


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def version_refusal(version: str) -> str | None:
    """Why this SGLang release is refused (one line), or None when its minor is the tested
    one: the hooks follow the host pools' private attributes, which change between minors."""
    parts = version.split("+")[0].split(".")
    if ".".join(parts[:2]) == TESTED_MINOR:
        return None
    return (f"kvtier SGLang HiCache plugin disabled: it follows SGLang {TESTED_MINOR}.x's host "
            f"pools (tested with {TESTED_SGLANG}), this is SGLang {version}; HiCache keeps "
            f"SGLang's own allocator and kernels (unset {ENV} to silence this)")


_active: Config | None = None
_lock = threading.Lock()


def register() -> None:
    """The ``sglang.srt.plugins`` entry point; SGLang calls it in every process before it
    applies hooks. Does nothing unless ``KVTIER_SGLANG_HICACHE`` is set."""
    global _active
    text = os.environ.get(ENV, "").strip()
    if not text:
        return
    refusal = version_refusal(sglang_version())
    if refusal is not None:
        log.error(refusal)
        return
    cfg = load_config(text)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    with _lock:
        if _active is not None:                 # a second load in one process: one set
            _active = cfg
            return
        _active = cfg
        for module, cls in POOL_CLASSES:
            for attr in HOOKED:
                HookRegistry.register(f"{module}.{cls}.{attr}", _HOOKS[attr], HookType.AROUND)
    log.info("kvtier SGLang HiCache plugin: MHA/MLA host pools allocate with %r and move pages "
             "with %r", cfg.host_allocator, cfg.transfer_engine)


def active_config() -> Config | None:
    return _active


def _served(pool: Any) -> bool:
    if _active is None:
        return False
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    return type(pool) in (MHATokenToKVPoolHost, MLATokenToKVPoolHost)


# ----- allocation ---------------------------------------------------------------------------
class TensorAllocator:
    """SGLang's ``HostTensorAllocator`` interface (``allocate(dims, dtype, device)``) over a
    kvtier host allocator; keeps the ``HostBuffer`` it returns."""

    fd = None

    def __init__(self, name: str, config: Mapping[str, Any]):
        self.name = name
        self.allocator = registry.create_host_allocator(name, dict(config))
        self.buffer: HostBuffer | None = None
        self.dims: tuple | None = None
        self.dtype: torch.dtype | None = None

    def allocate(self, dims: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
        if str(device) != "cpu":
            raise LayoutError(f"kvtier host allocator {self.name!r}: SGLang asked for a "
                              f"{device} buffer; host pools are CPU memory")
        nbytes = math.prod(dims) * dtype.itemsize
        self.buffer = self.allocator.allocate(nbytes)
        self.dims, self.dtype = tuple(dims), dtype
        return self.buffer.tensor[:nbytes].view(dtype).view(dims)


def _init_kv_buffer(original: Callable, pool: Any) -> Any:
    if not _served(pool):
        return original(pool)
    cfg = _active
    assert cfg is not None
    check_pool(pool)
    shim = TensorAllocator(cfg.host_allocator, cfg.host_allocator_config)
    pin = pool.pin_memory
    pool.allocator, pool.pin_memory = shim, False    # kvtier's allocator pins, not SGLang
    try:
        tensor = original(pool)
    except BaseException:
        pool.pin_memory = pin
        if shim.buffer is not None:
            shim.buffer.close()
        raise
    buf = shim.buffer
    if buf is None or tensor.data_ptr() != buf.ptr:
        if buf is not None:
            buf.close()
        pool.pin_memory = pin
        raise LayoutError(f"{type(pool).__name__}: SGLang allocated its host buffer without "
                          f"the host allocator on device type "
                          f"{pool._transfer_device.type!r}; kvtier's plugin serves CUDA, ROCm "
                          "and CPU pools")
    pool.pin_memory = bool(buf.device_addressable)
    # SGLang's destroy() unregisters what it registered; this buffer it did not.
    from sglang.srt.mem_cache.pool_host import common
    setattr(tensor, getattr(common, "_CUDA_HOST_REGISTERED_RANGES_ATTR",
                            "_sglang_cuda_host_registered_ranges"), [])
    pool.kvtier = PoolBridge(cfg, buf)
    log.info("kvtier SGLang plugin: %s host pool (%s, %.2f GB) from %r: %s%s",
             type(pool).__name__, pool.layout, buf.nbytes / 1e9, cfg.host_allocator,
             buf.backing, ", device-addressable" if buf.device_addressable else "")
    return tensor


def check_pool(pool: Any) -> None:
    """LayoutError (one line) unless kvtier can move this pool's pages."""
    name = type(pool).__name__
    if pool.layout not in LAYOUTS:
        raise LayoutError(f"{name}: host layout {pool.layout!r} is not served by kvtier's "
                          f"plugin (use one of {sorted(LAYOUTS)}, or unset {ENV})")
    if pool.layer_num != pool.target_layer_num:
        drafts = pool.layer_num - pool.target_layer_num
        raise LayoutError(f"{name}: packed draft KV layers ({drafts}) are not served by "
                          f"kvtier's plugin (unset {ENV})")
    if getattr(pool, "dcp_size", 1) != 1:
        raise LayoutError(f"{name}: decode context parallelism (dcp_size={pool.dcp_size}) is "
                          f"not served by kvtier's plugin (unset {ENV})")
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator
    if type(pool.allocator) is not HostTensorAllocator:
        raise LayoutError(f"{name}: SGLang's storage backend brings its own host allocator "
                          f"({type(pool.allocator).__name__}), which kvtier's would replace; "
                          f"use one or the other (unset {ENV})")
    if getattr(pool, "_layer_shard_enabled", False) or \
            getattr(pool, "_native_buffers", None) is not None:
        raise LayoutError(f"{name}: layer-sharded or split MLA buffers are not served by "
                          f"kvtier's plugin (unset {ENV})")


# ----- transfers ----------------------------------------------------------------------------
@dataclass
class Lane:
    """One KV component: SGLang's host tensor and device tensors as kvtier pools, an engine."""

    host_pool: HostKVPool
    device_pool: DeviceKVPool
    engine: TransferEngine


@dataclass
class _Load:
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    handles: list
    last: int = -1


class PoolBridge:
    """kvtier's side of one SGLang host pool: the buffer it allocated and, once SGLang has
    finished the pool, a transfer engine per KV component (``pool.kvtier``)."""

    def __init__(self, config: Config, buffer: HostBuffer):
        self.config = config
        self.buffer = buffer
        self.lanes: list[Lane] = []
        self.tokens_per_page = 1
        self.num_layers = 0
        self._loads: dict[tuple[int, int], _Load] = {}
        self._lock = threading.Lock()

    def report(self) -> dict[str, Any]:
        """Where the buffer came from and what moves it (logs, tests, support)."""
        b = self.buffer
        return {"host_allocator": self.config.host_allocator, "backing": b.backing,
                "nbytes": b.nbytes, "numa_node": b.numa_node,
                "device_addressable": b.device_addressable, "details": dict(b.details),
                "transfer_engine": [type(lane.engine).name for lane in self.lanes],
                "kvtier_layout": [lane.host_pool.layout for lane in self.lanes],
                "tokens_per_page": self.tokens_per_page}

    def attach(self, pool: Any) -> None:
        """Build the lanes over the finished SGLang pool (its device tensors are set last)."""
        layout, whole_pages = LAYOUTS[pool.layout]
        s = int(pool.page_size) if whole_pages else 1
        if pool.size % s:
            raise LayoutError(f"{type(pool).__name__}: {pool.size} host tokens are not whole "
                              f"pages of {s}")
        if hasattr(pool, "device_k_buffers"):
            comps = [(pool.kv_buffer[0], pool.device_k_buffers),
                     (pool.kv_buffer[1], pool.device_v_buffers)]
        else:
            comps = [(pool.kv_buffer, pool.device_kv_buffers)]
        self.tokens_per_page, self.num_layers = s, int(pool.layer_num)
        try:
            for host, device in comps:
                self.lanes.append(self._lane(pool, host, list(device), layout, s))
        except BaseException:
            self.close()
            raise

    def _lane(self, pool: Any, host: torch.Tensor, device: list[torch.Tensor], layout: str,
              s: int) -> Lane:
        layers = int(pool.layer_num)
        row = host.nbytes // (layers * int(pool.size))
        # One "latent" row of bytes per token: kvtier moves bytes, SGLang keeps the dtype.
        spec = KVSpec.mla(num_layers=layers, kv_lora_rank=row, rope_dim=0, page_size=s,
                          dtype="uint8")
        views = []
        for i, t in enumerate(device):
            if not t.is_contiguous() or t.nbytes != t.shape[0] * row:
                raise LayoutError(f"{type(pool).__name__}: device layer {i} is not contiguous "
                                  f"rows of {row} bytes (shape {tuple(t.shape)}, {t.dtype})")
            slots = t.shape[0] // s * s
            views.append(t.view(torch.uint8).view(t.shape[0], 1, row)[:slots])
        device_pool = DeviceKVPool(spec, views)
        b = self.buffer
        flat = host.view(-1).view(torch.uint8)
        host_buffer = HostBuffer(ptr=host.data_ptr(), nbytes=host.nbytes, tensor=flat,
                                 backing=b.backing, numa_node=b.numa_node,
                                 device_addressable=b.device_addressable,
                                 page_size_bytes=b.page_size_bytes,
                                 details={"owner": f"sglang {type(pool).__name__}",
                                          "sglang_layout": pool.layout})
        host_pool = HostKVPool(spec, int(pool.size) // s, allocator=None, layout=layout,
                               buffer=host_buffer)
        engine = registry.create_transfer_engine(self.config.transfer_engine, device_pool,
                                                 host_pool,
                                                 dict(self.config.transfer_engine_config))
        return Lane(host_pool, device_pool, engine)

    def pages(self, indices: torch.Tensor, what: str) -> torch.Tensor:
        """kvtier page numbers of SGLang token indices (whole pages), LayoutError otherwise."""
        idx = indices.reshape(-1).to(torch.int64)
        s = self.tokens_per_page
        if s == 1:
            return idx
        if idx.numel() % s:
            raise LayoutError(f"{idx.numel()} {what} indices are not whole pages of {s}")
        rows = idx.view(-1, s)
        first = rows[:, 0]
        step = torch.arange(s, dtype=torch.int64, device=idx.device)
        if bool(((first % s) != 0).any()) or not torch.equal(rows, first[:, None] + step):
            raise LayoutError(f"{what} indices are not whole, aligned pages of {s} tokens")
        return torch.div(first, s, rounding_mode="floor")

    def load_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
                   layer: int) -> None:
        """Layer ``layer`` of a load is on the device when this returns (the first call of a
        load starts the engine's layer-by-layer load of every layer)."""
        key = (id(host_indices), id(device_indices))
        with self._lock:
            job = self._loads.get(key)
            if job is None or layer <= job.last or job.host_indices is not host_indices or \
                    job.device_indices is not device_indices:
                h = self.pages(host_indices, "host")
                d = self.pages(device_indices, "device")
                job = _Load(host_indices, device_indices,
                            [lane.engine.load(h, d) for lane in self.lanes])
                self._loads.pop(key, None)
                self._loads[key] = job
                while len(self._loads) > MAX_OPEN_LOADS:
                    old = self._loads.pop(next(iter(self._loads)))
                    for handle in old.handles:
                        handle.wait()
        for handle in job.handles:
            handle.wait_layer(layer)
        job.last = layer
        if layer >= self.num_layers - 1:
            with self._lock:
                if self._loads.get(key) is job:
                    del self._loads[key]

    def backup(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        h = self.pages(host_indices, "host")
        d = self.pages(device_indices, "device")
        handles = [lane.engine.backup(d, h) for lane in self.lanes]
        for handle in handles:
            handle.wait()

    def close(self) -> None:
        with self._lock:
            loads, self._loads = list(self._loads.values()), {}
        for job in loads:
            for handle in job.handles:
                try:
                    handle.wait()
                except Exception:  # closing: the load's own caller saw its error
                    pass
        for lane in self.lanes:
            lane.engine.close()


# ----- hooks (HookType.AROUND: the original first argument) ---------------------------------
def _init(original: Callable, pool: Any, *args: Any, **kwargs: Any) -> None:
    original(pool, *args, **kwargs)
    bridge = getattr(pool, "kvtier", None)
    if isinstance(bridge, PoolBridge) and _served(pool):
        bridge.attach(pool)


def _load_to_device_per_layer(original: Callable, pool: Any, device_pool: Any,
                              host_indices: Any, device_indices: Any, layer_id: int,
                              io_backend: str, *, is_draft: bool = False) -> None:
    bridge = getattr(pool, "kvtier", None)
    if not isinstance(bridge, PoolBridge) or not bridge.lanes:
        return original(pool, device_pool, host_indices, device_indices, layer_id,
                        io_backend, is_draft=is_draft)
    if not 0 <= layer_id < bridge.num_layers:      # SGLang's own bound: nothing to load
        return None
    bridge.load_layer(host_indices, device_indices, layer_id)
    return None


def _backup_from_device_all_layer(original: Callable, pool: Any, device_pool: Any,
                                  host_indices: Any, device_indices: Any,
                                  io_backend: str) -> None:
    bridge = getattr(pool, "kvtier", None)
    if not isinstance(bridge, PoolBridge) or not bridge.lanes:
        return original(pool, device_pool, host_indices, device_indices, io_backend)
    bridge.backup(host_indices, device_indices)
    return None


def _destroy(original: Callable, pool: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return original(pool, *args, **kwargs)
    finally:
        bridge = getattr(pool, "kvtier", None)
        if isinstance(bridge, PoolBridge):
            bridge.close()


_HOOKS: dict[str, Callable] = {"init_kv_buffer": _init_kv_buffer, "__init__": _init,
                               "load_to_device_per_layer": _load_to_device_per_layer,
                               "backup_from_device_all_layer": _backup_from_device_all_layer,
                               "destroy": _destroy}


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.integrations.sglang.plugin``: check ``KVTIER_SGLANG_HICACHE`` the
    way the plugin reads it, without starting SGLang."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        print(f"{ENV} is not set: the plugin does nothing")
        return 0
    refusal = version_refusal(sglang_version())
    try:
        cfg = load_config(text)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
        return 2
    print(json.dumps({"config": cfg.__dict__, "sglang": sglang_version(),
                      "refused": refusal}, default=str))
    return 1 if refusal else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
