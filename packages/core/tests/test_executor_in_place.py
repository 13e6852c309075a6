"""L3 pages loaded in place by the cache's two halves (`CachePlanner` + `CacheExecutor`, as
the vLLM connector runs them): once the data path says it loads in place, a load plan names
the L3 pages as ``l3_loads`` (no host page), the executor loads them straight from the `shm`
arena's pinned slots into the device pages, bitwise, and lets every slot go once they land.
A page gone since the lookup ends the run there; a data path that cannot load in place fails
those operations (counted) and runs the rest of the plan; bad operations are refused before
anything runs.

Pages are random bytes, device pages random indices; a second executor on the same arena
stands for a second engine process."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheExecutor, CachePlanner, Plan, PlanResult
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import InvalidArgumentError, PageIndexError
from kvtier.testing import fill_random

#: 3 layers x K,V x 16 tokens x 2 heads x 32 x 2 B = 12 KiB: a slot is exactly one page
SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=32, page_size=16, dtype="bfloat16")
DEV_PAGES = 40
HOST_PAGES = 16


class Half:
    """One engine process's planner and executor over a device pool of random bytes."""

    def __init__(self, arena: str, seed: int, **config):
        self.dpool = DeviceKVPool.empty(SPEC, DEV_PAGES)
        g = torch.Generator().manual_seed(seed)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, g)
        self.rng = random.Random(seed)
        cfg = {"model_id": "in-place-halves", "host_pool_pages": HOST_PAGES,
               "l3_io_threads": 1, "cost_aware_fetch": False, "l3_store": "shm",
               "l3_config": {"name": arena, "capacity_pages": 64, "remove_when_unused": True},
               **config}
        self.ex = CacheExecutor.from_config(cfg, device_pool=self.dpool,
                                            num_host_pages=HOST_PAGES)
        store = self.ex.store
        self.planner = CachePlanner(cfg, spec=SPEC, device_layout=self.dpool.page_order,
                                    num_host_pages=HOST_PAGES,
                                    l3_exists=store.batch_exists if store else None)

    def pages(self, n: int) -> list[int]:
        return self.rng.sample(range(DEV_PAGES), n)

    def page(self, d: int) -> bytes:
        ps = SPEC.page_size
        return b"".join(t[d * ps:(d + 1) * ps].contiguous().view(torch.uint8).numpy().tobytes()
                        for comp in self.dpool.layers for t in comp)

    def run(self, plan: Plan) -> PlanResult:
        """Submit, wait layer by layer, book the result."""
        self.ex.submit(plan)
        for i in range(SPEC.num_layers):
            self.ex.wait_layer(plan.plan_id, i, timeout=20)
        assert self.ex.wait(plan.plan_id, 20)
        results = [r for r in self.ex.poll() if r.plan_id == plan.plan_id]
        assert len(results) == 1
        self.planner.complete(results[0])
        return results[0]

    def save(self, keys: list[bytes]) -> list[bytes]:
        """Back ``keys`` up from random device pages and write them through to L3; their
        bytes."""
        dev = self.pages(len(keys))
        want = [self.page(d) for d in dev]
        res = self.run(self.planner.plan_save(keys, dev))
        assert res.ok and len(res.l3_writes) == len(keys), res
        return want

    def close(self) -> None:
        self.ex.close()


@contextlib.contextmanager
def two_halves(**b_config):
    arena = f"kvtier-test-halves-{os.getpid()}-{os.urandom(4).hex()}"
    a = Half(arena, seed=1)
    b = Half(arena, seed=2, **b_config)
    try:
        yield a, b
    finally:
        b.close()
        a.close()


def keys_of(half: Half, seed: int, pages: int = 6) -> list[bytes]:
    r = random.Random(seed)
    return half.planner.keys([r.randrange(1, 30000) for _ in range(pages * SPEC.page_size + 5)])


def test_a_second_data_path_loads_the_first_ones_pages_in_place_bitwise():
    with two_halves() as (a, b):
        assert b.ex.in_place is not None and b.ex.in_place_why_not == ""
        keys = keys_of(a, 11)
        want = a.save(keys)
        hit = b.planner.lookup(keys)
        assert (hit.l2_pages, hit.l3_pages) == (0, 6)
        other = keys_of(a, 21, pages=2)
        a.save(other)
        through_l2 = b.planner.plan_load(other, b.pages(2))   # not told yet: reads via L2
        assert len(through_l2.l3_reads) == 2 and not through_l2.l3_loads
        assert b.run(through_l2).ok
        b.planner.set_in_place(True)
        free = b.planner.host.free_count
        dev = b.pages(6)
        plan = b.planner.plan_load(keys, dev)
        assert not plan.l3_reads and not plan.loads and plan.load_pages == tuple(dev)
        assert b.planner.host.free_count == free              # no host page taken
        res = b.run(plan)
        assert res.l3_loads == (True,) * 6 and res.loaded_prefix == 6
        assert [b.page(d) for d in dev] == want
        assert b.ex.store.arena.pinned() == 0                 # every slot let go
        assert b.ex.metrics()["l3_in_place_pages"] == 6
        pm = b.planner.metrics()
        assert pm["l3_in_place_pages"] == 6 and pm["l3_hit_pages"] == 2 + 6
        assert pm.get("l3_read_failed_pages", 0) == 0
        b.planner.check()


def test_in_place_pages_follow_an_l2_hit_and_a_page_gone_ends_the_run():
    with two_halves() as (a, b):
        keys = keys_of(a, 12)
        want = a.save(keys)
        mine = b.save(keys[:2])                  # b holds the first two in its L2
        b.planner.set_in_place(True)
        dev = b.pages(6)
        plan = b.planner.plan_load(keys, dev)
        assert len(plan.loads) == 2 and len(plan.l3_loads) == 4
        assert a.ex.store.delete([keys[4]]) == 1            # gone since the lookup
        res = b.run(plan)
        assert res.loads == (True, True) and res.l3_loads == (True, True, False, False)
        assert res.loaded_prefix == 4
        assert [b.page(d) for d in dev[:4]] == mine + want[2:4]
        assert b.ex.store.arena.pinned() == 0
        assert b.ex.metrics()["l3_read_missed_pages"] == 2
        pm = b.planner.metrics()
        assert pm["l2_hit_pages"] == 2 and pm["l3_hit_pages"] == 2
        assert pm["load_failed_pages"] == 2
        assert not b.planner.unreadable                     # absent, not unreadable
        b.planner.check()


def test_a_data_path_that_does_not_load_in_place_fails_those_loads_and_runs_the_rest():
    with two_halves(l3_in_place_loads=False) as (a, b):
        assert b.ex.in_place is None and b.ex.in_place_why_not == "off (l3_in_place_loads)"
        keys = keys_of(a, 13)
        a.save(keys)
        mine = b.save(keys[:2])
        b.planner.set_in_place(True)     # told wrongly (a rank that cannot): misses only
        dev = b.pages(6)
        res = b.run(b.planner.plan_load(keys, dev))
        assert res.loads == (True, True) and res.l3_loads == (False,) * 4
        assert [b.page(d) for d in dev[:2]] == mine
        assert b.ex.metrics()["l3_in_place_refused_pages"] == 4
        b.planner.check()


def test_the_planner_loads_in_place_only_when_told_and_only_with_l3():
    with two_halves() as (a, b):
        with pytest.raises(InvalidArgumentError, match="in_place must be a bool"):
            b.planner.set_in_place("yes")                        # type: ignore[arg-type]
        assert b.planner.in_place is False
        b.planner.set_in_place(True)
        assert b.planner.in_place is True
        b.planner.set_in_place(False)
        assert b.planner.in_place is False
    p = CachePlanner({"model_id": "x"}, spec=SPEC, device_layout="token", num_host_pages=4)
    p.set_in_place(True)
    assert p.in_place is False                           # no L3: nothing to load in place


def test_the_split_counts_in_place_pages_at_the_l2_rate(monkeypatch):
    """Before the L3 rate is measured, a split that reads through L2 offers a probe's worth
    of L3 pages (8: the test's pages are small, so L3_PROBE_BYTES is 8 of them); loaded in
    place there is no read to measure and every hit is offered."""
    from kvtier.cache.cost import CostModel
    monkeypatch.setattr(CostModel, "L3_PROBE_BYTES", 8 * SPEC.page_bytes)
    with two_halves(cost_aware_fetch=True, recompute_tokens_per_s=1.0) as (a, b):
        keys = keys_of(a, 14, pages=12)
        a.save(keys)
        through_l2 = b.planner.offer(keys, num_tokens=12 * SPEC.page_size + 5)
        assert through_l2.lookup.l3_pages == 12 and through_l2.l3_pages == 8
        b.planner.set_in_place(True)
        direct = b.planner.offer(keys, num_tokens=12 * SPEC.page_size + 5)
        assert direct.l3_pages == 12 and direct.probe is None


@pytest.mark.parametrize("ops, error, match", [
    ({"l3_loads": ((b"k", 40),)}, PageIndexError, "out of range"),
    ({"l3_loads": (("k", 1),)}, InvalidArgumentError, "is not bytes"),
    ({"l3_loads": ((b"k", 1), (b"j", 1))}, PageIndexError, "repeat"),
    ({"l3_loads": ((b"k", 1),), "loads": ((0, 1),)}, PageIndexError, "repeat"),
    ({"l3_loads": ((b"k", 1),), "backups": ((1, 0),)}, PageIndexError, "both loaded"),
    ({"l3_loads": ((b"k",),)}, InvalidArgumentError, "not a pair"),
])
def test_bad_in_place_loads_are_refused_before_anything_runs(ops, error, match):
    with two_halves() as (_, b):
        before = b.page(1)
        with pytest.raises(error, match=match):
            b.ex.submit(Plan(12345, **ops))
        assert b.page(1) == before and b.ex.store.arena.pinned() == 0
        assert b.ex.wait_idle(5) and b.ex.poll() == []


def test_in_place_loads_without_a_store_are_refused():
    dpool = DeviceKVPool.empty(SPEC, 4)
    ex = CacheExecutor.from_config({"model_id": "x", "host_pool_pages": 2}, device_pool=dpool)
    try:
        assert ex.in_place is None and ex.in_place_why_not == "no L3 store"
        with pytest.raises(InvalidArgumentError, match="no L3 store"):
            ex.submit(Plan(1, l3_loads=((b"k", 0),)))
    finally:
        ex.close()


def test_results_carry_in_place_loads_in_load_order():
    plan = Plan(1, loads=((0, 5),), l3_loads=((b"a", 7), (b"b", 3)))
    assert plan.load_pages == (5, 7, 3) and plan.device_pages == (5, 7, 3) and not plan.empty
    assert Plan(2, l3_loads=((b"a", 1),)).empty is False
    failed = plan.failed()
    assert failed.l3_loads == (False, False) and failed.loaded_prefix == 0
    res = PlanResult(1, loads=(True,), l3_loads=(True, False))
    assert res.load_results == (True, True, False) and res.loaded_prefix == 2 and not res.ok
