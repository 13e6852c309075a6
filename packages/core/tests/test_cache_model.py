"""Model-based test of the tiered cache in both layouts an engine runs it in: after any
sequence of requests (lookup, load, prefill, save, release -- some left half done while
others run), lookups, evictions and lost plans, every page the cache loads into a device page
is bitwise what was saved for its key, whichever tier it came from; so is every page it holds
in L1 or L2 and every object L3 holds; the index keeps its invariants, no device or host page
is lost or shared, and nothing stays pinned once no request is active.

One rule set and one set of invariants drive two layouts:

* one process: `TieredKVCache` (match -> prefetch -> fetch -> commit -> release, evict);
* two processes: a `CachePlanner` here and a `CacheExecutor`, with the device pool, the host
  pool and the L3 store, in a child process (cache_model_child.py), as vLLM's scheduler and
  worker: plans and results cross a pipe, pickled. L1 is then the engine's own: a request may
  find a prefix of its pages there already. The results are booked in any order the rules
  choose, a save may be booked in two parts (its backups, then its L3 writes) as vLLM's worker
  books it, and a plan may be lost (made, never sent, failed).

The reference model is the map page key -> the bytes first saved for it. "Prefill" of a page
whose key the model knows writes those same bytes (a model computes the same KV for the same
prefix); a new key's page gets fresh random bytes, and a page waiting for a load holds random
garbage. Pools are tiny so every tier overflows, and the memory L3 store evicts on its own.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache_model_child import Child, PageBytes, as_bytes, write_device_page
from kvtier import KVSpec
from kvtier.cache import CachePlanner, Plan, PlanResult, TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.page_allocator import PageAllocator
from kvtier.testing import fill_random
from kvtier.testing.contracts import raw_bytes

ONE, TWO = "one process", "two processes"
TWO_TESTS = ("TestTwoProcess", "two_process")     # names of the two-process layout's tests
L3_PAGES = 12
MAX_PARKED = 2          # requests started and not finished at once

# A prompt is a few page "symbols" (pages with equal symbol sequences share a prefix), maybe a
# partial tail, and how many of its leading pages the engine's own L1 holds (two processes;
# at most those whose bytes were saved before).
prompts = st.tuples(st.lists(st.integers(0, 2), min_size=0, max_size=5), st.integers(0, 1),
                    st.integers(0, 2))

# Two processes: book a plan's result as soon as it comes back (most often), or leave it for
# `complete_one` to book in any order.
books = st.integers(0, 3).map(bool)


@dataclass
class Request:
    """A request started (its hits looked up, their load submitted) and not finished."""

    tokens: list[int]
    keys: list[bytes]
    dev: list[int]                 # device pages the engine gave it
    start: int = 0                 # leading pages it had in L1 already
    match: Any = None              # one process: its match and fetch
    fetch: Any = None
    load: Plan | None = None       # two processes: its load plan


# ---------------------------------------------------------------------------------------------
# The two layouts. Each runs the same requests; `CacheModel` below holds the reference model.
# ---------------------------------------------------------------------------------------------
class OneProcess:
    """`TieredKVCache` over a device pool whose free pages the test hands out."""

    device_pages = 10
    host_pages = 6

    def __init__(self, m: "CacheModel"):
        self.m = m
        self.dpool = DeviceKVPool.empty(m.spec, self.device_pages)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, m.gen)
        self.page_bytes = PageBytes(self.dpool)
        self.alloc = PageAllocator(self.device_pages)
        self.cache = TieredKVCache.from_config(
            m.config(self.host_pages), device_pool=self.dpool,
            allocate_device_pages=self.alloc.alloc, free_device_pages=self.alloc.free)

    def take(self, n: int) -> list[int] | None:
        pages = self.alloc.alloc(n)
        if pages is None:
            self.cache.evict(n - self.alloc.free_count)
            pages = self.alloc.alloc(n)
        return pages

    def check_device(self, keys: list[bytes], pages: list[int], what: str) -> None:
        for key, p in zip(keys, pages):
            self.m.check(key, self.page_bytes(p), f"{what} {p}")

    # ----- requests -----------------------------------------------------------------------------
    def start(self, tokens: list[int], prefix: int, squeeze: bool,
              lose_l3: int | None) -> Request:
        c = self.cache
        m = c.match(tokens)
        self.check_device(m.keys, m.l1_pages, "L1 hit")
        if squeeze:                          # evict everything evictable while m holds pins
            c.evict(self.device_pages)
            c.evict(self.host_pages, tier="l2")
            self.check_device(m.keys, m.l1_pages, "pinned L1 hit after eviction")
            pages = c.pages()
            for key, p in zip(m.keys, m.l1_pages):
                assert pages[key][0] == p, "a pinned L1 page was evicted"
        if lose_l3 is not None and m.l3_count:   # the store loses an object after match
            first = m.l1_count + m.l2_count
            c.store.delete([m.keys[first + lose_l3 % m.l3_count]])
        want = m.pages_to_load
        dev = self.take(want)
        if dev is None:                     # L1 too full of pinned pages: load a shorter run
            dev = self.take(min(want, self.alloc.free_count)) or []
        return Request(tokens, m.keys, dev, m.l1_count, match=m, fetch=c.fetch(m, dev))

    def finish(self, req: Request, *, save: bool, book: bool, two_part: bool) -> None:
        c, m, h = self.cache, req.match, req.fetch
        h.wait()
        assert h.pages_loaded <= len(req.dev)
        first = m.l1_count
        self.check_device(m.keys[first:first + h.pages_loaded], h.device_pages, "fetched page")
        n2 = min(h.pages_loaded, m.l2_count)
        self.m.loaded["l1"] += m.l1_count
        self.m.loaded["l2"] += n2
        self.m.loaded["l3"] += h.pages_loaded - n2
        if save:
            need = len(m.keys) - first - h.pages_loaded
            spare = list(h.unused_pages[:need])
            more = self.take(need - len(spare))
            if more is not None:
                new = spare + more
                for key, p in zip(m.keys[first + h.pages_loaded:], new):   # "prefill"
                    write_device_page(self.dpool, p, self.m.page_data(key))
                res = c.commit(req.tokens, m.l1_pages + h.device_pages + new, match=m)
                assert res.new_pages + len(res.not_taken) <= len(m.keys)
        self.alloc.free(c.release(m))

    def prefetch(self, tokens: list[int], prefix: int, book: bool) -> None:
        m = self.cache.match(tokens)
        self.cache.prefetch(m)
        self.cache.release(m)

    # ----- other operations ---------------------------------------------------------------------
    def evict_l1(self, n: int) -> None:
        before = self.alloc.free_count
        got = self.cache.evict(n)
        assert 0 <= got <= n
        assert self.alloc.free_count == before + got

    def evict_l2(self, n: int, book: bool) -> None:
        assert 0 <= self.cache.evict(n, tier="l2") <= n

    def settle(self) -> None:
        assert self.cache.wait_idle(10)

    def l3_objects(self) -> None:
        """Read every object L3 holds for a known key into a spare host page and compare."""
        c = self.cache
        self.settle()
        if not c.host_pool.free_count:
            c.evict(1, tier="l2")
        if not c.host_pool.free_count:
            return
        page = c.host_pool.alloc(1)
        try:
            for key in self.m.ref:
                if c.store.batch_get([key], page) == [True]:
                    self.m.check(key, as_bytes(raw_bytes(c.host_pool.view[page[0]])),
                                 "L3 object")
        finally:
            c.host_pool.free(page)

    # ----- invariants ---------------------------------------------------------------------------
    def check_index(self) -> None:
        self.cache.check_invariants()

    def check_cached_pages(self) -> None:
        c = self.cache
        # under the cache's lock: a page the index lets go of in the background (an L3
        # write-back done) is not taken again (the rate probe's read) while it is compared
        with c._lock:
            for key, (d, h) in c.pages().items():
                if d is not None:
                    self.m.check(key, self.page_bytes(d), f"L1 page {d}")
                if h is not None:
                    self.m.check(key, as_bytes(raw_bytes(c.host_pool.view[h])),
                                 f"L2 page {h}")

    def check_accounting(self) -> None:
        # Every device page is free on the engine side, held by the cache as an L1 page, or
        # held by a request still active (given to its fetch and not taken); none leaked, none
        # double-owned. Every host page is free or an L2 page.
        self.settle()
        c = self.cache
        pages = c.pages()
        l1 = {d for d, _ in pages.values() if d is not None}
        l2 = [h for _, h in pages.values() if h is not None]
        assert len(l1) == c.metrics()["l1_pages"]
        held = {d for r in self.m.parked for d in r.dev} - l1
        assert self.alloc.free_count + len(l1) + len(held) == self.device_pages
        assert c.host_pool.free_count + len(l2) == self.host_pages

    def check_idle(self) -> None:
        self.settle()
        self.cache.check_invariants(idle=not self.m.parked)

    def drain(self) -> None:
        self.settle()

    def close(self) -> None:
        self.cache.close()
        assert self.cache.metrics().get("store_errors", 0) == 0


class TwoProcesses:
    """A `CachePlanner` here, its `CacheExecutor` in a child process (the engine's worker)."""

    device_pages = 16
    host_pages = 5

    def __init__(self, m: "CacheModel", child: Child):
        self.m = m
        self.child = child
        cfg = m.config(self.host_pages)
        layout = child.call("reset", cfg, m.spec, self.device_pages, self.host_pages, 11)
        self.pl = CachePlanner(cfg, spec=m.spec, device_layout=layout,
                               num_host_pages=self.host_pages, l3_exists=self.l3_exists)
        self.plans: dict[int, Plan] = {}            # sent, not booked yet
        self.results: dict[int, PlanResult] = {}    # come back from the child
        # saves the child reports in two results: the second (their L3 writes) of each
        self.two_part: set[int] = set()
        self.booked_first: set[int] = set()
        self.finals: dict[int, PlanResult] = {}

    def l3_exists(self, keys: list[bytes]) -> int:
        return self.child.call("exists", list(keys))

    def busy(self) -> set[int]:
        """Device pages an active request holds or a plan not booked yet names."""
        out = {d for r in self.m.parked for d in r.dev}
        for plan in self.plans.values():
            out |= set(plan.device_pages)
        return out

    def free_device(self, n: int) -> list[int] | None:
        busy = self.busy()
        free = [p for p in range(self.device_pages) if p not in busy]
        return free[:n] if len(free) >= n else None

    def write(self, pages: list[int], datas: list[bytes]) -> None:
        if pages:
            self.child.call("write_device", pages, datas)

    # ----- plans --------------------------------------------------------------------------------
    def send(self, plan: Plan, book: bool = False) -> None:
        self.child.call("submit", plan)
        self.plans[plan.plan_id] = plan
        if book:
            self.book(plan.plan_id)

    def result(self, pid: int) -> PlanResult:
        """Plan ``pid``'s result, once the child has finished it (results that come back
        meanwhile are kept: the planner books them when the rules say)."""
        if pid not in self.results:
            self.arrived(self.child.call("wait", pid, 10))
        return self.results[pid]

    def arrived(self, results: list[PlanResult]) -> None:
        for res in results:
            assert isinstance(res, PlanResult), res
            assert not res.held_host_pages, f"a store call passed its deadline: {res}"
            pid = res.plan_id
            if pid in self.two_part:            # a save's second result: its L3 writes
                assert pid not in self.finals and not res.writes_pending, res
                self.finals[pid] = res
                continue
            assert pid not in self.results, res
            self.results[pid] = res
            if res.writes_pending:
                self.two_part.add(pid)

    def book(self, pid: int) -> None:
        """Book plan ``pid``'s result; for a save reported in two, the first call books its
        backups (the plan stays outstanding, for its writes) and the second its writes."""
        if pid in self.two_part and pid in self.booked_first:
            self.booked_first.discard(pid)
            if pid not in self.finals:
                self.arrived(self.child.call("wait", pid, 10))
            self.two_part.discard(pid)
            del self.plans[pid]
            self.pl.complete(self.finals.pop(pid))
            return
        res = self.result(pid)
        if res.writes_pending:          # what is left to book has no device page
            self.booked_first.add(pid)
            self.plans[pid] = Plan(pid, l3_writes=self.plans[pid].l3_writes)
        else:
            del self.plans[pid]
        self.pl.complete(res)

    # ----- requests -----------------------------------------------------------------------------
    def start(self, tokens: list[int], prefix: int, squeeze: bool,
              lose_l3: int | None) -> Request | None:
        keys = self.pl.keys(tokens)
        dev = self.free_device(len(keys))
        if dev is None:
            return None
        start = min(prefix, self.m.known_prefix(keys))
        hit = self.pl.lookup(keys, start)
        if lose_l3 is not None and hit.l3_pages:     # the store loses an object after lookup
            self.child.call("delete", [keys[start + hit.l2_pages + lose_l3 % hit.l3_pages]])
        # the engine's L1 holds the prefix; the other pages hold garbage until loaded or
        # prefilled
        self.write(dev, [self.m.ref[k] for k in keys[:start]]
                   + [self.m.random_page() for _ in keys[start:]])
        req = Request(tokens, keys, dev, start)
        if hit.pages:
            req.load = self.pl.plan_load(keys, dev[start:start + hit.pages], start)
            self.send(req.load)
        if squeeze:                     # evict everything evictable while the load runs
            self.send(self.pl.plan_evict(self.host_pages))
        return req

    def finish(self, req: Request, *, save: bool, book: bool, two_part: bool) -> None:
        loaded = 0
        plan = req.load
        if plan is not None:
            res = self.result(plan.plan_id)
            keys = req.keys[req.start:req.start + len(plan.load_pages)]
            ok = [(k, d) for k, d, good in zip(keys, plan.load_pages, res.load_results) if good]
            got = self.child.call("read_device", [d for _, d in ok])
            for (key, d), data in zip(ok, got):
                self.m.check(key, data, f"loaded device page {d}")
            read = {hp for _, hp in plan.l3_reads}
            for (hp, _), good in zip(plan.loads, res.loads):
                if good:
                    self.m.loaded["l3" if hp in read else "l2"] += 1
            loaded = res.loaded_prefix
            if book and plan.plan_id in self.plans:
                self.book(plan.plan_id)
        if not save:
            return
        first = req.start + loaded                       # "prefill" of the rest
        self.write(req.dev[first:], [self.m.page_data(k) for k in req.keys[first:]])
        plan = self.pl.plan_save(req.keys, req.dev)
        if two_part:
            # as vLLM's worker: the executor reports the backups as soon as they land (their
            # pages hit from here), the L3 writes in a second result booked whenever the
            # rules say
            pid = plan.plan_id
            self.child.call("submit", plan, True)
            self.plans[pid] = plan
            self.arrived(self.child.call("wait_backups", pid, 10))
            self.book(pid)
            if book and pid in self.plans:
                self.book(pid)
        else:
            self.send(plan, book)

    def prefetch(self, tokens: list[int], prefix: int, book: bool) -> None:
        keys = self.pl.keys(tokens)
        start = min(prefix, self.m.known_prefix(keys))
        hit = self.pl.lookup(keys, start)
        if hit.l3_pages:
            self.send(self.pl.plan_prefetch(keys, start, hit.l3_pages), book)

    # ----- other operations ---------------------------------------------------------------------
    def evict_l2(self, n: int, book: bool) -> None:
        self.send(self.pl.plan_evict(n), book)

    def settle(self) -> None:
        self.arrived(self.child.call("wait", None, 10))

    def plan_lost(self, tokens: list[int]) -> None:
        keys = self.pl.keys(tokens)
        dev = self.free_device(len(keys))
        if dev is not None:
            self.pl.fail(self.pl.plan_load(keys, dev).plan_id)

    def l3_objects(self) -> None:
        """Read every object L3 holds for a known key, through a host page no plan uses."""
        self.settle()
        host = self.pl.host
        if not host.free_count:
            self.send(self.pl.plan_evict(1), book=True)
        if not host.free_count:
            return
        keys = list(self.m.ref)
        (hp,) = host.alloc(1)
        try:
            got = self.child.call("read_l3", keys, hp)
        finally:
            host.free([hp])
        for key, data in zip(keys, got):
            if data is not None:
                self.m.check(key, data, "L3 object")

    # ----- invariants ---------------------------------------------------------------------------
    def check_index(self) -> None:
        self.pl.check()

    def check_cached_pages(self) -> None:
        l2 = self.pl.l2_pages()
        got = self.child.call("read_host", list(l2.values()))
        for (key, hp), data in zip(l2.items(), got):
            self.m.check(key, data, f"L2 page {hp}")

    def check_accounting(self) -> None:
        # every host page is free, in L2, or filled by a plan not booked yet; the planner
        # waits for exactly the plans not booked
        inflight: set[int] = set()
        for plan in self.plans.values():
            inflight |= {hp for _, hp in plan.l3_reads} | {hp for _, hp in plan.backups}
        l2 = set(self.pl.l2_pages().values())
        assert not (l2 & inflight)
        assert self.pl.host.free_count + len(l2) + len(inflight) == self.host_pages
        assert set(self.pl.pending_plans()) == {abs(pid) for pid in self.plans}

    def check_idle(self) -> None:
        if self.m.parked or self.plans:
            return
        assert self.pl.pending_plans() == []
        pinned = [nd for nd in self.pl.index.nodes.values() if nd.l2_pins]
        assert not pinned, f"pages still pinned with no plan outstanding: {pinned}"
        assert self.pl.metrics()["l2_pinned_pages"] == 0

    def drain(self) -> None:
        while self.plans:
            self.book(min(self.plans))

    def close(self) -> None:
        assert self.child.call("close") == 0, "the executor's store calls failed"
        assert self.pl.metrics().get("store_errors", 0) == 0, "the planner's L3 lookups failed"


# ---------------------------------------------------------------------------------------------
# The model and its rules
# ---------------------------------------------------------------------------------------------
#: The executor process of the two-process layout: one for this module, reset per example.
executor_process = Child()


@pytest.fixture(autouse=True, scope="module")
def _executor_process(request):
    """Start the executor process as the module starts, if a two-process test will run (it
    imports torch meanwhile), and stop it when the module's tests are done."""
    if any(item.path == request.path and any(name in item.nodeid for name in TWO_TESTS)
           for item in request.session.items):
        executor_process.start()
    yield
    executor_process.stop()


def one_process(self: "CacheModel") -> bool:
    return self.layout == ONE


def two_processes(self: "CacheModel") -> bool:
    return self.layout == TWO


class CacheModel(RuleBasedStateMachine):
    layout = ONE
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float16")
    host_layout = "page_first"
    write_policy = "write_through"
    prefetch_policy = "wait_complete"

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1234)
        self.ref: dict[bytes, bytes] = {}
        self.loaded = {"l1": 0, "l2": 0, "l3": 0}       # pages loaded and verified, by tier
        self.parked: list[Request] = []
        if self.layout == ONE:
            self.drv: Any = OneProcess(self)
        else:
            self.drv = TwoProcesses(self, executor_process)

    def config(self, host_pages: int) -> dict:
        return {"model_id": "cache-model", "host_pool_pages": host_pages,
                "host_layout": self.host_layout, "l3_store": "memory",
                "l3_config": {"capacity_bytes": L3_PAGES * self.spec.page_bytes},
                "write_policy": self.write_policy, "selective_threshold": 1,
                "prefetch_policy": self.prefetch_policy, "prefetch_timeout_base_s": 2.0,
                "prefetch_timeout_cap_s": 2.0, "l3_io_threads": 1, "l3_batch_pages": 3}

    # ----- the reference model ------------------------------------------------------------------
    def tokens(self, prompt: tuple[list[int], int, int]) -> list[int]:
        syms, tail, _ = prompt
        toks = [t for s in syms for t in (3 * s + 1, 3 * s + 2)]
        return toks + [99] * tail

    def random_page(self) -> bytes:
        return as_bytes(torch.randint(1, 256, (self.spec.page_bytes,), dtype=torch.uint8,
                                      generator=self.gen))

    def page_data(self, key: bytes) -> bytes:
        """The "prefill" of ``key``'s page: what was saved for it, or fresh random bytes."""
        data = self.ref.get(key)
        if data is None:
            data = self.ref[key] = self.random_page()
        return data

    def known_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.ref:
            n += 1
        return n

    def check(self, key: bytes, data: bytes, what: str) -> None:
        want = self.ref.get(key)
        assert want is not None, f"{what}: a page for a key never saved"
        assert data == want, f"{what} differs from what was saved for its key"

    # ----- rules --------------------------------------------------------------------------------
    def run_request(self, prompt, *, save: bool = True, squeeze: bool = False,
                    lose_l3: int | None = None, book: bool = True,
                    two_part: bool = False) -> None:
        req = self.drv.start(self.tokens(prompt), prompt[2], squeeze, lose_l3)
        if req is not None:
            self.drv.finish(req, save=save, book=book, two_part=two_part)

    @rule(prompt=prompts, book=books)
    def request(self, prompt, book):
        self.run_request(prompt, book=book)

    @precondition(lambda self: len(self.parked) < MAX_PARKED)
    @rule(prompt=prompts, squeeze=st.booleans(), lose_l3=st.none() | st.integers(0, 4))
    def start_request(self, prompt, squeeze, lose_l3):
        """Look up, submit the load, and leave the request active while other rules run."""
        req = self.drv.start(self.tokens(prompt), prompt[2], squeeze, lose_l3)
        if req is not None:
            self.parked.append(req)

    @precondition(lambda self: self.parked)
    @rule(data=st.data(), book=books)
    def finish_one(self, data, book):
        """Wait for an active request's load, check it, prefill the rest, save, release."""
        req = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1), label="request"))
        self.drv.finish(req, save=True, book=book, two_part=False)

    @rule(prompt=prompts, book=books)
    def request_under_eviction(self, prompt, book):
        self.run_request(prompt, squeeze=True, book=book)

    @rule(prompt=prompts, k=st.integers(0, 4), book=books)
    def request_with_l3_loss(self, prompt, k, book):
        self.run_request(prompt, lose_l3=k, book=book)

    @rule(prompt=prompts, book=books)
    def lookup_only(self, prompt, book):
        self.run_request(prompt, save=False, book=book)

    @rule(prompt=prompts, book=books)
    def prefetch_then_request(self, prompt, book):
        self.drv.prefetch(self.tokens(prompt), prompt[2], book)
        self.run_request(prompt, book=book)

    @precondition(two_processes)
    @rule(prompt=prompts, book=books)
    def request_saved_in_two_parts(self, prompt, book):
        self.run_request(prompt, book=book, two_part=True)

    @precondition(one_process)
    @rule(n=st.integers(1, OneProcess.device_pages))
    def evict_l1(self, n):
        self.drv.evict_l1(n)

    @rule(n=st.integers(0, 6), book=books)
    def evict_l2(self, n, book):
        self.drv.evict_l2(n, book)

    @rule()
    def settle(self):
        self.drv.settle()

    @precondition(lambda self: two_processes(self) and self.drv.plans)
    @rule(data=st.data())
    def complete_one(self, data):
        """Book one result the executor sent (or will send), in any order."""
        self.drv.book(data.draw(st.sampled_from(sorted(self.drv.plans)), label="plan"))

    @precondition(two_processes)
    @rule(prompt=prompts)
    def plan_lost(self, prompt):
        """A plan made but never sent (its worker gone): failed, everything comes back."""
        self.drv.plan_lost(self.tokens(prompt))

    @precondition(lambda self: self.ref)
    @rule()
    def l3_objects_are_committed_bytes(self):
        self.drv.l3_objects()

    # ----- invariants ---------------------------------------------------------------------------
    @invariant()
    def index_is_consistent(self):
        self.drv.check_index()

    @invariant()
    def cached_pages_are_committed_bytes(self):
        self.drv.check_cached_pages()

    @invariant()
    def pages_are_accounted_for(self):
        self.drv.check_accounting()

    @invariant()
    def nothing_pinned_between_requests(self):
        self.drv.check_idle()

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            # a step failed: that is the failure to report, not what a half-done request
            # leaves behind
            with contextlib.suppress(Exception):
                self.drv.close()
            return
        try:       # finish every request, book every plan: then nothing may stay pinned
            while self.parked:
                self.drv.finish(self.parked.pop(0), save=True, book=True, two_part=False)
            self.drv.drain()
            self.drv.check_index()
            self.drv.check_idle()
        finally:
            self.drv.close()


class WriteThrough:
    pass


class WriteBack:
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=6, rope_dim=2, page_size=3, dtype="bfloat16")
    host_layout = "layer_first"
    write_policy = "write_back"
    prefetch_policy = "timeout"


class Selective:
    spec = KVSpec.mha(num_layers=1, num_kv_heads=2, head_dim=3, page_size=1, dtype="float32")
    write_policy = "write_through_selective"
    prefetch_policy = "best_effort"


class OneProcessWriteThrough(WriteThrough, CacheModel):
    layout = ONE


class OneProcessWriteBack(WriteBack, CacheModel):
    layout = ONE


class OneProcessSelective(Selective, CacheModel):
    layout = ONE


class TwoProcessWriteThrough(WriteThrough, CacheModel):
    layout = TWO


class TwoProcessWriteBack(WriteBack, CacheModel):
    layout = TWO


class TwoProcessSelective(Selective, CacheModel):
    layout = TWO


_settings = settings(max_examples=16, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])

TestOneProcessWriteThrough = OneProcessWriteThrough.TestCase
TestOneProcessWriteBack = OneProcessWriteBack.TestCase
TestOneProcessSelective = OneProcessSelective.TestCase
TestTwoProcessWriteThrough = TwoProcessWriteThrough.TestCase
TestTwoProcessWriteBack = TwoProcessWriteBack.TestCase
TestTwoProcessSelective = TwoProcessSelective.TestCase
for _case in (TestOneProcessWriteThrough, TestOneProcessWriteBack, TestOneProcessSelective,
              TestTwoProcessWriteThrough, TestTwoProcessWriteBack, TestTwoProcessSelective):
    _case.settings = _settings
del _case


def test_the_model_reaches_every_tier():
    """The model is only meaningful if loads really come from L2 and L3: drive one fixed
    sequence in one process and check that each tier served pages that were verified."""
    m = OneProcessWriteThrough()
    try:
        p = ([0, 1, 2, 1], 1, 0)
        m.request(p, True)
        m.settle()
        m.request(p, True)                    # L1 hits
        m.evict_l1(OneProcess.device_pages)
        m.request(p, True)                    # L2 hits
        m.evict_l1(OneProcess.device_pages)
        m.settle()
        m.evict_l2(OneProcess.host_pages, True)
        m.request(p, True)                    # L3 hits
        m.l3_objects_are_committed_bytes()
        m.index_is_consistent()
        m.cached_pages_are_committed_bytes()
        m.pages_are_accounted_for()
        assert m.loaded["l1"] >= 4 and m.loaded["l2"] >= 4 and m.loaded["l3"] >= 4, m.loaded
    finally:
        m.teardown()


def test_the_two_process_model_reaches_l2_and_l3():
    """The same in two processes (L1 is the engine's): loads served from L2, then from L3,
    verified in the executor's device pool."""
    m = TwoProcessWriteThrough()
    try:
        p = ([0, 1, 2, 1], 1, 0)
        m.request(p, True)                    # saved: backed up to L2, written to L3
        m.request(p, True)                    # L2 hits
        m.evict_l2(TwoProcesses.host_pages, True)
        m.request(p, True)                    # L3 hits
        m.l3_objects_are_committed_bytes()
        m.index_is_consistent()
        m.cached_pages_are_committed_bytes()
        m.pages_are_accounted_for()
        assert m.loaded["l2"] >= 4 and m.loaded["l3"] >= 4, m.loaded
    finally:
        m.teardown()
