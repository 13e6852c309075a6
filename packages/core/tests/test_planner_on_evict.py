"""``l2_backup="on_evict"``: the planner remembers which device page holds which page
(`CachePlanner.defer_save`) and backs it up only when the engine is about to write that device
page again (`plan_reused`). Run on a real `CacheExecutor` (CPU pools, the torch engine, the
memory store) filled with random bytes: what comes back from L2 is bitwise what the device
page held before the engine overwrote it, and a device page written by anything else in the
meantime is never backed up under its old key."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheConfig, CacheExecutor, CachePlanner, TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import ConfigError, InvalidArgumentError, PageIndexError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.memory import MemoryStore
from kvtier.registry import create_transfer_engine
from kvtier.testing import fill_random

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, page_size=5, dtype="bfloat16")
DEVICE_PAGES, HOST_PAGES = 13, 11


class Rig:
    """A planner and an executor over random pools; ``l3`` adds a memory store."""

    def __init__(self, seed: int, l3: bool = False):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.dpool = DeviceKVPool.empty(SPEC, DEVICE_PAGES)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, self.gen)
        self.host = HostKVPool(SPEC, HOST_PAGES, allocator=TorchPinnedAllocator())
        fill_random(self.host.raw, self.gen)
        self.store = MemoryStore(spec=SPEC) if l3 else None
        if self.store is not None:
            self.store.attach(self.host)
        engine = create_transfer_engine("torch", self.dpool, self.host)
        self.ex = CacheExecutor(host_pool=self.host, engine=engine, store=self.store,
                                owned=(engine, self.host) + ((self.store,) if l3 else ()))
        cfg = {"model_id": "on-evict", "l2_backup": "on_evict"}
        self.pl = CachePlanner(cfg, spec=SPEC, device_layout="nhd", num_host_pages=HOST_PAGES,
                               l3_exists=self.store.batch_exists if l3 else None)

    def prompt(self, pages: int) -> list[int]:
        return [self.rng.randrange(1, 30000) for _ in range(pages * SPEC.page_size)]

    def page(self, d: int) -> torch.Tensor:
        return self.dpool.page_bytes(d).clone()

    def scribble(self, pages: list[int]) -> None:
        """The engine writes these device pages (other tokens)."""
        for d in pages:
            for c in range(SPEC.num_components):
                for layer in range(SPEC.num_layers):
                    fill_random(self.dpool.page(c, layer, d), self.gen)

    def run(self, plan) -> None:
        if plan.empty:
            self.pl.complete(plan.failed())
            return
        self.ex.submit(plan)
        assert self.ex.wait(plan.plan_id, 30) and self.ex.wait_idle(30)
        for res in self.ex.poll():
            self.pl.complete(res)

    def close(self) -> None:
        self.ex.close(30)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_only_reused_pages_are_backed_up_and_come_back_bitwise(seed):
    rig = Rig(seed)
    try:
        keys = rig.pl.keys(rig.prompt(9))
        dev = rig.rng.sample(range(DEVICE_PAGES), 9)          # random device pages
        assert rig.pl.defer_save(keys, dev[2:], 2) == 7       # the first 2: an L1 prefix hit
        assert rig.pl.deferred_pages == 7 and rig.pl.l2_pages() == {}
        held = {d: rig.page(d) for d in dev}
        # the engine hands 3 of them (and 2 pages it never deferred) out again
        again = rig.rng.sample(dev[2:], 3)
        other = [d for d in range(DEVICE_PAGES) if d not in dev][:2]
        plan = rig.pl.plan_reused(again + other)
        assert sorted(d for d, _ in plan.backups) == sorted(again)
        rig.run(plan)
        rig.scribble(again + other)
        assert rig.pl.deferred_pages == 4
        assert rig.pl.metrics()["reused_backup_pages"] == 3
        # each reused page is in L2 under its own key, byte for byte what the device held
        pos = {d: i for i, d in enumerate(dev)}
        l2 = rig.pl.l2_pages()
        assert sorted(l2) == sorted(keys[pos[d]] for d in again)
        for d in again:
            target = rig.rng.choice(other)
            load = rig.pl.plan_load(keys, [target], pos[d])
            assert load.loads and load.load_pages == (target,)
            rig.run(load)
            assert torch.equal(rig.page(target), held[d])
        # a page reused twice is backed up once
        assert rig.pl.plan_reused(again).empty
    finally:
        rig.close()


def test_a_device_page_a_load_writes_is_never_backed_up_under_its_old_key():
    rig = Rig(4)
    try:
        a, b = rig.pl.keys(rig.prompt(3)), rig.pl.keys(rig.prompt(3))
        rig.pl.defer_save(a, [0, 1, 2])
        rig.run(rig.pl.plan_save(b, [5, 6, 7]))             # b into L2 (on save, directly)
        load = rig.pl.plan_load(b, [1, 2, 3])               # b loaded over a's pages 1 and 2
        assert rig.pl.metrics()["deferred_dropped_pages"] == 2
        rig.run(load)
        plan = rig.pl.plan_reused([0, 1, 2])
        assert [d for d, _ in plan.backups] == [0]           # only page 0 still holds a
        rig.run(plan)
        assert set(rig.pl.l2_pages()) == set(b) | {a[0]}
    finally:
        rig.close()


def test_pages_already_in_l2_are_not_deferred_and_l3_writes_follow_the_reuse():
    rig = Rig(5, l3=True)
    try:
        keys = rig.pl.keys(rig.prompt(4))
        rig.run(rig.pl.plan_save(keys[:2], [0, 1]))
        assert rig.pl.defer_save(keys, [0, 1, 2, 3]) == 2
        assert rig.store.batch_exists(keys) == 2
        held = rig.page(3)
        plan = rig.pl.plan_reused([3, 2])
        assert len(plan.backups) == 2 and len(plan.l3_writes) == 2
        rig.run(plan)
        assert rig.store.batch_exists(keys) == 4
        load = rig.pl.plan_load(keys, [9], 3)
        rig.run(load)
        assert torch.equal(rig.page(9), held)
    finally:
        rig.close()


@pytest.mark.parametrize("call,err", [
    (lambda pl, k: pl.plan_reused([3, -1]), PageIndexError),
    (lambda pl, k: pl.plan_reused([3, 3]), PageIndexError),
    (lambda pl, k: pl.plan_reused(["3"]), PageIndexError),
    (lambda pl, k: pl.defer_save(k, [4, 5, 6], 1), InvalidArgumentError),
    (lambda pl, k: pl.defer_save(k, [4, 4]), PageIndexError),
    (lambda pl, k: pl.plan_reused([3], l3_write="yes"), InvalidArgumentError)],
    ids=["negative", "duplicate", "not-an-int", "more-pages-than-keys", "defer-duplicate",
         "l3-write-not-bool"])
def test_bad_input_is_a_one_line_error_before_anything_changes(call, err):
    rig = Rig(6)
    try:
        keys = rig.pl.keys(rig.prompt(3))
        rig.pl.defer_save(keys, [3, 7, 8])
        with pytest.raises(err) as exc:
            call(rig.pl, keys)
        assert "\n" not in str(exc.value)
        assert rig.pl.deferred_pages == 3 and rig.pl.pending_plans() == []
        assert [d for d, _ in rig.pl.plan_reused([8, 7, 3]).backups] == [8, 7, 3]
    finally:
        rig.close()


def test_the_setting_is_checked_and_refused_where_l1_is_kvtiers_own():
    with pytest.raises(ConfigError, match="l2_backup"):
        CacheConfig.from_dict({"model_id": "m", "l2_backup": "later"})
    pool = DeviceKVPool.empty(SPEC, 4)
    with pytest.raises(ConfigError, match="l2_backup='on_evict' needs an engine"):
        TieredKVCache({"model_id": "m", "l2_backup": "on_evict", "host_pool_pages": 4},
                      device_pool=pool, free_device_pages=lambda pages: None)
