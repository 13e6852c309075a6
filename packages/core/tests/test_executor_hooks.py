"""The hooks through which `TieredKVCache` runs all of its data on a `CacheExecutor`:
``on_done`` (a result is booked, not queued for `poll`), ``on_read`` (each batch of L3 reads
as it lands, before the loads that wait on it), ``stop`` (store work ends between calls), the
`PlanHandle` a submit returns, the write-queue bound and the failure hook. Real CPU pools,
the torch engine and the memory store, filled with random bytes."""

from __future__ import annotations

import random
import threading
import time

import torch

from kvtier import KVSpec
from kvtier.cache import CacheExecutor, Plan
from kvtier.device_pool import DeviceKVPool
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.memory import MemoryStore
from kvtier.registry import create_transfer_engine
from kvtier.testing import fill_random

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")


class Rig:
    def __init__(self, seed: int, *, store=None, **kw):
        gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.dpool = DeviceKVPool.empty(SPEC, 11)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, gen)
        self.host = HostKVPool(SPEC, 13, allocator=TorchPinnedAllocator())
        fill_random(self.host.raw, gen)
        self.store = store if store is not None else MemoryStore(spec=SPEC)
        self.store.attach(self.host)
        engine = create_transfer_engine("torch", self.dpool, self.host)
        self.ex = CacheExecutor(host_pool=self.host, engine=engine, store=self.store,
                                l3_io_threads=1, owned=(engine, self.store, self.host), **kw)

    def put(self, n: int) -> list[tuple[bytes, torch.Tensor]]:
        """``n`` random objects in the store, written from random host pages."""
        out = []
        for hp in self.rng.sample(range(13), n):
            key = self.rng.randbytes(32)
            assert self.store.batch_set([key], [hp]) == [True]
            out.append((key, self.host.page_bytes_view(hp).clone()))
        return out


def test_on_done_books_instead_of_poll_and_the_handle_waits_for_it():
    r = Rig(1)
    dev = random.Random(1).sample(range(11), 5)
    host = random.Random(2).sample(range(13), 5)
    got = []

    def on_done(res):
        time.sleep(0.05)                    # a slow booking: the handle waits for it
        got.append(res)
    h = r.ex.submit(Plan(7, backups=tuple(zip(dev, host))), on_done=on_done)
    h.synchronize()
    assert got and h.done() and h.result is got[0] and got[0].ok
    assert r.ex.poll() == []                # booked, not queued
    for d, hp in zip(dev, host):
        assert torch.equal(r.host.page_bytes_view(hp), r.dpool.page_bytes(d))
    r.ex.close()


def test_on_read_sees_each_batch_before_its_loads_and_stop_ends_the_rest():
    r = Rig(3, l3_batch_pages=2, l3_stream_layers=False)  # (streamed: tests/test_stream.py)
    objs = r.put(5)
    free = [hp for hp in range(13)]
    dst = free[-5:]
    dev = random.Random(4).sample(range(11), 5)
    batches = []

    def on_read(first, count, got):
        batches.append((first, count, list(got)))
    plan = Plan(9, l3_reads=tuple((k, hp) for (k, _), hp in zip(objs, dst)),
                loads=tuple(zip(dst, dev)))
    h = r.ex.submit(plan, on_read=on_read)
    h.synchronize()
    res = r.ex.poll()[0]
    assert batches == [(0, 2, [True, True]), (2, 2, [True, True]), (4, 1, [True])]
    assert res.ok
    for (_, want), d in zip(objs, dev):
        assert torch.equal(r.dpool.page_bytes(d), want)
    # a stop after the first batch: the rest are not asked for, and fail untried
    seen = []
    plan = Plan(10, l3_reads=tuple((k, hp) for (k, _), hp in zip(objs, dst)))
    r.ex.submit(plan, on_read=lambda f, c, g: seen.append(f), stop=lambda: bool(seen))
    assert r.ex.wait(10, 5)
    res = r.ex.poll()[0]
    assert seen == [0] and res.l3_reads == (True, True, False, False, False)
    assert res.l3_reads_tried == 2
    r.ex.close()


class _SlowStore(MemoryStore):
    def __init__(self, gate, **kw):
        super().__init__(**kw)
        self.gate = gate

    def batch_set(self, keys, pages):
        self.gate.wait(5)
        return super().batch_set(keys, pages)


def test_writes_past_the_queue_bound_are_dropped_and_counted():
    gate = threading.Event()
    store = _SlowStore(gate, spec=SPEC)
    r = Rig(5, store=store, l3_max_queued_pages=3)
    gate.set()
    r.put(1)                                 # (the store works)
    gate.clear()
    rng = random.Random(6)
    keys = [rng.randbytes(32) for _ in range(8)]
    r.ex.submit(Plan(1, l3_writes=((0, keys[0]),)))         # runs, blocked on the gate
    r.ex.submit(Plan(2, l3_writes=((1, keys[1]), (2, keys[2]))))   # queued: 2 pages
    r.ex.submit(Plan(3, l3_writes=((3, keys[3]), (4, keys[4]))))   # 2 + 2 > 3: dropped
    gate.set()
    assert r.ex.wait_idle(5)
    res = {x.plan_id: x for x in r.ex.poll()}
    assert res[3].l3_writes == (False, False) and res[2].l3_writes == (True, True)
    assert r.ex.metrics()["l3_writes_dropped"] == 2
    assert store.batch_exists([keys[3]]) == 0
    r.ex.close()


def test_a_failed_store_is_reported_through_the_hook():
    class Broken(MemoryStore):
        def batch_get(self, keys, pages):
            raise OSError("disk gone")
    failures = []
    r = Rig(7, store=Broken(spec=SPEC), l3_error_limit=2,
            on_failure=lambda tier, msg, cause: failures.append((tier, msg)))
    objs = r.put(2)
    for pid in (1, 2):
        r.ex.submit(Plan(pid, l3_reads=((objs[0][0], 12),)))
        assert r.ex.wait(pid, 5)
    assert failures and failures[0][0] == "l3" and "2 calls in a row" in failures[0][1]
    assert r.ex.l3_state.startswith("failed")
    r.ex.close()


def test_a_plan_handle_waits_like_an_engine_handle_and_synchronize_waits_for_booking():
    """``wait``/``wait_layer`` order the caller after the loads (an accelerator's stream goes
    on; the thread is not held for the booking); ``synchronize`` waits for ``on_done``."""
    r = Rig(9)
    dev = random.Random(9).sample(range(11), 4)
    host = random.Random(10).sample(range(13), 4)
    release = threading.Event()
    booked = []

    def on_done(res):
        release.wait(5)                     # a booking that takes its time
        booked.append(res)
    h = r.ex.submit(Plan(11, loads=tuple(zip(host, dev))), on_done=on_done)
    h.wait_layer(SPEC.num_layers - 1)
    h.wait()
    assert not h.done() and not booked      # the thread was not held for the booking
    for hp, d in zip(host, dev):            # (on the CPU the copies have landed)
        assert torch.equal(r.dpool.page_bytes(d), r.host.page_bytes_view(hp))
    release.set()
    h.synchronize()
    assert h.done() and booked and booked[0].ok
    r.ex.close()


class HeldWrites(MemoryStore):
    """A memory store whose writes wait until the test lets them go."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.go = threading.Event()

    def batch_set(self, keys, host_pages):
        assert self.go.wait(10)
        return super().batch_set(keys, host_pages)


def _save(r, pid, n, seed):
    rng = random.Random(seed)
    dev = rng.sample(range(11), n)
    host = rng.sample(range(13), n)
    keys = [rng.randbytes(32) for _ in range(n)]
    return Plan(pid, backups=tuple(zip(dev, host)), l3_writes=tuple(zip(host, keys))), dev, keys


def test_a_two_part_save_reports_its_backups_before_its_writes_land():
    """vLLM's worker books a save's backups in the step after it (their pages serve hits from
    then on) while its L3 writes still run: the executor reports the two in that order."""
    store = HeldWrites(spec=SPEC)
    r = Rig(21, store=store)
    plan, dev, keys = _save(r, 5, 4, 22)
    r.ex.submit(plan, two_part=True)
    assert r.ex.wait_backups(5, 10)                   # the writes are still held
    first = r.ex.poll()
    assert [(x.plan_id, x.writes_pending, x.backups, x.l3_writes) for x in first] == \
        [(5, True, (True,) * 4, ())]
    assert not r.ex.wait(5, 0.05)
    store.go.set()
    assert r.ex.wait(5, 10)
    second = r.ex.poll()
    assert [(x.plan_id, x.writes_pending, x.backups, x.l3_writes) for x in second] == \
        [(5, False, (), (True,) * 4)]
    probe = r.host.alloc(1)
    for key, d in zip(keys, dev):                     # each object is its page's bytes
        assert store.batch_get([key], probe) == [True]
        assert torch.equal(r.host.page_bytes_view(probe[0]), r.dpool.page_bytes(d))
    r.ex.close()


def test_a_two_part_save_books_in_order_and_a_plan_without_late_writes_in_one():
    store = HeldWrites(spec=SPEC)
    r = Rig(23, store=store)
    got = []
    plan, _, _ = _save(r, 8, 3, 24)
    booked = threading.Event()

    def on_done(res):
        got.append(res)
        if not res.writes_pending:
            booked.set()
    r.ex.submit(plan, on_done=on_done, two_part=True)
    assert r.ex.wait_backups(8, 10)
    store.go.set()
    assert booked.wait(10)
    assert [x.writes_pending for x in got] == [True, False]
    assert got[1].l3_writes == (True,) * 3
    # backups only, or writes alone: nothing outlasts anything, one result each
    only, _, _ = _save(r, 9, 2, 25)
    r.ex.submit(Plan(9, backups=only.backups), two_part=True)
    assert r.ex.wait(9, 10)
    assert [(x.plan_id, x.writes_pending) for x in r.ex.poll()] == [(9, False)]
    r.ex.close()


def test_a_two_part_save_whose_backups_fail_is_one_result_with_no_write_tried():
    r = Rig(27)
    plan, _, keys = _save(r, 4, 3, 28)

    def broken(*a, **k):
        raise RuntimeError("copy engine gone")
    r.ex.engine.backup = broken
    r.ex.submit(plan, two_part=True)
    assert r.ex.wait(4, 10)
    (res,) = r.ex.poll()
    assert not res.writes_pending and res.l3_writes == (False,) * 3
    assert r.store.batch_exists(keys) == 0
    r.ex.close()


def test_a_close_that_cuts_a_two_part_save_short_reports_its_writes_failed():
    """After its first result, what is left of a two-part save is its writes: a close that
    gives up on them reports those failed, not the save as a whole again."""
    store = HeldWrites(spec=SPEC)
    r = Rig(29, store=store, l3_call_timeout_s=60.0)
    plan, _, _ = _save(r, 6, 2, 30)
    r.ex.submit(plan, two_part=True)
    assert r.ex.wait_backups(6, 10)
    assert [x.writes_pending for x in r.ex.poll()] == [True]
    died = []
    r.ex._on_failure = lambda tier, message, cause: died.append(message)
    try:
        r.ex.close(timeout=0.3)
        assert [(x.plan_id, x.writes_pending, x.backups, x.l3_writes)
                for x in r.ex.poll()] == [(6, False, (), (False, False))]
    finally:
        store.go.set()
    # the write the close gave up on returns later: nothing more is reported, no thread dies
    for t in r.ex.l3.workers:
        t.join(5)
    assert r.ex.poll() == [] and died == []
