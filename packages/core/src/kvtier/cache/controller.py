"""`TieredKVCache`: the controller an engine calls on every request, in one process.

It keeps a `PageIndex` of KV pages by chained page key across L1 (the engine's device pool),
L2 (a `HostKVPool` it owns) and L3 (any registered `L3Store`) and applies the write, prefetch
and eviction policies (`kvtier.policies`, `kvtier.cache.eviction`). It moves no data itself:
every copy and store call runs as a `Plan` on its `CacheExecutor`, the same data path vLLM's
worker runs (one store loop, one definition of a miss, one deadline, one bounded close).
Engines whose scheduler and workers are separate processes use the index half there too:
`CachePlanner` (`kvtier.cache.planner`).

Usage: `docs/integrate.md` walks through a complete integration (`examples/integrate.py`):
``match`` (pins the hits) -> ``prefetch`` (optional, early) -> ``fetch`` (a `FetchHandle`:
``wait_layer(i)`` per layer; ``unused_pages`` stay the engine's) -> prefill the rest ->
``commit`` (every full page, prefix included) -> ``release`` (returns the pages the cache did
not take); ``evict``, ``metrics``, ``wait_idle``, ``restart_l3``, ``close`` (or ``with``).

Prefetch policies (`kvtier.policies`): ``wait_complete`` (the default) waits for every L3
page, each store call within ``l3_call_timeout_s``; ``timeout`` waits up to a budget growing
with the request; ``best_effort`` never waits, so without an early prefetch() it loads nothing
from L3. Metrics: ``l2/l3_matched_pages`` what match() found, ``l2/l3_hit_pages`` what was
loaded into L1, ``prefetch_cut_pages`` matched but not loaded.

Cost-aware fetch (``cost_aware_fetch``, on by default; `kvtier.cache.cost`): a fetch loads only
the leading hit pages whose loading beats recomputing them at the measured L2 -> L1 and L3
rates and the engine's recompute rate (``recompute_tokens_per_s`` or `observe_recompute`);
the rest stay the engine's to compute (``cost_skipped_pages_l2``/``_l3``). `prefetch` reads
only the L3 pages the split would load (``cost_skipped_prefetch_pages`` the others), but for
a probe now and then that keeps the L3 rate measured.

Ownership: the cache owns every device page it registered (taken by commit or a fetch) and
gives it back through ``free_device_pages`` when it evicts it; other pages stay the engine's.
Pages passed to fetch/commit must be the engine's and not in a fetch still loading (else a
typed error, before anything changes). Hits stay pinned until ``release(match)``.

Invariants: L1 is prefix-closed and so is L1 u L2; eviction takes leaves only, never a pinned
page or one being copied. Store failures are misses, counted; a call past its deadline is a
counted failure; ``l3_error_limit`` failures in a row or a dead I/O thread mark L3 failed
(``metrics()["l3_state"]``, raised once as `TierFailureError`) until ``restart_l3()``.
``close()`` returns within ``close_timeout_s``; a cache not closed is closed at exit.
Thread-safe.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Literal, Mapping, Sequence

from ..device_pool import DeviceKVPool
from ..errors import (InvalidArgumentError, PageIndexError, TierFailureError,
                      TokensError, TransferError)
from ..host_pool import HostKVPool
from ..interfaces import CompletedHandle, L3Store, TransferEngine, TransferHandle
from ..keys import PageKeyer
from ..metrics import Metrics
from ..policies import PrefetchPolicy, WritePolicy
from . import eviction, handles, inplace, l3tasks, lifecycle, transfers
from .config import CacheConfig
from .cost import CostModel, group_bytes
from .executor import CacheExecutor
from .planner import CachePlanner
from .handles import CommitResult, FetchHandle, Match
from .index import Node, PageIndex
from .keying import make_keyer
from .parts import build_parts
from .l3io import L3IO
from .plans import Plan, PlanResult
from .unreadable import UnreadableKeys

log = logging.getLogger("kvtier.cache")

__all__ = ["CacheConfig", "TieredKVCache", "Match", "FetchHandle", "CommitResult"]


class TieredKVCache:
    """Index, policies and background I/O of a three-tier KV cache (see the module doc)."""

    def __init__(self, config: CacheConfig | Mapping[str, Any], *, device_pool: DeviceKVPool,
                 free_device_pages: Callable[[list[int]], None],
                 allocate_device_pages: Callable[[int], list[int] | None] | None = None,
                 host_pool: HostKVPool | None = None, store: L3Store | None = None,
                 engine: TransferEngine | None = None,
                 engine_identity: Mapping[str, Any] | None = None):
        self.config = cfg = CacheConfig.from_dict(config)
        if not isinstance(device_pool, DeviceKVPool):
            raise InvalidArgumentError(f"device_pool must be a DeviceKVPool, got "
                                       f"{type(device_pool).__name__}", argument="device_pool")
        if not callable(free_device_pages):
            raise InvalidArgumentError("free_device_pages must be callable",
                                       argument="free_device_pages")
        if allocate_device_pages is not None and not callable(allocate_device_pages):
            raise InvalidArgumentError("allocate_device_pages must be callable or None",
                                       argument="allocate_device_pages")
        self.spec = spec = device_pool.spec
        self.device_pool = device_pool
        self._free_cb = free_device_pages
        self._alloc_cb = allocate_device_pages
        self.metrics_registry = Metrics()
        parts = build_parts(cfg, device_pool,
                            make_keyer(cfg, spec, device_layout=device_pool.page_order,
                                       engine=engine_identity),
                            host_pool=host_pool, engine=engine, store=store)
        self.host_pool, self.engine, self.store = parts.host_pool, parts.engine, parts.store
        self._loading: dict[int, FetchHandle] = {}   # device pages of loads in flight
        self._closed = False
        self._closing = False
        self._l3_probed = False            # `l3tasks.probe_read` made
        self._failure: TierFailureError | None = None
        self._failure_reported = True
        self.cost = CostModel.from_config(cfg)
        #: The data path: every copy and store call of this cache runs as a `Plan` on it.
        self._ex = CacheExecutor.over_parts(
            cfg, parts, cost=self.cost, metrics=self.metrics_registry, l3_name="kvtier-l3-io",
            on_failure=self._tier_failed)
        self._l3: L3IO | None = self._ex.l3
        #: The index and policy half: the same planner vLLM's scheduler runs, its index
        #: covering L1 as well here, its host page ids the host pool's own.
        self.planner = planner = CachePlanner(
            cfg, spec=spec, device_layout=device_pool.page_order,
            engine_identity=engine_identity, cost=self.cost, host_ids=parts.host_pool,
            l3_exists=self._l3.exists if self._l3 is not None else None,
            metrics=self.metrics_registry)
        self.keyer: PageKeyer = planner.keyer
        self.write_policy: WritePolicy = planner.write_policy
        self.prefetch_policy: PrefetchPolicy = planner.prefetch_policy
        self._lock = planner._lock
        self._index: PageIndex = planner.index
        #: Keys whose L3 read failed: not offered again until a write replaces them.
        self.unreadable: UnreadableKeys = planner.unreadable
        self._completer = self._ex._completer
        self._in_place: inplace.InPlace | None = parts.in_place
        #: Why L3 pages are not loaded in place ("" when they are).
        self.in_place_why_not = self._ex.in_place_why_not
        lifecycle.register_gauges(self)
        lifecycle.close_on_exit(self)

    @classmethod
    def from_config(cls, config: CacheConfig | Mapping[str, Any], **kwargs: Any
                    ) -> "TieredKVCache":
        """Build from a dict (or CacheConfig); keyword arguments as for the constructor."""
        return cls(CacheConfig.from_dict(config), **kwargs)

    # ----- public API -----------------------------------------------------------------------
    def keys(self, tokens: Any) -> list[bytes]:
        """Chained keys of every full page of ``tokens`` in this cache's namespace."""
        if handles.is_meta(tokens):
            raise TokensError("tokens are a meta-device tensor (no data); pass real token ids")
        return self.keyer.keys(tokens)

    def match(self, tokens: Any) -> Match:
        """Longest cached prefix of ``tokens`` per tier; pins the L1 and L2 hits."""
        self._check()
        t0 = time.perf_counter()
        keys = self.keys(tokens)
        n = len(keys)
        idx = self._index
        with self._lock:
            l1 = idx.l1_run(keys)
            l2 = idx.l2_run(keys, len(l1))
            for node in l1:
                node.l1_pins += 1
            for node in l2:
                node.l2_pins += 1
            for node in l1 + l2:
                node.hits += 1
            idx.touch_chain(l1 + l2)
            # (the pages in L2 already or being copied there are not copied again)
            transfers.schedule_backup(self, [nd for nd in l1 if self.planner.wants_backup(
                nd.key, nd.hits, on_hit=True)])
        i = len(l1) + len(l2)
        l3 = 0
        if n - i and self._l3_usable() and \
                self.prefetch_policy.consult_l3((n - i) * self.spec.page_size):
            ok = self.unreadable.readable_prefix(keys[i:])
            l3 = self._l3.exists(keys[i:i + ok]) if ok else 0  # type: ignore[union-attr]
        m = Match(self, keys, len(tokens), self.spec.page_size, l1, l2, l3)
        ps = self.spec.page_size
        miss = n - i - l3
        self.metrics_registry.add_many({    # l2/l3 *hit* pages: counted once loaded
            "match_calls": 1, "match_pages": n, "l1_hit_pages": len(l1),
            "l2_matched_pages": len(l2), "l3_matched_pages": l3, "miss_pages": miss,
            "match_tokens": len(tokens), "l1_hit_tokens": len(l1) * ps,
            "l2_matched_tokens": len(l2) * ps, "l3_matched_tokens": l3 * ps,
            "miss_tokens": len(tokens) - (n - miss) * ps})
        self.metrics_registry.observe("match", time.perf_counter() - t0)
        return m

    def prefetch(self, match: Match, *, expected_wait_s: float = 0.0) -> None:
        """Start reading the match's L3 run into L2 in the background (idempotent). Call it
        when the request is queued; `fetch` starts it itself otherwise.

        With the cost-aware fetch on, only the L3 pages the split would load are read (the
        rest are recomputed, and the engine's commit puts them in L1 and L2): reading them
        anyway would spend the disk and push useful pages out of L2. ``expected_wait_s``:
        how long the request is expected to wait for its turn (a serving engine's queue);
        the pages a read lands within it, behind the reads already queued or running (those
        of the requests ahead), cost the request nothing, so the split counts them as
        already in L2. The pages not read are counted in ``cost_skipped_prefetch_pages``;
        every `CostModel.L3_PROBE_INTERVAL_S` a read of `CostModel.L3_PROBE_PAGES` of them is
        made anyway, so the L3 rate stays measured. Before the L3 rate is known, only such a
        probe is read."""
        self._check()
        self._check_match(match)
        if isinstance(expected_wait_s, bool) or not isinstance(expected_wait_s, (int, float)) \
                or not 0 <= expected_wait_s < float("inf"):
            raise InvalidArgumentError(f"expected_wait_s must be a finite number >= 0, got "
                                       f"{expected_wait_s!r}", argument="expected_wait_s",
                                       value=expected_wait_s)
        if match.l3_count == 0 or match.read is not None:
            return
        if self._in_place is not None:      # in place: a fetch loads straight from the arena
            self._stage(match)              # (into which the store copies what it lacks)
            return
        limit = self.cost.first_read_cap(match.l3_count, self.spec.page_bytes)
        if self.cost.enabled and limit == match.l3_count:
            behind = self._l3.read_backlog() if self._l3 is not None else 0
            ready = self.cost.pages_readable_in(expected_wait_s, self.spec.page_bytes,
                                                match.l3_count, behind)
            _, limit = self._split(match, match.l2_count, match.l3_count, l3_ready=ready)
            if limit < match.l3_count and self.cost.wants_l3_probe():
                limit = max(limit, min(match.l3_count, self.cost.L3_PROBE_PAGES))
            self.metrics_registry.add("cost_skipped_prefetch_pages", match.l3_count - limit)
        if limit:
            l3tasks.start_read(self, match, limit)

    def _split(self, match: Match, l2_pages: int, l3_pages: int, *, l3_ready: int = 0,
               in_place: bool = False, streamed: bool = False) -> tuple[int, int]:
        """`CostModel.split` of ``l2_pages + l3_pages`` hit pages of ``match`` (the rest and
        the match's misses are recomputed)."""
        ps = self.spec.page_size
        return self.cost.split(
            l2_pages=l2_pages, l3_pages=l3_pages, in_place=in_place, l3_ready=l3_ready,
            groups=len(self._ex.read_groups) if streamed else 0,
            compute_tokens=max(1, match.num_tokens - match.total_pages * ps),
            page_size=ps, page_bytes=self.spec.page_bytes, layers=self.spec.num_layers,
            context=match.num_tokens)

    def prefetch_ready(self, match: Match) -> bool:
        """Would `fetch` return without waiting on L3 now, under the prefetch policy?"""
        self._check_match(match)
        task = match.read
        if match.l3_count == 0 or not self._l3_usable():
            return True
        if task is None:                       # fetch would start the read and wait for it
            return self.prefetch_policy.wait_budget_s(self.spec.page_size) == 0
        with task.cv:
            if task.complete:
                return True
        budget = self.prefetch_policy.wait_budget_s(task.num_pages * self.spec.page_size)
        return time.perf_counter() - task.t0 >= budget

    def fetch(self, match: Match, device_pages: Sequence[int] | Any | None = None
              ) -> FetchHandle:
        """Bring the match's L2 hit and L3 hit into ``device_pages`` (L3 -> L2 -> L1).

        ``device_pages`` (length <= ``match.pages_to_load``) must be engine pages the cache
        does not own and no fetch is loading; None takes them from ``allocate_device_pages``
        (evicting L1 if needed). Pages from ``pages_loaded`` on stay the engine's.
        """
        self._check()
        self._check_match(match)
        if match.fetch_handle is not None:
            raise InvalidArgumentError("this match was already fetched", argument="match")
        t0 = time.perf_counter()
        want = match.pages_to_load
        if device_pages is None:
            dev = eviction.allocate_device(self, want)
        else:
            dev = self._check_engine_pages(device_pages, "device_pages")
            if len(dev) > want:
                raise InvalidArgumentError(f"fetch got {len(dev)} device pages but the match "
                                           f"has only {want} pages to load",
                                           argument="device_pages", value=len(dev))
        n2 = min(match.l2_count, len(dev))
        n3_want = min(match.l3_count, len(dev) - n2)
        skip2 = skip3 = 0
        direct = self._in_place if n3_want and self._l3_usable() else None
        streams = direct is None and match.read is None and self.streams_l3 and \
            self.cost.stream_pays(n3_want, self.spec.page_bytes, self.config.l3_stream_min_read_s)
        if self.cost.enabled and n2 + n3_want:
            k2, k3 = self._split(match, n2, n3_want, in_place=direct is not None,
                                 l3_ready=0 if direct is not None else match.l3_pages_landed,
                                 streamed=streams)
            skip2, skip3 = n2 - k2, n3_want - k3
            n2, n3_want = k2, k3
            # no L3 page read by this fetch: a probe read keeps the rate measured (where some
            # are, that read is the fetch's own: a probe of the first pages would replace it)
            if skip3 and not n3_want and direct is None and match.read is None and \
                    self.cost.wants_l3_probe():
                l3tasks.start_read(self, match, self.cost.L3_PROBE_PAGES)
        if direct is not None and n3_want:
            self._stage(match)
            self._wait_stage(match, n3_want)
        n_direct = n3_want if direct is not None else 0
        stream = None
        chained = False
        if n3_want and direct is None and match.read is None and (streams or self._chains):
            # the read runs in the load's own plan: layer group by layer group (streamed), or
            # batch by batch, each batch's load starting as it lands while the next is read
            stream = l3tasks.stream_task(self, match,
                                         self.cost.first_read_cap(n3_want, self.spec.page_bytes),
                                         wait_room=not streams)
            chained = stream is not None and not streams
            if stream is None:                # no room, or a prefetch began meanwhile
                l3tasks.wait_read(self, match, n3_want)
        elif n3_want and direct is None:
            l3tasks.start_read(self, match, self.cost.first_read_cap(n3_want, self.spec.page_bytes))
            l3tasks.wait_read(self, match, n3_want)
        box: dict[str, Any] = {}
        with self._lock:
            self._check_match(match)
            self._check_engine_pages(dev, "device_pages")  # again: a fetch may have begun
            task = match.read
            landed: list[Node] = []
            rest: list[Node] = []
            # (all skipped: a probe or prefetch reads on for later requests, not cancelled)
            if task is not None and (n3_want or not skip3) and not n_direct and stream is None:
                task.cancelled = True             # later pages land unpinned, for others
                landed, rest = task.landed[:n3_want], task.landed[n3_want:]
            nodes = match.hand_over_l2(n2, landed, rest)
            match.give(dev)
            start = match.l1_count + match.l2_count
            reads = tuple(zip(stream.keys, stream.host_pages)) if stream is not None else ()
            plan = Plan(self._new_plan_id(),
                        loads=tuple(zip([nd.host_page for nd in nodes]  # type: ignore[misc]
                                        + [hp for _, hp in reads], dev)),
                        l3_loads=tuple(zip(match.keys[start:start + n_direct],
                                           dev[len(nodes):])), l3_reads=reads)
            handle: TransferHandle = CompletedHandle(self.spec.num_layers)
            ph = None
            t_submit = time.perf_counter()
            if not plan.empty:
                booked = (lambda res: self._fetch_booked(box, res)) if stream is None else \
                    (lambda res: self._stream_booked(stream, box, res))
                try:
                    ph = self._ex.submit(plan, on_done=booked, whole_reads=chained,
                                         stop=None if stream is None else lambda: stream.cancelled)
                except BaseException:
                    match.take_back_l2(nodes)
                    if stream is not None:
                        stream.done(plan.failed())
                    raise
                handle = ph
        # a streamed read: how many leading L3 pages load is known once the first layer
        # group is back (the prefill could not start before it anyway); waited for unlocked
        n_stream = 0
        if ph is not None and chained:
            n_stream = ph.read_lead()     # its loads have started (most have landed)
        elif ph is not None and ph.stream is not None:
            n_stream = ph.stream.first_group()
            if n_stream:          # what the wait cost beyond the first group's bytes
                st = ph.stream
                self.cost.observe_l3_wait(
                    time.perf_counter() - t_submit, group_bytes(
                        self.spec.page_bytes, self.spec.num_layers, st.groups[0], n_stream), 0)
        with self._lock:
            n_load = 0 if ph is None else len(nodes) + ph.in_place_pages + n_stream
            load, unused = dev[:n_load], dev[n_load:]
            fh = FetchHandle(self._finish_fetch, match, handle, nodes, load, unused,
                             self.spec.num_layers, from_l2=n2,
                             in_place_pages=n_load - len(nodes))
            match.attach_fetch(fh)
            for d in load:
                self._loading[d] = fh
            box["fh"] = fh
            if n_direct > n_load - len(nodes):
                self.metrics_registry.add("l3_read_miss_pages", n_direct - n_load + len(nodes))
        n_in = n_load - len(nodes) - n_stream      # in place
        self.metrics_registry.add_many({
            "fetch_calls": 1, "fetched_l2_pages": n2,
            "fetched_l3_pages": len(landed) + n_in + n_stream, "l3_loaded_pages": n_in,
            "l3_in_place_pages": 0,          # (the data path counts those that land)
            "bytes_l3_read": n_in * self.spec.page_bytes,  # (streamed: once they land)
            "prefetch_cut_pages": n3_want - len(landed) - n_in - n_stream
            + (match.l3_count - n3_want - skip3),
            "cost_skipped_pages_l2": skip2, "cost_skipped_pages_l3": skip3,
            "bytes_h2d": n_load * self.spec.page_bytes})
        self.metrics_registry.observe("fetch", time.perf_counter() - t0)
        if plan.empty:
            self._finish_fetch(fh, None)
        elif "res" in box:                   # finished before the handle existed
            self._finish_fetch(fh, self._load_error(fh, box["res"]))
        return fh

    def _fetch_booked(self, box: dict[str, Any], res: PlanResult) -> None:
        """A fetch's plan finished: book it (on the data path's thread)."""
        with self._lock:
            fh = box.get("fh")
            if fh is None:
                box["res"] = res
                return
        self._finish_fetch(fh, self._load_error(fh, res))

    def _stream_booked(self, task: l3tasks.ReadTask, box: dict[str, Any], res: PlanResult
                       ) -> None:
        """A fetch that streamed its L3 pages finished (or a late store call released its
        host pages): the pages read whole go into L2, then the load is booked."""
        if not res.released_host_pages:
            tried = res.l3_reads_tried or 0
            if tried:
                task.batch(0, tried, list(res.l3_reads[:tried]))
        task.done(res)
        if not res.released_host_pages:
            self._fetch_booked(box, res)

    @property
    def reads_in_fetch(self) -> bool:
        """Does a fetch read its L3 pages itself, in the plan that loads them, so each
        batch's load starts as it lands (`CacheConfig.l3_load_while_reading`)? Where an
        earlier `prefetch` started the read, the fetch waits for it and loads after; an
        engine that would call `prefetch` just before `fetch` leaves it to the fetch. Only
        under a prefetch policy that waits for every page (a fetch that stopped waiting
        would hand back device pages a late batch could still load into)."""
        return self.streams_l3 or self._chains

    @property
    def _chains(self) -> bool:
        return self.config.l3_load_while_reading and self._in_place is None and \
            self._l3 is not None and self.prefetch_policy.waits_for_all

    @property
    def streams_l3(self) -> bool:
        """Does a fetch stream its L3 pages (read and loaded layer group by layer group,
        `kvtier.cache.stream`) rather than wait for their whole read? Not where they load in
        place; ``stream_why_not`` says why not otherwise."""
        return bool(self._ex.read_groups) and self._in_place is None

    @property
    def stream_why_not(self) -> str:
        if self._in_place is not None:
            return "L3 pages load in place"
        return self._ex.stream_why_not

    @staticmethod
    def _load_error(fh: FetchHandle, res: PlanResult) -> TransferError | None:
        # (a streamed fetch's plan lists loads past the pages it loads: its L3 run after a
        # miss in the first layer group; their loads never start)
        ok = all(res.loads[:fh.pages_loaded]) and all(res.l3_loads[:fh.in_place_pages])
        return None if ok else TransferError("L2 -> L1 load failed")

    def commit(self, tokens: Any, device_pages: Sequence[int] | Any,
               match: Match | None = None) -> CommitResult:
        """Register the full pages of ``tokens`` (held in ``device_pages``, one per full page,
        prefix included) and apply the write policy. With ``match`` the pages taken stay
        pinned until ``release(match)``."""
        self._check()
        t0 = time.perf_counter()
        keys = self.keys(tokens)
        dev = handles.device_page_list(self.device_pool, device_pages, "device_pages")
        if len(dev) != len(keys):
            raise InvalidArgumentError(f"commit needs one device page per full page: "
                                       f"{len(keys)} full pages, {len(dev)} device pages",
                                       argument="device_pages", value=len(dev))
        if len(set(dev)) != len(dev):
            raise PageIndexError("commit device_pages contain duplicates")
        if match is not None:
            self._check_match(match)
            if match.keys[:len(keys)] != keys[:len(match.keys)]:
                raise InvalidArgumentError("commit tokens do not extend the match's tokens",
                                           argument="match")
            self._settle_fetch(match)
        taken: list[int] = []
        not_taken: list[int] = []
        new = 0
        idx = self._index
        with self._lock:
            for i, d in enumerate(dev):          # validate before touching anything
                owner = idx.l1_owner(d)
                if owner is not None and owner.key != keys[i]:
                    raise InvalidArgumentError(
                        f"device page {d} belongs to the cache for another page key; commit "
                        f"must pass the engine's pages for these tokens",
                        argument="device_pages", value=d)
                if d in self._loading:
                    raise InvalidArgumentError(
                        f"device page {d} is being loaded by a fetch still in flight; wait "
                        "for it (or release its match) before reusing the page",
                        argument="device_pages", value=d)
            if match is not None:
                match.give(d for d in dev if idx.l1_owner(d) is None)
            parent: Node | None = None
            chain: list[Node] = []
            backups: list[Node] = []
            # pages the match found in L3 (and the engine recomputed, or loaded): the store
            # has them, so their backups to L2 are not written to L3 again
            l3_lo = l3_hi = 0
            if match is not None:
                l3_lo = match.l1_count + match.l2_count
                l3_hi = l3_lo + match.l3_count
            for j, (key, d) in enumerate(zip(keys, dev)):
                node = idx.node(key, parent)
                if l3_lo <= j < l3_hi and key not in self.unreadable:
                    node.in_l3 = True     # (an unreadable one is written again)
                if node.device_page is None:
                    idx.l1_add(node, d, touch=False)     # touched below, leaf first
                    new += 1
                    taken.append(d)
                    if match is not None:
                        match.hold_l1(node, d)
                        match.take(d)
                elif node.device_page == d:
                    if match is not None and not match.holds(d):
                        match.hold_l1(node, d)
                        if match.gave(d):
                            match.take(d)
                else:
                    not_taken.append(d)
                if self.planner.wants_backup(key, node.hits):
                    backups.append(node)         # (but those in L2 already or on their way)
                chain.append(node)
                parent = node
            idx.touch_chain(chain)
            transfers.schedule_backup(self, backups)
        self.metrics_registry.add_many({"commit_calls": 1, "committed_pages": new})
        self.metrics_registry.observe("commit", time.perf_counter() - t0)
        return CommitResult(new, tuple(taken), tuple(not_taken))

    def release(self, match: Match) -> list[int]:
        """The request is done: unpin its pages, stop its prefetch. Returns the device pages
        it passed in that the cache did not take (the engine's to free). Idempotent."""
        if not isinstance(match, Match) or not match.belongs_to(self):
            raise InvalidArgumentError("release needs a Match from this cache",
                                       argument="match")
        self._settle_fetch(match)
        with self._lock:
            out = match.mark_released()
            if out is None:
                return []
            l1, l2, leftover = out
            for node in l1:
                node.l1_pins -= 1
            for node in l2:
                node.l2_pins -= 1
            return leftover

    def evict(self, num_pages: int, tier: Literal["l1", "l2"] = "l1") -> int:
        """Evict up to ``num_pages`` unpinned leaf pages from L1 (given back through
        ``free_device_pages``) or L2; returns how many were freed."""
        self._check()
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgumentError(f"num_pages must be an int >= 0, got {num_pages!r}",
                                       argument="num_pages", value=num_pages)
        if tier == "l2":
            with self._lock:
                return eviction.evict_l2(self, num_pages)
        if tier != "l1":
            raise InvalidArgumentError(f"tier must be 'l1' or 'l2', got {tier!r}",
                                       argument="tier", value=tier)
        return eviction.evict_l1(self, num_pages)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no transfer completion or L3 I/O is queued or running (tests,
        benchmarks, deterministic replays); False on timeout."""
        return self._ex.wait_idle(timeout)

    def observe_recompute(self, tokens: int, seconds: float,
                          context: int | None = None) -> None:
        """The engine prefilled ``tokens`` tokens in ``seconds``: the recompute rate the
        cost-aware fetch weighs loads against (unless the config gives it). ``context``:
        the request's length (the tokens computed were its last ones), so that the cost of
        attention over a long context is fitted too."""
        self.cost.observe_recompute(tokens, seconds, context)

    def forget_l3(self, keys: Sequence[bytes]) -> None:
        """An L3 read of ``keys`` failed: they are not offered from L3 again, and a page of
        theirs in L1 or L2 is written to L3 again, until a write replaces them."""
        self.metrics_registry.add("l3_unreadable_marked", self.planner.forget_l3(keys))

    def metrics(self) -> dict[str, Any]:
        """A snapshot of every counter, gauge and latency summary."""
        return self.metrics_registry.snapshot()

    def pages(self) -> dict[bytes, tuple[int | None, int | None]]:
        """Key -> (device page or None, host page or None) of every indexed page."""
        with self._lock:
            return {k: (nd.device_page, nd.host_page) for k, nd in self._index.nodes.items()}

    def check_invariants(self, *, idle: bool = False) -> None:
        """Assert the index's structural invariants (tests); with ``idle`` also that no page
        is pinned or in flight (no request active, after `wait_idle`)."""
        with self._lock:
            self._index.check(self.host_pool)
            assert not (set(self._loading) & set(self._index.l1_by_page)), "loading an L1 page"
            if idle:
                assert not self._loading, "a fetch is still loading"
                for nd in self._index.nodes.values():
                    assert nd.l1_pins == 0 and nd.l2_pins == 0, f"{nd} is pinned"

    def restart_l3(self) -> None:
        """Bring L3 back after a reported failure: new I/O threads, error streak reset."""
        self._check(report=False)
        if self._l3 is None:
            raise InvalidArgumentError("this cache has no L3 store", argument="l3_store")
        with self._lock:
            if self._failure is not None and self._failure.tier == "l3":
                self._failure = None
                self._failure_reported = True
        self._l3.restart()

    def close(self) -> None:
        """Finish or cancel queued write-backs (``close_policy``), stop the threads and close
        what the cache created; returns within ``close_timeout_s``. Idempotent."""
        lifecycle.close(self, self.config.close_timeout_s)

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- internals --------------------------------------------------------------------------
    def _check(self, report: bool = True) -> None:
        lifecycle.check(self, report)

    def _tier_failed(self, tier: str, message: str, cause: BaseException | None) -> None:
        lifecycle.tier_failed(self, tier, message, cause)

    def _new_plan_id(self) -> int:
        with self._lock:
            return self.planner._new_id()      # one id scheme: the planner instance's

    def _stage(self, match: Match) -> None:
        """Ask the store to stage the match's L3 run into its in-place region (once)."""
        if match.stage is None and self._l3_usable():
            match.stage = self._ask_stage(match, match.l3_count)

    def _ask_stage(self, match: Match, n_pages: int) -> Any:
        """The store's ticket for staging the first ``n_pages`` of the match's L3 run (None:
        nothing to stage, or the store failed: its in-place pins will miss)."""
        start = match.l1_count + match.l2_count
        try:
            return self._l3.store.stage(match.keys[start:start + n_pages])  # type: ignore[union-attr]
        except Exception as exc:
            log.warning("kvtier cache: staging %d L3 pages failed: %s", n_pages, exc)
            self.metrics_registry.add("l3_stage_errors")
            return None

    def _wait_stage(self, match: Match, n_pages: int) -> None:
        """Wait for the match's staging within the prefetch policy's budget (from the
        staging's start) and the store's own bound; what is not staged then is recomputed.
        Pages staged while the request waited may have left the arena since (staged for
        others, written by others): they are asked for once more, within the same bounds
        (a run the arena holds whole costs no round trip)."""
        if match.stage is None:
            return
        budget = self.prefetch_policy.wait_budget_s(n_pages * self.spec.page_size)
        t0 = time.perf_counter()
        if inplace.wait_staged(match.stage, self.metrics_registry, budget):
            again = self._ask_stage(match, n_pages)
            if again is not None and again.done():
                again.cancel()              # nothing left to stage: its holds are not needed
            elif again is not None:
                match.stage, old = again, match.stage
                old.cancel()
                self.metrics_registry.add("l3_stage_again_fetches")
                inplace.wait_staged(again, self.metrics_registry, budget)
        self.metrics_registry.observe("l3_stage_wait", time.perf_counter() - t0)

    def _l3_usable(self) -> bool:
        return self._l3 is not None and self._l3.usable()

    def _finish_fetch(self, fh: FetchHandle, err: BaseException | None) -> None:
        transfers.finish_fetch(self, fh, err)

    def _settle_fetch(self, match: Match) -> None:
        """Wait (host side) for the match's fetch still in flight, then book its outcome."""
        fh = match.fetch_handle
        if fh is not None and not fh.finished:
            self._finish_fetch(fh, transfers.landed(fh.transfer))

    def _check_match(self, match: Match) -> None:
        handles.check_match(self, match)

    def _check_engine_pages(self, pages: Any, what: str) -> list[int]:
        return handles.check_engine_pages(self, pages, what)

    def _alloc_host(self, n: int) -> list[int]:
        return eviction.alloc_host(self, n)

    def _enqueue_write(self, nodes: list[Node], *, evict_after: bool,
                       write: list[bool] | None = None) -> None:
        if not evict_after and not self.planner.l3_write_pays():
            task = l3tasks.WriteTask(self, nodes, evict_after, write)
            self.metrics_registry.add("cost_skipped_l3_writes", sum(task.write))
            task.done([None] * len(nodes))
            return
        l3tasks.enqueue_write(self, nodes, evict_after=evict_after, write=write)
