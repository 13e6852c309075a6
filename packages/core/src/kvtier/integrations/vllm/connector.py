"""`KVTierConnector`: the `KVConnectorBase_V1` subclass (see the package docstring)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults,
    KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ... import registry
from ...cache import CacheConfig
from ...errors import ConfigError, LayoutError
from ...host_pool import HostKVPool
from ...spec import KVSpec, dtype_name
from .datapath import PAGE_ORDER, DataPath
from .identity import engine_identity, make_keyer, rank_key, request_root
from .index import HostPageIndex

try:      # vLLM >= 0.31 names the tier an external hit came from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")

#: CacheConfig fields the connector does not take from the user (vLLM decides them).
_FROM_VLLM = ("tp_rank", "tp_size")
_WRITE_POLICIES = ("write_through",)


# --------------------------------------------------------------------------------------------
# Plain data between the two halves
# --------------------------------------------------------------------------------------------
@dataclass
class LoadOrder:
    """Copy these host pages into these vLLM blocks (L3 pages are read from the store first)."""

    req_id: str
    block_ids: list[int]
    host_pages: list[int]
    keys: list[bytes]
    from_l3: list[bool]
    is_async: bool


@dataclass
class SaveOrder:
    """Back these vLLM blocks up into these host pages after the forward pass wrote them."""

    block_ids: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    saves: SaveOrder = field(default_factory=SaveOrder)
    write_l3: bool = True
    #: Requests that finished while their asynchronous load ran: report them as sent once the
    #: load is done, so vLLM frees their blocks only then.
    finished_while_loading: list[str] = field(default_factory=list)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker learnt this step: L3 pages that landed (or not) in host pages, keys a
    host page turned out not to hold, saves that were skipped."""

    l3_landed: list[tuple[bytes, int]] = field(default_factory=list)
    l3_failed_pages: list[int] = field(default_factory=list)
    bad_keys: list[bytes] = field(default_factory=list)
    save_skipped: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierWorkerMetadata":
        assert isinstance(other, KVTierWorkerMetadata)
        # A page counts as landed only where every rank's shard landed.
        theirs = set(other.l3_landed)
        landed = [x for x in self.l3_landed if x in theirs]
        failed = set(self.l3_failed_pages) | set(other.l3_failed_pages)
        failed |= {p for _, p in set(self.l3_landed) ^ theirs}
        return KVTierWorkerMetadata(l3_landed=landed, l3_failed_pages=sorted(failed),
                                    bad_keys=sorted(set(self.bad_keys) | set(other.bad_keys)),
                                    save_skipped=sorted(set(self.save_skipped)
                                                        | set(other.save_skipped)))


class KVTierConnectorStats(KVConnectorStats):
    """kvtier's counters for one interval (pages, bytes, failures per tier); sums."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        merged = Counter(self.data)
        merged.update(other.data or {})
        return KVTierConnectorStats(data=dict(merged))

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# --------------------------------------------------------------------------------------------
# Configuration shared by both halves
# --------------------------------------------------------------------------------------------
def cache_config_from_vllm(vllm_config: "VllmConfig") -> CacheConfig:
    """kvtier's typed CacheConfig from ``kv_connector_extra_config`` (unknown keys: a
    ConfigError naming the key); ``model_id`` defaults to vLLM's model."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    for name in _FROM_VLLM:
        if name in extra:
            raise ConfigError(f"kv_connector_extra_config.{name}: the connector takes it from "
                              "vLLM's parallel config; remove it", key=name, value=extra[name])
    extra.setdefault("model_id", str(vllm_config.model_config.model))
    cfg = CacheConfig.from_dict(extra)
    if cfg.write_policy not in _WRITE_POLICIES:
        raise ConfigError(f"write_policy={cfg.write_policy!r} is not supported by the vLLM "
                          f"connector; supported: {list(_WRITE_POLICIES)}", key="write_policy",
                          value=cfg.write_policy)
    if cfg.host_layout != "page_first":
        raise ConfigError("the vLLM connector needs host_layout='page_first'",
                          key="host_layout", value=cfg.host_layout)
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ConfigError("kvtier's vLLM connector does not support pipeline parallelism yet",
                          key="pipeline_parallel_size",
                          value=vllm_config.parallel_config.pipeline_parallel_size)
    return cfg


def spec_from_kv_cache_config(kv_cache_config: "KVCacheConfig") -> tuple[KVSpec, list[str]]:
    """The KVSpec of vLLM's (single, full-attention) KV cache group and its layer names."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise LayoutError(f"kvtier's vLLM connector needs one KV cache group, got "
                          f"{len(groups)} (hybrid / sliding-window models are not supported)")
    g = groups[0]
    s = g.kv_cache_spec
    if getattr(s, "head_size_v", s.head_size) != s.head_size:
        raise LayoutError("K and V of different head sizes are not supported")
    spec = KVSpec.mha(num_layers=len(g.layer_names), num_kv_heads=int(s.num_kv_heads),
                      head_dim=int(s.head_size), page_size=int(s.block_size),
                      dtype=dtype_name(s.dtype))
    return spec, list(g.layer_names)


def expected_page_order(vllm_config: "VllmConfig") -> str:
    """The byte order of a block the platform's attention backend uses."""
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    return PAGE_ORDER["vllm_cpu"] if device == "cpu" else PAGE_ORDER["vllm_flash"]


# --------------------------------------------------------------------------------------------
# Scheduler-side per-request state
# --------------------------------------------------------------------------------------------
class _Req:
    __slots__ = ("request", "keys", "root", "block_ids", "cacheable", "async_pins",
                 "l3_reserved", "loading", "saved")

    def __init__(self, request: "Request", cacheable: bool, root: bytes | None):
        self.request = request
        self.keys: list[bytes] = []
        self.root = root
        self.block_ids: list[int] = []
        self.cacheable = cacheable
        self.async_pins: list[int] = []
        self.l3_reserved: dict[int, bytes] = {}
        self.loading = False
        self.saved = 0            # blocks before this one were offered to the host pool


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's tiers (host pool, L3 store) under vLLM's paged KV cache."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False          # a dropped backup is a later miss, never lost work

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = cache_config_from_vllm(vllm_config)
        self.spec, self.layer_names = spec_from_kv_cache_config(kv_cache_config)
        if self.spec.page_size != vllm_config.cache_config.block_size:
            raise LayoutError(f"KV group block size {self.spec.page_size} differs from the "
                              f"cache block size {vllm_config.cache_config.block_size}")
        self.block_size = self.spec.page_size
        self.page_order = expected_page_order(vllm_config)
        self.identity = engine_identity(vllm_config, self.page_order)
        self.keyer = make_keyer(self.cfg.model_id, self.spec, self.identity, self.cfg.salt)
        self.num_device_blocks = int(kv_cache_config.num_blocks)
        self.num_host_pages = self.cfg.host_pages_for(self.spec.page_bytes,
                                                      self.num_device_blocks)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != \
                "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r: a failed load (corrupted or "
                        "missing L3 object) fails its request instead of recomputing; set "
                        "kv_load_failure_policy='recompute'",
                        self._kv_transfer_config.kv_load_failure_policy)
        self._lock = threading.Lock()
        self.totals: Counter[str] = Counter()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()
        log.info("kvtier connector (%s): %d host pages of %d bytes, L3 %s, namespace %s",
                 role.name.lower(), self.num_host_pages, self.spec.page_bytes,
                 self.cfg.l3_store or "none", self.keyer.namespace_id)

    # ===================================== scheduler side ====================================
    def _init_scheduler(self) -> None:
        self.index = HostPageIndex(self.num_host_pages)
        self.reqs: dict[str, _Req] = {}
        self._plans: dict[str, tuple[int, int, int]] = {}      # req -> (start, l2, l3)
        self._loads: list[LoadOrder] = []
        self._sync_pins: list[int] = []
        self._finished_loading: list[str] = []
        self._hit_sources: dict[str, tuple[int, int]] = {}
        self.store = None
        if self.cfg.l3_store:      # for existence checks only; the worker reads and writes
            self.store = registry.create_l3_store(self.cfg.l3_store, self.cfg.l3_config,
                                                  spec=self.spec)
        self._l3_errors_in_row = 0
        self._interval: Counter[str] = Counter()

    def _req(self, request: "Request") -> _Req:
        r = self.reqs.get(request.request_id)
        if r is None:
            cacheable = not request.mm_features and request.lora_request is None \
                and getattr(request, "prompt_embeds", None) is None
            r = _Req(request, cacheable, request_root(self.keyer, request.cache_salt))
            self.reqs[request.request_id] = r
        return r

    def _keys_upto(self, r: _Req, num_blocks: int) -> list[bytes]:
        have = len(r.keys)
        if num_blocks > have:
            toks = r.request.all_token_ids[have * self.block_size:num_blocks * self.block_size]
            prev = r.keys[-1] if r.keys else r.root
            r.keys.extend(self.keyer.keys(list(toks), prev=prev))
        return r.keys[:num_blocks]

    def _l3_exists(self, keys: list[bytes]) -> int:
        if self.store is None or not keys:
            return 0
        try:
            n = int(self.store.batch_exists([rank_key(k, 0, self.tp_size) for k in keys]))
            self._l3_errors_in_row = 0
            return max(0, min(n, len(keys)))
        except Exception as exc:   # a dead store is a miss, counted and logged
            self._l3_errors_in_row += 1
            self.totals["l3_lookup_errors"] += 1
            if self._l3_errors_in_row in (1, self.cfg.l3_error_limit):
                log.warning("kvtier: L3 lookup failed (%d in a row): %s",
                            self._l3_errors_in_row, exc)
            return 0

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        r = self._req(request)
        if not r.cacheable:
            return 0, False
        limit = (request.num_tokens - 1) // self.block_size   # vLLM computes >= 1 token
        start = num_computed_tokens // self.block_size
        if start >= limit:
            return 0, False
        keys = self._keys_upto(r, limit)
        l2 = self.index.leading_hits(keys[start:])
        l3 = self._l3_exists(keys[start + l2:limit])
        self._plans[request.request_id] = (start, l2, l3)
        return (l2 + l3) * self.block_size, l3 > 0

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int
                                       ) -> dict[Any, int]:
        l2, l3 = self._hit_sources.pop(request.request_id, (0, 0))
        if CacheHitSource is None or num_external_tokens == 0 or \
                (l2 + l3) * self.block_size != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        out = {CacheHitSource.HOST: l2 * self.block_size, CacheHitSource.DISK: l3 * self.block_size}
        return {k: v for k, v in out.items() if v}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        r = self._req(request)
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens == 0 or plan is None:
            return
        start, l2, l3 = plan
        n = num_external_tokens // self.block_size
        if n != l2 + l3:        # vLLM took fewer tokens than offered: load those only
            l2, l3 = min(l2, n), max(0, n - l2)
        block_ids = list(blocks.get_block_ids()[0][start:start + n])
        keys = r.keys[start:start + n]
        pages: list[int] = []
        from_l3: list[bool] = []
        for k in keys[:l2]:
            p = self.index.page_of(k)
            pages.append(-1 if p is None else p)     # evicted meanwhile: fails, recomputed
            from_l3.append(False)
        l2_pages = [p for p in pages if p >= 0]
        self.index.touch(keys[:l2])
        self.index.pin(l2_pages)
        new = self.index.allocate(l3)
        for i, k in enumerate(keys[l2:]):
            if i < len(new):
                pages.append(new[i])
                r.l3_reserved[new[i]] = k
            else:
                pages.append(-1)                     # no host page free: fails, recomputed
            from_l3.append(True)
        is_async = l3 > 0
        if is_async:
            r.async_pins = l2_pages
            r.loading = True
        else:
            self._sync_pins.extend(l2_pages)
        self._hit_sources[request.request_id] = (l2, l3)
        for c in (self.totals, self._interval):
            c.update(hit_tokens_l2=l2 * self.block_size, hit_tokens_l3=l3 * self.block_size,
                     load_requests=1)
        self._loads.append(LoadOrder(request.request_id, block_ids, pages, keys, from_l3,
                                     is_async))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVTierMetadata(loads=self._loads, write_l3=self.store is not None,
                              finished_while_loading=self._finished_loading)
        self._loads, self._finished_loading = [], []
        for new in scheduler_output.scheduled_new_reqs:
            r = self.reqs.get(new.req_id)
            if r is not None:
                r.block_ids = list(new.block_ids[0])
                self._plan_saves(r, new.num_computed_tokens
                                 + scheduler_output.num_scheduled_tokens.get(new.req_id, 0),
                                 meta.saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self.reqs.get(req_id)
            if r is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = list(nb[0]) if nb is not None else []
            elif nb is not None:
                r.block_ids.extend(nb[0])
            self._plan_saves(r, cached.num_computed_tokens[i]
                             + scheduler_output.num_scheduled_tokens.get(req_id, 0), meta.saves)
        # Loads of this step run before its saves on the worker: their pages are safe now.
        self.index.unpin(self._sync_pins)
        self._sync_pins = []
        return meta

    def _plan_saves(self, r: _Req, computed_tokens: int, saves: SaveOrder) -> None:
        if not r.cacheable:
            return
        full = min(computed_tokens, r.request.num_tokens, len(r.block_ids) * self.block_size)
        full //= self.block_size
        keys = self._keys_upto(r, full)
        for i in range(r.saved, full):
            k = keys[i]
            r.saved = i + 1
            if k in self.index:
                self.index.touch([k])
                continue
            if k in saves.keys:
                continue
            page = self.index.allocate(1)
            if not page:
                self.totals["saves_skipped_l2_full"] += full - i
                r.saved = full
                return
            self.index.insert(k, page[0])
            saves.block_ids.append(r.block_ids[i])
            saves.host_pages.append(page[0])
            saves.keys.append(k)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, KVTierWorkerMetadata):
            reserved = {p: (rid, k) for rid, r in self.reqs.items()
                        for p, k in r.l3_reserved.items()}
            for key, page in wm.l3_landed:
                owner = reserved.get(page)
                if owner is None or owner[1] != key:
                    continue
                self.reqs[owner[0]].l3_reserved.pop(page)
                if key in self.index:
                    self.index.free([page])
                else:
                    self.index.insert(key, page)
            for page in wm.l3_failed_pages:
                owner = reserved.get(page)
                if owner is not None and page in self.reqs[owner[0]].l3_reserved:
                    self.reqs[owner[0]].l3_reserved.pop(page)
                    self.index.free([page])
            for key in list(wm.bad_keys) + list(wm.save_skipped):
                self.index.drop(key)
        for req_id in connector_output.finished_recving or ():
            r = self.reqs.get(req_id)
            if r is None:
                continue
            self._end_load(r)
        stats = connector_output.kv_connector_stats
        if stats is not None and stats.data:
            self.totals.update(stats.data)
        if connector_output.invalid_block_ids:
            self.totals["invalid_blocks_reported"] += len(connector_output.invalid_block_ids)

    def _end_load(self, r: _Req) -> None:
        self.index.unpin(r.async_pins)
        r.async_pins = []
        if r.l3_reserved:                   # never reported: give the pages back
            self.index.free(list(r.l3_reserved))
            r.l3_reserved = {}
        r.loading = False

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        r = self.reqs.get(request.request_id)
        self._plans.pop(request.request_id, None)
        self._hit_sources.pop(request.request_id, None)
        if r is not None and r.loading:
            self._finished_loading.append(request.request_id)
            return True, None
        self.reqs.pop(request.request_id, None)
        return False, None

    def metrics(self) -> dict[str, Any]:
        """Cumulative counters: hits per tier (tokens), and the workers' pages, bytes and
        failures as reported through vLLM's connector stats."""
        out = dict(self.totals)
        if self._role == KVConnectorRole.SCHEDULER:
            out["l2_pages_indexed"] = len(self.index)
            out["l2_evictions"] = self.index.evictions
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    # ====================================== worker side ======================================
    def _init_worker(self) -> None:
        self.data: DataPath | None = None
        self._layer_idx = {name: i for i, name in enumerate(self.layer_names)}
        self._sync_handles: list[Any] = []
        self._waited: set[int] = set()
        self._load_errors: set[int] = set()
        self._save_plan: tuple[list[int], list[int], list[bytes]] | None = None
        self._worker_meta = KVTierWorkerMetadata()
        self._pending_async: set[str] = set()
        self._finish_after_load: set[str] = set()
        self._done_sending: set[str] = set()
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:   # no parallel state (single process)
            self.tp_rank = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"vLLM registered no KV tensor for layers {missing}")
        layers = [kv_caches[n] for n in self.layer_names]
        host_pool = HostKVPool(self.spec, self.num_host_pages,
                               allocator=registry.create_host_allocator(
                                   self.cfg.host_allocator, self.cfg.host_allocator_config))
        store = None
        try:
            if self.cfg.l3_store:
                store = registry.create_l3_store(self.cfg.l3_store, self.cfg.l3_config,
                                                 spec=self.spec)
                store.attach(host_pool)
            tp_rank, tp_size = self.tp_rank, self.tp_size
            self.data = DataPath(self.spec, layers, host_pool, store,
                                 store_key=lambda k: rank_key(k, tp_rank, tp_size),
                                 l3_batch_pages=self.cfg.l3_batch_pages)
        except BaseException:
            if store is not None:
                store.close()
            host_pool.close()
            raise
        if self.data.page_order != self.page_order:
            raise LayoutError(f"vLLM's KV blocks are laid out {self.data.layout} "
                              f"(page order {self.data.page_order}), but the key namespace was "
                              f"made for page order {self.page_order}")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTierMetadata) or self.data is None:
            return
        self._finish_after_load |= set(meta.finished_while_loading)
        for order in meta.loads:
            if order.is_async:
                self._pending_async.add(order.req_id)
                self.data.start_async_load(order.req_id, order.block_ids, order.host_pages,
                                           order.keys, order.from_l3)
                continue
            valid = [p >= 0 for p in order.host_pages]
            held = self.data.check_pages(order.keys, [max(p, 0) for p in order.host_pages])
            blocks, pages = [], []
            for b, p, k, v, h in zip(order.block_ids, order.host_pages, order.keys, valid,
                                     held):
                if v and h:
                    blocks.append(b)
                    pages.append(p)
                else:
                    self._load_errors.add(b)
                    if v:
                        self._worker_meta.bad_keys.append(k)
            if len(blocks) != len(order.block_ids):
                self.data.count(load_failures=len(order.block_ids) - len(blocks))
            if blocks:
                self._sync_handles.append((self.data.start_load(blocks, pages), blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_idx.get(layer_name)
        if i is None or not self._sync_handles:
            return
        self._wait_layer(i)

    def _wait_layer(self, i: int) -> None:
        if i in self._waited:
            return
        self._waited.add(i)
        for handle, blocks in self._sync_handles:
            try:
                handle.wait_layer(i)
            except Exception as exc:        # those blocks are recomputed
                log.warning("kvtier: load into layer %d failed: %s", i, exc)
                self._load_errors.update(blocks)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTierMetadata) or self.data is None or not meta.saves.keys:
            return
        i = self._layer_idx.get(layer_name)
        if i is None:
            return
        if self._save_plan is None:
            s = meta.saves
            ok = self.data.claim_for_save(s.host_pages)
            self._save_plan = ([b for b, o in zip(s.block_ids, ok) if o],
                               [p for p, o in zip(s.host_pages, ok) if o],
                               [k for k, o in zip(s.keys, ok) if o])
            self._worker_meta.save_skipped.extend(k for k, o in zip(s.keys, ok) if not o)
            self._save_layers: set[int] = set()
        blocks, pages, _ = self._save_plan
        if blocks:
            self.data.save_layer(i, blocks, pages)
        self._save_layers.add(i)

    def wait_for_save(self) -> None:
        if self.data is None:
            return
        for i in range(self.spec.num_layers):       # every load has landed by now
            if self._sync_handles and i not in self._waited:
                log.warning("kvtier: layer %d was not waited for before its forward; its "
                            "loaded blocks are recomputed", i)
                self._wait_layer(i)
                for _, blocks in self._sync_handles:
                    self._load_errors.update(blocks)
        self._sync_handles = []
        self._waited = set()
        plan, self._save_plan = self._save_plan, None
        if plan is None:
            return
        blocks, pages, keys = plan
        meta = self._connector_metadata
        missing = [i for i in range(self.spec.num_layers) if i not in self._save_layers]
        if missing and blocks:
            for i in missing:     # a layer vLLM did not hand to save_kv_layer
                self.data.save_layer(i, blocks, pages)
        self.data.commit_saves(keys, pages, isinstance(meta, KVTierMetadata) and meta.write_l3)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.data is None:
            return out
        for res in self.data.poll_results():
            self._pending_async.discard(res.req_id)
            self._load_errors.update(res.failed_blocks)
            wm = self._worker_meta
            wm.l3_landed.extend(res.l3_landed)
            wm.l3_failed_pages.extend(res.l3_failed_pages)
            wm.bad_keys.extend(res.bad_keys)
            out.finished_recving.add(res.req_id)
            if res.req_id in self._finish_after_load:
                self._finish_after_load.discard(res.req_id)
                out.finished_sending.add(res.req_id)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        wm = self._worker_meta
        if not (wm.l3_landed or wm.l3_failed_pages or wm.bad_keys or wm.save_skipped):
            return None
        self._worker_meta = KVTierWorkerMetadata()
        return wm

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role == KVConnectorRole.SCHEDULER:     # this interval's hits per tier
            data, self._interval = dict(self._interval), Counter()
            return KVTierConnectorStats(data=data) if any(data.values()) else None
        if self.data is None:
            return None
        data = self.data.take_counters()
        if not any(data.values()):
            return None
        with self._lock:
            self.totals.update(data)
        return KVTierConnectorStats(data=data)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            if self.data is not None:
                self.data.close(self.cfg.close_timeout_s)
                self.data = None
        elif self.store is not None:
            self.store.close()
            self.store = None
