"""L3 pages loaded in place from the `shm` store's arena (`kvtier.cache.inplace`): a second
cache (as a second engine process would) loads the pages a first one wrote straight from the
arena into its device pages, bitwise, without a copy into its L2; a pinned slot keeps every
writer -- of this open file, of another open file, of another process -- off it until the
load has landed; stores and pages that cannot be read in place go through L2 as before.

Pages are random bytes, device pages random indices; page sizes exact multiples of 4 KiB
(in place) and not (through L2)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier import KVSpec
from kvtier.errors import TransferError
from kvtier.cache import TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.l3_stores.shm import ShmStore
from kvtier.l3_stores.shm_arena import BUSY, OK
from kvtier.page_allocator import PageAllocator

#: 3 layers x K,V x 16 tokens x 2 heads x 32 x 2 B = 12 KiB: a slot is exactly one page
SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=32, page_size=16, dtype="bfloat16")
#: 3 layers x K,V x 9 tokens x 2 heads x 24 x 2 B = 5,184 B: a slot takes 8 KiB
ODD = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=9, dtype="bfloat16")
PAGES = 6
DEV_PAGES = 40


def arena_name() -> str:
    return f"kvtier-test-inplace-{os.getpid()}-{os.urandom(4).hex()}"


def shm(spec: KVSpec, name: str) -> ShmStore:
    return ShmStore({"name": name, "capacity_pages": 64, "remove_when_unused": True},
                    spec=spec)


class Engine:
    """A cache over a device pool of random bytes, as one engine process holds it."""

    def __init__(self, spec: KVSpec, store, seed: int, **config):
        self.spec = spec
        self.dpool = DeviceKVPool.empty(spec, DEV_PAGES)
        g = torch.Generator().manual_seed(seed)
        for comp in self.dpool.layers:
            for t in comp:
                v = t.view(torch.uint8)
                v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8))
        self.alloc = PageAllocator(DEV_PAGES)
        self.rng = random.Random(seed)
        cfg = {"model_id": "in-place", "host_pool_pages": 16, "l3_io_threads": 1,
               "cost_aware_fetch": False, **config}
        self.store = store
        self.cache = TieredKVCache.from_config(cfg, device_pool=self.dpool, store=store,
                                               allocate_device_pages=self.alloc.alloc,
                                               free_device_pages=self.alloc.free)

    def pages(self, n: int) -> list[int]:
        """``n`` free device pages in random order (not 0, 1, 2...)."""
        got = self.alloc.alloc(n)
        self.rng.shuffle(got)
        return got

    def page(self, d: int) -> bytes:
        ps = self.spec.page_size
        return b"".join(t[d * ps:(d + 1) * ps].contiguous().view(torch.uint8).numpy().tobytes()
                        for comp in self.dpool.layers for t in comp)

    def compute(self, toks) -> list[bytes]:
        """Commit ``toks`` (their pages hold random bytes), written through to L3; returns
        each page's bytes."""
        c = self.cache
        m = c.match(toks)
        pages = self.pages(len(m.keys))
        want = [self.page(d) for d in pages]
        c.commit(toks, pages, match=m)
        self.alloc.free(c.release(m))
        assert c.wait_idle(20)
        return want

    def load(self, toks) -> tuple[int, list[bytes]]:
        """match + fetch into random device pages: (pages loaded, their bytes)."""
        c = self.cache
        m = c.match(toks)
        dev = self.pages(m.pages_to_load)
        h = c.fetch(m, dev)
        for i in range(self.spec.num_layers):
            h.wait_layer(i)
        h.wait()
        got = [self.page(d) for d in dev[:h.pages_loaded]]
        self.alloc.free(c.release(m))
        return h.pages_loaded, got

    def close(self) -> None:
        self.cache.close()
        self.store.close()


@contextlib.contextmanager
def two_engines(spec: KVSpec, seed: int, **b_config):
    """Two caches on one new arena, as two engine processes hold them; closed after."""
    name = arena_name()
    a = Engine(spec, shm(spec, name), seed=seed, **b_config.pop("a_config", {}))
    b = Engine(spec, shm(spec, name), seed=seed + 1, **b_config)
    try:
        yield a, b
    finally:
        b.close()
        a.close()


def tokens(seed: int, pages: int = PAGES, spec: KVSpec = SPEC) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 30000) for _ in range(pages * spec.page_size + 3)]


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_a_second_cache_loads_the_first_ones_pages_in_place_bitwise(host_layout):
    with two_engines(SPEC, 1, host_layout=host_layout,
                     a_config={"host_layout": host_layout}) as (a, b):
        assert a.cache.in_place_why_not == "" and b.cache.in_place_why_not == ""
        toks = tokens(7)
        want = a.compute(toks)
        loaded, got = b.load(toks)
        assert loaded == PAGES and got == want
        mb = b.cache.metrics()
        assert mb["l3_in_place_pages"] == PAGES and mb["l3_hit_pages"] == PAGES
        assert b.cache.host_pool.free_count == 16           # nothing went through L2
        assert b.store.arena.pinned() == 0                  # every slot let go
        # now in b's L1: a second match hits there
        m = b.cache.match(toks)
        assert m.l1_count == PAGES
        b.alloc.free(b.cache.release(m))
        b.cache._index.check()
    # nothing of the in-place path keeps the arena mapped: the last store removed it
    assert not os.path.exists(a.store.path)


def test_in_place_pages_follow_an_l2_hit_in_one_fetch():
    """The first pages from L2, the rest in place: one handle, layer by layer, bitwise."""
    with two_engines(SPEC, 3) as (a, b):
        toks = tokens(11)
        want = a.compute(toks)
        # b computes the first 2 pages itself (its L2 holds them), the rest are a's
        head = toks[:2 * SPEC.page_size + 1]
        b_head = b.compute(head)
        b.cache.evict(100)                     # out of L1: L2 holds b's 2 pages
        loaded, got = b.load(toks)
        assert loaded == PAGES
        assert got[:2] == b_head and got[2:] == want[2:]
        mb = b.cache.metrics()
        assert mb["l2_hit_pages"] == 2 and mb["l3_in_place_pages"] == PAGES - 2


def test_a_page_missing_from_the_arena_ends_the_in_place_run():
    with two_engines(SPEC, 5) as (a, b):
        toks = tokens(13)
        want = a.compute(toks)
        m = b.cache.match(toks)
        assert m.l3_count == PAGES
        a.store.delete([a.cache.keys(toks)[3]])       # gone after the lookup, before the load
        dev = b.pages(m.pages_to_load)
        h = b.cache.fetch(m, dev)
        h.wait()
        assert h.pages_loaded == 3
        assert [b.page(d) for d in dev[:3]] == want[:3]
        b.alloc.free(b.cache.release(m))
        assert b.store.arena.pinned() == 0
        b.cache._index.check()


def test_a_pinned_slot_keeps_writers_of_any_open_file_off_it():
    name = arena_name()
    s1, s2 = shm(SPEC, name), shm(SPEC, name)      # two open files, as two processes
    e = Engine(SPEC, s1, seed=8)
    try:
        toks = tokens(17, pages=1)
        e.compute(toks)
        key = e.cache.keys(toks)[0]
        reads = s1.in_place_reads()
        slots = reads.pin([key])
        assert len(slots) == 1
        arena2, arena1 = s2.arena, s1.arena
        d = arena2.digest(key)
        assert arena2.claim(d, 1, 0.05)[0] == BUSY        # another open file: the lock
        assert arena1.claim(d, 1, 0.05)[0] == BUSY        # this open file: the pin count
        assert arena2.remove(d, 0.05) is False            # nor deleted
        reads.unpin(slots)
        status, slot, odd, _ = arena2.claim(d, 1, 0.05)
        assert status == OK
        arena2.abandon(slot, odd)
    finally:
        e.close()
        s2.close()


def test_a_pinned_slot_is_not_evicted_by_another_process():
    """A real second process fills the pinned slot's set: the slot survives, bitwise."""
    name = arena_name()
    store = ShmStore({"name": name, "capacity_pages": 4, "ways": 4,
                      "remove_when_unused": True}, spec=SPEC)
    e = Engine(SPEC, store, seed=9)
    try:
        toks = tokens(19, pages=1)
        want = e.compute(toks)
        key = e.cache.keys(toks)[0]
        reads = store.in_place_reads()
        slots = reads.pin([key])
        child = textwrap.dedent(f"""
            import torch
            from kvtier import KVSpec
            from kvtier.host_pool import HostKVPool
            from kvtier.l3_stores.shm import ShmStore
            from kvtier.registry import create_host_allocator
            spec = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=32, page_size=16,
                              dtype="bfloat16")
            s = ShmStore({{"name": {name!r}, "capacity_pages": 4, "ways": 4}}, spec=spec)
            pool = HostKVPool(spec, 8, allocator=create_host_allocator("mmap", {{}}))
            pool.raw.copy_(torch.randint(0, 256, pool.raw.shape, dtype=torch.uint8))
            s.attach(pool)
            ok = s.batch_set([b"other-%d" % i for i in range(8)], list(range(8)))
            print(sum(ok))
            s.close()
        """)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.split()[-1]) == 8        # each evicting another: 3 ways left
        reads.unpin(slots)
        e.cache.evict(100)
        e.cache.evict(100, tier="l2")
        assert e.cache.wait_idle(20)
        loaded, got = e.load(toks)
        assert loaded == 1 and got == want
    finally:
        e.close()


def test_pages_that_are_not_a_slot_go_through_l2():
    with two_engines(ODD, 10) as (a, b):
        assert "not exactly a page" in b.cache.in_place_why_not
        toks = tokens(23, spec=ODD)
        want = a.compute(toks)
        loaded, got = b.load(toks)
        assert loaded == PAGES and got == want
        assert b.cache.metrics()["l3_in_place_pages"] == 0


def test_in_place_loads_off_read_through_l2():
    with two_engines(SPEC, 12, l3_in_place_loads=False) as (a, b):
        assert "off" in b.cache.in_place_why_not
        toks = tokens(29)
        want = a.compute(toks)
        loaded, got = b.load(toks)
        assert loaded == PAGES and got == want
        m = b.cache.metrics()
        assert m["l3_in_place_pages"] == 0 and m["l3_hit_pages"] == PAGES


def test_a_device_that_cannot_read_host_memory_is_a_reason_not_an_error():
    from kvtier.cache.inplace import register_host_memory
    buf = torch.zeros(4096, dtype=torch.uint8)
    reg, why = register_host_memory(buf.data_ptr(), 4096, torch.device("cpu"))
    assert reg is not None and why == ""
    reg.close()
    reg, why = register_host_memory(buf.data_ptr(), 4096, torch.device("meta"))
    assert reg is None and "meta device" in why
    if not torch.cuda.is_available():           # a CPU build: no CUDA runtime to register with
        reg, why = register_host_memory(buf.data_ptr(), 4096, torch.device("cuda"))
        assert reg is None and why


def test_an_in_place_load_that_fails_to_start_lets_every_slot_go():
    with two_engines(SPEC, 14) as (a, b):
        toks = tokens(31)
        want = a.compute(toks)
        engine = b.cache._in_place.engine

        def refuse(*args, **kw):
            raise RuntimeError("engine refused the copy")
        real, engine.load = engine.load, refuse
        m = b.cache.match(toks)
        dev = b.pages(m.pages_to_load)
        fh = b.cache.fetch(m, dev)                     # a failed load is the handle's error
        with pytest.raises(TransferError, match="load failed"):
            fh.wait()
        assert fh.error is not None and b.store.arena.pinned() == 0
        b.alloc.free(b.cache.release(m))            # the pages given come back
        engine.load = real
        loaded, got = b.load(toks)                     # and the next fetch loads in place
        assert loaded == PAGES and got == want
        b.cache._index.check()
