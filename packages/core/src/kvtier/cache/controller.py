"""`TieredKVCache`: the controller an engine calls on every request.

It keeps an index of KV pages by chained page key across three tiers -- L1 (the engine's
device pool), L2 (a `HostKVPool` it owns) and L3 (any registered `L3Store`) -- moves pages with
any registered `TransferEngine`, and applies the write, prefetch and eviction policies of
`kvtier.policies`.

Usage (every name below is public API)::

    from kvtier.cache import TieredKVCache, CacheConfig

    cache = TieredKVCache.from_config(
        {"model_id": "llama-tiny", "host_pool_pages": 512, "l3_store": "file",
         "l3_config": {"root": "/var/cache/kv"}, "write_policy": "write_through"},
        device_pool=device_pool,            # kvtier.DeviceKVPool over the engine's L1 tensors
        allocate_device_pages=alloc,        # (n) -> list[int] | None: the engine's allocator
        free_device_pages=free)             # (pages) -> None: L1 eviction gives pages back
    # or CacheConfig.from_env("KVTIER_"), CacheConfig.add_arguments(parser)/from_args(args)

    m = cache.match(tokens)         # Match: l1_pages (device pages of the leading L1 hit),
                                    # l2_count / l2_pages (host pages after it), l3_count,
                                    # keys, num_tokens_hit(tier), total_pages. Pins its hits.
    cache.prefetch(m)               # optional, when the request is queued: start L3 -> L2
    cache.prefetch_ready(m)         # would fetch() now return without waiting (policy)?
    h = cache.fetch(m, dev_pages)   # dev_pages: where the L2+L3 hits go (len <= l2+l3 count;
                                    # None: take them from allocate_device_pages). Applies the
                                    # prefetch policy, starts the H2D load and returns a
                                    # FetchHandle: wait_layer(i), wait(), done(), pages_loaded
                                    # (leading pages that really land: L3 misses, the policy's
                                    # deadline or a full L2 cut it short), device_pages (the
                                    # loaded ones), unused_pages (given, not loaded: reuse
                                    # them for the prefill). With best_effort, call prefetch()
                                    # early: fetch() takes only what has landed by then.
    r = cache.commit(tokens, pages, match=m)   # after prefill: pages = ALL full pages of
                                    # tokens (prefix included). Registers the new ones in L1
                                    # (pinned for m until release) and applies the write
                                    # policy. CommitResult: taken, not_taken (duplicates of
                                    # pages already cached: they stay the engine's).
    leftover = cache.release(m)     # request finished: unpin its pages; returns the device
                                    # pages it passed in that the cache did not take (the
                                    # engine frees or reuses them).
    cache.evict(n)                  # free n unpinned L1 pages (given back through
                                    # free_device_pages); evict(n, tier="l2") for host pages.
    cache.metrics()                 # dict: hits/misses per tier (pages, tokens), bytes per
                                    # direction, latencies (p50/p90/p99), evictions, store
                                    # errors, queue depths, l3_state.
    cache.keys(tokens)              # the chained page keys the cache uses for tokens
    cache.wait_idle(timeout)        # block until background copies and L3 I/O are done
    cache.restart_l3()              # after a reported L3 failure: new I/O threads
    cache.close()                   # flush or cancel queued write-backs (close_policy).

A request's life: match -> fetch -> wait_layer(i) per layer during the forward pass ->
prefill the rest into ``h.unused_pages`` and fresh pages -> commit(tokens, l1_pages +
h.device_pages + new, match=m) -> release(m) (free what it returns). An engine that runs out
of device pages calls ``evict(n)``; `kvtier.simulate.PageAllocator` is a minimal engine-side
allocator (tests, simulator, demos).

Ownership: the cache owns every device page it registered (a page taken by commit or by a
fetch) and gives it back through ``free_device_pages`` when it evicts it; every other page
stays the engine's. Device pages passed to fetch/commit must be the engine's (a cache-owned
page there is an InvalidArgumentError, raised before anything changes). L1 hits and pages
taken for a match stay pinned (never evicted) until ``release(match)``; every match must be
released.

Invariants: the L1 set is prefix-closed (a page is in L1 only if its parent is) and so is
L1 u L2; eviction takes leaves only, never a pinned page or a page being copied. L3 is
consulted for the run after the L2 hit. Store failures are misses, counted and logged; a
store that keeps raising (``l3_error_limit`` calls in a row) or a dead I/O thread marks L3
failed: it is logged, shown in ``metrics()["l3_state"]`` and raised once as
`TierFailureError` from the next call; L3 then stays off (never silently) until
``restart_l3()``. All public methods are thread-safe.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from .config import CacheConfig
from ..device_pool import DeviceKVPool
from ..errors import (ConfigError, InvalidArgumentError, PageIndexError,
                     TierFailureError, TransferError)
from ..host_pool import HostKVPool
from ..interfaces import CompletedHandle, L3Store, TransferEngine, TransferHandle
from ..keys import PageKeyer
from ..metrics import Metrics
from ..policies import (LRUOrder, PrefetchPolicy, WritePolicy, make_prefetch_policy,
                       make_write_policy)

log = logging.getLogger("kvtier.cache")

__all__ = ["CacheConfig", "TieredKVCache", "Match", "FetchHandle", "CommitResult"]

# --------------------------------------------------------------------------------------------
# Index entries and results
# --------------------------------------------------------------------------------------------
class _Node:
    """One page key in L1 and/or L2. Exists only while it holds a device or host page."""

    __slots__ = ("key", "parent", "kids", "l1_children", "device_page", "host_page",
                 "l1_pins", "l2_pins", "hits", "in_l3", "backup_pending", "wb_pending")

    def __init__(self, key: bytes, parent: "_Node | None"):
        self.key = key
        self.parent = parent
        self.kids: set[_Node] = set()  # child nodes in the index (any tier)
        self.l1_children = 0         # child nodes in L1
        self.device_page: int | None = None
        self.host_page: int | None = None
        self.l1_pins = 0             # requests / copies using the device page
        self.l2_pins = 0             # requests / copies using the host page
        self.hits = 0
        self.in_l3 = False           # we wrote it to L3 (the store may have dropped it since)
        self.backup_pending = False  # an L1 -> L2 copy is in flight
        self.wb_pending = False      # an L2 -> L3 write-back before eviction is in flight

    @property
    def children(self) -> int:
        return len(self.kids)

    def __repr__(self) -> str:
        return (f"_Node({self.key[:4].hex()}, dev={self.device_page}, host={self.host_page}, "
                f"pins={self.l1_pins}/{self.l2_pins}, children={self.children})")


@dataclass(frozen=True)
class CommitResult:
    """What a commit did: ``taken`` device pages now belong to the cache; ``not_taken`` ones
    (pages whose key was already cached on another device page) stay the engine's."""

    new_pages: int
    taken: tuple[int, ...]
    not_taken: tuple[int, ...]


class Match:
    """Result of `TieredKVCache.match`: the leading L1 hit, the L2 hit after it and the count
    of L3 pages after that. Holds pins on its hits until ``release``."""

    def __init__(self, cache: "TieredKVCache", keys: list[bytes], num_tokens: int,
                 l1_nodes: list[_Node], l2_nodes: list[_Node], l3_count: int):
        self._cache = cache
        self.keys = keys
        self.num_tokens = num_tokens
        self.page_size = cache.spec.page_size
        self.l1_pages: list[int] = [n.device_page for n in l1_nodes]  # type: ignore[misc]
        self.l2_pages: list[int] = [n.host_page for n in l2_nodes]    # type: ignore[misc]
        self.l3_count = l3_count
        self._l1_nodes = l1_nodes
        self._l2_nodes = l2_nodes
        self._pinned_l1: list[_Node] = list(l1_nodes)    # L1 pins this match holds
        self._pinned_l2: list[_Node] = list(l2_nodes)    # L2 pins this match holds
        self._held: set[int] = set(self.l1_pages)       # device pages pinned for it
        self._given: set[int] = set()      # engine pages passed in (not the cache's then)
        self._taken: set[int] = set()      # of those, the ones the cache took
        self._read: _ReadTask | None = None
        self._fetch: FetchHandle | None = None
        self._released = False

    @property
    def l1_count(self) -> int:
        return len(self.l1_pages)

    @property
    def l2_count(self) -> int:
        return len(self.l2_pages)

    @property
    def total_pages(self) -> int:
        """Pages hit in any tier (L1 + L2 + L3)."""
        return self.l1_count + self.l2_count + self.l3_count

    @property
    def pages_to_load(self) -> int:
        """Pages a fetch would bring into L1 (L2 + L3 hits)."""
        return self.l2_count + self.l3_count

    def num_tokens_hit(self, tier: str | None = None) -> int:
        """Tokens hit in ``tier`` ("l1", "l2", "l3") or in all of them (None)."""
        counts = {"l1": self.l1_count, "l2": self.l2_count, "l3": self.l3_count}
        if tier is None:
            return self.total_pages * self.page_size
        if tier not in counts:
            raise InvalidArgumentError(f"tier must be 'l1', 'l2', 'l3' or None, got {tier!r}",
                                       argument="tier", value=tier)
        return counts[tier] * self.page_size

    @property
    def released(self) -> bool:
        return self._released

    def __repr__(self) -> str:
        return (f"Match(tokens={self.num_tokens}, pages={len(self.keys)}, l1={self.l1_count}, "
                f"l2={self.l2_count}, l3={self.l3_count})")


class FetchHandle:
    """Completion of a fetch. ``wait_layer(i)`` lets layer i's forward start as soon as
    layer i is in place; ``pages_loaded`` leading pages of the match's L2+L3 hit land in
    ``device_pages[:pages_loaded]``. The hits stay pinned until the load is done."""

    def __init__(self, cache: "TieredKVCache", match: Match, handle: TransferHandle,
                 nodes: list[_Node], device_pages: list[int], unused: list[int],
                 num_layers: int):
        self._cache = cache
        self.match = match
        self._handle = handle
        self._nodes = nodes
        self.device_pages = device_pages        # pages being loaded, in order
        self.unused_pages = unused              # pages given but not loaded (the engine's)
        self.pages_loaded = len(device_pages)
        self.num_layers = num_layers
        self._finished = False
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self.not_taken: list[int] = []          # set once finished: loaded duplicates

    def wait_layer(self, layer: int) -> None:
        self._handle.wait_layer(layer)

    def wait(self) -> None:
        try:
            self._handle.wait()
        except TransferError as exc:
            self._cache._finish_fetch(self, exc)
            raise
        if self._handle.done():
            self._cache._finish_fetch(self, None)

    def done(self) -> bool:
        if self._handle.done():
            self._cache._finish_fetch(self, None)
            return True
        return False

    @property
    def tokens_loaded(self) -> int:
        return self.pages_loaded * self.match.page_size


# --------------------------------------------------------------------------------------------
# Background work
# --------------------------------------------------------------------------------------------
class _ReadTask:
    """L3 -> L2 read of a match's L3 run into freshly allocated host pages."""

    is_read = True

    def __init__(self, match: Match, keys: list[bytes], host_pages: list[int],
                 parent_key: bytes | None):
        self.match = match
        self.keys = keys
        self.host_pages = host_pages
        self.parent_key = parent_key
        self.landed: list[_Node] = []     # nodes registered in L2 and pinned for the match
        self.used = 0                     # host pages consumed (registered or freed)
        self.cancelled = False            # the match no longer wants more pages
        self.finished = False
        self.cv = threading.Condition()
        self.n_landed = 0
        self.t0 = time.perf_counter()

    @property
    def num_pages(self) -> int:
        return len(self.keys)


class _WriteTask:
    """L2 -> L3 write of registered L2 pages (pinned while queued). With ``evict_after`` the
    pages are freed afterwards, children before parents; ``write[i]`` False marks a clean
    page that only waits for its children's write-back before it is freed."""

    is_read = False

    def __init__(self, nodes: list[_Node], evict_after: bool, write: list[bool] | None = None):
        self.nodes = nodes
        self.host_pages = [n.host_page for n in nodes]
        self.evict_after = evict_after
        self.write = write if write is not None else [True] * len(nodes)

    @property
    def num_pages(self) -> int:
        return len(self.nodes)


class _TaskQueue:
    """Reads before writes; counts queued pages; can be drained."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.reads: deque = deque()
        self.writes: deque = deque()
        self.inflight = 0
        self.queued_write_pages = 0
        self.stopping = False

    def put(self, task: Any) -> None:
        with self.cv:
            if task.is_read:
                self.reads.append(task)
            else:
                self.writes.append(task)
                self.queued_write_pages += task.num_pages
            self.cv.notify()

    def get(self) -> Any:
        with self.cv:
            while not self.reads and not self.writes and not self.stopping:
                self.cv.wait()
            if self.reads:
                task = self.reads.popleft()
            elif self.writes:
                task = self.writes.popleft()
                self.queued_write_pages -= task.num_pages
            else:
                return None
            self.inflight += 1
            return task

    def task_done(self) -> None:
        with self.cv:
            self.inflight -= 1
            self.cv.notify_all()

    def drain(self) -> list[Any]:
        with self.cv:
            tasks = list(self.reads) + list(self.writes)
            self.reads.clear()
            self.writes.clear()
            self.queued_write_pages = 0
            self.cv.notify_all()
            return tasks

    def wait_idle(self, timeout: float | None) -> bool:
        with self.cv:
            return self.cv.wait_for(
                lambda: not self.reads and not self.writes and self.inflight == 0, timeout)

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()

    def depths(self) -> tuple[int, int]:
        with self.cv:
            return (sum(t.num_pages for t in self.reads), self.queued_write_pages)


def _host_wait(handle: TransferHandle) -> None:
    """Block the calling thread until ``handle``'s copies have really landed."""
    sync = getattr(handle, "synchronize", None)
    if sync is not None:
        sync()
        return
    handle.wait()
    delay = 20e-6
    while not handle.done():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class _Completer:
    """One thread that waits for transfers to land and then runs their callbacks, in order."""

    def __init__(self, on_death: Callable[[BaseException], None]):
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._busy = 0
        self._on_death = on_death
        self.thread = threading.Thread(target=self._run, name="kvtier-cache-completer",
                                       daemon=True)
        self.thread.start()

    def submit(self, handle: TransferHandle, callback: Callable[[BaseException | None], None]
               ) -> None:
        if not self.thread.is_alive():        # dead (and reported): finish inline
            self._finish(handle, callback)
            return
        with self._cv:
            self._q.append((handle, callback))
            self._cv.notify()

    @staticmethod
    def _finish(handle: TransferHandle, callback: Callable) -> None:
        err: BaseException | None = None
        try:
            _host_wait(handle)
        except Exception as exc:
            err = exc
        callback(err)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._q and not self._stop:
                        self._cv.wait()
                    if not self._q:
                        return
                    item = self._q.popleft()
                    self._busy += 1
                try:
                    self._finish(*item)
                finally:
                    with self._cv:
                        self._busy -= 1
                        self._cv.notify_all()
        except BaseException as exc:
            self._on_death(exc)
            with self._cv:                     # finish what is queued, then exit
                items = list(self._q)
                self._q.clear()
            for item in items:
                try:
                    self._finish(*item)
                except BaseException:  # pragma: no cover - already reported as dead
                    pass

    def wait_idle(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: (not self._q and not self._busy)
                                     or not self.thread.is_alive(), timeout)

    def depth(self) -> int:
        with self._cv:
            return len(self._q) + self._busy

    def stop(self, timeout: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.thread.join(timeout)


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------
class TieredKVCache:
    """Index, policies and background I/O of a three-tier KV cache (see the module doc)."""

    def __init__(self, config: CacheConfig | Mapping[str, Any], *, device_pool: DeviceKVPool,
                 free_device_pages: Callable[[list[int]], None],
                 allocate_device_pages: Callable[[int], list[int] | None] | None = None,
                 host_pool: HostKVPool | None = None, store: L3Store | None = None,
                 engine: TransferEngine | None = None):
        from ..registry import create_host_allocator, create_l3_store, create_transfer_engine
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
        self.keyer = PageKeyer(model_id=cfg.model_id, spec=spec, tp_rank=cfg.tp_rank,
                               tp_size=cfg.tp_size, salt=cfg.salt)
        self.write_policy: WritePolicy = make_write_policy(
            cfg.write_policy, selective_threshold=cfg.selective_threshold)
        self.prefetch_policy: PrefetchPolicy = make_prefetch_policy(
            cfg.prefetch_policy, min_tokens=cfg.prefetch_min_tokens,
            base_s=cfg.prefetch_timeout_base_s,
            per_1k_tokens_s=cfg.prefetch_timeout_per_1k_tokens_s,
            cap_s=cfg.prefetch_timeout_cap_s)
        self.metrics_registry = Metrics()
        self._owned: list[Any] = []          # what close() closes, in reverse order
        try:
            if host_pool is None:
                n_host = cfg.host_pages_for(spec.page_bytes, device_pool.num_pages)
                allocator = create_host_allocator(cfg.host_allocator, cfg.host_allocator_config)
                host_pool = HostKVPool(spec, n_host, layout=cfg.host_layout, allocator=allocator)
                self._owned.append(host_pool)
            elif host_pool.spec.fingerprint != spec.fingerprint:
                raise ConfigError(f"host pool spec {host_pool.spec} differs from the device "
                                  f"pool's {spec}", key="spec")
            self.host_pool = host_pool
            if engine is None:
                engine = create_transfer_engine(cfg.transfer_engine, device_pool, host_pool,
                                                cfg.transfer_config)
                self._owned.append(engine)
            self.engine = engine
            if store is None and cfg.l3_store is not None:
                store = create_l3_store(cfg.l3_store, cfg.l3_config, spec=spec)
                self._owned.append(store)
            if store is not None:
                store.attach(host_pool)
            self.store = store
        except BaseException:
            for obj in reversed(self._owned):
                obj.close()
            raise
        self._lock = threading.RLock()
        self._nodes: dict[bytes, _Node] = {}
        self._l1_by_page: dict[int, _Node] = {}
        self._l1_lru = LRUOrder()
        self._l2_lru = LRUOrder()
        self._closed = False
        self._closing = False
        self._backups_inflight = 0          # L1 pages pinned by an L1 -> L2 copy
        self._failure: TierFailureError | None = None
        self._failure_reported = True
        self._l3_state = "ok" if store is not None else "none"
        self._l3_error_streak = 0
        self._queue = _TaskQueue()
        self._workers: list[threading.Thread] = []
        self._completer = _Completer(self._completer_died)
        if store is not None:
            self._start_l3_workers()
        self._register_gauges()

    @classmethod
    def from_config(cls, config: CacheConfig | Mapping[str, Any], **kwargs: Any
                    ) -> "TieredKVCache":
        """Build from a dict (or CacheConfig); keyword arguments as for the constructor."""
        return cls(CacheConfig.from_dict(config), **kwargs)

    # ----- public API -----------------------------------------------------------------------
    def keys(self, tokens: Any) -> list[bytes]:
        """Chained keys of every full page of ``tokens`` in this cache's namespace."""
        return self.keyer.keys(tokens)

    def match(self, tokens: Any) -> Match:
        """Longest cached prefix of ``tokens`` per tier; pins the L1 and L2 hits."""
        self._check()
        t0 = time.perf_counter()
        keys = self.keyer.keys(tokens)
        num_tokens = len(tokens)
        n = len(keys)
        backups: list[_Node] = []
        with self._lock:
            nodes = self._nodes
            i = 0
            l1: list[_Node] = []
            while i < n:
                node = nodes.get(keys[i])
                if node is None or node.device_page is None:
                    break
                node.l1_pins += 1
                l1.append(node)
                i += 1
            l2: list[_Node] = []
            while i < n:
                node = nodes.get(keys[i])
                if node is None or node.host_page is None:
                    break
                node.l2_pins += 1
                l2.append(node)
                i += 1
            pol = self.write_policy
            l1_touch, l2_touch = self._l1_lru.touch, self._l2_lru.touch
            for node in reversed(l2):
                node.hits += 1
                l2_touch(node.key, node)
            for node in reversed(l1):
                node.hits += 1
                l1_touch(node.key, node)
                if node.host_page is not None:
                    l2_touch(node.key, node)
                elif not node.backup_pending and pol.backup_on_hit(node.hits):
                    backups.append(node)
            if backups:
                backups.reverse()
                self._schedule_backup(backups)
        l3 = 0
        rest = n - i
        if rest and self._l3_usable() and \
                self.prefetch_policy.consult_l3(rest * self.spec.page_size):
            l3 = self._l3_exists(keys[i:])
        m = Match(self, keys, num_tokens, l1, l2, l3)
        ps = self.spec.page_size
        miss = n - len(l1) - len(l2) - l3
        self.metrics_registry.add_many({
            "match_calls": 1, "match_pages": n, "l1_hit_pages": len(l1),
            "l2_hit_pages": len(l2), "l3_hit_pages": l3, "miss_pages": miss,
            "match_tokens": num_tokens, "l1_hit_tokens": len(l1) * ps,
            "l2_hit_tokens": len(l2) * ps, "l3_hit_tokens": l3 * ps,
            "miss_tokens": num_tokens - (n - miss) * ps})
        self.metrics_registry.observe("match", time.perf_counter() - t0)
        return m

    def prefetch(self, match: Match) -> None:
        """Start reading the match's L3 run into L2 in the background (idempotent). Call it
        when the request is queued; `fetch` starts it itself otherwise."""
        self._check()
        self._check_match(match)
        self._start_read(match)

    def prefetch_ready(self, match: Match) -> bool:
        """Would `fetch` return without waiting on L3 now, under the prefetch policy?"""
        self._check_match(match)
        task = match._read
        if match.l3_count == 0 or not self._l3_usable():
            return True
        if task is None:                       # fetch would start the read and wait for it
            return self.prefetch_policy.wait_budget_s(self.spec.page_size) == 0
        with task.cv:
            if task.finished or task.n_landed >= task.num_pages:
                return True
        budget = self.prefetch_policy.wait_budget_s(task.num_pages * self.spec.page_size)
        return time.perf_counter() - task.t0 >= budget

    def fetch(self, match: Match, device_pages: Sequence[int] | Any | None = None
              ) -> FetchHandle:
        """Bring the match's L2 hit and L3 hit into ``device_pages`` (L3 -> L2 -> L1).

        ``device_pages`` (length <= ``match.pages_to_load``) must be engine pages the cache
        does not own; None takes them from ``allocate_device_pages`` (evicting L1 if needed).
        Pages from ``pages_loaded`` on are not loaded and stay the engine's.
        """
        self._check()
        self._check_match(match)
        if match._fetch is not None:
            raise InvalidArgumentError("this match was already fetched", argument="match")
        t0 = time.perf_counter()
        want = match.pages_to_load
        if device_pages is None:
            dev = self._allocate_device(want)
        else:
            dev = self._check_engine_pages(device_pages, "device_pages")
            if len(dev) > want:
                raise InvalidArgumentError(f"fetch got {len(dev)} device pages but the match "
                                           f"has only {want} pages to load",
                                           argument="device_pages", value=len(dev))
        n2 = min(match.l2_count, len(dev))
        n3_want = min(match.l3_count, len(dev) - n2)
        if n3_want:
            self._start_read(match)
            self._wait_read(match, n3_want)
        with self._lock:
            self._check_match(match)
            task = match._read
            landed: list[_Node] = []
            rest_landed: list[_Node] = []
            if task is not None:
                task.cancelled = True             # later pages land unpinned, for others
                landed = task.landed[:n3_want]
                rest_landed = task.landed[n3_want:]
            nodes = match._l2_nodes[:n2] + landed
            match._pinned_l2 = match._l2_nodes[n2:] + rest_landed
            match._given.update(dev)
            load = dev[:len(nodes)]
            unused = dev[len(nodes):]
            if nodes:
                try:
                    handle: TransferHandle = self.engine.load(
                        [nd.host_page for nd in nodes], load)
                except BaseException:
                    match._pinned_l2 += nodes
                    raise
            else:
                handle = CompletedHandle(self.spec.num_layers)
            fh = FetchHandle(self, match, handle, nodes, load, unused, self.spec.num_layers)
            match._fetch = fh
        cut = n3_want - len(landed)
        self.metrics_registry.add_many({
            "fetch_calls": 1, "fetched_l2_pages": n2, "fetched_l3_pages": len(landed),
            "prefetch_cut_pages": cut + (match.l3_count - n3_want),
            "bytes_h2d": len(nodes) * self.spec.page_bytes})
        self.metrics_registry.observe("fetch", time.perf_counter() - t0)
        if nodes:
            self._completer.submit(handle, lambda err: self._finish_fetch(fh, err))
        else:
            self._finish_fetch(fh, None)
        return fh

    def commit(self, tokens: Any, device_pages: Sequence[int] | Any,
               match: Match | None = None) -> CommitResult:
        """Register the full pages of ``tokens`` (held in ``device_pages``, one per full page,
        prefix included) and apply the write policy. With ``match`` the pages taken stay
        pinned until ``release(match)``."""
        self._check()
        t0 = time.perf_counter()
        keys = self.keyer.keys(tokens)
        dev = self._page_list(device_pages, "device_pages")
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
        with self._lock:
            by_page = self._l1_by_page
            for i, d in enumerate(dev):          # validate before touching anything
                owner = by_page.get(d)
                if owner is not None and owner.key != keys[i]:
                    raise InvalidArgumentError(
                        f"device page {d} belongs to the cache for another page key; commit "
                        f"must pass the engine's pages for these tokens",
                        argument="device_pages", value=d)
            if match is not None:
                match._given.update(d for d in dev if d not in by_page)
            nodes = self._nodes
            parent: _Node | None = None
            chain: list[_Node] = []
            pol = self.write_policy
            backups: list[_Node] = []
            for key, d in zip(keys, dev):
                node = nodes.get(key)
                if node is None:
                    node = _Node(key, parent)
                    nodes[key] = node
                    if parent is not None:
                        parent.kids.add(node)
                if node.device_page is None:
                    self._l1_add(node, d, touch=False)     # touched below, leaf first
                    new += 1
                    taken.append(d)
                    if match is not None:
                        node.l1_pins += 1
                        match._pinned_l1.append(node)
                        match._held.add(d)
                        match._taken.add(d)
                elif node.device_page == d:
                    if match is not None and d not in match._held:
                        node.l1_pins += 1
                        match._pinned_l1.append(node)
                        match._held.add(d)
                        if d in match._given:
                            match._taken.add(d)
                else:
                    not_taken.append(d)
                if node.host_page is None and not node.backup_pending \
                        and pol.backup_on_commit(node.hits):
                    backups.append(node)
                chain.append(node)
                parent = node
            l1_touch, l2_touch = self._l1_lru.touch, self._l2_lru.touch
            for node in reversed(chain):
                l1_touch(node.key, node)
                if node.host_page is not None:
                    l2_touch(node.key, node)
            if backups:
                self._schedule_backup(backups)
        self.metrics_registry.add_many({"commit_calls": 1, "committed_pages": new})
        self.metrics_registry.observe("commit", time.perf_counter() - t0)
        return CommitResult(new, tuple(taken), tuple(not_taken))

    def _settle_fetch(self, match: Match) -> None:
        """Wait (host side) for the match's fetch still in flight, then book its outcome."""
        fh = match._fetch
        if fh is not None and not fh._finished:
            try:
                _host_wait(fh._handle)
                err = None
            except Exception as exc:
                err = exc
            self._finish_fetch(fh, err)

    def release(self, match: Match) -> list[int]:
        """The request is done: unpin its pages, stop its prefetch. Returns the device pages
        it passed in that the cache did not take (the engine's to free). Idempotent."""
        if not isinstance(match, Match) or match._cache is not self:
            raise InvalidArgumentError("release needs a Match from this cache",
                                       argument="match")
        self._settle_fetch(match)
        with self._lock:
            if match._released:
                return []
            match._released = True
            if match._read is not None:
                match._read.cancelled = True
            for node in match._pinned_l1:
                node.l1_pins -= 1
            for node in match._pinned_l2:
                node.l2_pins -= 1
            match._pinned_l1 = []
            match._pinned_l2 = []
            return sorted(match._given - match._taken)

    def evict(self, num_pages: int, tier: Literal["l1", "l2"] = "l1") -> int:
        """Evict up to ``num_pages`` unpinned leaf pages from L1 (given back through
        ``free_device_pages``) or L2; returns how many were freed."""
        self._check()
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgumentError(f"num_pages must be an int >= 0, got {num_pages!r}",
                                       argument="num_pages", value=num_pages)
        if tier == "l2":
            with self._lock:
                return self._evict_l2(num_pages)
        if tier != "l1":
            raise InvalidArgumentError(f"tier must be 'l1' or 'l2', got {tier!r}",
                                       argument="tier", value=tier)
        return self._evict_l1(num_pages)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no transfer completion or L3 I/O is queued or running (tests,
        benchmarks, deterministic replays); False on timeout."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        left = lambda: None if deadline is None else max(0.0, deadline - time.perf_counter())  # noqa: E731
        while True:
            if not self._completer.wait_idle(left()):
                return False
            if not self._queue.wait_idle(left()):
                return False
            if self._completer.depth() == 0:   # an L3 write may not queue new transfers
                return True

    def metrics(self) -> dict[str, Any]:
        """A snapshot of every counter, gauge and latency summary."""
        return self.metrics_registry.snapshot()

    def restart_l3(self) -> None:
        """Bring L3 back after a reported failure: new I/O threads, error streak reset."""
        self._check(report=False)
        if self.store is None:
            raise InvalidArgumentError("this cache has no L3 store", argument="l3_store")
        with self._lock:
            self._workers = [t for t in self._workers if t.is_alive()]
            self._l3_error_streak = 0
            self._l3_state = "ok"
            if self._failure is not None and self._failure.tier == "l3":
                self._failure = None
                self._failure_reported = True
            self._start_l3_workers()

    def close(self) -> None:
        """Finish or cancel queued write-backs (``close_policy``), stop the threads and close
        what the cache created. Nothing a store acknowledged is lost; idempotent."""
        with self._lock:
            if self._closed or self._closing:
                return
            self._closing = True
        cfg = self.config
        deadline = time.perf_counter() + cfg.close_timeout_s
        left = lambda: max(0.0, deadline - time.perf_counter())  # noqa: E731
        self._completer.wait_idle(left())
        for task in self._queue.drain() if cfg.close_policy == "cancel" else []:
            self._abort_task(task, cancelled=True)
        if cfg.close_policy == "flush" and self._l3_usable() and \
                self.write_policy.l3_on_l2_evict:
            with self._lock:
                dirty = [n for n in self._nodes.values() if n.host_page is not None
                         and not n.in_l3 and not n.wb_pending]
                for n in dirty:
                    n.l2_pins += 1
            if dirty:
                self._queue.put(_WriteTask(dirty, evict_after=False))
        # cancel reads (they only fill L2, which is going away)
        with self._queue.cv:
            reads = list(self._queue.reads)
            self._queue.reads.clear()
        for task in reads:
            self._abort_task(task, cancelled=True)
        if not self._queue.wait_idle(left()):
            log.error("kvtier cache: close timed out with L3 work in flight")
        self._queue.stop()
        for t in self._workers:
            t.join(left())
        for task in self._queue.drain():        # only if workers died or timed out
            self._abort_task(task, cancelled=True)
        self._completer.stop(left())
        with self._lock:
            self._closed = True
        for obj in reversed(self._owned):
            try:
                obj.close()
            except Exception as exc:
                log.warning("kvtier cache: closing %s failed: %s", type(obj).__name__, exc)

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- health ---------------------------------------------------------------------------
    def _check(self, report: bool = True) -> None:
        if self._closed or self._closing:
            raise InvalidArgumentError("the cache is closed", argument="cache")
        if self._l3_state == "ok":
            for t in self._workers:
                if not t.is_alive():
                    self._tier_failed("l3", f"L3 I/O thread {t.name} is dead", None)
                    break
        if report and not self._failure_reported:
            with self._lock:
                failure, self._failure_reported = self._failure, True
            if failure is not None:
                raise failure

    def _tier_failed(self, tier: str, message: str, cause: BaseException | None) -> None:
        with self._lock:
            if tier == "l3":
                if self._l3_state.startswith("failed"):
                    return
                self._l3_state = f"failed: {message}"
            exc = TierFailureError(f"{tier} tier failed: {message}", tier=tier, cause=cause)
            exc.__cause__ = cause
            self._failure = exc
            self._failure_reported = False
        self.metrics_registry.add(f"{tier}_failures")
        log.error("kvtier cache: %s tier failed: %s", tier, message, exc_info=cause)
        if tier == "l3":
            for task in self._queue.drain():
                self._abort_task(task, cancelled=False)

    def _completer_died(self, exc: BaseException) -> None:
        self._tier_failed("transfer", f"completion thread died: {type(exc).__name__}: {exc}",
                          exc)

    def _l3_usable(self) -> bool:
        return self.store is not None and self._l3_state == "ok"

    def _l3_exists(self, keys: list[bytes]) -> int:
        t0 = time.perf_counter()
        try:
            n = self.store.batch_exists(keys)  # type: ignore[union-attr]
        except Exception as exc:
            self._store_error("batch_exists", exc)
            return 0
        self._store_ok()
        self.metrics_registry.observe("l3_exists", time.perf_counter() - t0)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(keys):
            self._store_error("batch_exists", ValueError(f"returned {n!r}"))
            return 0
        return n

    def _store_error(self, op: str, exc: BaseException) -> None:
        name = self.store.name if self.store is not None else "?"
        self.metrics_registry.add("store_errors")
        log.warning("kvtier cache: L3 store %r %s failed: %s: %s", name, op,
                    type(exc).__name__, exc)
        with self._lock:
            self._l3_error_streak += 1
            broken = self._l3_error_streak >= self.config.l3_error_limit
        if broken:
            self._tier_failed("l3", f"store {name!r} failed {self.config.l3_error_limit} "
                              f"calls in a row; last: {op}: {type(exc).__name__}: {exc}", exc)

    def _store_ok(self) -> None:
        if self._l3_error_streak:
            with self._lock:
                self._l3_error_streak = 0

    # ----- index helpers (lock held) --------------------------------------------------------
    def _l1_add(self, node: _Node, page: int, touch: bool = True) -> None:
        node.device_page = page
        self._l1_by_page[page] = node
        if node.parent is not None:
            node.parent.l1_children += 1
        if touch:
            self._l1_lru.touch(node.key, node)

    def _l1_remove(self, node: _Node) -> int:
        page = node.device_page
        assert page is not None
        node.device_page = None
        del self._l1_by_page[page]
        if node.parent is not None:
            node.parent.l1_children -= 1
        self._l1_lru.discard(node.key)
        self._maybe_drop(node)
        return page

    def _l2_add(self, node: _Node, page: int) -> None:
        """Register an L2 copy; the caller touches the chain (`_touch_l2_up`)."""
        node.host_page = page
        self._l2_lru.touch(node.key, node)

    def _touch_l2_up(self, nodes: list[_Node]) -> None:
        """Touch ``nodes`` (chain order) and their ancestors in L2, deepest first, so that a
        prefix stays newer than its extensions (the LRU scan then meets leaves first)."""
        touch = self._l2_lru.touch
        seen: set[bytes] = set()
        for nd in reversed(nodes):
            cur: _Node | None = nd
            while cur is not None and cur.key not in seen:
                seen.add(cur.key)
                if cur.host_page is not None:
                    touch(cur.key, cur)
                cur = cur.parent

    def _l2_remove(self, node: _Node) -> int:
        page = node.host_page
        assert page is not None
        node.host_page = None
        self._l2_lru.discard(node.key)
        self._maybe_drop(node)
        return page

    def _maybe_drop(self, node: _Node) -> None:
        if node.device_page is None and node.host_page is None:
            assert node.children == 0, f"{node} would orphan its children"
            del self._nodes[node.key]
            if node.parent is not None:
                node.parent.kids.discard(node)

    def _alloc_host(self, n: int) -> list[int]:
        """Up to ``n`` host pages, evicting unpinned L2 leaves as needed."""
        if n <= 0:
            return []
        free = self.host_pool.free_count
        if free < n:
            self._evict_l2(n - free)
            free = self.host_pool.free_count
        return self.host_pool.alloc(min(n, free))

    def _evict_l2(self, n: int) -> int:
        """Free up to ``n`` host pages: clean leaves now; dirty ones (write_back) after their
        L3 write. Returns how many were freed now."""
        l3_wb = self.write_policy.l3_on_l2_evict and self._l3_usable()
        l3_off = self.write_policy.l3_on_l2_evict and self.store is not None and not l3_wb
        lost = 0

        def dirty(nd: _Node) -> bool:
            return l3_wb and not nd.in_l3 and nd.device_page is None

        victims = self._l2_lru.select(
            n, evictable=lambda nd: nd.l2_pins == 0 and not nd.wb_pending,
            blockers=lambda nd: 0 if nd.device_page is not None else nd.children,
            parent=lambda nd: nd.parent.key if nd.parent is not None else None,
            leaves=lambda nd: nd.device_page is None)
        freed: list[int] = []
        later: list[_Node] = []           # freed after their (or their children's) write-back
        write: list[bool] = []
        waiting: dict[bytes, int] = {}    # parent key -> children queued in `later`
        for nd in victims:                # children come before their parents
            if nd.l2_pins or nd.wb_pending:
                continue
            children = 0 if nd.device_page is not None else nd.children
            if children > waiting.get(nd.key, 0):
                continue                          # re-check: the selection is optimistic
            if dirty(nd) or children:
                nd.wb_pending = True
                nd.l2_pins += 1
                later.append(nd)
                write.append(dirty(nd))
                if nd.parent is not None and nd.device_page is None:
                    waiting[nd.parent.key] = waiting.get(nd.parent.key, 0) + 1
            else:
                if l3_off and not nd.in_l3 and nd.device_page is None:
                    lost += 1                     # write-back impossible: L3 failed
                freed.append(self._l2_remove(nd))
        if freed:
            self.host_pool.free(freed)
            self.metrics_registry.add_many({"l2_evictions": len(freed),
                                            "l3_writes_dropped": lost})
        if later:
            self._enqueue_write(later, evict_after=True, write=write)
        return len(freed)

    def _evict_l1(self, n: int) -> int:
        freed = self._evict_l1_once(n)
        if freed < n and self._backups_inflight:
            # Pages being copied to L2 are pinned until the copy lands (on a GPU that is
            # asynchronous): wait for the copies in flight, then take what they freed up.
            self._completer.wait_idle(None)
            freed += self._evict_l1_once(n - freed)
        return freed

    def _evict_l1_once(self, n: int) -> int:
        pol = self.write_policy
        with self._lock:
            victims = self._l1_lru.select(
                n, evictable=lambda nd: nd.l1_pins == 0 and not nd.backup_pending,
                blockers=lambda nd: nd.l1_children,
                parent=lambda nd: nd.parent.key if nd.parent is not None else None,
                leaves=lambda nd: True)
            # Children come before parents: a page needs an L2 copy (demotion) if the policy
            # says so (write_back) or if children of it stay in the index; children that
            # leave with this same batch do not count.
            demote: list[_Node] = []
            leaving: dict[bytes, int] = {}
            for nd in victims:
                if nd.host_page is not None:
                    continue                      # keeps its L2 copy: stays in the index
                if pol.demote_on_l1_evict or nd.children > leaving.get(nd.key, 0):
                    demote.append(nd)
                elif nd.parent is not None:
                    leaving[nd.parent.key] = leaving.get(nd.parent.key, 0) + 1
            pages = self._alloc_host(len(demote)) if demote else []
            demote = demote[:len(pages)]
            for nd in demote:
                nd.backup_pending = True
                self._backups_inflight += 1
                nd.l1_pins += 1
            handle = None
            if demote:
                try:
                    handle = self.engine.backup([nd.device_page for nd in demote], pages)
                except BaseException:
                    self._undo_backup(demote, pages)
                    raise
        if handle is not None:
            t0 = time.perf_counter()
            err: BaseException | None = None
            try:
                _host_wait(handle)
            except Exception as exc:
                err = exc
            self._finish_backup(demote, pages, err, t0, l3=pol.l3_on_backup)
            self.metrics_registry.add("l1_demotions", len(demote) if err is None else 0)
        freed: list[int] = []
        dropped_dirty = 0
        with self._lock:
            for nd in victims:
                if nd.device_page is None or nd.l1_pins or nd.backup_pending \
                        or nd.l1_children:
                    continue
                if nd.host_page is None:
                    # No L2 copy: its L2-only descendants (colder: they left L1 first) go
                    # too, unless one is in use -- never leave them without their prefix.
                    if nd.children and not self._drop_l2_subtree(nd):
                        continue
                    if pol.demote_on_l1_evict:
                        dropped_dirty += 1
                freed.append(self._l1_remove(nd))
        if freed:
            self.metrics_registry.add_many({"l1_evictions": len(freed),
                                            "l1_dirty_dropped": dropped_dirty})
            self._free_cb(freed)
        return len(freed)

    def _drop_l2_subtree(self, top: _Node) -> bool:
        """Drop every descendant of ``top`` (all L2-only: ``top`` is an L1 leaf) from L2,
        leaves first; nothing if any of them is in use. Lock held."""
        order: list[_Node] = []
        stack = list(top.kids)
        while stack:
            nd = stack.pop()
            if nd.l2_pins or nd.wb_pending or nd.device_page is not None:
                return False
            order.append(nd)
            stack.extend(nd.kids)
        freed = [self._l2_remove(nd) for nd in reversed(order)]   # children first
        self.host_pool.free(freed)
        self.metrics_registry.add("l2_evictions", len(freed))
        return True

    def _allocate_device(self, n: int) -> list[int]:
        if n == 0:
            return []
        if self._alloc_cb is None:
            raise InvalidArgumentError("fetch without device_pages needs the "
                                       "allocate_device_pages callback",
                                       argument="device_pages")
        want = n
        while want > 0:
            pages = self._alloc_cb(want)
            if pages is None:
                self._evict_l1(want)
                pages = self._alloc_cb(want)
            if pages is not None:
                return self._check_engine_pages(pages, "allocate_device_pages()")
            want //= 2
        return []

    def _page_list(self, pages: Any, what: str) -> list[int]:
        """Device page indices as a list of ints, range-checked (fast path for int lists)."""
        if isinstance(pages, (list, tuple)) and all(type(p) is int for p in pages):
            if pages and (min(pages) < 0 or max(pages) >= self.device_pool.num_pages):
                bad = min(pages) if min(pages) < 0 else max(pages)
                raise PageIndexError(f"{what}: device page {bad} out of range [0, "
                                     f"{self.device_pool.num_pages})", index=bad,
                                     limit=self.device_pool.num_pages)
            return list(pages)
        return self.device_pool.check_pages(pages, what).tolist()

    def _check_engine_pages(self, pages: Any, what: str) -> list[int]:
        dev = self._page_list(pages, what)
        if len(set(dev)) != len(dev):
            raise PageIndexError(f"{what} contain duplicates")
        with self._lock:
            owned = [d for d in dev if d in self._l1_by_page]
        if owned:
            raise InvalidArgumentError(f"{what}: device page {owned[0]} belongs to the cache "
                                       "(an L1 page); pass free engine pages",
                                       argument="device_pages", value=owned[0])
        return dev

    def _check_match(self, match: Match) -> None:
        if not isinstance(match, Match) or match._cache is not self:
            raise InvalidArgumentError("expected a Match from this cache's match()",
                                       argument="match")
        if match._released:
            raise InvalidArgumentError("this match was released", argument="match")

    # ----- L1 -> L2 backups -----------------------------------------------------------------
    def _schedule_backup(self, nodes: list[_Node]) -> None:
        """Copy L1 pages to new host pages in the background (lock held)."""
        cand = [nd for nd in nodes if nd.device_page is not None and nd.host_page is None
                and not nd.backup_pending]
        if not cand:
            return
        pages = self._alloc_host(len(cand))
        if len(pages) < len(cand):
            self.metrics_registry.add("backup_skipped_pages", len(cand) - len(pages))
            cand = cand[:len(pages)]
            if not cand:
                return
        for nd in cand:
            nd.backup_pending = True
            self._backups_inflight += 1
            nd.l1_pins += 1
        try:
            handle = self.engine.backup([nd.device_page for nd in cand], pages)
        except BaseException:
            self._undo_backup(cand, pages)
            raise
        t0 = time.perf_counter()
        l3 = self.write_policy.l3_on_backup
        self._completer.submit(
            handle, lambda err: self._finish_backup(cand, pages, err, t0, l3=l3))

    def _undo_backup(self, nodes: list[_Node], pages: list[int]) -> None:
        for nd in nodes:
            nd.backup_pending = False
            self._backups_inflight -= 1
            nd.l1_pins -= 1
        self.host_pool.free(pages)

    def _finish_backup(self, nodes: list[_Node], pages: list[int], err: BaseException | None,
                       t0: float, *, l3: bool) -> None:
        if err is not None:
            self.metrics_registry.add("transfer_errors")
            log.warning("kvtier cache: L1 -> L2 backup failed: %s", err)
        writes: list[_Node] = []
        unused: list[int] = []
        with self._lock:
            for nd, p in zip(nodes, pages):
                nd.backup_pending = False
                self._backups_inflight -= 1
                nd.l1_pins -= 1
                if err is not None or nd.host_page is not None:
                    unused.append(p)
                    continue
                self._l2_add(nd, p)
                if l3 and not nd.in_l3:
                    writes.append(nd)
            if unused:
                self.host_pool.free(unused)
            done = len(nodes) - len(unused)
            if done:
                self._touch_l2_up(nodes)
            if writes and self.store is not None:    # counted as dropped while L3 is off
                for nd in writes:
                    nd.l2_pins += 1
                self._enqueue_write(writes, evict_after=False)
        if err is None:
            self.metrics_registry.add_many({"backup_pages": done,
                                            "bytes_d2h": len(nodes) * self.spec.page_bytes})
            self.metrics_registry.observe("backup_l2", time.perf_counter() - t0)

    # ----- fetch completion -----------------------------------------------------------------
    def _finish_fetch(self, fh: FetchHandle, err: BaseException | None) -> None:
        with self._lock:
            if fh._finished:
                return
            fh._finished = True
            m = fh.match
            for nd in fh._nodes:          # the load no longer reads the host pages
                nd.l2_pins -= 1
            if err is not None:
                fh._error = err
                fh.not_taken = list(fh.device_pages)
                self.metrics_registry.add("transfer_errors")
                log.warning("kvtier cache: L2 -> L1 load failed: %s", err)
                return
            fresh: list[_Node] = []
            for nd, d in zip(fh._nodes, fh.device_pages):
                if nd.device_page is None:
                    parent = nd.parent
                    if parent is not None and parent.device_page is None:
                        fh.not_taken.append(d)    # cannot happen while the prefix is pinned
                        continue
                    self._l1_add(nd, d)
                    fresh.append(nd)
                elif nd.device_page != d:
                    fh.not_taken.append(d)        # someone else loaded it meanwhile
                    continue
                if not m._released and d not in m._held:
                    nd.l1_pins += 1
                    m._pinned_l1.append(nd)
                    m._held.add(d)
                m._taken.add(d)
            touch = self._l1_lru.touch
            for nd in reversed(fresh):
                touch(nd.key, nd)
            for nd in reversed(m._l1_nodes):
                if nd.device_page is not None:
                    touch(nd.key, nd)
        self.metrics_registry.observe("load_l1", time.perf_counter() - fh._t0)

    # ----- L3 I/O -----------------------------------------------------------------------------
    def _start_l3_workers(self) -> None:
        for _ in range(self.config.l3_io_threads - len(self._workers)):
            t = threading.Thread(target=self._l3_worker, daemon=True,
                                 name=f"kvtier-l3-io-{len(self._workers)}")
            self._workers.append(t)
            t.start()

    def _l3_worker(self) -> None:
        # Tasks finish themselves (finally blocks), so a dying thread leaves no waiter hanging.
        try:
            while True:
                task = self._queue.get()
                if task is None:
                    return
                try:
                    if task.is_read:
                        self._run_read(task)
                    else:
                        self._run_write(task)
                finally:
                    self._queue.task_done()
        except BaseException as exc:
            name = threading.current_thread().name
            self._tier_failed("l3", f"L3 I/O thread {name} died: {type(exc).__name__}: {exc}",
                              exc)

    def _start_read(self, match: Match) -> None:
        with self._lock:
            if match._read is not None or match.l3_count == 0 or not self._l3_usable():
                return
            start = match.l1_count + match.l2_count
            pages = self._alloc_host(match.l3_count)
            if len(pages) < match.l3_count:
                self.metrics_registry.add("prefetch_no_space_pages",
                                          match.l3_count - len(pages))
            keys = match.keys[start:start + len(pages)]
            task = _ReadTask(match, keys, pages, match.keys[start - 1] if start else None)
            match._read = task
            if not pages:
                task.finished = True
                return
        self._queue.put(task)

    def _wait_read(self, match: Match, want: int) -> None:
        task = match._read
        if task is None:
            return
        want = min(want, task.num_pages)
        budget = self.prefetch_policy.wait_budget_s(want * self.spec.page_size)
        remaining = budget - (time.perf_counter() - task.t0)
        pred = lambda: task.finished or task.n_landed >= want  # noqa: E731
        with task.cv:
            if pred() or remaining <= 0:
                return
            task.cv.wait_for(pred, None if math.isinf(remaining) else remaining)

    def _run_read(self, task: _ReadTask) -> None:
        store = self.store
        assert store is not None
        b = self.config.l3_batch_pages
        i, n = 0, task.num_pages
        try:
            while i < n and not task.cancelled and self._l3_usable():
                kb, pb = task.keys[i:i + b], task.host_pages[i:i + b]
                t0 = time.perf_counter()
                try:
                    ok = store.batch_get(kb, pb)
                except Exception as exc:
                    self._store_error("batch_get", exc)
                    break
                self._store_ok()
                self.metrics_registry.observe("l3_read", time.perf_counter() - t0)
                lead = 0
                if isinstance(ok, list) and len(ok) == len(kb):
                    while lead < len(kb) and ok[lead] is True:
                        lead += 1
                else:
                    self._store_error("batch_get", ValueError(f"returned {ok!r}"))
                self._land(task, i, lead)
                i += lead
                if lead < len(kb):
                    self.metrics_registry.add("l3_read_miss_pages", n - i)
                    break
        finally:
            self._end_read(task)

    def _land(self, task: _ReadTask, start: int, count: int) -> None:
        """Register pages read from L3 in L2 (pinned for the match while it wants them)."""
        if count <= 0:
            return
        dup: list[int] = []
        with self._lock:
            if start == 0:
                pkey = task.parent_key
            else:
                pkey = task.keys[start - 1]
            parent = self._nodes.get(pkey) if pkey is not None else None
            ok = pkey is None or parent is not None
            pin = not task.cancelled and not task.match._released
            landed = 0
            for j in range(start, start + count):
                hp = task.host_pages[j]
                task.used = j + 1
                if not ok:
                    dup.append(hp)                # prefix gone: the page would be orphaned
                    continue
                key = task.keys[j]
                node = self._nodes.get(key)
                if node is None:
                    node = _Node(key, parent)
                    self._nodes[key] = node
                    if parent is not None:
                        parent.kids.add(node)
                if node.host_page is None:
                    self._l2_add(node, hp)
                else:
                    dup.append(hp)
                node.in_l3 = True
                if pin:
                    node.l2_pins += 1
                    task.landed.append(node)
                    task.match._pinned_l2.append(node)
                    landed += 1
                parent = node
            if ok:
                self._touch_l2_up(task.landed[-landed:] if landed else [])
            if dup:
                self.host_pool.free(dup)
        self.metrics_registry.add_many({"l3_loaded_pages": count,
                                        "bytes_l3_read": count * self.spec.page_bytes})
        with task.cv:
            task.n_landed += landed
            task.cv.notify_all()

    def _end_read(self, task: _ReadTask) -> None:
        with self._lock:
            rest = task.host_pages[task.used:]
            task.used = len(task.host_pages)
            if rest:
                self.host_pool.free(rest)
        with task.cv:
            task.finished = True
            task.cv.notify_all()

    def _enqueue_write(self, nodes: list[_Node], *, evict_after: bool,
                       write: list[bool] | None = None) -> None:
        """Queue an L3 write of pinned L2 pages (lock held); drops it when the queue is full."""
        task = _WriteTask(nodes, evict_after, write)
        if not self._l3_usable() or \
                self._queue.queued_write_pages + len(nodes) > self.config.l3_max_queued_pages:
            self.metrics_registry.add("l3_writes_dropped", sum(task.write))
            self._write_done(task, [None] * len(nodes))
            return
        self._queue.put(task)

    def _run_write(self, task: _WriteTask) -> None:
        store = self.store
        assert store is not None
        b = self.config.l3_batch_pages
        todo = [i for i, w in enumerate(task.write) if w]
        results: list[bool | None] = [None] * task.num_pages
        try:
            for s in range(0, len(todo), b):
                idx = todo[s:s + b]
                kb = [task.nodes[i].key for i in idx]
                pb = [task.host_pages[i] for i in idx]
                ok: Any = [False] * len(kb)
                if self._l3_usable():
                    t0 = time.perf_counter()
                    try:
                        ok = store.batch_set(kb, pb)
                    except Exception as exc:
                        self._store_error("batch_set", exc)
                        ok = [False] * len(kb)
                    else:
                        self._store_ok()
                        self.metrics_registry.observe("l3_write", time.perf_counter() - t0)
                        if not isinstance(ok, list) or len(ok) != len(kb):
                            self._store_error("batch_set", ValueError(f"returned {ok!r}"))
                            ok = [False] * len(kb)
                for i, v in zip(idx, ok):
                    results[i] = v is True
        finally:
            for i in todo:
                if results[i] is None:
                    results[i] = False
            self._write_done(task, results)

    def _write_done(self, task: _WriteTask, ok: list[bool | None]) -> None:
        """Unpin a write task's pages; free evicted ones, children first. ``ok[i]`` is None
        for pages not written (clean, cancelled or dropped)."""
        written = sum(1 for v in ok if v)
        failed = sum(1 for v in ok if v is False)
        freed: list[int] = []
        with self._lock:
            for nd, good in zip(task.nodes, ok):
                nd.l2_pins -= 1
                if good:
                    nd.in_l3 = True
                if task.evict_after:
                    nd.wb_pending = False
                    if nd.host_page is not None and nd.l2_pins == 0 \
                            and (nd.device_page is not None or not nd.children):
                        freed.append(self._l2_remove(nd))
            if freed:
                self.host_pool.free(freed)
        self.metrics_registry.add_many({
            "l3_written_pages": written, "l3_write_failed_pages": failed,
            "bytes_l3_written": written * self.spec.page_bytes,
            "l2_evictions": len(freed), "l2_writebacks": written if task.evict_after else 0})

    def _abort_task(self, task: Any, *, cancelled: bool) -> None:
        """Finish a task that will not run: reads end empty, writes count as not written."""
        if task.is_read:
            self._end_read(task)
        else:
            if cancelled:
                self.metrics_registry.add("l3_writes_cancelled", sum(task.write))
            self._write_done(task, [None] * task.num_pages)

    # ----- introspection ----------------------------------------------------------------------
    def _register_gauges(self) -> None:
        m = self.metrics_registry
        m.gauge("l1_pages", lambda: len(self._l1_by_page))
        m.gauge("l2_pages", lambda: len(self._l2_lru))
        m.gauge("l2_free_pages", lambda: self.host_pool.free_count)
        m.gauge("l2_capacity_pages", lambda: self.host_pool.num_pages)
        m.gauge("l3_read_queue_pages", lambda: self._queue.depths()[0])
        m.gauge("l3_write_queue_pages", lambda: self._queue.depths()[1])
        m.gauge("transfer_queue", lambda: self._completer.depth())
        m.gauge("l3_state", lambda: self._l3_state)
        m.gauge("page_bytes", lambda: self.spec.page_bytes)
        m.gauge("page_size", lambda: self.spec.page_size)

    def _check_invariants(self) -> None:
        """Assert the index's structural invariants (tests)."""
        with self._lock:
            seen_host: set[int] = set()
            for key, nd in self._nodes.items():
                assert nd.key == key
                assert nd.device_page is not None or nd.host_page is not None, nd
                p = nd.parent
                if p is not None:
                    assert self._nodes.get(p.key) is p, f"{nd}: parent gone"
                    if nd.device_page is not None:
                        assert p.device_page is not None, f"{nd}: L1 page, parent not in L1"
                if nd.device_page is not None:
                    assert self._l1_by_page.get(nd.device_page) is nd
                    assert nd.key in self._l1_lru
                if nd.host_page is not None:
                    assert nd.host_page not in seen_host
                    seen_host.add(nd.host_page)
                    assert self.host_pool.is_allocated(nd.host_page)
                    assert nd.key in self._l2_lru
                assert nd.l1_pins >= 0 and nd.l2_pins >= 0, nd
            children: dict[bytes, int] = {}
            l1_children: dict[bytes, int] = {}
            for nd in self._nodes.values():
                if nd.parent is not None:
                    children[nd.parent.key] = children.get(nd.parent.key, 0) + 1
                    if nd.device_page is not None:
                        l1_children[nd.parent.key] = l1_children.get(nd.parent.key, 0) + 1
            for key, nd in self._nodes.items():
                assert nd.children == children.get(key, 0), nd
                assert all(self._nodes.get(k.key) is k and k.parent is nd for k in nd.kids), nd
                assert nd.l1_children == l1_children.get(key, 0), nd
            assert len(self._l1_by_page) == len(self._l1_lru)
            assert self._backups_inflight == sum(nd.backup_pending
                                                 for nd in self._nodes.values())
            assert len(seen_host) == len(self._l2_lru)

