"""The chain store: write-through, reads from the first member that has a page, promotion,
exists across members, config checks, and the chain under a real cache."""

from __future__ import annotations

import glob
import os
import random

import pytest
import torch

from kvtier.device_pool import DeviceKVPool
from kvtier.errors import BackendNotFoundError, ConfigError, StoreError
from kvtier.l3_stores import shm as shm_mod
from kvtier.l3_stores.chain import ChainStore
from kvtier.l3_stores.shm import ShmStore
from kvtier.testing import L3StoreContract
from kvtier.testing.contracts import assert_bitwise_equal
from kvtier.testing.data import fill_random, make_host_pool, random_specs

SPEC = random_specs()[0]


@pytest.fixture
def pool():
    p = make_host_pool(SPEC, 24)
    yield p
    p.close()


@pytest.fixture
def shm_name():
    n = f"kvtier-test-chain-{os.getpid()}-{os.urandom(4).hex()}"
    yield n
    for path in glob.glob(os.path.join(shm_mod.DEFAULT_ROOT, f"{n}-*")):
        os.unlink(path)


def memory_chain(n: int = 2, **kw) -> ChainStore:
    return ChainStore({"stores": [{"store": "memory"} for _ in range(n)], **kw}, spec=SPEC)


class TestChainOfMemoryStores(L3StoreContract):
    """The contract over a chain of two in-process stores, without promotion."""

    def pytest_generate_tests(self, metafunc) -> None:
        if "backend_name" in metafunc.fixturenames:
            metafunc.parametrize("backend_name", ["chain"])

    def make_config(self, backend_name: str, workdir: str) -> dict:
        return {"stores": [{"store": "memory"}, {"store": "memory"}], "promote": False}


def test_reads_come_from_the_first_member_that_has_a_page_and_are_promoted(pool):
    with memory_chain(3) as c:
        c.attach(pool)
        fast, mid, slow = c.members
        keys = [os.urandom(32) for _ in range(6)]
        want = [pool.view[p].clone() for p in range(6)]
        assert slow.batch_set(keys[:3], [0, 1, 2]) == [True] * 3     # only the slowest
        assert mid.batch_set(keys[3:5], [3, 4]) == [True] * 2
        assert fast.batch_set(keys[5:], [5]) == [True]
        fill_random(pool.raw)
        dst = random.Random(2).sample(range(6, 24), 6)
        assert c.batch_get(keys, dst) == [True] * 6
        for i, p in enumerate(dst):
            assert_bitwise_equal(pool.view[p], want[i], f"key {i}")
        assert fast.batch_exists(keys) == 6, "everything found lower down is now in the first"
        assert mid.batch_exists(keys[:3]) == 3 and slow.batch_exists(keys[3:5]) == 0
        st = c.stats()
        assert st["promoted"] == 3 + 3 + 2 and st["get_hits"] == 6
        assert [m["store"] for m in st["members"]] == ["memory"] * 3


def test_promotion_can_be_turned_off(pool):
    with memory_chain(promote=False) as c:
        c.attach(pool)
        assert c.members[1].batch_set([b"k"], [0]) == [True]
        assert c.batch_get([b"k"], [1]) == [True]
        assert c.members[0].batch_exists([b"k"]) == 0 and c.stats()["promoted"] == 0


def test_exists_is_the_leading_run_across_members(pool):
    with memory_chain(3) as c:
        c.attach(pool)
        k = [bytes([i]) * 8 for i in range(1, 8)]
        c.members[0].batch_set([k[0], k[2]], [0, 1])
        c.members[2].batch_set([k[1], k[3]], [0, 1])
        c.members[1].batch_set([k[4]], [0])
        c.members[0].batch_set([k[6]], [0])             # after a gap: not counted
        assert c.batch_exists(k) == 5
        assert c.batch_exists(k[5:]) == 0 and c.batch_exists([]) == 0


def test_writes_reach_every_member_and_a_failed_one_leaves_no_older_copy(pool, monkeypatch):
    with memory_chain() as c:
        c.attach(pool)
        old = pool.view[0].clone()
        assert c.batch_set([b"k"], [0]) == [True]
        assert all(m.batch_exists([b"k"]) == 1 for m in c.members)
        slow = c.members[1]
        monkeypatch.setattr(slow, "batch_set", lambda keys, pages: [False] * len(keys))
        new = pool.view[1].clone()
        assert not torch.equal(old, new)
        assert c.batch_set([b"k"], [1]) == [True]            # the fast member took it
        assert slow.batch_exists([b"k"]) == 0, "the slow member's older copy was deleted"
        c.members[0].delete([b"k"])
        assert c.batch_get([b"k"], [2]) == [False]           # never the old bytes
        assert c.stats()["write_through_failed"] == 1


def test_a_write_no_member_stores_is_false_and_counted(pool, monkeypatch):
    with memory_chain() as c:
        c.attach(pool)
        for m in c.members:
            monkeypatch.setattr(m, "batch_set", lambda keys, pages: [False] * len(keys))
        assert c.batch_set([b"a", b"b"], [0, 1]) == [False, False]
        st = c.stats()
        assert st["set_ok"] == 0 and st["errors"] == 2


def test_delete_and_clear_reach_every_member(pool):
    with memory_chain() as c:
        c.attach(pool)
        c.members[0].batch_set([b"a"], [0])
        c.members[1].batch_set([b"a", b"b"], [0, 1])
        assert c.delete([b"a", b"b", b"c"]) == 2
        assert c.batch_exists([b"a"]) == 0 and c.batch_exists([b"b"]) == 0
        c.members[1].batch_set([b"a"], [0])
        c.clear()
        assert all(m.batch_exists([b"a"]) == 0 for m in c.members)


@pytest.mark.skipif(not ShmStore.probe().ok, reason="shm unavailable here")
def test_shm_then_file_with_the_namespace_handed_down(pool, tmp_path, shm_name):
    config = {"namespace": "ns1", "stores": [
        {"store": "shm", "config": {"name": shm_name, "capacity_pages": 4,
                                    "remove_when_unused": True}},
        {"store": "file", "config": {"root": str(tmp_path / "files")}}]}
    with ChainStore(config, spec=SPEC) as c:
        c.attach(pool)
        shm, files = c.members
        assert shm.path.endswith(".ns-ns1.arena") and files.config.namespace == "ns1"
        keys = [os.urandom(32) for _ in range(10)]
        want = [pool.view[p].clone() for p in range(10)]
        assert c.batch_set(keys, list(range(10))) == [True] * 10     # shm keeps 4
        assert shm.stats()["objects"] == 4 and files.batch_exists(keys) == 10
        assert c.batch_exists(keys) == 10
        assert c.batch_get(keys, list(range(10, 20))) == [True] * 10
        for i in range(10):
            assert_bitwise_equal(pool.view[10 + i], want[i], f"key {i}")
        assert c.stats()["promoted"] >= 6


def test_closed_chain_refuses_calls(pool):
    c = memory_chain()
    c.attach(pool)
    c.close()
    c.close()
    with pytest.raises(StoreError):
        c.batch_exists([b"k"])


@pytest.mark.parametrize("stores", [[], "shm", [{"config": {}}], [{"store": "memory", "x": 1}],
                                    [{"store": "memory", "config": 3}], [{"store": 7}], [3]])
def test_bad_member_lists_are_config_errors(stores):
    with pytest.raises(ConfigError):
        ChainStore({"stores": stores}, spec=SPEC)


def test_an_unknown_member_is_named():
    with pytest.raises(BackendNotFoundError):
        ChainStore({"stores": [{"store": "memory"}, {"store": "no-such-store"}]}, spec=SPEC)


def test_a_member_config_error_closes_the_members_built(tmp_path):
    with pytest.raises(ConfigError):
        ChainStore({"stores": [{"store": "memory"},
                               {"store": "memory", "config": {"capacity_bytes": 1}}]},
                   spec=SPEC)


@pytest.mark.skipif(not ShmStore.probe().ok, reason="shm unavailable here")
def test_the_chain_under_a_cache(tmp_path, shm_name):
    """A cache configured with l3_store="chain" as with any store: pages pushed down to L3
    come back bitwise, and the cache's namespace reaches the members."""
    from kvtier.cache import TieredKVCache
    from kvtier.page_allocator import PageAllocator
    spec = SPEC
    dpool = DeviceKVPool.empty(spec, 16)
    for comp in dpool.layers:
        for t in comp:
            fill_random(t)
    alloc = PageAllocator(16)
    l3 = {"stores": [{"store": "shm", "config": {"name": shm_name, "capacity_pages": 64,
                                                  "remove_when_unused": True}},
                     {"store": "file", "config": {"root": str(tmp_path / "files")}}]}
    cache = TieredKVCache.from_config(
        {"model_id": "chain-test", "host_pool_pages": 8, "l3_io_threads": 1,
         "l3_store": "chain", "l3_config": l3, "prefetch_policy": "wait_complete",
         "cost_aware_fetch": False},
        device_pool=dpool, allocate_device_pages=alloc.alloc, free_device_pages=alloc.free)
    try:
        tokens = list(range(4 * spec.page_size))
        m = cache.match(tokens)
        cache.fetch(m, alloc.alloc(m.pages_to_load)).wait()
        pages = alloc.alloc(4)
        want = [torch.cat([dpool.page(c, layer, p).reshape(-1).view(torch.uint8).clone()
                           for layer in range(spec.num_layers)
                           for c in range(spec.num_components)]) for p in pages]
        cache.commit(tokens, pages, match=m)
        alloc.free(cache.release(m))
        assert cache.wait_idle(60)
        cache.evict(100)
        assert cache.wait_idle(60)
        cache.evict(100, tier="l2")
        assert cache.wait_idle(60)
        m = cache.match(tokens)
        assert m.l3_count == 4, m
        h = cache.fetch(m, alloc.alloc(m.pages_to_load))
        h.wait()
        assert h.pages_loaded == 4
        for p, w in zip(h.device_pages, want):
            got = torch.cat([dpool.page(c, layer, p).reshape(-1).view(torch.uint8)
                             for layer in range(spec.num_layers)
                             for c in range(spec.num_components)])
            assert torch.equal(got, w)
        cache.release(m)
        paths = glob.glob(os.path.join(shm_mod.DEFAULT_ROOT, f"{shm_name}-*"))
        assert len(paths) == 1 and ".ns-" in paths[0], paths
    finally:
        cache.close()
