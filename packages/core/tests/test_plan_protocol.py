"""The plan protocol as `CacheExecutor` enforces it (rules in `kvtier.cache.plans`): a plan id
runs once, ever; host pages may alias inside a plan only along the two ordered chains (L3 read
-> load, backup -> L3 write); malformed operations are typed errors. Each refusal is checked
on real pools and a real store, filled with random bytes, to leave every byte as it was."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheExecutor, Plan, PlanResult
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import InvalidArgumentError, PageIndexError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.memory import MemoryStore
from kvtier.registry import create_transfer_engine
from kvtier.testing import fill_random

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
SCRATCH = 7                     # a host page no plan uses: where store objects are read back


class Rig:
    """A CacheExecutor over CPU pools, the torch engine and the memory store, all random."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.dpool = DeviceKVPool.empty(SPEC, 8)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, self.gen)
        self.host = HostKVPool(SPEC, 8, allocator=TorchPinnedAllocator())
        fill_random(self.host.raw, self.gen)
        self.store = MemoryStore(spec=SPEC)
        self.store.attach(self.host)
        engine = create_transfer_engine("torch", self.dpool, self.host)
        # one L3 thread: a plan's store calls run in the order it starts them
        self.ex = CacheExecutor(host_pool=self.host, engine=engine, store=self.store,
                                l3_io_threads=1, owned=(engine, self.store, self.host))

    def key(self) -> bytes:
        return self.rng.randbytes(32)

    def run(self, plan: Plan) -> PlanResult:
        self.ex.submit(plan)
        assert self.ex.wait(plan.plan_id, 10)
        (res,) = self.ex.poll()
        return res

    def submit_or_run(self, plan: Plan) -> Exception | None:
        """The error if ``plan`` is refused; else None, once it has run."""
        try:
            self.run(plan)
        except (InvalidArgumentError, PageIndexError) as exc:
            return exc
        return None

    def device(self, p: int) -> torch.Tensor:
        return self.dpool.page_bytes(p).clone()

    def hpage(self, p: int) -> torch.Tensor:
        return self.host.page_bytes_view(p).clone()

    def stored(self, key: bytes) -> torch.Tensor | None:
        """The bytes the store holds under ``key`` (read into the scratch host page)."""
        if not self.store.batch_get([key], [SCRATCH])[0]:
            return None
        return self.hpage(SCRATCH)

    def put(self, key: bytes, host_page: int) -> None:
        assert self.run(Plan(self.rng.randrange(1 << 40, 1 << 41),
                             l3_writes=((host_page, key),))).ok

    def close(self) -> None:
        self.ex.close()


def _snapshot(rig: Rig) -> tuple[torch.Tensor, torch.Tensor, dict[bytes, torch.Tensor]]:
    dev = torch.stack([rig.device(p) for p in range(rig.dpool.num_pages)])
    host = torch.stack([rig.hpage(p) for p in range(rig.host.num_pages) if p != SCRATCH])
    return dev, host, {k: v.clone() for k, v in rig.store._objects.items()}


def _assert_unchanged(rig: Rig, before: tuple) -> None:
    dev, host, objs = _snapshot(rig)
    assert torch.equal(dev, before[0]), "a device page changed"
    assert torch.equal(host, before[1]), "a host page changed"
    assert objs.keys() == before[2].keys(), "the store's keys changed"
    assert all(torch.equal(objs[k], before[2][k]) for k in objs), "a stored object changed"


@pytest.fixture
def rig():
    r = Rig(seed=20240611)
    yield r
    r.close()


# ----- a plan id runs once ------------------------------------------------------------------
def test_a_polled_plan_is_not_run_again(rig):
    """Replaying a load after its result was polled would copy whatever the host page holds
    by then over a device page the engine has written since."""
    load = Plan(5, loads=((2, 3),))
    assert rig.run(load).ok
    assert torch.equal(rig.device(3), rig.hpage(2))
    assert rig.run(Plan(6, backups=((0, 2),))).ok          # host page 2 now holds page 0's KV
    fill_random(rig.dpool.layers[0][0], rig.gen)          # the engine writes new KV in L1
    fill_random(rig.dpool.layers[1][1], rig.gen)
    before = _snapshot(rig)
    err = rig.submit_or_run(load)
    _assert_unchanged(rig, before)                         # before the fix: page 3 overwritten
    assert isinstance(err, InvalidArgumentError) and "already submitted" in str(err)
    assert "\n" not in str(err)
    assert rig.ex.poll() == []


@pytest.mark.parametrize("pid", [9, -9, 0, (123 << 32) | 4, -((123 << 32) | 4)])
def test_every_id_is_refused_after_it_ran_whatever_its_sign(rig, pid):
    assert rig.run(Plan(pid, loads=((1, 1),))).ok
    before = _snapshot(rig)
    for plan in (Plan(pid, loads=((1, 1),)), Plan(pid, backups=((4, 4),)), Plan(pid)):
        with pytest.raises(InvalidArgumentError, match="already submitted"):
            rig.ex.submit(plan)
    _assert_unchanged(rig, before)
    assert rig.run(Plan(-pid if pid else 1, loads=((1, 1),))).ok   # its negation is another


def test_ids_out_of_order_and_a_bounded_memory(rig):
    """Ids arrive out of order (a planner makes plan 7 before plan 5 is submitted) and with
    either sign (a save's L3 writes as -id): each runs once. Past the bound the oldest are
    forgotten into a floor per group (sign, bits above the low 32: one planner) that still
    refuses them, and the memory stays bounded."""
    ex = rig.ex
    ex._submitted.limit = 64
    hi = 77 << 32
    order = []
    for block in range(0, 400, 10):                      # shuffled within blocks of ten
        ids = [hi | i for i in range(block + 1, block + 11) if i != 2]
        ids += [-pid for pid in ids if rig.rng.random() < 0.5]
        rig.rng.shuffle(ids)
        order += ids
    for pid in order:
        ex.submit(Plan(pid))
        assert len(ex._submitted) <= 64
    assert ex.wait_idle(10)
    assert {r.plan_id for r in ex.poll()} == set(order)
    for pid in rig.rng.sample(order, 60) + order[-20:]:
        with pytest.raises(InvalidArgumentError, match="already submitted"):
            ex.submit(Plan(pid))
    with pytest.raises(InvalidArgumentError):   # never submitted, but far below the floor
        ex.submit(Plan(hi | 2))
    for pid in (hi | 401, -(hi | 401), (5 << 32) | 1, 3, -3):
        ex.submit(Plan(pid))                    # that planner's next; a new planner; another
    assert ex.wait_idle(10)


# ----- aliased host pages -------------------------------------------------------------------
def test_an_l3_read_into_a_page_an_l3_write_stores_is_refused(rig):
    """Before: the write stored the read's object -- key A's bytes under key B."""
    a, b = rig.key(), rig.key()
    rig.put(a, 0)
    assert not torch.equal(rig.hpage(0), rig.hpage(1))
    before = _snapshot(rig)
    err = rig.submit_or_run(Plan(11, l3_reads=((a, 1),), l3_writes=((1, b),)))
    got = rig.stored(b)
    assert got is None or not torch.equal(got, rig.stored(a)), "key B holds key A's bytes"
    _assert_unchanged(rig, before)
    assert isinstance(err, PageIndexError) and "L3 read" in str(err) and "\n" not in str(err)


def test_a_backup_into_a_page_a_load_reads_is_refused(rig):
    """Before: the load copied the backup's page (device page 0) into device page 5."""
    before = _snapshot(rig)
    err = rig.submit_or_run(Plan(12, backups=((0, 2),), loads=((2, 5),)))
    assert not torch.equal(rig.device(5), rig.device(0)), "device page 5 got page 0's KV"
    _assert_unchanged(rig, before)
    assert isinstance(err, PageIndexError) and "backup" in str(err)


def test_an_l3_read_and_a_backup_into_one_page_are_refused(rig):
    """Before: the host page held one fill or the other, and the write-through of the
    backup (a legal chain) stored whichever landed last under the backup's key."""
    a, b = rig.key(), rig.key()
    rig.put(a, 0)
    before = _snapshot(rig)
    err = rig.submit_or_run(Plan(13, l3_reads=((a, 3),), backups=((4, 3),),
                                 l3_writes=((3, b),)))
    _assert_unchanged(rig, before)
    assert isinstance(err, PageIndexError)


def test_the_two_chains_still_run_and_land_the_right_bytes(rig):
    a, b = rig.key(), rig.key()
    rig.put(a, 0)
    want_a = rig.stored(a)
    res = rig.run(Plan(14, l3_reads=((a, 2),), loads=((2, 6),)))        # L3 -> L2 -> L1
    assert res.ok and torch.equal(rig.device(6), want_a)
    res = rig.run(Plan(15, backups=((1, 4),), l3_writes=((4, b),)))     # write-through
    assert res.ok and torch.equal(rig.stored(b), rig.device(1))
    res = rig.run(Plan(16, loads=((4, 2),), l3_writes=((4, rig.key()),)))   # both only read
    assert res.ok and torch.equal(rig.device(2), rig.device(1))


# ----- malformed operations -----------------------------------------------------------------
@pytest.mark.parametrize("plan", [
    Plan(21, loads=((1, 2, 3),)),
    Plan(22, backups=((1,),)),
    Plan(23, loads=(4,)),
    Plan(24, l3_writes=((1, "key"),)),
    Plan(25, l3_reads=((bytearray(b"k"), 1),)),
    Plan(26, loads="ab"),                                     # type: ignore[arg-type]
    Plan("27", loads=((1, 2),)),                              # type: ignore[arg-type]
    Plan(True, loads=((1, 2),)),                              # type: ignore[arg-type]
], ids=["triple", "single", "not-a-pair", "str-key", "bytearray-key", "str-ops", "str-id",
        "bool-id"])
def test_malformed_operations_are_typed_errors(rig, plan):
    before = _snapshot(rig)
    with pytest.raises(InvalidArgumentError) as exc:
        rig.ex.submit(plan)
    assert "\n" not in str(exc.value)
    _assert_unchanged(rig, before)
    assert rig.ex.poll() == []


# ----- results the planner cannot have asked for ----------------------------------------------
def _planner():
    from kvtier.cache import CachePlanner
    return CachePlanner({"model_id": "protocol"}, spec=SPEC, device_layout="nhd",
                        num_host_pages=8)


def _prompt(seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 30000) for _ in range(4 * SPEC.page_size)]


def test_a_result_of_another_planner_is_refused_not_booked():
    """A scheduler restarts while a worker still runs the old scheduler's plan: that plan's
    result must not be booked against the new planner's plan of the same number (its backups
    would register host pages holding another prompt's bytes under this prompt's keys)."""
    old, new = _planner(), _planner()
    a = old.plan_save(old.keys(_prompt(1)), [0, 1, 2, 3])
    b = new.plan_save(new.keys(_prompt(2)), [4, 5, 6, 7])
    stale = PlanResult(a.plan_id, backups=(True,) * len(a.backups))
    with pytest.raises(InvalidArgumentError, match="not from this planner"):
        new.complete(stale)
    assert new.pending_plans() == [b.plan_id] and new.l2_pages() == {}
    new.complete(PlanResult(b.plan_id, backups=(True,) * len(b.backups)))
    assert len(new.l2_pages()) == 4


@pytest.mark.parametrize("bad", [
    dict(backups=(1, 1, 1, 1)), dict(backups=("yes",) * 4), dict(backups=[True] * 4),
    dict(backups=(True,) * 4, held_host_pages=(99,)),
    dict(backups=(True,) * 4, released_host_pages=(-1,))],
    ids=["ints", "strings", "a-list", "held-out-of-range", "released-negative"])
def test_results_that_are_not_bools_or_host_pages_are_refused(bad):
    pl = _planner()
    p = pl.plan_save(pl.keys(_prompt(3)), [0, 1, 2, 3])
    with pytest.raises(InvalidArgumentError):
        pl.complete(PlanResult(p.plan_id, **bad))
    assert pl.pending_plans() == [p.plan_id] and pl.l2_pages() == {}


def test_wait_layer_waits_for_the_loads_an_l3_read_feeds(rig):
    """A plan with L2 loads and loads fed by a slow L3 read: `wait_layer(i)` returns only when
    layer i of every load, the L3-fed ones included, is in its device pages."""
    import time
    key = rig.key()
    rig.put(key, 2)                                    # the object L3 will serve
    want_l3, want_l2 = rig.hpage(2), rig.hpage(0)
    slow = rig.store.batch_get

    def batch_get(keys, pages):
        time.sleep(0.3)
        return slow(keys, pages)
    rig.store.batch_get = batch_get
    plan = Plan(77, l3_reads=((key, 3),), loads=((0, 4), (3, 5)))
    rig.ex.submit(plan)
    for layer in range(SPEC.num_layers):
        rig.ex.wait_layer(77, layer, timeout=10)
    assert torch.equal(rig.device(4), want_l2)
    assert torch.equal(rig.device(5), want_l3)         # not still the old bytes
    assert rig.ex.wait(77, 10)
    assert rig.ex.poll()[0].ok
