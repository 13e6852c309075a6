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
    r = Rig(3, l3_batch_pages=2)
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
