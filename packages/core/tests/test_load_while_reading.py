"""Loads that start as their L3 reads land (`CacheConfig.l3_load_while_reading`): a plan whose
L3 reads feed loads starts each batch's loads once that batch is back, while the next batch
is read, and only for the leading run of reads that came back; `TieredKVCache.fetch` reads
its L3 pages in the plan that loads them. Real CPU pools and the torch engine, random bytes;
the store is the memory store with its calls gated and keys failed on demand."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheConfig, CacheExecutor, Plan, TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.memory import MemoryStore
from kvtier.registry import create_transfer_engine
from kvtier.testing import fill_random

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, page_size=3, dtype="float16")


class CallGatedStore(MemoryStore):
    """The memory store whose ``batch_get`` call number i (from 0) waits for ``gates[i]`` when
    there is one, and whose keys in ``fail`` come back False."""

    def __init__(self, *, spec):
        super().__init__(spec=spec)
        self.gates: dict[int, threading.Event] = {}
        self.fail: set[bytes] = set()
        self.calls = 0
        self.waiting = threading.Event()         # a call is held at its gate

    def batch_get(self, keys, host_pages):
        i = self.calls
        self.calls += 1
        gate = self.gates.get(i)
        if gate is not None:
            self.waiting.set()
            gate.wait(10)
        out = super().batch_get([k for k in keys], host_pages)
        return [ok and k not in self.fail for k, ok in zip(keys, out)]


def _until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


class Rig:
    def __init__(self, seed: int, batch: int):
        gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.dpool = DeviceKVPool.empty(SPEC, 23)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, gen)
        self.host = HostKVPool(SPEC, 29, allocator=TorchPinnedAllocator())
        fill_random(self.host.raw, gen)
        self.store = CallGatedStore(spec=SPEC)
        self.store.attach(self.host)
        engine = create_transfer_engine("torch", self.dpool, self.host)
        self.ex = CacheExecutor(host_pool=self.host, engine=engine, store=self.store,
                                l3_io_threads=1, l3_batch_pages=batch,
                                owned=(engine, self.store, self.host))

    def plan(self, n2: int, n3: int):
        """A load of ``n2`` L2 pages and ``n3`` L3 pages (written to the store from random host
        pages, then read into other random host pages) into random device pages: (plan,
        device pages, the bytes each device page must get, the L3 keys)."""
        hps = self.rng.sample(range(29), n2 + 2 * n3)
        l2, src, dst = hps[:n2], hps[n2:n2 + n3], hps[n2 + n3:]
        keys = [self.rng.randbytes(32) for _ in range(n3)]
        assert self.store.batch_set(keys, src) == [True] * n3
        want = [self.host.page_bytes_view(hp).clone() for hp in l2 + src]
        dev = self.rng.sample(range(23), n2 + n3)
        plan = Plan(self.rng.randrange(1, 1 << 30), l3_reads=tuple(zip(keys, dst)),
                    loads=tuple(zip(l2 + dst, dev)))
        return plan, dev, want, keys


def test_each_batch_loads_as_it_lands_while_the_next_is_read():
    r = Rig(1, batch=3)
    plan, dev, want, _ = r.plan(2, 7)           # L3 batches of 3, 3 and 1 pages
    before = [r.dpool.page_bytes(d).clone() for d in dev]
    r.store.gates[1] = threading.Event()        # the second batch is held back
    h = r.ex.submit(plan)
    assert r.store.waiting.wait(5)
    # the L2 pages and the first batch are in place while the second is still being read
    assert _until(lambda: all(torch.equal(r.dpool.page_bytes(d), w)
                              for d, w in zip(dev[:5], want[:5])))
    for d, old in zip(dev[5:], before[5:]):
        assert torch.equal(r.dpool.page_bytes(d), old)
    assert not h.done()
    r.store.gates[1].set()
    assert h.read_lead(5) == 7
    h.synchronize()
    res = r.ex.poll()[0]
    assert res.ok and res.loads == (True,) * 9 and res.l3_reads == (True,) * 7
    for d, w in zip(dev, want):
        assert torch.equal(r.dpool.page_bytes(d), w)
    r.ex.close()


@pytest.mark.parametrize("seed, batch, n2, n3, miss", [
    (2, 3, 1, 6, 4),      # reads [ok, ok, ok | ok, miss, ok]: read 5 came back after the miss
    (3, 2, 2, 3, 0),      # the first batch fails at its first page: only the L2 hit loads
])
def test_a_read_after_a_miss_feeds_no_load_even_in_the_same_batch(seed, batch, n2, n3, miss):
    """The pages after a miss are recomputed by the engine, which may write them at once, so
    nothing may still load into them; the pages before it load bitwise."""
    r = Rig(seed, batch=batch)
    plan, dev, want, keys = r.plan(n2, n3)
    before = [r.dpool.page_bytes(d).clone() for d in dev]
    r.store.fail.add(keys[miss])
    h = r.ex.submit(plan)
    assert h.read_lead(5) == miss
    h.synchronize()
    res = r.ex.poll()[0]
    assert res.l3_reads[:miss + 1] == (True,) * miss + (False,)
    n = n2 + miss
    assert res.loads == (True,) * n + (False,) * (n3 - miss)
    for d, w in zip(dev[:n], want[:n]):
        assert torch.equal(r.dpool.page_bytes(d), w)
    for d, old in zip(dev[n:], before[n:]):
        assert torch.equal(r.dpool.page_bytes(d), old)
    r.ex.close()


# ----- through TieredKVCache.fetch ------------------------------------------------------------
def _cache(store, **cfg):
    dpool = DeviceKVPool.empty(SPEC, 24)
    config = dict(model_id="lwr", host_pool_pages=24, write_policy="write_through",
                  cost_aware_fetch=False, l3_io_threads=1, l3_batch_pages=2,
                  l3_load_while_reading=True)
    config.update(cfg)
    cache = TieredKVCache(config, device_pool=dpool, free_device_pages=lambda p: None,
                          store=store)
    return cache, dpool


def _seven_pages(seed: int, **cfg):
    """Seven random pages committed, then the first two in L2 and the rest in L3 only."""
    store = CallGatedStore(spec=SPEC)
    cache, dpool = _cache(store, **cfg)
    gen = torch.Generator().manual_seed(seed)
    pages = random.Random(seed).sample(range(24), 7)
    for layer in dpool.chunks:
        for c in layer:
            for p in pages:
                c[p].copy_(torch.randint(0, 256, c[p].shape, dtype=torch.uint8, generator=gen))
    want = [dpool.page_bytes(p).clone() for p in pages]
    tokens = list(range(1, 3 * 7 + 1))
    cache.commit(tokens, pages)
    assert cache.wait_idle(5)
    cache.evict(24, "l1")
    cache.evict(5, "l2")                      # leaves first: the last five
    assert cache.wait_idle(5)
    m = cache.match(tokens)
    assert (m.l1_count, m.l2_count, m.l3_count) == (0, 2, 5)
    dev = [p for p in random.Random(seed + 1).sample(range(24), 24) if p not in pages][:7]
    return store, cache, dpool, m, want, dev


def test_a_fetch_loads_its_l2_hit_and_first_batches_while_the_rest_is_read():
    store, cache, dpool, m, want, dev = _seven_pages(4)
    assert cache.reads_in_fetch
    store.gates[store.calls + 1] = gate = threading.Event()    # the second L3 batch
    before = [dpool.page_bytes(d).clone() for d in dev]
    out: list = []
    t = threading.Thread(target=lambda: out.append(cache.fetch(m, dev)))
    t.start()
    assert store.waiting.wait(5)
    # the fetch waits for its reads; the L2 hit and the first L3 batch are loaded already
    assert _until(lambda: all(torch.equal(dpool.page_bytes(d), w)
                              for d, w in zip(dev[:4], want[:4])))
    for d, old in zip(dev[4:], before[4:]):
        assert torch.equal(dpool.page_bytes(d), old)
    assert t.is_alive()
    gate.set()
    t.join(5)
    fh = out[0]
    fh.wait()
    assert fh.pages_loaded == 7 and fh.from_l2 == 2
    for d, w in zip(dev, want):
        assert torch.equal(dpool.page_bytes(d), w)
    cache.release(m)
    assert cache.wait_idle(5)
    assert cache.metrics()["l3_hit_pages"] == 5
    cache.check_invariants(idle=True)
    cache.close()


def test_a_fetch_whose_read_misses_leaves_the_pages_after_it_untouched():
    store, cache, dpool, m, want, dev = _seven_pages(5, l3_batch_pages=3)
    store.fail.add(m.keys[3])                 # L3 pages [ok, miss, ok | ...]
    before = [dpool.page_bytes(d).clone() for d in dev]
    fh = cache.fetch(m, dev)
    fh.wait()
    assert fh.pages_loaded == 3 and fh.unused_pages == dev[3:]
    for d, w in zip(dev[:3], want[:3]):
        assert torch.equal(dpool.page_bytes(d), w)
    assert cache.wait_idle(5)
    for d, old in zip(dev[3:], before[3:]):
        assert torch.equal(dpool.page_bytes(d), old)
    cache.release(m)
    assert m.keys[3] in cache.unreadable
    cache.check_invariants(idle=True)
    cache.close()


def test_a_fetch_whose_store_call_passes_its_deadline_loads_what_landed_and_goes_on():
    """The second L3 batch's call hangs past ``l3_call_timeout_s``: the fetch returns with the
    L2 hit and the first batch loaded, bitwise, the rest left to the engine and untouched; the
    host pages the stuck call may still write into are held until it returns, then freed."""
    store, cache, dpool, m, want, dev = _seven_pages(6, l3_call_timeout_s=0.3,
                                                     l3_error_limit=100)
    store.gates[store.calls + 1] = gate = threading.Event()
    before = [dpool.page_bytes(d).clone() for d in dev]
    free_before = cache.host_pool.free_count
    t0 = time.monotonic()
    fh = cache.fetch(m, dev)
    fh.wait()
    assert time.monotonic() - t0 < 5
    assert fh.pages_loaded == 4 and fh.unused_pages == dev[4:]
    for d, w in zip(dev[:4], want[:4]):
        assert torch.equal(dpool.page_bytes(d), w)
    for d, old in zip(dev[4:], before[4:]):
        assert torch.equal(dpool.page_bytes(d), old)
    cache.release(m)
    gate.set()                                   # the stuck call returns: its pages go back
    assert _until(lambda: cache.host_pool.free_count >= free_before - 2)
    assert cache.wait_idle(5)
    for d, old in zip(dev[4:], before[4:]):      # the late call loaded nothing
        assert torch.equal(dpool.page_bytes(d), old)
    assert cache.metrics()["l3_state"] == "ok"
    cache.check_invariants(idle=True)
    cache.close()


def test_a_fetch_whose_match_a_prefetch_began_reading_meanwhile_waits_for_that_read(
        monkeypatch):
    """Another thread's `prefetch` starts the match's read just before the fetch takes it on:
    the fetch waits for that read (not only what has landed so far) and loads every page."""
    from kvtier.cache import l3tasks
    store, cache, dpool, m, want, dev = _seven_pages(7)
    store.gates[store.calls] = gate = threading.Event()     # the prefetch's first call
    own = l3tasks.stream_task

    def raced(c, match, want_pages, **kw):
        l3tasks.start_read(c, match)              # as if a prefetch had just begun
        threading.Timer(0.2, gate.set).start()
        return own(c, match, want_pages, **kw)
    monkeypatch.setattr(l3tasks, "stream_task", raced)
    fh = cache.fetch(m, dev)
    fh.wait()
    assert fh.pages_loaded == 7
    for d, w in zip(dev, want):
        assert torch.equal(dpool.page_bytes(d), w)
    cache.release(m)
    assert cache.wait_idle(5)
    cache.check_invariants(idle=True)
    cache.close()


def test_which_fetches_read_in_their_load_plan():
    for cfg, want in (({}, True), ({"l3_load_while_reading": False}, False),
                      ({"prefetch_policy": "timeout"}, False),
                      ({"prefetch_policy": "best_effort"}, False)):
        cache, _ = _cache(CallGatedStore(spec=SPEC), **cfg)
        assert cache.reads_in_fetch is want, cfg
        cache.close()
    cache, _ = _cache(None)
    assert not cache.reads_in_fetch
    cache.close()
    assert CacheConfig(model_id="m").l3_load_while_reading is False   # measured no gain
