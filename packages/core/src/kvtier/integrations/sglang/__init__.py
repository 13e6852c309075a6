"""Any kvtier L3 store as an SGLang HiCache storage backend (written against SGLang 0.5.23).

Start SGLang with its ``dynamic`` storage backend pointing here::

    --enable-hierarchical-cache --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
      "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
      "store": "file", "store_config": {"root": "/var/cache/kvtier"}}'

How SGLang's calls map onto kvtier:

* **Construction.** SGLang's ``StorageBackendFactory`` builds the class with
  ``(storage_config, {})``. The extra config is read once into a typed :class:`Config` (an
  unknown key is a ``ConfigError`` naming it); the store is looked up by name in kvtier's
  registry (``file``, ``mooncake``, ``umbp`` or any third-party entry point) and its own config
  is checked, so a missing store or a bad setting fails SGLang's attach with the reason.
* **Zero-copy bridge.** ``register_mem_pool_host`` wraps SGLang's host KV buffer, in place, as
  a kvtier :class:`~kvtier.HostKVPool` and attaches the store to it. The page geometry is read
  off SGLang's own ``get_page_buffer_meta``: one SGLang page is ``m`` segments of ``b`` bytes
  (MHA ``page_first``: K and V; MLA ``page_first``: one; ``layer_first``: one per layer and
  K/V), segment ``j`` of page ``q`` at ``base + j * num_pages * b + q * b``. That is kvtier's
  ``page_first`` layout (``m == 1``) or its ``layer_first`` layout with ``m`` one-component
  "layers", under a :class:`~kvtier.KVSpec` that describes those bytes, not the model
  (:func:`bridge_spec`). A store object is a page's segments in address order -- exactly
  SGLang's flat page (``get_data_page``) -- so the legacy calls read and write the same objects.
* **v1 calls.** Host indices -> ``get_page_buffer_meta`` -> page pointers -> kvtier page
  numbers (every pointer checked against the bridge) -> ``store.batch_get`` / ``batch_set``
  straight into / out of SGLang's host pages. ``batch_exists`` is the store's count of
  consecutive leading hits.
* **Keys.** SGLang's page hash plus the suffixes SGLang's own file backend adds: model, TP rank
  and size (MHA; MLA pages are replicated across TP ranks and share one object), PP, attention
  CP and DCP shards -- prefixed with ``sglang/<host layout>/<dtype>/`` (and ``key_prefix``) so
  two layouts that order a page's bytes differently never exchange objects; UTF-8 bytes.
* **Failures.** No call SGLang makes from its storage threads raises: an error is a miss (or
  an unstored page), a counted error in :meth:`KVTierHiCacheStorage.stats` and ``get_stats``,
  and a rate-limited log line. Configuration problems raise at construction and at
  ``register_mem_pool_host``, where SGLang's attach fails loudly instead of running without L3.

SGLang is imported here only; ``import kvtier`` never imports it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ... import registry
from ...config import build_config
from ...errors import ConfigError, InvalidArgumentError, LayoutError, StoreError
from ...host_pool import HostKVPool
from ...interfaces import L3_STORES, HostBuffer, L3Store
from ...layout import LAYER_FIRST, PAGE_FIRST
from ...metrics import Metrics
from ...spec import DTYPES, KVSpec
from .. import SGLANG_CLASS, SGLANG_MODULE

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except (ImportError, OSError, RuntimeError) as _exc:  # pragma: no cover - needs no sglang
    raise ImportError(
        f"kvtier.integrations.sglang needs SGLang's HiCache storage interface "
        f"(sglang.srt.mem_cache.hicache_storage, written against sglang 0.5.23): "
        f"{type(_exc).__name__}: {_exc}. Install SGLang for your accelerator first.") from _exc

log = logging.getLogger(__name__)

#: The SGLang release this adapter follows (its HiCacheStorage interface changes often).
TESTED_SGLANG = "0.5.23"
#: Seconds between two log lines about the same kind of failure.
LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Config:
    """``--hicache-storage-backend-extra-config`` as the adapter reads it."""

    #: kvtier L3 store by registry name: "file", "mooncake", "umbp", or a third-party one.
    store: str
    #: That store's own config (its ``Config`` fields), checked at construction.
    store_config: dict = field(default_factory=dict)
    #: Extra namespace in front of every key (a tenant, a deployment).
    key_prefix: str = ""
    #: batch_set_v1 writes only pages after the leading ones the store already holds (keys
    #: name their content, as in SGLang's own backends).
    skip_existing: bool = True
    #: SGLang's own keys of the dynamic backend, accepted so one JSON object serves both.
    backend_name: str = "kvtier"
    module_path: str = SGLANG_MODULE
    class_name: str = SGLANG_CLASS
    interface_v1: int | bool = 0


def rank_suffix(storage_config: Any) -> str:
    """The key suffix SGLang 0.5.23's file backend (``HiCacheFile``) gives this rank's pages.

    MHA: ``_<model>_<tp_rank>_<tp_size>`` (each TP rank holds other heads); MLA (rank
    replicated): ``_<model>``; then ``_<pp_size>_<pp_rank>`` with PP, ``_cp<rank>_<size>``
    with attention CP, and the DCP shard with decode context parallelism.
    """
    c = storage_config
    model = "-".join(c.model_name.split("/")) if c.model_name else ""
    shard = f"_{c.pp_size}_{c.pp_rank}" if c.pp_size > 1 else ""
    if getattr(c, "attn_cp_size", 1) > 1:
        shard += f"_cp{c.attn_cp_rank}_{c.attn_cp_size}"
    suffix = f"_{model}{shard}" if c.is_mla_model else f"_{model}_{c.tp_rank}_{c.tp_size}{shard}"
    if getattr(c, "dcp_size", 1) > 1:
        suffix += (f"_tp{c.tp_size}_dcp{c.dcp_rank}_{c.dcp_size}"
                   f"_page{c.logical_page_size}")
    return suffix


def bridge_spec(segments: int, segment_bytes: int, page_size: int,
                dtype: torch.dtype) -> KVSpec:
    """A KVSpec whose pages are ``segments`` runs of ``page_size`` rows, ``segment_bytes``
    each: the byte geometry of one SGLang host page (one-component rows, so ``mla`` kind)."""
    name = next((n for n, dt in DTYPES.items() if dt == dtype), "uint8")
    itemsize = DTYPES[name].itemsize
    row = segment_bytes // page_size
    if segment_bytes % page_size or row % itemsize:
        raise LayoutError(f"an SGLang page segment of {segment_bytes} bytes is not "
                          f"{page_size} rows of {dtype} elements")
    return KVSpec.mla(num_layers=segments, kv_lora_rank=row // itemsize, rope_dim=0,
                      page_size=page_size, dtype=name)


@dataclass(frozen=True)
class PageBridge:
    """SGLang's host KV buffer seen as a kvtier HostKVPool (same memory, no copy)."""

    pool: HostKVPool
    base: int                 # address of SGLang's kv_buffer
    segments: int             # m: segments per page
    segment_bytes: int        # b: bytes per segment
    tokens_per_key: int       # host indices per key (SGLang's logical page size)
    sglang_layout: str

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def page_bytes(self) -> int:
        return self.segments * self.segment_bytes

    def pages(self, ptrs: Sequence[int], sizes: Sequence[int], n: int) -> list[int]:
        """kvtier page numbers of ``n`` pages from get_page_buffer_meta's (ptrs, sizes);
        raises LayoutError unless every pointer is where the bridge says it is."""
        m, b = self.segments, self.segment_bytes
        if len(ptrs) != n * m or len(sizes) != n * m:
            raise LayoutError(f"get_page_buffer_meta gave {len(ptrs)} pointers for {n} pages "
                              f"of {m} segments")
        if n == 0:
            return []
        if any(int(s) != b for s in sizes):
            raise LayoutError(f"get_page_buffer_meta gave segment sizes {sorted(set(sizes))}, "
                              f"the bridge has {b}")
        rel = torch.tensor([int(p) for p in ptrs], dtype=torch.int64).view(n, m).sort(1).values
        rel -= self.base
        q = torch.div(rel[:, 0], b, rounding_mode="floor")
        want = q[:, None] * b + torch.arange(m, dtype=torch.int64) * (self.num_pages * b)
        if not torch.equal(rel, want) or int(q.min()) < 0 or int(q.max()) >= self.num_pages:
            raise LayoutError("get_page_buffer_meta pointers are not pages of the bridged "
                              "host buffer")
        return q.tolist()


def _page_meta(host_pool: Any, page: int, tokens: int) -> tuple[list[int], list[int]]:
    idx = torch.arange(page * tokens, (page + 1) * tokens, dtype=torch.int64)
    ptrs, sizes = host_pool.get_page_buffer_meta(idx)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def build_bridge(host_pool: Any) -> PageBridge:
    """Wrap an SGLang host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``...) as a
    kvtier HostKVPool over the same memory; LayoutError for layouts that are not whole pages of
    evenly spaced segments of one buffer (``page_first_kv_split``, ``page_unified``...)."""
    layout = str(getattr(host_pool, "layout", "?"))
    kv = getattr(host_pool, "kv_buffer", None)
    if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
        raise LayoutError(f"SGLang host pool {type(host_pool).__name__} ({layout}) has no "
                          "materialised kv_buffer to read pages into")
    if kv.device.type != "cpu" or not kv.is_contiguous():
        raise LayoutError(f"SGLang kv_buffer must be one contiguous host tensor, got "
                          f"{kv.device} contiguous={kv.is_contiguous()}")
    for extra in ("v_buffer", "index_k_buffer"):   # split layouts keep pages in other tensors
        other = getattr(host_pool, extra, None)
        if isinstance(other, torch.Tensor) and other.data_ptr() != kv.data_ptr() and \
                not (kv.data_ptr() <= other.data_ptr() < kv.data_ptr() + kv.nbytes):
            raise LayoutError(f"SGLang host layout {layout!r} keeps pages in separate "
                              f"buffers ({extra}); use page_first, page_first_direct or "
                              "layer_first")
    tokens = int(getattr(host_pool, "logical_page_size", host_pool.page_size))
    phys = int(host_pool.page_size)
    keys_total = int(getattr(host_pool, "logical_size", host_pool.size)) // tokens
    if keys_total < 1:
        raise LayoutError(f"SGLang host pool holds no whole page of {tokens} tokens")
    base, nbytes = kv.data_ptr(), kv.numel() * kv.element_size()
    ptrs, sizes = _page_meta(host_pool, 0, tokens)
    m = len(ptrs)
    if m == 0 or len(set(sizes)) != 1:
        raise LayoutError(f"SGLang layout {layout!r}: a page is {m} segments of sizes "
                          f"{sorted(set(sizes))}; the bridge needs equal segments")
    b = sizes[0]
    if nbytes % (m * b):
        raise LayoutError(f"SGLang kv_buffer of {nbytes} bytes is not whole pages of {m} x {b}")
    spec = bridge_spec(m, b, phys, kv.dtype)
    buffer = HostBuffer(ptr=base, nbytes=nbytes, tensor=kv.reshape(-1).view(torch.uint8),
                        backing=f"sglang {type(host_pool).__name__}",
                        device_addressable=bool(getattr(host_pool, "pin_memory", False)),
                        details={"sglang_layout": layout, "owner": "sglang"})
    pool = HostKVPool(spec, nbytes // (m * b), layout=PAGE_FIRST if m == 1 else LAYER_FIRST,
                      buffer=buffer)
    bridge = PageBridge(pool, base, m, b, tokens, layout)
    for page in sorted({0, 1 % keys_total, keys_total // 2, keys_total - 1}):
        p, s = _page_meta(host_pool, page, tokens)
        q = bridge.pages(p, s, 1)[0]
        kv_ptrs = sorted(seg.data_ptr() for seg in pool.page_segments(q))
        if kv_ptrs != sorted(p):               # the bridge's own layout math agrees
            raise LayoutError(f"SGLang layout {layout!r}: kvtier page {q} segments "
                              f"{kv_ptrs} differ from SGLang's {sorted(p)}")
    return bridge


class KVTierHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a kvtier L3 store; see the module docstring."""

    Config = Config

    def __init__(self, storage_config: Any, extra: dict | None = None):
        self.storage_config = storage_config
        self.config: Config = build_config(Config, dict(storage_config.extra_config or {}),
                                           section="sglang")
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError("kvtier's SGLang adapter stores whole pages per rank; "
                              "tp_lcm_size (split heads) is not supported", key="tp_lcm_size")
        self.store_cls = registry.get_backend_class(L3_STORES, self.config.store)
        self.store_config = build_config(self.store_cls.Config, self.config.store_config,
                                         section=self.config.store)
        self.key_suffix = rank_suffix(storage_config)
        self.metrics_enabled = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.store: L3Store | None = None
        self.bridge: PageBridge | None = None
        self.mem_pool_host: Any = None
        self._prefix = ""
        self._closed = False
        self._lock = threading.Lock()
        #: The adapter's counters (pages, hits, errors by call): ``stats()`` reads them and,
        #: with SGLang's storage metrics on, they reach SGLang's /metrics as ``kvtier_*``.
        self.metrics = Metrics()
        self._errors: Counter[str] = Counter()
        self._last_error = ""
        self._logged: dict[tuple[str, str], float] = {}
        self._metrics: dict[str, list[float]] = {k: [] for k in (
            "prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")}
        self._mirror: Any = None
        if self.metrics_enabled:
            self._mirror = self._make_mirror(storage_config)
        try:
            version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        if version.split("+")[0] != TESTED_SGLANG:
            log.warning("kvtier's SGLang adapter follows sglang %s, this is %s",
                        TESTED_SGLANG, version)
        if not self.config.interface_v1:
            log.warning("kvtier HiCache storage: interface_v1 is not set, so SGLang uses the "
                        "legacy copying calls; add \"interface_v1\": 1 to the extra config for "
                        "zero-copy page I/O")

    # ----- registration (SGLang's attach: errors here fail the attach, loudly) ---------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bridge SGLang's host pool to a kvtier HostKVPool and attach a new store to it."""
        super().register_mem_pool_host(mem_pool_host)
        bridge = build_bridge(mem_pool_host)
        store = self.store_cls(self.store_config, spec=bridge.pool.spec)
        try:
            store.attach(bridge.pool)
        except BaseException:
            store.close()
            raise
        old, self.store, self.bridge = self.store, store, bridge
        dtype = str(getattr(mem_pool_host.kv_buffer, "dtype", "")).removeprefix("torch.")
        user = f"{self.config.key_prefix}/" if self.config.key_prefix else ""
        self._prefix = f"{user}sglang/{bridge.sglang_layout}/{dtype}/"
        self._closed = False
        if old is not None:
            old.close()
        log.info("kvtier HiCache storage: store %r over SGLang's %s host pool (%d pages of "
                 "%d x %d bytes, kvtier %s)", self.config.store, bridge.sglang_layout,
                 bridge.num_pages, bridge.segments, bridge.segment_bytes, bridge.pool.layout)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Side pools of hybrid models (Mamba, SWA, DSA indexer, draft) are not stored: refuse
        them at attach rather than miss every page later."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) != "kv":
            raise ConfigError(f"kvtier's SGLang adapter stores the KV pool only; the "
                              f"{host_pool_name!s} pool of this model is not supported",
                              key="pool", value=str(host_pool_name))

    # ----- the zero-copy v1 calls ------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of consecutive leading keys the store holds (0 on any failure)."""
        try:
            store, _ = self._attached()
            n = int(store.batch_exists(self._keys(keys)))
        except Exception as exc:
            self._failed("batch_exists", exc)
            return 0
        self._count(exists_calls=1, exists_keys=len(keys), exists_hits=n)
        return n

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Read pages straight into SGLang's host pages; one bool per key."""
        n = self._len(keys)
        if not n:
            return []
        try:
            store, bridge = self._attached()
            pages = self._pages(host_indices, n)
            t0 = time.perf_counter()
            got = [bool(x) for x in store.batch_get(self._keys(keys), pages)]
            elapsed = time.perf_counter() - t0
            if len(got) != n:
                raise StoreError(f"store answered {len(got)} results for {n} keys",
                                 backend=self.config.store)
        except Exception as exc:
            self._failed("batch_get_v1", exc)
            return [False] * n
        hits = sum(got)
        self._count(get_pages=n, get_hits=hits)
        self._metric("prefetch", n, elapsed)
        return got

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Write SGLang's host pages straight from their memory; one bool per key."""
        n = self._len(keys)
        if not n:
            return []
        try:
            store, _ = self._attached()
            pages = self._pages(host_indices, n)
            t0 = time.perf_counter()
            done = self._set_pages(store, self._keys(keys), pages)
            elapsed = time.perf_counter() - t0
        except Exception as exc:
            self._failed("batch_set_v1", exc)
            return [False] * n
        self._metric("backup", n, elapsed)
        return done

    # ----- the legacy calls (SGLang uses them when interface_v1 is not set) -----------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Read pages into flat page tensors (SGLang's ``get_dummy_flat_data_page``), staged
        through a page borrowed from SGLang's host pool; None per miss."""
        n = self._len(keys)
        if not n:
            return []
        out: list[Any] = [None] * n
        try:
            store, bridge = self._attached()
            dsts = self._flat_pages(target_locations, n)
            with self._borrowed(n) as pages:
                got = store.batch_get(self._keys(keys), pages)
                for i, (hit, page) in enumerate(zip(got, pages)):
                    if hit:
                        self._copy_out(page, dsts[i])
                        out[i] = target_locations[i]
        except Exception as exc:
            self._failed("batch_get", exc)
            return [None] * n
        hits = sum(x is not None for x in out)
        self._count(get_pages=n, get_hits=hits, legacy_calls=1)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Write flat page tensors (SGLang's ``get_data_page``); True if all were stored."""
        n = self._len(keys)
        if not n:
            return True
        try:
            store, bridge = self._attached()
            srcs = self._flat_pages(values, n)
            with self._borrowed(n) as pages:
                for src, page in zip(srcs, pages):
                    self._copy_in(src, page)
                done = self._set_pages(store, self._keys(keys), pages)
        except Exception as exc:
            self._failed("batch_set", exc)
            return False
        self._count(legacy_calls=1)
        return all(done)

    # ----- v2 calls: the KV pool only ---------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult
        try:
            others = [str(t.name) for t in pool_transfers or [] if str(t.name) != "kv"]
            if others:
                raise InvalidArgumentError(f"pools {others} are not stored by kvtier",
                                           argument="pool_transfers")
        except Exception as exc:
            self._failed("batch_exists_v2", exc)
            return PoolTransferResult.empty()
        n = self.batch_exists(keys, extra_info)
        return PoolTransferResult(n, {PoolName.KV: n} if n else {}, list(range(1, n + 1)))

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_get_v1, "batch_get_v2", extra_info)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_set_v1, "batch_set_v2", extra_info)

    def _v2(self, transfers: Any, fn: Any, op: str, extra_info: Any) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers or []:
            keys = list(getattr(t, "keys", None) or [])
            if str(t.name) == "kv" and t.host_indices is not None:
                out[t.name] = fn(keys, t.host_indices, extra_info)
            else:
                self._failed(op, InvalidArgumentError(f"pool {t.name!s} is not stored by "
                                                      "kvtier", argument="transfers"))
                out[t.name] = [False] * len(keys)
        return out

    # ----- housekeeping ------------------------------------------------------------------------
    def clear(self) -> bool:
        """Delete every object of this store's namespace (all ranks sharing it)."""
        try:
            store, _ = self._attached()
            store.clear()
        except Exception as exc:
            self._failed("clear", exc)
            return False
        return True

    def stats(self) -> dict[str, Any]:
        """Adapter counters (pages, hits, errors by call) and the store's own stats."""
        with self._lock:
            d: dict[str, Any] = dict(self.metrics.export()[0])
            d["errors"] = sum(self._errors.values())
            d["errors_by_call"] = dict(self._errors)
            d["last_error"] = self._last_error
        d["store_name"] = self.config.store
        if self.bridge is not None:
            d.update(sglang_layout=self.bridge.sglang_layout, pages=self.bridge.num_pages,
                     page_bytes=self.bridge.page_bytes, segments=self.bridge.segments,
                     kvtier_layout=self.bridge.pool.layout)
        try:
            d["store"] = self.store.stats() if self.store is not None else {}
        except Exception as exc:     # stats of a broken store: say so, don't raise
            d["store"] = {"error": f"{type(exc).__name__}: {exc}"}
        return d

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per call since the last call, when
        storage metrics are enabled) carrying :meth:`stats` as ``.kvtier``."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
            with self._lock:
                drained = {k: list(v) for k, v in self._metrics.items()}
                for v in self._metrics.values():
                    v.clear()
            metrics = StorageMetrics(**drained)
            metrics.kvtier = self.stats()
            return metrics
        except Exception as exc:
            self._failed("get_stats", exc)
            return None

    def close(self) -> None:
        """Close the store (idempotent); SGLang's host memory stays SGLang's."""
        with self._lock:
            store, self.store, self._closed = self.store, None, True
        if store is not None:
            store.close()

    def __repr__(self) -> str:
        return (f"KVTierHiCacheStorage(store={self.config.store!r}, "
                f"layout={getattr(self.bridge, 'sglang_layout', None)!r})")

    # ----- helpers ----------------------------------------------------------------------------
    def storage_key(self, key: str) -> bytes:
        """The kvtier store key of one SGLang page hash on this rank."""
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"SGLang page keys are non-empty strings, got {key!r}",
                                       argument="keys", value=key)
        return (self._prefix + key + self.key_suffix).encode("utf-8")

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        if isinstance(keys, (str, bytes)):
            raise InvalidArgumentError("keys must be a list of strings", argument="keys")
        return [self.storage_key(k) for k in keys]

    @staticmethod
    def _len(keys: Any) -> int:
        try:
            return len(keys)
        except TypeError:
            return 0

    def _attached(self) -> tuple[L3Store, PageBridge]:
        store, bridge = self.store, self.bridge
        if store is None or bridge is None:
            raise StoreError("closed" if self._closed else
                             "no host pool registered (register_mem_pool_host)",
                             backend=self.config.store)
        return store, bridge

    def _pages(self, host_indices: Any, n: int) -> list[int]:
        bridge = self._attached()[1]
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices must be a 1-D tensor",
                                       argument="host_indices")
        if host_indices.numel() != n * bridge.tokens_per_key:
            raise InvalidArgumentError(f"{host_indices.numel()} host indices for {n} pages of "
                                       f"{bridge.tokens_per_key} tokens",
                                       argument="host_indices")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices.cpu())
        return bridge.pages(ptrs, sizes, n)

    def _set_pages(self, store: L3Store, keys: list[bytes], pages: list[int]) -> list[bool]:
        n = len(keys)
        have = int(store.batch_exists(keys)) if self.config.skip_existing else 0
        done = [True] * have
        if have < n:
            done += [bool(x) for x in store.batch_set(keys[have:], pages[have:])]
        if len(done) != n:
            raise StoreError(f"store answered {len(done)} results for {n} keys",
                             backend=self.config.store)
        self._count(set_pages=n, set_ok=sum(done), set_skipped_existing=have)
        return done

    @contextmanager
    def _borrowed(self, n: int) -> Iterator[list[int]]:
        """``n`` pages of SGLang's own host pool, taken from its allocator for one legacy call
        (the store reads and writes only the attached pool)."""
        tokens = self._attached()[1].tokens_per_key
        idx = self.mem_pool_host.alloc(n * tokens)
        if idx is None:
            raise StoreError(f"SGLang's host pool has no {n} free pages to stage a legacy call",
                             backend=self.config.store)
        try:
            yield self._pages(idx, n)
        finally:
            self.mem_pool_host.free(idx)

    def _flat_pages(self, tensors: Any, n: int) -> list[torch.Tensor]:
        """uint8 views of ``n`` flat page tensors, each exactly one page."""
        page_bytes = self._attached()[1].page_bytes
        if tensors is None or self._len(tensors) != n:
            raise InvalidArgumentError(f"{n} keys need {n} page tensors", argument="values")
        out = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or \
                    not t.is_contiguous() or t.numel() * t.element_size() != page_bytes:
                raise InvalidArgumentError(f"a flat page must be a contiguous host tensor of "
                                           f"{page_bytes} bytes", argument="values")
            out.append(t.reshape(-1).view(torch.uint8))
        return out

    def _copy_out(self, page: int, dst: torch.Tensor) -> None:
        off = 0
        for seg in sorted(self.bridge.pool.page_segments(page), key=lambda s: s.data_ptr()):
            dst[off:off + seg.numel()].copy_(seg)
            off += seg.numel()

    def _copy_in(self, src: torch.Tensor, page: int) -> None:
        off = 0
        for seg in sorted(self.bridge.pool.page_segments(page), key=lambda s: s.data_ptr()):
            seg.copy_(src[off:off + seg.numel()])
            off += seg.numel()

    def _count(self, **deltas: int) -> None:
        self.metrics.add_many(deltas)
        self._sync_mirror()

    def _make_mirror(self, storage_config: Any) -> Any:
        """kvtier's counters as prometheus_client objects in this (scheduler) process; SGLang
        serves /metrics in prometheus_client's multiprocess mode, which gathers them."""
        try:
            from ...prometheus import PrometheusMirror, Source
            labels = {"store": self.config.store,
                      "tp_rank": str(getattr(storage_config, "tp_rank", 0)),
                      "model_name": str(getattr(storage_config, "model_name", "") or "")}
            return PrometheusMirror(Source(self.metrics, labels))
        except Exception as exc:   # metrics must never fail the backend: say so, go on
            log.warning("kvtier HiCache storage: kvtier metrics not exported to SGLang's "
                        "/metrics: %s: %s", type(exc).__name__, exc)
            return None

    def _sync_mirror(self) -> None:
        if self._mirror is None:
            return
        try:
            self._mirror.sync()
        except Exception as exc:
            self._mirror = None
            log.warning("kvtier HiCache storage: kvtier metrics export stopped: %s: %s",
                        type(exc).__name__, exc)

    def _metric(self, what: str, pages: int, elapsed: float) -> None:
        if not self.metrics_enabled or self.bridge is None:
            return
        gb = pages * self.bridge.page_bytes / (1 << 30)
        with self._lock:
            self._metrics[f"{what}_pgs"].append(pages)
            self._metrics[f"{what}_bandwidth"].append(gb / elapsed if elapsed > 0 else 0.0)

    def _failed(self, op: str, exc: BaseException) -> None:
        """Count a failed call and log it (first time with its traceback, then at most once a
        minute per kind); the caller returns a miss."""
        kind = type(exc).__name__
        now = time.monotonic()
        self.metrics.add(f"{op}_errors")
        self._sync_mirror()
        with self._lock:
            self._errors[op] += 1
            self._last_error = f"{op}: {kind}: {exc}"
            last = self._logged.get((op, kind))
            if last is not None and now - last < LOG_INTERVAL_S:
                return
            self._logged[(op, kind)] = now
            count = self._errors[op]
        log.warning("kvtier HiCache storage (%s): %s failed, counted as a miss (%d so far): "
                    "%s: %s", self.config.store, op, count, kind, exc,
                    exc_info=exc if last is None else None)
