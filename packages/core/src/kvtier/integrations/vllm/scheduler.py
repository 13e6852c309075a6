"""The connector's scheduler side: kvtier's planner (index and policy) behind vLLM's scheduler
hooks. It holds no tensors and moves no data: it maps vLLM's requests and blocks onto the
planner's keys and plans, and books what the workers report. Every decision -- what to offer,
the cost split, what to save and write, what a failed load costs -- is the planner's
(`kvtier.cache.CachePlanner`); this module only dispatches.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from ...cache import CachePlanner, Plan
from ...cache.cost import pairs
from ...cache.inplace import store_loads_in_place
from ...cache.keying import open_store, rank_key
from ...cache.l3io import L3IO
from ...metrics import Metrics
from .config import NULL_BLOCK, EngineView
from .identity import request_root
from .metadata import KVTierConnectorStats, KVTierMetadata, KVTierWorkerMetadata, LoadOrder

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


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


def _outside_window(block_ids: list[int]) -> int:
    """How many leading pages of a sliding-window request's external hit vLLM holds no block
    for (the null block: before the window)."""
    n = 0
    while n < len(block_ids) and block_ids[n] == NULL_BLOCK:
        n += 1
    return n


def _held_runs(block_ids: list[int], first: int) -> list[tuple[int, list[int]]]:
    """The runs of held blocks (not the null block) in ``block_ids``, which start at page
    ``first``: (page of the run's first block, its blocks)."""
    out: list[tuple[int, list[int]]] = []
    for i, b in enumerate(block_ids):
        if b == NULL_BLOCK:
            continue
        if out and out[-1][0] + len(out[-1][1]) == first + i:
            out[-1][1].append(b)
        else:
            out.append((first + i, [b]))
    return out


class SchedulerSide:
    """The scheduler's half of `KVTierConnector` (see the module doc)."""

    def __init__(self, view: EngineView, totals: "Counter[str]"):
        self.view = view
        cfg = self.cfg = view.cfg
        self.spec = view.spec
        self.block_size = view.block_size
        self.group = view.group
        self.totals = totals
        self.store = None
        exists = None
        self._exists_io: L3IO | None = None
        store = open_store(cfg, self.spec, view.keyer)
        if store is not None:      # existence checks only; the workers read and write
            self.store = store
            # the scheduler's existence checks run under the store-call deadline: a stuck
            # store costs misses, never a stalled scheduler loop
            io = self._exists_io = L3IO(store, threads=0, error_limit=cfg.l3_error_limit,
                                        call_timeout_s=cfg.l3_call_timeout_s,
                                        metrics=Metrics(), name="kvtier-scheduler-l3")
            # rank 0's objects as the workers key them: MLA's latent is stored once, under
            # the page key itself, whatever vLLM's TP size (`EngineView.l3_writer`)
            tp = cfg.tp_size
            exists = lambda keys: io.exists([rank_key(k, 0, tp) for k in keys])  # noqa: E731
        self.planner = CachePlanner(cfg, spec=self.spec, device_layout=view.page_order,
                                    num_host_pages=view.num_host_pages, l3_exists=exists,
                                    engine_identity=view.identity)
        self.keyer = self.planner.keyer
        # loads in place where the store can (the workers' first report corrects this where
        # a device cannot): a new engine's first requests already skip the copy into L2
        self.planner.set_in_place(store_loads_in_place(cfg, store))
        self.reqs: dict[str, _Req] = {}
        #: req -> (start, L2 pages, L3 pages offered, whether vLLM was told the load is async)
        self._offers: dict[str, tuple[int, int, int, bool]] = {}
        self._prefetches: list[Plan] = []
        self._loads: list[LoadOrder] = []
        #: Requests that ended while their asynchronous load ran: vLLM frees their blocks
        #: when the load is reported received, and so the connector forgets them then.
        self._ended_loading: set[str] = set()
        self._hit_sources: dict[str, tuple[int, int]] = {}
        self._interval: Counter[str] = Counter()
        self._async_reqs: dict[int, str] = {}                    # plan id -> request
        self._load_reqs: dict[int, tuple[str, int]] = {}  # load plan -> (request, start)
        self._saved_last_step = False

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
        offer = self.planner.offer(keys, start, num_tokens=request.num_tokens)
        if offer.probe is not None:
            self._prefetches.append(offer.probe)
            self.totals["cost_probe_pages"] += len(offer.probe.l3_reads)
        for c in (self.totals, self._interval):     # pages the split left to vLLM
            c.update(cost_skipped_pages_l2=offer.skipped_l2,
                     cost_skipped_pages_l3=offer.skipped_l3)
        # asynchronous (vLLM schedules the request once it is reported received) unless the
        # L3 pages load in place, as L2 pages do: layer by layer before the forward
        is_async = offer.l3_pages > 0 and not self.planner.in_place
        self._offers[request.request_id] = (start, offer.l2_pages, offer.l3_pages, is_async)
        return offer.pages * self.block_size, is_async

    def hit_sources(self, request: "Request", num_external_tokens: int,
                    host: Any, disk: Any) -> dict[Any, int] | None:
        """vLLM's cache-hit sources of the request's external hit (None: not ours)."""
        l2, l3 = self._hit_sources.pop(request.request_id, (0, 0))
        if num_external_tokens == 0 or (l2 + l3) * self.block_size != num_external_tokens:
            return None
        out = {host: l2 * self.block_size, disk: l3 * self.block_size}
        return {k: v for k, v in out.items() if v}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        r = self._req(request)
        offered = self._offers.pop(request.request_id, None)
        if offered is None or num_external_tokens == 0:
            return
        start, l2, l3, is_async = offered
        n = num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[self.group][start:start + n])
        # a sliding-window model: vLLM gave the null block to the pages before the window;
        # they count as computed and only the window's pages are loaded
        skip = _outside_window(block_ids) if self.view.sliding_window else 0
        first, block_ids = start + skip, block_ids[skip:]
        plan = self.planner.plan_load(r.keys, block_ids, first)
        covered = set(plan.load_pages)
        failed = [b for b in block_ids if b not in covered]     # recomputed by vLLM
        self._load_reqs[plan.plan_id] = (request.request_id, first)
        if is_async:
            r.load_plan = plan.plan_id
            self._async_reqs[plan.plan_id] = request.request_id
        # pages outside the window count as hits of the tier the offer found them in
        n3 = len(plan.l3_reads) + len(plan.l3_loads) + max(0, skip - l2)
        n2 = len(plan.loads) - len(plan.l3_reads) + min(skip, l2)
        self._hit_sources[request.request_id] = (n2, n - n2)
        for c in (self.totals, self._interval):
            c.update(hit_tokens_l2=n2 * self.block_size, hit_tokens_l3=n3 * self.block_size,
                     load_requests=1, planned_but_uncovered_blocks=len(failed))
        self._loads.append(LoadOrder(request.request_id, plan, failed, is_async))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._loads, prefetches=self._prefetches)
        self._loads, self._prefetches = [], []
        sched = scheduler_output.num_scheduled_tokens
        step: list[tuple[int, int]] = []           # (scheduled, computed before) per request
        for new in scheduler_output.scheduled_new_reqs:
            step.append((sched.get(new.req_id, 0), new.num_computed_tokens))
            r = self.reqs.get(new.req_id)
            if r is not None:
                r.block_ids = list(new.block_ids[self.group])
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
                r.block_ids = list(nb[self.group]) if nb is not None else []
            elif nb is not None:
                r.block_ids.extend(nb[self.group])
            self._plan_saves(r, cached.num_computed_tokens[i] + sched.get(req_id, 0),
                             meta.saves)
        # vLLM 0.32 starts a step's connector work after launching its forward unless told
        # the step loads synchronously: last step's backups (blocks -> host pages, on a copy
        # stream where there is one) must land before this forward can write a block vLLM
        # gave away (`WorkerSide.start_load_kv`)
        if self._saved_last_step:
            scheduler_output.has_sync_kv_loads = True
        self._saved_last_step = bool(meta.saves)
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
        ids = r.block_ids[r.saved:full]
        runs = [(r.saved, ids)] if not self.view.sliding_window else \
            _held_runs(ids, r.saved)    # pages outside the window are not held: not saved
        r.saved = full
        for first, run in runs:
            plan = self.planner.plan_save(keys, run, first)
            if plan.empty:
                self.planner.complete(plan.failed())       # nothing to run: book it now
            else:
                saves.append(plan)

    def book_worker_meta(self, wm: Any) -> None:
        """What the workers reported for this group: plan results, rates, L3 health."""
        if isinstance(wm, KVTierWorkerMetadata):
            if wm.rates:
                self.planner.adopt_rates(wm.rates)
            if wm.l3_state is not None:
                self.planner.set_l3_state(wm.l3_state)
            if wm.in_place is not None:
                self.planner.set_in_place(wm.in_place)
            for res in wm.results:
                self._book(res)

    def received(self, req_ids: Any) -> None:
        """vLLM was told these requests' asynchronous loads finished."""
        for req_id in req_ids:
            if req_id in self._ended_loading:        # ended while loading: vLLM frees now
                self._ended_loading.discard(req_id)
                self.reqs.pop(req_id, None)

    def set_async(self, request_id: str) -> None:
        """Make the request's offered load asynchronous (a hybrid model's groups: vLLM can
        recover a failed load of several groups only per request, and only when it is
        asynchronous)."""
        o = self._offers.get(request_id)
        if o is not None:
            self._offers[request_id] = (o[0], o[1], o[2], True)

    def _book(self, res: Any) -> None:
        try:
            self.planner.complete(res)
        except Exception as exc:   # a result the planner does not know: log only
            log.warning("kvtier: result of plan %s not booked: %s", res.plan_id, exc)
        load = self._load_reqs.pop(res.plan_id, None)
        lr = self.reqs.get(load[0]) if load is not None else None
        if load is not None and lr is not None and not all(res.loads):
            # vLLM recomputes from the first failed block and asks again: offer no more
            # than this load delivered
            lr.max_pages = load[1] + res.loaded_prefix
            self.totals["failed_load_requests"] += 1
        req_id = self._async_reqs.pop(res.plan_id, None)
        r = self.reqs.get(req_id) if req_id is not None else None
        if r is not None:
            r.load_plan = None

    def request_finished(self, request: "Request") -> bool:
        """True: the request's load is still running (vLLM frees its blocks once it ends)."""
        self._offers.pop(request.request_id, None)
        self._hit_sources.pop(request.request_id, None)
        r = self.reqs.get(request.request_id)
        if r is not None and r.load_plan is not None:
            self._ended_loading.add(request.request_id)
            return True
        self.reqs.pop(request.request_id, None)
        return False

    def metrics(self) -> dict[str, Any]:
        """The planner's counters and the rates its split runs on."""
        out: dict[str, Any] = {"planner": {k: v for k, v in self.planner.metrics().items()
                                           if k != "latency"}}
        cost = self.planner.cost
        out["cost_rates"] = cost.rates()
        out["cost_reports"] = getattr(cost, "reports", 0)
        if self._exists_io is not None:
            out["scheduler_l3"] = self._exists_io.metrics.snapshot()
        return out

    def stats(self) -> KVTierConnectorStats | None:
        """This interval's hits per tier."""
        data, self._interval = dict(self._interval), Counter()
        return KVTierConnectorStats(data=data) if any(data.values()) else None

    def shutdown(self) -> None:
        if self.store is not None:
            if self._exists_io is not None:
                self._exists_io.stop(self.cfg.close_timeout_s)
            self.store.close()
            self.store = None
