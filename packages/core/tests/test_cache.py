"""TieredKVCache: round trips from every tier, commit/release ownership, pins, eviction,
write and prefetch policies, concurrency and shutdown."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheConfig, FetchHandle, Match, TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import InvalidArgumentError, PageIndexError, TokensError
from kvtier.l3_stores.memory import MemoryStore
from kvtier.page_allocator import PageAllocator
from kvtier.testing import fill_random, random_specs
from kvtier.testing.contracts import raw_bytes
from kvtier.testing.data import spec_id

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")


class GatedHandle:
    """A transfer handle that lands only once ``gate`` is set."""

    def __init__(self, h, gate: threading.Event):
        self.h = h
        self.gate = gate

    def synchronize(self):
        self.gate.wait(10)
        self.h.synchronize()

    def wait(self):
        self.synchronize()

    def wait_layer(self, i):
        self.synchronize()

    def done(self):
        return self.gate.is_set() and self.h.done()


def gate_transfers(cache: TieredKVCache, direction: str) -> threading.Event:
    """Make the cache engine's ``direction`` ("load" or "backup") copies wait for the event
    returned."""
    gate = threading.Event()
    real = getattr(cache.engine, direction)
    setattr(cache.engine, direction, lambda a, b: GatedHandle(real(a, b), gate))
    return gate


class Rig:
    """A cache plus the engine side: a device pool, a page allocator, and 'prefill' that
    writes random bytes into pages and remembers them per page key."""

    def __init__(self, spec: KVSpec = SPEC, device_pages: int = 24, *, store: Any = None,
                 **config: Any):
        self.spec = spec
        self.gen = torch.Generator().manual_seed(7)
        self.dpool = DeviceKVPool.empty(spec, device_pages)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, self.gen)
        self.alloc = PageAllocator(device_pages)
        cfg = {"model_id": "test", "host_pool_pages": 16, "l3_io_threads": 1}
        cfg.update(config)
        self.cache = TieredKVCache.from_config(
            cfg, device_pool=self.dpool, allocate_device_pages=self.alloc.alloc,
            free_device_pages=self.alloc.free, store=store)
        self.ref: dict[bytes, torch.Tensor] = {}

    def page_bytes(self, page: int) -> torch.Tensor:
        s = self.spec
        return torch.cat([raw_bytes(self.dpool.page(c, layer, page))
                          for layer in range(s.num_layers) for c in range(s.num_components)])

    def take(self, n: int) -> list[int]:
        pages = self.alloc.alloc(n)
        if pages is None:
            self.cache.evict(n - self.alloc.free_count)
            pages = self.alloc.alloc(n)
        assert pages is not None
        return pages

    def prefill(self, keys: list[bytes], pages: list[int]) -> None:
        """'Compute' pages: the same prefix always gives the same bytes (as a model would);
        a new prefix gets fresh random bytes."""
        s = self.spec
        for key, p in zip(keys, pages):
            want = self.ref.get(key)
            if want is None:
                for layer in range(s.num_layers):
                    for c in range(s.num_components):
                        fill_random(self.dpool.page(c, layer, p), self.gen)
                self.ref[key] = self.page_bytes(p)
                continue
            off = 0
            for layer in range(s.num_layers):
                for c in range(s.num_components):
                    flat = self.dpool.page(c, layer, p).view(-1).view(torch.uint8)
                    flat.copy_(want[off:off + flat.numel()])
                    off += flat.numel()

    def request(self, tokens: list[int], *, release: bool = True) -> tuple[Match, FetchHandle]:
        c = self.cache
        m = c.match(tokens)
        h = c.fetch(m, self.take(m.pages_to_load))
        h.wait()
        self.verify(m.keys, m.l1_pages)
        self.verify(m.keys[m.l1_count:], h.device_pages)
        n = len(m.keys) - m.l1_count - h.pages_loaded
        new = self.take(n)
        self.prefill(m.keys[len(m.keys) - n:], new)
        c.commit(tokens, m.l1_pages + h.device_pages + new, match=m)
        if release:
            self.alloc.free(c.release(m))
        return m, h

    def verify(self, keys: list[bytes], pages: list[int]) -> None:
        for key, p in zip(keys, pages):
            assert torch.equal(self.page_bytes(p), self.ref[key]), f"page {p} differs"

    def l1_only_to_l2(self) -> None:
        self.cache.wait_idle()
        self.cache.evict(10_000)

    def close(self) -> None:
        self.cache.close()


@pytest.fixture
def rig():
    r = Rig(l3_store="memory", prefetch_policy="wait_complete")
    yield r
    r.close()


def toks(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------
# Round trips from every tier
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("spec", random_specs(), ids=spec_id)
def test_every_tier_returns_the_committed_bytes(spec, layout, tmp_path):
    r = Rig(spec, device_pages=20, host_pool_pages=12, host_layout=layout, l3_store="file",
            l3_config={"root": str(tmp_path / "l3")}, prefetch_policy="wait_complete")
    try:
        t = toks(5 * spec.page_size + spec.page_size - 1, seed=spec.page_size)
        m, _ = r.request(t)
        assert (m.l1_count, m.l2_count, m.l3_count) == (0, 0, 0)
        r.cache.wait_idle()
        m, _ = r.request(t)
        assert m.l1_count == 5                                  # L1 hits (verified inside)
        r.l1_only_to_l2()
        m, h = r.request(t)
        assert (m.l1_count, m.l2_count, h.pages_loaded) == (0, 5, 5)
        r.l1_only_to_l2()
        r.cache.evict(100, tier="l2")
        m, h = r.request(t)
        assert (m.l1_count, m.l2_count, m.l3_count, h.pages_loaded) == (0, 0, 5, 5)
        r.cache.check_invariants()
        mt = r.cache.metrics()
        assert mt["l1_hit_pages"] == 5 and mt["l2_hit_pages"] == 5 and mt["l3_hit_pages"] == 5
    finally:
        r.close()


def test_mixed_tiers_in_one_match(rig):
    t = toks(8 * 4, seed=3)
    rig.request(t)
    rig.cache.wait_idle()
    rig.cache.evict(3)                       # the last 3 pages leave L1 (leaves first)
    rig.cache.wait_idle()
    rig.cache.evict(1, tier="l2")            # drop the last page's L2 copy: L3 only now
    assert rig.cache.keys(t)[-1] not in rig.cache.pages()
    m = rig.cache.match(t)
    assert (m.l1_count, m.l2_count, m.l3_count) == (5, 2, 1), m
    rig.cache.release(m)
    m, h = rig.request(t)
    assert h.pages_loaded == 3
    assert m.num_tokens_hit() == 32 and m.num_tokens_hit("l1") == 20
    assert m.num_tokens_hit("l3") == 4


def test_wait_layer_and_done(rig):
    t = toks(6 * 4, seed=4)
    rig.request(t)
    rig.l1_only_to_l2()
    m = rig.cache.match(t)
    h = rig.cache.fetch(m, rig.take(m.pages_to_load))
    for layer in range(SPEC.num_layers):
        h.wait_layer(layer)
    deadline = time.time() + 5
    while not h.done():
        assert time.time() < deadline
    rig.verify(m.keys, h.device_pages)
    assert h.tokens_loaded == 24
    rig.alloc.free(rig.cache.release(m))


# ---------------------------------------------------------------------------------------------
# commit / release ownership
# ---------------------------------------------------------------------------------------------
def test_commit_takes_new_pages_and_leaves_duplicates_to_the_engine(rig):
    c = rig.cache
    t = toks(4 * 4, seed=5)
    a = rig.take(4)
    rig.prefill(c.keys(t), a)
    res = c.commit(t, a)
    assert res.new_pages == 4 and list(res.taken) == a and not res.not_taken
    b = rig.take(4)                          # the same tokens computed again elsewhere
    res = c.commit(t, b)
    assert res.new_pages == 0 and list(res.not_taken) == b
    rig.alloc.free(b)                        # still the engine's
    assert c.commit(t, a).new_pages == 0     # re-committing the cache's own pages: no-op
    c.check_invariants()


def test_release_returns_exactly_the_engine_pages(rig):
    c = rig.cache
    t = toks(5 * 4, seed=6)
    rig.request(t)
    rig.l1_only_to_l2()
    m = c.match(t + [1, 2, 3, 4])            # 5 L2 pages + 1 new page
    dev = rig.take(5)
    h = c.fetch(m, dev)
    h.wait()
    new = rig.take(1)
    extra = rig.take(2)                      # given to nobody: stays with the test
    c.commit(t + [1, 2, 3, 4], h.device_pages + new, match=m)
    assert c.release(m) == []                # the cache took every page it was given
    assert c.release(m) == []                # idempotent
    rig.alloc.free(extra)
    c.wait_idle()                            # backups in flight pin their source pages
    free_before = rig.alloc.free_count
    assert c.evict(10_000) == 6              # all 6 are the cache's now
    assert rig.alloc.free_count == free_before + 6


def test_release_without_commit_returns_fetch_pages(rig):
    c = rig.cache
    t = toks(3 * 4, seed=7)
    rig.request(t)
    rig.l1_only_to_l2()
    m = c.match(t)
    dev = rig.take(3)
    c.fetch(m, dev).wait()
    # loaded pages were taken into L1 (they hold the keys now), so nothing comes back
    assert c.release(m) == []
    m = c.match(t)
    assert m.l1_count == 3
    c.release(m)


def test_commit_rejects_bad_input_before_touching_anything(rig):
    c = rig.cache
    t = toks(3 * 4, seed=8)
    pages = rig.take(3)
    rig.prefill(c.keys(t), pages)
    c.commit(t, pages)
    other = toks(3 * 4, seed=9)
    with pytest.raises(InvalidArgumentError):
        c.commit(other, pages)               # pages the cache holds for other keys
    with pytest.raises(InvalidArgumentError):
        c.commit(other, rig.take(2))         # one page per full page
    with pytest.raises(PageIndexError):
        c.commit(other, [1, 1, 2])
    with pytest.raises(PageIndexError):
        c.commit(other, [0, 1, 10_000])
    with pytest.raises(TokensError):
        c.commit("not tokens", [])
    with pytest.raises(TokensError):
        c.match([1.5, 2.5])
    assert len(c.pages()) == 3
    c.check_invariants()


def test_fetch_and_match_misuse_are_typed_errors(rig):
    c = rig.cache
    t = toks(3 * 4, seed=10)
    rig.request(t)
    rig.l1_only_to_l2()
    m = c.match(t)
    with pytest.raises(InvalidArgumentError):
        c.fetch(m, rig.take(4))              # more pages than it can load
    l1_page = next((d for d, _ in c.pages().values() if d is not None), None)
    if l1_page is not None:
        with pytest.raises(InvalidArgumentError):
            c.fetch(m, [l1_page])            # a page the cache owns
    h = c.fetch(m, rig.take(3))
    h.wait()
    with pytest.raises(InvalidArgumentError):
        c.fetch(m, [])                       # twice
    c.release(m)
    with pytest.raises(InvalidArgumentError):
        c.fetch(m, [])                       # released
    with pytest.raises(InvalidArgumentError):
        c.prefetch(m)
    other = Rig(store=None)
    try:
        with pytest.raises(InvalidArgumentError):
            other.cache.fetch(c.match(t), [])   # a match of another cache
    finally:
        other.close()
    with pytest.raises(InvalidArgumentError):
        c.evict(-1)
    with pytest.raises(InvalidArgumentError):
        c.evict(1, tier="l4")


def test_fetch_allocates_through_the_callback_when_no_pages_given(rig):
    c = rig.cache
    t = toks(4 * 4, seed=11)
    rig.request(t)
    rig.l1_only_to_l2()
    m = c.match(t)
    free = rig.alloc.free_count
    h = c.fetch(m)
    h.wait()
    assert h.pages_loaded == 4 and rig.alloc.free_count == free - 4
    rig.verify(m.keys, h.device_pages)
    assert c.release(m) == []


# ---------------------------------------------------------------------------------------------
# Pins and eviction
# ---------------------------------------------------------------------------------------------
def test_pinned_pages_are_never_evicted(rig):
    c = rig.cache
    t = toks(6 * 4, seed=12)
    m, _ = rig.request(t, release=False)
    c.wait_idle()
    assert c.evict(100) == 0                 # every L1 page is in use
    assert c.evict(100, tier="l2") == 6      # their L2 copies are not in use: droppable
    rig.verify(c.keys(t), [c.pages()[k][0] for k in c.keys(t)])
    rig.alloc.free(c.release(m))
    assert c.evict(100) == 6


def test_eviction_takes_leaves_first_and_keeps_prefixes(rig):
    c = rig.cache
    base = toks(4 * 4, seed=13)
    a, b = base + toks(8, seed=14), base + toks(8, seed=15)
    rig.request(a)
    rig.request(b)
    c.wait_idle()
    keys_a, keys_b = c.keys(a), c.keys(b)
    # Touch a's branch last: b's tail is the least recently used leaf.
    m = c.match(a)
    c.release(m)
    assert c.evict(2) == 2
    pages = c.pages()
    assert pages[keys_b[-1]][0] is None and pages[keys_b[-2]][0] is None
    assert all(pages[k][0] is not None for k in keys_a)
    for _ in range(20):
        c.evict(1)
        c.check_invariants()                # L1 stays prefix-closed after every step
    assert all(d is None for d, _ in c.pages().values())


def test_l1_leaf_without_l2_copy_drops_its_l2_children_not_orphaning_them():
    # write_through_selective never backs up unhit pages: a parent may sit in L1 only while
    # its child lives in L2 only.
    r = Rig(host_pool_pages=4, write_policy="write_through_selective", selective_threshold=1)
    try:
        c = r.cache
        t = toks(3 * 4, seed=16)
        r.request(t)
        m = c.match(t)                      # hit once -> every page backed up
        c.release(m)
        c.wait_idle()
        k = c.keys(t)
        c.evict(1)                          # the leaf leaves L1 (it has an L2 copy)
        c.evict(1, tier="l2")               # now drop the middle page's L2 copy (L1-resident)
        c.check_invariants()
        c.evict(100)
        c.check_invariants()
        pages = c.pages()
        for i, key in enumerate(k):          # nothing left that lost its prefix
            assert key not in pages or i == 0 or k[i - 1] in pages
    finally:
        r.close()


def test_evicting_a_whole_chain_copies_nothing():
    # No L2 copies (the selective threshold is never reached): evicting the whole chain in
    # one call drops it; inner pages need no L2 copy since their children leave too.
    r = Rig(write_policy="write_through_selective", selective_threshold=5)
    try:
        c = r.cache
        r.request(toks(4 * 4, seed=17))
        c.wait_idle()
        assert c.evict(4) == 4
        mt = c.metrics()
        assert mt.get("l1_demotions", 0) == 0 and mt.get("bytes_d2h", 0) == 0
        assert not c.pages()
    finally:
        r.close()


def test_evict_waits_for_backups_in_flight_instead_of_coming_up_short():
    r = Rig(write_policy="write_through")
    try:
        c = r.cache
        gate = gate_transfers(c, "backup")    # backups land when the gate opens
        r.request(toks(4 * 4, seed=18))
        assert c.metrics()["backups_in_flight"] == 4
        threading.Timer(0.2, gate.set).start()
        t0 = time.perf_counter()
        assert c.evict(4) == 4                # waited for the copies, then evicted
        assert time.perf_counter() - t0 >= 0.15
        assert c.metrics()["backups_in_flight"] == 0
        m = c.match(toks(4 * 4, seed=18))
        assert m.l2_count == 4                # and the copies are in L2
        c.release(m)
        c.check_invariants()
    finally:
        r.close()


def test_l2_budget_is_honoured_and_full_l2_skips_backups():
    r = Rig(host_pool_pages=5, device_pages=40)
    try:
        c = r.cache
        ms = []
        for seed in range(4):                # pin 4 pages' L2 copies through matches
            t = toks(4, seed=100 + seed)
            r.request(t)
            c.wait_idle()
        r.l1_only_to_l2()
        for seed in range(4):
            ms.append(c.match(toks(4, seed=100 + seed)))    # L2 hits, pinned
        t = toks(3 * 4, seed=200)
        r.request(t)
        c.wait_idle()
        assert c.host_pool.free_count >= 0
        assert c.metrics()["l2_pages"] <= 5
        mt = c.metrics()
        assert mt["backup_skipped_pages"] >= 2           # only one free host page
        for m in ms:
            assert all(c.pages()[k][1] is not None for k in m.keys)
            r.alloc.free(c.release(m))
        c.check_invariants()
    finally:
        r.close()


class SlowStore(MemoryStore):
    """A memory store whose reads take ``delay`` seconds per call (or block on ``gate``)."""

    def __init__(self, config=None, *, spec, delay: float = 0.0):
        super().__init__(config, spec=spec)
        self.delay = delay
        self.gate: threading.Event | None = None

    def batch_get(self, keys, host_pages):
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay)
        return super().batch_get(keys, host_pages)


def _l3_only(r: Rig, t: list[int]) -> None:
    r.request(t)
    r.l1_only_to_l2()
    r.cache.evict(10_000, tier="l2")
    m = r.cache.match(t)
    assert m.l3_count == len(m.keys), m
    r.cache.release(m)


def test_prefetch_cannot_starve_pinned_pages():
    store = SlowStore(spec=SPEC)
    r = Rig(host_pool_pages=4, store=store, prefetch_policy="wait_complete")
    try:
        c = r.cache
        t_l3 = toks(3 * 4, seed=20)
        _l3_only(r, t_l3)
        pinned = []
        for seed in range(4):                # fill L2 with pages pinned by live matches
            t = toks(4, seed=300 + seed)
            r.request(t)
            c.wait_idle()
        r.l1_only_to_l2()
        for seed in range(4):
            pinned.append(c.match(toks(4, seed=300 + seed)))
        snap = {m.keys[0]: raw_bytes(c.host_pool.view[m.l2_pages[0]]).clone() for m in pinned}
        m = c.match(t_l3)
        h = c.fetch(m, r.take(m.pages_to_load))
        h.wait()
        assert h.pages_loaded == 0          # no host page to read into: a miss, not a steal
        assert c.metrics()["prefetch_no_space_pages"] == 3
        for pm in pinned:                    # pinned pages untouched
            assert torch.equal(raw_bytes(c.host_pool.view[pm.l2_pages[0]]), snap[pm.keys[0]])
        r.alloc.free(c.release(m))
        for pm in pinned:
            r.alloc.free(c.release(pm))
        m, h = r.request(t_l3)               # once unpinned, L3 serves it again
        assert h.pages_loaded == 3
    finally:
        r.close()
        store.close()


# ---------------------------------------------------------------------------------------------
# Write policies
# ---------------------------------------------------------------------------------------------
def _tiers(c: TieredKVCache, keys: list[bytes]) -> list[str]:
    out = []
    for k in keys:
        dev, host = c.pages().get(k, (None, None))
        s = ""
        if dev is not None:
            s += "1"
        if host is not None:
            s += "2"
        if c.store.batch_exists([k]):
            s += "3"
        out.append(s)
    return out


def test_write_through_backs_up_every_commit_to_l2_then_l3():
    r = Rig(l3_store="memory", write_policy="write_through")
    try:
        t = toks(4 * 4, seed=30)
        r.request(t)
        assert r.cache.wait_idle(10)
        assert _tiers(r.cache, r.cache.keys(t)) == ["123"] * 4
        mt = r.cache.metrics()
        assert mt["bytes_d2h"] == 4 * SPEC.page_bytes
        assert mt["bytes_l3_written"] == 4 * SPEC.page_bytes
    finally:
        r.close()


def test_write_through_selective_waits_for_the_hit_threshold():
    r = Rig(l3_store="memory", write_policy="write_through_selective", selective_threshold=2)
    try:
        c = r.cache
        t = toks(3 * 4, seed=31)
        r.request(t)
        c.wait_idle()
        assert _tiers(c, c.keys(t)) == ["1"] * 3
        c.release(c.match(t))                 # 1 hit
        c.wait_idle()
        assert _tiers(c, c.keys(t)) == ["1"] * 3
        c.release(c.match(t))                 # 2 hits: backed up, then to L3
        c.wait_idle()
        assert _tiers(c, c.keys(t)) == ["123"] * 3
    finally:
        r.close()


def test_write_back_writes_down_only_on_eviction():
    r = Rig(l3_store="memory", write_policy="write_back", prefetch_policy="wait_complete")
    try:
        c = r.cache
        t = toks(3 * 4, seed=32)
        r.request(t)
        c.wait_idle()
        assert _tiers(c, c.keys(t)) == ["1"] * 3
        assert c.evict(100) == 3
        assert _tiers(c, c.keys(t)) == ["2"] * 3
        assert c.metrics()["l1_demotions"] == 3
        c.evict(100, tier="l2")
        c.wait_idle()
        assert _tiers(c, c.keys(t)) == ["3"] * 3
        assert c.metrics()["l2_writebacks"] == 3
        m, h = r.request(t)                  # and it comes back from L3 intact
        assert h.pages_loaded == 3
    finally:
        r.close()


def test_close_flush_writes_dirty_pages_and_cancel_drops_queued_writes():
    store = MemoryStore(spec=SPEC)
    r = Rig(store=store, write_policy="write_back", close_policy="flush")
    t = toks(3 * 4, seed=33)
    r.request(t)
    r.cache.evict(100)                        # dirty in L2, not in L3
    keys = r.cache.keys(t)
    assert store.batch_exists(keys) == 0
    r.close()
    assert store.batch_exists(keys) == 3      # flushed on close

    class GatedWrites(MemoryStore):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.gate = threading.Event()
            self.started = threading.Event()

        def batch_set(self, keys, host_pages):
            self.started.set()
            self.gate.wait(10)
            return super().batch_set(keys, host_pages)

    store2 = GatedWrites(spec=SPEC)
    r = Rig(store=store2, write_policy="write_through", close_policy="cancel",
            l3_batch_pages=1)
    t1, t2 = toks(4, seed=34), toks(2 * 4, seed=35)
    r.request(t1)
    assert store2.started.wait(10)            # the first write is in flight (acknowledged
    r.request(t2)                             # once it returns); the second one queued
    assert r.cache.wait_idle(0.5) is False    # the second write waits behind the first
    closer = threading.Thread(target=r.close)
    closer.start()
    time.sleep(0.1)
    store2.gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert store2.batch_exists(r.cache.keys(t1)) == 1      # in-flight write completed
    assert store2.batch_exists(r.cache.keys(t2)) == 0      # queued ones were cancelled
    assert r.cache.metrics()["l3_writes_cancelled"] == 2
    store.close()
    store2.close()


def test_calls_after_close_are_refused(rig):
    rig.close()
    with pytest.raises(InvalidArgumentError):
        rig.cache.match([1, 2, 3, 4])
    rig.close()                               # idempotent
    assert isinstance(rig.cache.metrics(), dict)


# ---------------------------------------------------------------------------------------------
# Prefetch policies
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,expect_loaded,max_s", [
    ("best_effort", 0, 0.3),                  # never waits
    ("wait_complete", 3, 5.0),                # waits for every page
    ("timeout", 0, 0.45),                     # waits base + per-1K, then gives up
])
def test_prefetch_policies_bound_the_wait(policy, expect_loaded, max_s):
    store = SlowStore(spec=SPEC, delay=0.6)
    r = Rig(store=store, prefetch_policy=policy, prefetch_timeout_base_s=0.1,
            prefetch_timeout_per_1k_tokens_s=0.0, prefetch_timeout_cap_s=0.2)
    try:
        t = toks(3 * 4, seed=40)
        _l3_only(r, t)
        m = r.cache.match(t)
        t0 = time.perf_counter()
        h = r.cache.fetch(m, r.take(m.pages_to_load))
        took = time.perf_counter() - t0
        h.wait()
        assert h.pages_loaded == expect_loaded and took < max_s, (h.pages_loaded, took)
        if policy == "timeout":
            assert took >= 0.1
        r.verify(m.keys, h.device_pages)
        r.alloc.free(r.cache.release(m))
        assert r.cache.metrics()["prefetch_cut_pages"] == 3 - expect_loaded
        assert r.cache.wait_idle(10)
        r.cache.check_invariants()
    finally:
        r.close()
        store.close()


def test_best_effort_takes_what_an_early_prefetch_brought():
    store = SlowStore(spec=SPEC, delay=0.05)
    r = Rig(store=store, prefetch_policy="best_effort")
    try:
        t = toks(3 * 4, seed=41)
        _l3_only(r, t)
        m = r.cache.match(t)
        r.cache.prefetch(m)                   # request queued: start reading now
        deadline = time.time() + 5
        while not r.cache.prefetch_ready(m) or m.l3_pages_landed < 3:
            assert time.time() < deadline
            time.sleep(0.01)
        h = r.cache.fetch(m, r.take(m.pages_to_load))
        h.wait()
        assert h.pages_loaded == 3
        r.verify(m.keys, h.device_pages)
        r.alloc.free(r.cache.release(m))
    finally:
        r.close()
        store.close()


def test_prefetch_ready_follows_the_policy():
    store = SlowStore(spec=SPEC)
    store.gate = threading.Event()
    r = Rig(store=store, prefetch_policy="wait_complete")
    try:
        t = toks(2 * 4, seed=42)
        store.gate.set()
        _l3_only(r, t)
        store.gate.clear()
        m = r.cache.match(t)
        r.cache.prefetch(m)
        assert not r.cache.prefetch_ready(m)
        store.gate.set()
        deadline = time.time() + 5
        while not r.cache.prefetch_ready(m):
            assert time.time() < deadline
            time.sleep(0.01)
        r.cache.release(m)
    finally:
        r.close()
        store.close()


def test_min_tokens_keeps_short_runs_away_from_l3():
    r = Rig(l3_store="memory", prefetch_min_tokens=3 * 4)
    try:
        short, long_ = toks(2 * 4, seed=43), toks(3 * 4, seed=44)
        _l3_only(r, long_)
        r.request(short)
        r.l1_only_to_l2()
        r.cache.evict(100, tier="l2")
        m = r.cache.match(short)
        assert m.l3_count == 0                # 8 tokens < 12: L3 not consulted
        r.cache.release(m)
        m = r.cache.match(long_)
        assert m.l3_count == 3
        r.cache.release(m)
    finally:
        r.close()


def test_landing_after_the_prefix_is_gone_is_discarded():
    """A read finishing after its match was released and the prefix evicted must not
    register pages whose parent is gone."""
    store = SlowStore(spec=SPEC)
    store.gate = threading.Event()
    store.gate.set()
    r = Rig(store=store, prefetch_policy="best_effort")
    try:
        c = r.cache
        base, tail = toks(2 * 4, seed=45), toks(2 * 4, seed=46)
        _l3_only(r, base + tail)
        r.request(base)                       # prefix back in L1 (and L2)
        c.wait_idle()
        store.gate.clear()
        m = c.match(base + tail)
        assert (m.l1_count, m.l3_count) == (2, 2)
        c.prefetch(m)
        c.release(m)
        c.evict(100)
        c.evict(100, tier="l2")
        c.wait_idle(0.2)
        assert c.keys(base)[-1] not in c.pages()
        store.gate.set()
        assert c.wait_idle(10)
        c.check_invariants()
        assert all(k not in c.pages() for k in c.keys(base + tail))
    finally:
        r.close()
        store.close()


# ---------------------------------------------------------------------------------------------
# Concurrency
# ---------------------------------------------------------------------------------------------
def test_concurrent_requests_keep_data_and_index_consistent():
    r = Rig(device_pages=64, host_pool_pages=24, l3_store="memory",
            prefetch_policy="wait_complete", l3_io_threads=2)
    lock = threading.Lock()
    errors: list[BaseException] = []
    shared = toks(3 * 4, seed=50)

    def take(n):
        with lock:
            return r.take(n)

    def worker(wid: int) -> None:
        c = r.cache
        try:
            for i in range(25):
                t = shared + toks(4 * ((wid + i) % 3 + 1), seed=1000 * wid + i % 4)
                m = c.match(t)
                dev = take(m.pages_to_load) if m.pages_to_load <= 8 else []
                h = c.fetch(m, dev)
                h.wait()
                with lock:
                    r.verify(m.keys, m.l1_pages)
                    r.verify(m.keys[m.l1_count:], h.device_pages)
                n = len(m.keys) - m.l1_count - h.pages_loaded
                new = take(n)
                with lock:
                    r.prefill(m.keys[len(m.keys) - n:], new)
                c.commit(t, m.l1_pages + h.device_pages + new, match=m)
                left = c.release(m)
                with lock:
                    r.alloc.free(left)
                if i % 7 == wid:
                    c.evict(5)
                    c.evict(5, tier="l2")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    try:
        assert not errors, errors
        assert r.cache.wait_idle(10)
        r.cache.check_invariants()
        l1 = {k: d for k, (d, _) in r.cache.pages().items() if d is not None}
        r.verify(list(l1), list(l1.values()))
        assert r.cache.evict(len(l1)) == len(l1)          # nothing left pinned
        assert r.alloc.free_count == 64
    finally:
        r.close()


def test_config_object_and_mapping_build_the_same_cache():
    cfg = CacheConfig(model_id="m", host_pool_pages=4)
    r = Rig(store=None, host_pool_pages=4)
    try:
        assert r.cache.config == CacheConfig.from_dict({"model_id": "test",
                                                        "host_pool_pages": 4,
                                                        "l3_io_threads": 1})
        assert cfg.host_pages_for(SPEC.page_bytes, 100) == 4
    finally:
        r.close()
