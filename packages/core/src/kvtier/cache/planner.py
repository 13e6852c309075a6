"""`CachePlanner`: the index/policy half of the cache, for a process that holds no KV data.

It answers "how many leading pages of these keys can you load, from L2 or L3?", keeps the L2
index (host page ids only, LRU eviction leaf first), and turns a request's loads and saves
into plain-data `Plan` s for a `CacheExecutor` elsewhere; the executor's `PlanResult` s come
back through `complete`. It holds no tensors and does no engine or store I/O: L3 presence
comes from a callable (``l3_exists(keys) -> leading count``, e.g. an `L3Store`'s
``batch_exists``). L1 is the engine's own (vLLM's block pool): the planner manages L2 and L3
residency only, and a run may be indexed from any page on (its prefix in the engine's L1).

Life of a request (vLLM's scheduler-side connector)::

    planner = CachePlanner(config, spec=spec, l3_exists=store.batch_exists)
    keys = planner.keys(token_ids)
    hit = planner.lookup(keys, start=num_computed_pages)   # Lookup(l2_pages, l3_pages)
    plan = planner.plan_load(keys, device_pages, start=num_computed_pages)
    ... later, after prefill ...
    plan = planner.plan_save(keys, device_pages)            # backups (+ L3 writes)
    ... ship plans to the worker; for each PlanResult that comes back:
    planner.complete(result)

Pages being read, backed up or written stay out of eviction until their plan completes; a
plan that will never run is failed with `fail` (pins and host pages come back). Policies: as
`CacheConfig` (``write_through`` backs every saved page up and writes it to L3;
``write_through_selective`` backs a page up at its ``selective_threshold``-th save;
``write_back`` backs every saved page up -- the engine's L1 evicts without telling -- and
writes it to L3 only when L2 evicts it). Thread-safe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import InvalidArgumentError, PageIndexError
from ..keys import PageKeyer
from ..metrics import Metrics
from ..policies import make_prefetch_policy, make_write_policy
from ..spec import KVSpec
from .config import CacheConfig
from .cost import CostModel, ReportedCostModel
from .eviction import after_l3_write, alloc_evicting, select_l2
from .index import Node, PageIdPool, PageIndex
from .keying import make_keyer
from .l3io import first_miss
from .plans import Lookup, Offer, Plan, PlanResult, hit_counts
from .unreadable import UnreadableKeys

log = logging.getLogger("kvtier.cache")

__all__ = ["CachePlanner"]


@dataclass
class _Pending:
    plan: Plan
    pinned: list[Node] = field(default_factory=list)           # L2 pages the loads read
    read_parents: list[bytes | None] = field(default_factory=list)
    backup_keys: list[bytes] = field(default_factory=list)
    backup_parents: list[bytes | None] = field(default_factory=list)
    wt_writes: int = 0                  # first l3_writes: write-through of the backups
    #: The backup each write-through write is of (its index in ``backups``); the backups
    #: not written are pages a lookup found in L3 already.
    wt_of: list[int] = field(default_factory=list)
    wb_nodes: list[Node] = field(default_factory=list)         # write-backs, then evict
    wb_write: list[bool] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)            # pending keys it holds
    started: float = 0.0                # a load with L3 reads: when it was planned
    #: The backed-up pages as booked (None: that backup failed), in backup order.
    writing: list[Node | None] = field(default_factory=list)
    #: Booked but for its L3 writes (a result with ``writes_pending``): the write-through
    #: pages in ``writing`` stay pinned until the writes' result comes.
    write_pins: bool = False


class CachePlanner:
    """Index and policies of L2/L3 without data (see the module doc)."""

    def __init__(self, config: CacheConfig | Mapping[str, Any], *, spec: KVSpec,
                 device_layout: str, num_host_pages: int | None = None,
                 num_device_pages: int = 0,
                 l3_exists: Callable[[Sequence[bytes]], int] | None = None,
                 engine_identity: Mapping[str, Any] | None = None,
                 cost: CostModel | None = None, host_ids: Any = None,
                 metrics: Metrics | None = None):
        self.config = cfg = CacheConfig.from_dict(config)
        if not isinstance(spec, KVSpec):
            raise InvalidArgumentError(f"spec must be a KVSpec, got {type(spec).__name__}",
                                       argument="spec")
        if l3_exists is not None and not callable(l3_exists):
            raise InvalidArgumentError("l3_exists must be callable or None",
                                       argument="l3_exists")
        if not isinstance(device_layout, str) or not device_layout:
            raise InvalidArgumentError(f"device_layout must be the device pool's page order "
                                       f"(DeviceKVPool.page_order), got {device_layout!r}",
                                       argument="device_layout", value=device_layout)
        self.spec = spec
        self.keyer: PageKeyer = make_keyer(cfg, spec, device_layout=device_layout,
                                           engine=engine_identity)
        self.write_policy = make_write_policy(cfg.write_policy,
                                              selective_threshold=cfg.selective_threshold)
        self.prefetch_policy = make_prefetch_policy(
            cfg.prefetch_policy, min_tokens=cfg.prefetch_min_tokens,
            base_s=cfg.prefetch_timeout_base_s,
            per_1k_tokens_s=cfg.prefetch_timeout_per_1k_tokens_s,
            cap_s=cfg.prefetch_timeout_cap_s)
        if host_ids is not None:
            #: In one process the host pool itself hands out the page ids (`TieredKVCache`).
            self.host = host_ids
        else:
            n = num_host_pages if num_host_pages is not None else \
                cfg.host_pages_for(spec.page_bytes, max(1, num_device_pages))
            self.host = PageIdPool(n)
        self.index = PageIndex()
        #: The cost split's rates: measured by the data path and handed over (`adopt_rates`)
        #: unless a model measured in this process is given.
        self.cost: CostModel = cost if cost is not None else ReportedCostModel.from_config(cfg)
        self._l3_exists = l3_exists
        self._lock = threading.RLock()
        self._plans: dict[int, _Pending] = {}
        self._pending: dict[bytes, int] = {}      # key -> plan reading / backing it up
        self._held: dict[int, tuple[set[int], list[Node]]] = {}   # late store calls
        self._saves: OrderedDict[bytes, int] = OrderedDict()   # selective: saves per key
        #: Plan ids carry this planner's instance in their high bits, so a result of another
        #: planner (one before a restart) is refused instead of booked against a new plan.
        self.instance = secrets.randbits(30) + 1
        self._next_id = 0
        #: Keys whose L3 read failed: not offered again until a write replaces them.
        self.unreadable = UnreadableKeys()
        #: Keys a lookup found in L3 lately (bounded, oldest out): a save of one of them
        #: backs it up to L2 but does not write it to L3 again.
        self._in_l3: OrderedDict[bytes, None] = OrderedDict()
        #: The data path's L3 health as last reported (`set_l3_state`); "failed" stops the
        #: existence checks (nothing could be read).
        self.l3_state = "ok" if l3_exists is not None else "none"
        #: Does the data path load L3 pages in place (`set_in_place`)? Then a load plans
        #: ``l3_loads`` instead of L3 reads into host pages, and the split counts those pages
        #: at the L2 rate.
        self.in_place = False
        self.metrics_registry = metrics if metrics is not None else Metrics()
        m = self.metrics_registry
        if metrics is not None:
            return                          # the owner of the registry has its gauges
        m.gauge("l2_pages", lambda: self.index.l2_count)
        m.gauge("l2_free_pages", lambda: self.host.free_count)
        m.gauge("l2_capacity_pages", lambda: self.host.num_pages)
        m.gauge("plans_pending", lambda: len(self._plans))
        m.gauge("l2_pinned_pages", self._pinned_pages)
        m.gauge("l3_unreadable_keys", lambda: len(self.unreadable))
        m.gauge("l3_state", lambda: self.l3_state)

    # ----- queries ----------------------------------------------------------------------------
    @property
    def num_host_pages(self) -> int:
        return self.host.num_pages

    @property
    def has_l3(self) -> bool:
        return self._l3_exists is not None

    def keys(self, tokens: Any) -> list[bytes]:
        """Chained keys of every full page of ``tokens`` (same namespace as the cache's)."""
        return self.keyer.keys(tokens)

    def lookup(self, keys: Sequence[bytes], start: int = 0) -> Lookup:
        """Leading pages of ``keys[start:]`` in L2, then in L3 after them. Pins nothing."""
        self._check_start(keys, start)
        with self._lock:
            n2 = len(self.index.l2_run(keys, start))
        rest = list(keys[start + n2:])
        n3 = cut = 0
        if rest and self._l3_usable() and \
                self.prefetch_policy.consult_l3(len(rest) * self.spec.page_size):
            ok = self.unreadable.readable_prefix(rest)
            if ok:
                n3 = self._exists(rest[:ok])
            cut = int(n3 == ok < len(rest))      # the run went on into an unreadable key
            if n3:
                self._saw_in_l3(rest[:n3])
        self.metrics_registry.add_many({"lookup_calls": 1, "lookup_pages": len(keys) - start,
                                        "l2_matched_pages": n2, "l3_matched_pages": n3,
                                        "l3_unreadable_cut_lookups": cut})
        return Lookup(start, n2, n3)

    def offer(self, keys: Sequence[bytes], start: int = 0, *,
              num_tokens: int | None = None) -> Offer:
        """`lookup` and the cost split: of the leading hits from ``start``, those whose
        loading beats recomputing them at the measured rates (`CostModel.pages_to_load`);
        the engine computes the rest and the request's ``num_tokens`` (default: its full
        pages) after them. Before the L3 rate is known, at most `CostModel.L3_PROBE_PAGES`
        L3 pages are offered (a first read measures it); while the split skips every L3 page
        (where it loads some, their read measures the rate), a probe of as many pages is
        planned into L2 every `CostModel.L3_PROBE_INTERVAL_S`
        (``Offer.probe``), so a store that was slow and recovers is used again."""
        hit = self.lookup(keys, start)
        cost = self.cost
        l2, l3 = hit.l2_pages, hit.l3_pages
        if not cost.enabled or not hit.pages:
            return Offer(hit, l2, l3)
        direct = self.in_place             # L3 pages load as L2 pages do: no read to measure
        if not direct:
            l3 = cost.first_read_cap(l3, self.spec.page_bytes)
        ps = self.spec.page_size
        total = len(keys) * ps if num_tokens is None else num_tokens
        k2, k3 = cost.split(l2_pages=l2, l3_pages=l3, in_place=direct,
                            compute_tokens=max(1, total - (start + l2 + l3) * ps),
                            page_size=ps, page_bytes=self.spec.page_bytes,
                            layers=self.spec.num_layers, context=total)
        probe = None
        if k3 == 0 < l3 and not direct and cost.wants_l3_probe():
            probe = self.plan_prefetch(keys, start + l2, cost.L3_PROBE_PAGES)
            if probe.empty:
                self.complete(probe.failed())
                probe = None
        self.metrics_registry.add_many({"cost_skipped_pages_l2": l2 - k2,
                                        "cost_skipped_pages_l3": hit.l3_pages - k3,
                                        "cost_probe_pages": len(probe.l3_reads) if probe
                                        else 0})
        return Offer(hit, k2, k3, probe)

    def adopt_rates(self, rates: Mapping[str, Any] | None) -> None:
        """Rates the data path measured (`CacheExecutor.rates`), for the split."""
        adopt = getattr(self.cost, "adopt", None)
        if adopt is not None:
            adopt(rates)

    def l3_write_pays(self) -> bool:
        """Write saved pages to L3? Always with ``l3_write_when_slow``; else only while L3
        is not measured slower than recomputing (a page nobody could load faster than it is
        recomputed is not worth the disk)."""
        return self.config.l3_write_when_slow or not self.cost.l3_slower_than_recompute(
            self.spec.page_size, self.spec.page_bytes)

    def set_l3_state(self, state: str) -> None:
        """The data path's L3 health (`CacheExecutor.l3_state`): while it is ``failed...``
        no page is offered from L3 (every read would fail); one log line per change."""
        if not isinstance(state, str):
            raise InvalidArgumentError(f"l3 state must be a str, got {state!r}",
                                       argument="state", value=state)
        if self._l3_exists is None or state == self.l3_state:
            return
        was, self.l3_state = self.l3_state, state
        log.warning("kvtier planner: the data path's L3 tier went from %s to %s", was, state)

    def set_in_place(self, in_place: bool) -> None:
        """The data path loads L3 pages straight from its store's memory
        (`CacheExecutor.in_place`; across ranks, only if every rank does)."""
        if not isinstance(in_place, bool):
            raise InvalidArgumentError(f"in_place must be a bool, got {in_place!r}",
                                       argument="in_place", value=in_place)
        self.in_place = in_place and self._l3_exists is not None

    def _l3_usable(self) -> bool:
        return self._l3_exists is not None and not self.l3_state.startswith("failed")

    def pending_plans(self) -> list[int]:
        with self._lock:
            return sorted(self._plans)

    def l2_pages(self) -> dict[bytes, int]:
        """Key -> host page of every page in L2 (tests, debugging)."""
        with self._lock:
            return self.index.l2_pages()

    def metrics(self) -> dict[str, Any]:
        return self.metrics_registry.snapshot()

    def check(self) -> None:
        """Assert the index's invariants (tests)."""
        with self._lock:
            self.index.check(self.host)
            for nd in self.index.nodes.values():
                assert nd.device_page is None, nd

    # ----- plans ------------------------------------------------------------------------------
    def plan_load(self, keys: Sequence[bytes], device_pages: Sequence[int], start: int = 0
                  ) -> Plan:
        """Load ``keys[start:start + len(device_pages)]`` into ``device_pages``: the leading
        L2 run directly, the rest through L3 reads into newly allocated host pages, or straight
        from the store's memory (``l3_loads``) where the data path loads in place. The plan
        may cover fewer pages (``plan.load_pages``) when L2 changed or has no room; a page L3
        no longer holds fails in the result (use `PlanResult.loaded_prefix`)."""
        dev = self._span(keys, device_pages, start, "plan_load")
        with self._lock:
            st = _Pending(Plan(self._new_id()))
            l2 = self.index.l2_run(keys, start)[:len(dev)]
            for nd in l2:
                nd.l2_pins += 1
                nd.hits += 1
            st.pinned = l2
            self.index.touch_l2_up(l2)
            first, n = start + len(l2), len(dev) - len(l2)
            direct: list[tuple[bytes, int]] = []
            reads: list[tuple[bytes, int]] = []
            if self.in_place and n > 0 and self._l3_usable():
                n = self.unreadable.readable_prefix(keys[first:first + n])
                direct = list(zip(keys[first:first + n], dev[len(l2):]))
            else:
                reads = self._reads(st, keys, first, n)
            loads = [(nd.host_page, d) for nd, d in zip(l2, dev)]
            loads += [(h, d) for (_, h), d in zip(reads, dev[len(l2):])]
            if reads:
                st.started = time.perf_counter()
            plan = self._pend(st, l3_reads=tuple(reads), loads=tuple(loads),
                              l3_loads=tuple(direct), stage=bool(direct))
        self.metrics_registry.add_many({"planned_l2_load_pages": len(l2),
                                        "planned_l3_load_pages": len(reads) + len(direct)})
        return plan

    def plan_prefetch(self, keys: Sequence[bytes], start: int = 0, num_pages: int = 1
                      ) -> Plan:
        """L3 -> L2 only: read up to ``num_pages`` pages of ``keys`` that follow the L2 run
        from ``start`` into new host pages (no device pages); they join L2 when the plan
        completes. For reads that serve later requests or keep the L3 rate measured; a page
        L3 no longer holds fails in the result."""
        self._check_start(keys, start)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgumentError(f"num_pages must be an int >= 0, got {num_pages!r}",
                                       argument="num_pages", value=num_pages)
        with self._lock:
            st = _Pending(Plan(self._new_id()))
            first = start + len(self.index.l2_run(keys, start))
            reads = self._reads(st, keys, first, min(num_pages, len(keys) - first))
            plan = self._pend(st, l3_reads=tuple(reads))
        self.metrics_registry.add("planned_prefetch_pages", len(reads))
        return plan

    def plan_save(self, keys: Sequence[bytes], device_pages: Sequence[int], start: int = 0,
                  *, l3_write: bool | None = None) -> Plan:
        """Back up ``keys[start + i]`` held in ``device_pages[i]`` to L2 (and L3) under the
        write policy; pages already in L2 or in flight are skipped. The write-through L3
        writes are dropped (counted in ``cost_skipped_l3_writes``) when `l3_write_pays` says
        no, or ``l3_write=False``."""
        if l3_write is None:
            l3_write = self.l3_write_pays()
        if not isinstance(l3_write, bool):
            raise InvalidArgumentError(f"l3_write must be a bool, got {l3_write!r}",
                                       argument="l3_write", value=l3_write)
        dev = self._span(keys, device_pages, start, "plan_save")
        pol = self.write_policy
        with self._lock:
            st = _Pending(Plan(self._new_id()))
            cand: list[tuple[int, int]] = []           # (key index, device page)
            seen: list[Node] = []
            for i, d in enumerate(dev):
                k = keys[start + i]
                nd = self.index.get(k)
                if nd is not None and nd.host_page is not None:
                    seen.append(nd)
                    continue
                if k in self._pending or not self.wants_backup(k):
                    continue
                cand.append((start + i, d))
            self.index.touch_l2_up(seen)
            pages = self._alloc(len(cand), st)
            if len(pages) < len(cand):
                self.metrics_registry.add("backup_skipped_pages", len(cand) - len(pages))
                cand = cand[:len(pages)]
            backups = tuple((d, h) for (_, d), h in zip(cand, pages))
            st.backup_keys = [keys[i] for i, _ in cand]
            st.backup_parents = [keys[i - 1] if i > 0 else None for i, _ in cand]
            writes: tuple[tuple[int, bytes], ...] = ()
            skipped = 0
            known = 0
            if pol.l3_on_backup and self._l3_exists is not None:
                if l3_write:
                    # a page a lookup just found in L3 (and vLLM recomputed) is there already
                    st.wt_of = [j for j, k in enumerate(st.backup_keys) if k not in self._in_l3]
                    known = len(st.backup_keys) - len(st.wt_of)
                    writes = tuple((pages[j], st.backup_keys[j]) for j in st.wt_of)
                    st.wt_writes = len(writes)
                else:
                    skipped = len(pages)
            for k in st.backup_keys:
                self._pending[k] = st.plan.plan_id
                st.keys.append(k)
            plan = self._pend(st, backups=backups, l3_writes=writes)
        self.metrics_registry.add_many({"planned_backup_pages": len(backups),
                                        "cost_skipped_l3_writes": skipped,
                                        "l3_known_skipped_writes": known})
        return plan

    def plan_evict(self, num_pages: int) -> Plan:
        """Free up to ``num_pages`` host pages now (clean leaves); with ``write_back`` dirty
        ones come back as this plan's L3 writes and are freed when it completes."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgumentError(f"num_pages must be an int >= 0, got {num_pages!r}",
                                       argument="num_pages", value=num_pages)
        with self._lock:
            st = _Pending(Plan(self._new_id()))
            self._evict(num_pages, st)
            return self._pend(st)

    def complete(self, result: PlanResult) -> None:
        """Book what the data path did with a plan (once per plan; a plan whose writes were
        pending takes a second result with its ``l3_writes`` only)."""
        if not isinstance(result, PlanResult):
            raise InvalidArgumentError(f"complete needs a PlanResult, got "
                                       f"{type(result).__name__}", argument="result")
        self._check_result(result)
        with self._lock:
            st = self._plans.get(result.plan_id)
            if st is None and result.released_host_pages:
                self._release(result)
                return
            if st is None:
                raise InvalidArgumentError(f"plan {result.plan_id} is not pending",
                                           argument="result", value=result.plan_id)
            p = st.plan
            if result.writes_pending and (st.write_pins or not p.l3_writes):
                raise InvalidArgumentError(f"result of plan {p.plan_id} says its L3 writes "
                                           "are pending, but it has none left",
                                           argument="result", value=p.plan_id)
            want = (len(p.l3_reads), len(p.loads), len(p.backups), len(p.l3_loads),
                    len(p.l3_writes))
            if st.write_pins:                  # the second result: the writes only
                want = (0, 0, 0, 0, len(p.l3_writes))
            elif result.writes_pending:
                want = want[:4] + (0,)
            if (len(result.l3_reads), len(result.loads), len(result.backups),
                    len(result.l3_loads), len(result.l3_writes)) != want:
                raise InvalidArgumentError(f"result of plan {p.plan_id} does not match its "
                                           "operations", argument="result")
            free: list[int] = []
            unreadable = 0
            first = not st.write_pins
            if first:
                unreadable = self._book_ops(st, result, free)
            if result.writes_pending:
                self._unpend(st)                  # in L2 now: a save skips them
                if free:
                    self.host.free(free)
            else:
                del self._plans[p.plan_id]
                evicted = self._book_writes(st, result, free)
        if first:
            self._count_ops(st, result, unreadable)
        if not result.writes_pending:
            wrote = sum(result.l3_writes)
            self.metrics_registry.add_many({
                "l3_written_pages": wrote,
                "l3_write_failed_pages": len(result.l3_writes) - wrote,
                "l2_evictions": len(evicted)})

    def _book_ops(self, st: _Pending, result: PlanResult, free: list[int]) -> int:
        """Book a result's reads, loads and backups (lock held); with ``writes_pending`` the
        backed-up pages stay pinned for their writes. Returns the keys marked unreadable."""
        p = st.plan
        for nd in st.pinned:
            nd.l2_pins -= 1
        landed: list[Node] = []
        # the first read that failed is not offered again (a lookup stops there, so the
        # reads after it, not tried, need no mark), if the store was asked for it (a plan
        # that never ran says nothing of its objects); a write that succeeded replaced it
        miss = first_miss(result.l3_reads, len(result.l3_reads))
        unreadable = self.forget_l3([p.l3_reads[miss][0]] if miss < result.tried_reads else [])
        for k, _ in p.l3_reads[miss:]:       # not known to be readable there: written again
            self._in_l3.pop(k, None)
        for (key, hp), parent, ok in zip(p.l3_reads, st.read_parents, result.l3_reads):
            got = self._register(key, hp, parent) if ok else None
            if got is None:
                free.append(hp)
            else:
                got.in_l3 = True
                landed.append(got)
        backed: list[Node | None] = []
        for (_, hp), key, parent, ok in zip(p.backups, st.backup_keys, st.backup_parents,
                                            result.backups):
            got = self._register(key, hp, parent) if ok else None
            backed.append(got)
            if got is None:
                free.append(hp)
            else:
                landed.append(got)
        self.index.touch_l2_up(landed)
        for got in backed:
            if got is not None and got.key in self._in_l3:
                got.in_l3 = True          # a lookup found it there: not written again
        if result.writes_pending:
            for pinned in (backed[j] for j in st.wt_of):
                if pinned is not None:
                    pinned.l2_pins += 1   # its L3 write still reads the host page
            st.write_pins = True
        st.writing = backed
        return unreadable

    def _book_writes(self, st: _Pending, result: PlanResult, free: list[int]) -> list[int]:
        """Book a plan's L3 writes and end it (lock held); returns the evicted host pages."""
        p = st.plan
        written = [k for (_, k), ok in zip(p.l3_writes, result.l3_writes) if ok]
        if written:
            self.unreadable.discard(written)
        for nd, ok in zip((st.writing[j] for j in st.wt_of),
                          result.l3_writes[:st.wt_writes]):
            if nd is None:
                continue
            if st.write_pins:
                nd.l2_pins -= 1
            if ok:
                nd.in_l3 = True
        it = iter(result.l3_writes[st.wt_writes:])
        ok_wb = [next(it) if w else None for w in st.wb_write]
        evicted = after_l3_write(self.index, st.wb_nodes, ok_wb, evict_after=True)
        free += evicted
        self._unpend(st)
        if result.held_host_pages:
            free = self._hold(p.plan_id, result.held_host_pages, free)
        if free:
            self.host.free(free)
        return evicted

    def _count_ops(self, st: _Pending, result: PlanResult, unreadable: int) -> None:
        p = st.plan
        if st.started and any(result.loads):     # the request waited this long for L3
            pb = self.spec.page_bytes
            self.cost.observe_l3_wait(time.perf_counter() - st.started,
                                      len(p.l3_reads) * pb, len(p.loads) * pb)
        read_hp = {hp for _, hp in p.l3_reads}
        l3_hits = sum(1 for (hp, _), ok in zip(p.loads, result.loads) if ok and hp in read_hp)
        in_place = sum(result.l3_loads)
        loaded = result.load_results
        self.metrics_registry.add_many(hit_counts(sum(result.loads) - l3_hits,
                                                  l3_hits + in_place, self.spec.page_size))
        self.metrics_registry.add_many({
            "l3_loaded_pages": sum(result.l3_reads) + in_place,
            "l3_in_place_pages": in_place,
            "l3_read_failed_pages": len(result.l3_reads) - sum(result.l3_reads)
            + len(result.l3_loads) - in_place,
            "loaded_pages": sum(loaded),
            "load_failed_pages": len(loaded) - sum(loaded),
            "backup_pages": sum(result.backups),
            "backup_failed_pages": len(result.backups) - sum(result.backups),
            "l3_unreadable_marked": unreadable})

    def fail(self, plan_id: int) -> None:
        """A plan that will never run (its worker is gone): book it as failed."""
        with self._lock:
            st = self._plans.get(plan_id)
            if st is None:
                raise InvalidArgumentError(f"plan {plan_id} is not pending",
                                           argument="plan_id", value=plan_id)
            res = st.plan.failed()
            if st.write_pins:                 # booked but for its writes
                res = PlanResult(plan_id, l3_writes=res.l3_writes)
        self.complete(res)

    def forget_l3(self, keys: Sequence[bytes]) -> int:
        """An L3 read of ``keys`` failed: they are not offered from L3 again, and a page of
        theirs still indexed is written to L3 again (write-back), until a write replaces
        them. Returns how many were newly marked. The one booking of a read miss, for the
        planner's results and the in-process cache's reads alike."""
        n = self.unreadable.add(keys)
        with self._lock:
            for k in keys:
                self._in_l3.pop(k, None)
                nd = self.index.get(k)
                if nd is not None:
                    nd.in_l3 = False
        return n

    def _saw_in_l3(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._in_l3.pop(k, None)
                self._in_l3[k] = None
            while len(self._in_l3) > 8 * self.host.num_pages + 1024:
                self._in_l3.popitem(last=False)

    def _pinned_pages(self) -> int:
        """L2 pages a plan still reads or writes (none once every plan is booked)."""
        with self._lock:
            return sum(1 for _, nd in self.index.l2_lru.items() if nd.l2_pins)

    # ----- helpers (lock held) ----------------------------------------------------------------
    def _unpend(self, st: _Pending) -> None:
        """The plan no longer holds its keys pending (another plan may back them up)."""
        for k in st.keys:
            if self._pending.get(k) == st.plan.plan_id:
                del self._pending[k]

    def _hold(self, plan_id: int, held: Sequence[int], free: list[int]) -> list[int]:
        """Keep host pages a late store call may touch out of use: not freed, and pinned
        where they hold an L2 page. Returns the pages free now."""
        hs = set(held)
        pinned = [nd for _, nd in self.index.l2_lru.items() if nd.host_page in hs]
        for nd in pinned:
            nd.l2_pins += 1
        self._held[plan_id] = (set(hs), pinned)
        self.metrics_registry.add("held_host_pages", len(hs))
        return [hp for hp in free if hp not in hs]

    def _release(self, result: PlanResult) -> None:
        entry = self._held.get(result.plan_id)
        if entry is None:
            raise InvalidArgumentError(f"plan {result.plan_id} holds no host pages",
                                       argument="result", value=result.plan_id)
        pages, pinned = entry
        rel = set(result.released_host_pages) & pages
        for nd in [nd for nd in pinned if nd.host_page in rel]:
            nd.l2_pins -= 1
            pinned.remove(nd)
        owned = {nd.host_page for _, nd in self.index.l2_lru.items()}
        free = [hp for hp in rel if hp not in owned]
        pages -= rel
        if not pages:
            del self._held[result.plan_id]
        if free:
            self.host.free(free)

    def _new_id(self) -> int:
        self._next_id += 1
        return (self.instance << 32) | (self._next_id & 0xFFFFFFFF)

    def _check_result(self, result: PlanResult) -> None:
        """Refuse a result this planner cannot have asked for, before anything changes."""
        pid = result.plan_id
        if isinstance(pid, bool) or not isinstance(pid, int) or pid >> 32 != self.instance:
            raise InvalidArgumentError(f"result of plan {pid!r} is not from this planner "
                                       f"(another planner instance or a restart); dropped",
                                       argument="result", value=pid)
        for name in ("l3_reads", "loads", "backups", "l3_writes", "l3_loads"):
            vals = getattr(result, name)
            if not isinstance(vals, tuple) or not all(v is True or v is False for v in vals):
                raise InvalidArgumentError(f"result of plan {pid}: {name} must be a tuple of "
                                           "bools", argument="result", value=pid)
        if not isinstance(result.writes_pending, bool):
            raise InvalidArgumentError(f"result of plan {pid}: writes_pending must be a bool",
                                       argument="result", value=pid)
        tried = result.l3_reads_tried
        if tried is not None and (isinstance(tried, bool) or not isinstance(tried, int)
                                  or not 0 <= tried <= len(result.l3_reads)):
            raise InvalidArgumentError(f"result of plan {pid}: l3_reads_tried must be None or "
                                       f"an int in [0, {len(result.l3_reads)}]",
                                       argument="result", value=pid)
        for name in ("held_host_pages", "released_host_pages"):
            vals = getattr(result, name)
            if not isinstance(vals, tuple) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and 0 <= v < self.host.num_pages
                    for v in vals):
                raise InvalidArgumentError(f"result of plan {pid}: {name} must be host pages "
                                           f"in [0, {self.host.num_pages})", argument="result",
                                           value=pid)

    def _register(self, key: bytes, hp: int, parent_key: bytes | None) -> Node | None:
        """Put a landed page in L2 under its parent (a root if the parent is not in L2);
        None if the key already has a host page (the caller frees ``hp``)."""
        parent = self.index.get(parent_key) if parent_key is not None else None
        nd = self.index.node(key, parent)
        if nd.host_page is not None:
            return None
        self.index.l2_add(nd, hp)
        return nd

    def _reads(self, st: _Pending, keys: Sequence[bytes], first: int, n: int
               ) -> list[tuple[bytes, int]]:
        """L3 reads of ``keys[first:first + n]`` into new host pages (fewer if L2 has no
        room; none without L3), their parents recorded in ``st``."""
        if n <= 0 or not self._l3_usable():
            return []
        n = self.unreadable.readable_prefix(keys[first:first + n])
        pages = self._alloc(n, st)
        st.read_parents = [keys[first + j - 1] if first + j > 0 else None
                           for j in range(len(pages))]
        return list(zip(keys[first:first + len(pages)], pages))

    def wants_backup(self, key: bytes, hits: int | None = None, *, on_hit: bool = False
                     ) -> bool:
        """The write policy's one decision (lock held): back this page up to L2 now? In one
        process (`TieredKVCache`) the page's ``hits`` in L1 count, at a commit or (``on_hit``)
        at a match. A planner that sees no L1 (``hits`` None) backs every saved page up --
        the engine's L1 evicts without telling -- unless the policy counts saves, which it
        then counts per key."""
        pol = self.write_policy
        if on_hit:
            return pol.backup_on_hit(hits or 0)
        if hits is not None:
            return pol.backup_on_commit(hits)
        if not pol.counts_saves:
            return True
        n = self._saves.pop(key, 0) + 1
        self._saves[key] = n
        while len(self._saves) > 4 * self.host.num_pages:
            self._saves.popitem(last=False)
        return pol.backup_on_commit(n)

    def _alloc(self, n: int, st: _Pending) -> list[int]:
        return alloc_evicting(self.host, n, lambda k: self._evict(k, st))

    def _evict(self, n: int, st: _Pending) -> None:
        ev = select_l2(self.index, n, l3_writeback=self.write_policy.l3_on_l2_evict
                       and self._l3_exists is not None, l3_broken=False)
        if ev.freed:
            self.host.free(ev.freed)
            self.metrics_registry.add("l2_evictions", len(ev.freed))
        st.wb_nodes += ev.later
        st.wb_write += ev.write

    def _pend(self, st: _Pending, *, l3_writes: tuple[tuple[int, bytes], ...] = (),
              **ops: Any) -> Plan:
        """The plan of ``st``: ``ops``, and ``l3_writes`` then the write-backs its evictions
        need; pending from now on."""
        wb = tuple((nd.host_page, nd.key) for nd, w in zip(st.wb_nodes, st.wb_write) if w)
        st.plan = Plan(st.plan.plan_id, l3_writes=l3_writes + wb, **ops)  # type: ignore[operator]
        self._plans[st.plan.plan_id] = st
        return st.plan

    def _exists(self, keys: list[bytes]) -> int:
        try:
            n = self._l3_exists(keys)  # type: ignore[misc]
        except Exception as exc:
            self.metrics_registry.add("store_errors")
            log.warning("kvtier planner: l3_exists failed: %s: %s", type(exc).__name__, exc)
            return 0
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(keys):
            self.metrics_registry.add("store_errors")
            log.warning("kvtier planner: l3_exists returned %r", n)
            return 0
        return n

    @classmethod
    def _span(cls, keys: Sequence[bytes], device_pages: Sequence[int], start: int,
              what: str) -> list[int]:
        """Checked device pages for ``keys[start:start + len(device_pages)]``."""
        cls._check_start(keys, start)
        dev = cls._pages(device_pages)
        if start + len(dev) > len(keys):
            raise InvalidArgumentError(f"{what} got {len(dev)} device pages for "
                                       f"{len(keys) - start} keys from page {start}",
                                       argument="device_pages", value=len(dev))
        return dev

    @staticmethod
    def _check_start(keys: Sequence[bytes], start: int) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or \
                not 0 <= start <= len(keys):
            raise InvalidArgumentError(f"start must be an int in [0, {len(keys)}], got "
                                       f"{start!r}", argument="start", value=start)

    @staticmethod
    def _pages(pages: Sequence[int]) -> list[int]:
        out = list(pages)
        for p in out:
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise PageIndexError(f"device pages must be ints >= 0, got {p!r}", index=p)
        if len(set(out)) != len(out):
            raise PageIndexError("device pages contain duplicates")
        return out
