"""Model-based test of the tiered cache: after any sequence of requests (match, fetch,
prefill, commit, release), lookups and evictions, every page the cache holds or loads into
L1 is bitwise what was committed for that prefix -- whichever tier it came from.

The reference model is the map page key -> the bytes first committed for it. "Prefill" of a
page already in the model writes those same bytes (a model computes the same KV for the same
prefix); a new page gets fresh random bytes. Pools are tiny so every tier overflows, and the
memory L3 store evicts on its own.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import KVSpec
from kvtier.cache import TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.page_allocator import PageAllocator
from kvtier.testing import fill_random
from kvtier.testing.contracts import raw_bytes

DEVICE_PAGES = 10
HOST_PAGES = 6
L3_PAGES = 12

# A prompt is a few page "symbols" (pages with equal symbol sequences share a prefix) and
# maybe a partial tail.
prompts = st.tuples(st.lists(st.integers(0, 2), min_size=0, max_size=5),
                    st.integers(0, 1))


def device_page_bytes(pool: DeviceKVPool, page: int) -> torch.Tensor:
    spec = pool.spec
    return torch.cat([raw_bytes(pool.page(c, layer, page)) for layer in range(spec.num_layers)
                      for c in range(spec.num_components)])


def write_device_page(pool: DeviceKVPool, page: int, data: torch.Tensor) -> None:
    spec = pool.spec
    off = 0
    for layer in range(spec.num_layers):
        for c in range(spec.num_components):
            view = pool.page(c, layer, page)
            n = view.numel() * view.element_size()
            view.view(-1).view(torch.uint8).copy_(data[off:off + n])
            off += n


class CacheMachine(RuleBasedStateMachine):
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float16")
    host_layout = "page_first"
    write_policy = "write_through"
    prefetch_policy = "wait_complete"

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1234)
        self.dpool = DeviceKVPool.empty(self.spec, DEVICE_PAGES)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, self.gen)
        self.alloc = PageAllocator(DEVICE_PAGES)
        self.cache = TieredKVCache.from_config(
            {"model_id": "stateful", "host_pool_pages": HOST_PAGES,
             "host_layout": self.host_layout, "l3_store": "memory",
             "l3_config": {"capacity_bytes": L3_PAGES * self.spec.page_bytes},
             "write_policy": self.write_policy, "selective_threshold": 1,
             "prefetch_policy": self.prefetch_policy, "prefetch_timeout_base_s": 2.0,
             "prefetch_timeout_cap_s": 2.0, "l3_io_threads": 1, "l3_batch_pages": 3},
            device_pool=self.dpool, allocate_device_pages=self.alloc.alloc,
            free_device_pages=self.alloc.free)
        self.ref: dict[bytes, torch.Tensor] = {}
        self.loaded = {"l1": 0, "l2": 0, "l3": 0}

    # ----- helpers ----------------------------------------------------------------------------
    def tokens(self, prompt: tuple[list[int], int]) -> list[int]:
        syms, tail = prompt
        toks = [t for s in syms for t in (3 * s + 1, 3 * s + 2)]
        return toks + [99] * tail

    def take(self, n: int) -> list[int] | None:
        pages = self.alloc.alloc(n)
        if pages is None:
            self.cache.evict(n - self.alloc.free_count)
            pages = self.alloc.alloc(n)
        return pages

    def check_pages(self, keys: list[bytes], pages: list[int], what: str) -> None:
        for key, p in zip(keys, pages):
            want = self.ref.get(key)
            assert want is not None, f"{what}: page for a key never committed"
            got = device_page_bytes(self.dpool, p)
            assert torch.equal(got, want), f"{what}: device page {p} differs from the commit"

    def lookup(self, tokens: list[int], commit: bool, *, squeeze: bool = False,
               lose_l3: int | None = None) -> None:
        c = self.cache
        m = c.match(tokens)
        self.check_pages(m.keys, m.l1_pages, "L1 hit")
        if squeeze:                          # evict everything evictable while m holds pins
            c.evict(DEVICE_PAGES)
            c.evict(HOST_PAGES, tier="l2")
            self.check_pages(m.keys, m.l1_pages, "pinned L1 hit after eviction")
            pages = c.pages()
            for key, p in zip(m.keys, m.l1_pages):
                assert pages[key][0] == p, "a pinned L1 page was evicted"
        if lose_l3 is not None and m.l3_count:   # the store loses an object after match
            start = m.l1_count + m.l2_count
            c.store.delete([m.keys[start + lose_l3 % m.l3_count]])
        want = m.pages_to_load
        dev = self.take(want)
        if dev is None:                     # L1 too full of pinned pages: load a shorter run
            dev = self.take(min(want, self.alloc.free_count)) or []
        h = c.fetch(m, dev)
        h.wait()
        assert h.pages_loaded <= len(dev)
        first = m.l1_count
        self.check_pages(m.keys[first:first + h.pages_loaded], h.device_pages, "fetched")
        n2 = min(h.pages_loaded, m.l2_count)
        self.loaded["l1"] += m.l1_count
        self.loaded["l2"] += n2
        self.loaded["l3"] += h.pages_loaded - n2
        if commit:
            need = len(m.keys) - first - h.pages_loaded
            spare = list(h.unused_pages[:need])
            more = self.take(need - len(spare))
            if more is not None:
                new = spare + more
                for key, p in zip(m.keys[first + h.pages_loaded:], new):   # "prefill"
                    data = self.ref.get(key)
                    if data is None:
                        data = torch.randint(1, 256, (self.spec.page_bytes,),
                                             dtype=torch.uint8, generator=self.gen)
                        self.ref[key] = data
                    write_device_page(self.dpool, p, data)
                res = c.commit(tokens, m.l1_pages + h.device_pages + new, match=m)
                assert res.new_pages + len(res.not_taken) <= len(m.keys)
        self.alloc.free(c.release(m))

    # ----- rules ------------------------------------------------------------------------------
    @rule(prompt=prompts)
    def request(self, prompt):
        self.lookup(self.tokens(prompt), commit=True)

    @rule(prompt=prompts)
    def request_under_eviction(self, prompt):
        self.lookup(self.tokens(prompt), commit=True, squeeze=True)

    @rule(prompt=prompts, k=st.integers(0, 4))
    def request_with_l3_loss(self, prompt, k):
        self.lookup(self.tokens(prompt), commit=True, lose_l3=k)

    @rule(prompt=prompts)
    def lookup_only(self, prompt):
        self.lookup(self.tokens(prompt), commit=False)

    @rule(prompt=prompts)
    def prefetch_then_request(self, prompt):
        tokens = self.tokens(prompt)
        m = self.cache.match(tokens)
        self.cache.prefetch(m)
        self.cache.release(m)
        self.lookup(tokens, commit=True)

    @rule(n=st.integers(1, DEVICE_PAGES))
    def evict_l1(self, n):
        before = self.alloc.free_count
        got = self.cache.evict(n)
        assert 0 <= got <= n
        assert self.alloc.free_count == before + got

    @rule(n=st.integers(1, HOST_PAGES))
    def evict_l2(self, n):
        assert 0 <= self.cache.evict(n, tier="l2") <= n

    @rule()
    def settle(self):
        assert self.cache.wait_idle(10)

    @precondition(lambda self: self.ref)
    @rule()
    def l3_objects_are_committed_bytes(self):
        """Read every object L3 holds for a known key into a spare host page and compare."""
        c = self.cache
        assert c.wait_idle(10)
        if not c.host_pool.free_count:
            c.evict(1, tier="l2")
        if not c.host_pool.free_count:
            return
        page = c.host_pool.alloc(1)
        try:
            for key, want in self.ref.items():
                if c.store.batch_get([key], page) == [True]:
                    got = raw_bytes(c.host_pool.view[page[0]])
                    assert torch.equal(got, want), "L3 object differs from the commit"
        finally:
            c.host_pool.free(page)

    # ----- invariants -------------------------------------------------------------------------
    @invariant()
    def index_is_consistent(self):
        self.cache.check_invariants()

    @invariant()
    def cached_pages_are_committed_bytes(self):
        c = self.cache
        pages = c.pages()
        l1 = [(k, d) for k, (d, _) in pages.items() if d is not None]
        l2 = [(k, h) for k, (_, h) in pages.items() if h is not None]
        for key, p in l1:
            assert torch.equal(device_page_bytes(self.dpool, p), self.ref[key]), \
                f"L1 page {p} differs from the commit"
        for key, p in l2:
            assert torch.equal(raw_bytes(c.host_pool.view[p]), self.ref[key]), \
                f"L2 page {p} differs from the commit"

    @invariant()
    def device_pages_are_accounted_for(self):
        # Between rules no request is active: every device page is either free on the engine
        # side or held by the cache as an L1 page; none leaked, none double-owned.
        assert self.alloc.free_count + self.cache.metrics()["l1_pages"] == DEVICE_PAGES

    @invariant()
    def nothing_pinned_between_requests(self):
        assert self.cache.wait_idle(10)
        self.cache.check_invariants(idle=True)

    def teardown(self) -> None:
        self.cache.close()
        assert self.cache.metrics().get("store_errors", 0) == 0


_settings = settings(max_examples=35, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


class WriteThroughMachine(CacheMachine):
    pass


class WriteBackMachine(CacheMachine):
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=6, rope_dim=2, page_size=3, dtype="bfloat16")
    host_layout = "layer_first"
    write_policy = "write_back"
    prefetch_policy = "timeout"


class SelectiveMachine(CacheMachine):
    spec = KVSpec.mha(num_layers=1, num_kv_heads=2, head_dim=3, page_size=1, dtype="float32")
    write_policy = "write_through_selective"
    prefetch_policy = "best_effort"


TestWriteThrough = WriteThroughMachine.TestCase
TestWriteThrough.settings = _settings
TestWriteBack = WriteBackMachine.TestCase
TestWriteBack.settings = _settings
TestSelective = SelectiveMachine.TestCase
TestSelective.settings = _settings


def test_the_model_reaches_every_tier():
    """The machine above is only meaningful if loads really come from L2 and L3: drive one
    fixed sequence and check that each tier served pages that were verified."""
    m = WriteThroughMachine()
    try:
        p = ([0, 1, 2, 1], 1)
        m.request(p)
        m.settle()
        m.request(p)                      # L1 hits
        m.evict_l1(DEVICE_PAGES)
        m.request(p)                      # L2 hits
        m.evict_l1(DEVICE_PAGES)
        m.settle()
        m.evict_l2(HOST_PAGES)
        m.request(p)                      # L3 hits
        m.l3_objects_are_committed_bytes()
        m.index_is_consistent()
        m.cached_pages_are_committed_bytes()
        assert m.loaded["l1"] >= 4 and m.loaded["l2"] >= 4 and m.loaded["l3"] >= 4, m.loaded
    finally:
        m.teardown()
