"""The cache's two halves apart: `CachePlanner` (index and policies, plain data only) and
`CacheExecutor` (host pool, engine, store), talking only through pickled plans and results,
with L2 and L3, as a scheduler process and a worker process would."""

from __future__ import annotations

import pickle
import random
import threading
import time

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheExecutor, CachePlanner, Lookup, Plan, PlanResult
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import InvalidArgumentError, PageIndexError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.testing import fill_random
from kvtier.testing.contracts import raw_bytes

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")


def wire(obj):
    """Cross a process boundary the way engine metadata does."""
    return pickle.loads(pickle.dumps(obj))


class Split:
    def __init__(self, *, l3: bool = True, host_pages: int = 8, device_pages: int = 32,
                 **config):
        self.dpool = DeviceKVPool.empty(SPEC, device_pages)
        self.gen = torch.Generator().manual_seed(3)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, self.gen)
        cfg = {"model_id": "split", "host_pool_pages": host_pages, "l3_io_threads": 1,
               **config}
        if l3:
            cfg["l3_store"] = "memory"
        self.ex = CacheExecutor.from_config(cfg, device_pool=self.dpool)
        exists = self.ex.store.batch_exists if l3 else None   # in vLLM: the store's own client
        self.pl = CachePlanner(cfg, spec=SPEC, device_layout="nhd", num_host_pages=host_pages,
                               l3_exists=exists)

    def run(self, plan: Plan) -> PlanResult:
        self.ex.submit(wire(plan))
        assert self.ex.wait(plan.plan_id, 10)
        (res,) = self.ex.poll()
        res = wire(res)
        self.pl.complete(res)
        self.pl.check()
        return res

    def page(self, p: int) -> torch.Tensor:
        return torch.cat([raw_bytes(self.dpool.page(c, layer, p))
                          for layer in range(SPEC.num_layers)
                          for c in range(SPEC.num_components)])

    def close(self):
        self.ex.close()


@pytest.fixture
def split():
    s = Split()
    yield s
    s.close()


def toks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def test_save_then_load_from_l2_is_bitwise(split):
    keys = split.pl.keys(toks(4 * 5))
    src = random.Random(1).sample(range(16), 5)
    want = [split.page(p).clone() for p in src]
    res = split.run(split.pl.plan_save(keys, src))
    assert res.ok and len(res.backups) == 5 and len(res.l3_writes) == 5   # write-through
    assert split.pl.lookup(keys) == Lookup(0, 5, 0)
    dst = random.Random(2).sample(range(16, 32), 3)
    plan = split.pl.plan_load(keys, dst, start=2)
    assert not plan.l3_reads and len(plan.loads) == 3
    res = split.run(plan)
    assert res.loaded_prefix == 3
    for i, d in enumerate(dst):
        assert torch.equal(split.page(d), want[2 + i])


def test_load_through_l3_after_l2_eviction(split):
    a, b = split.pl.keys(toks(4 * 6, 1)), split.pl.keys(toks(4 * 6, 2))
    pa = list(range(0, 6))
    want = [split.page(p).clone() for p in pa]
    assert split.run(split.pl.plan_save(a, pa)).ok
    assert split.run(split.pl.plan_save(b, list(range(6, 12)))).ok   # evicts most of a
    hit = split.pl.lookup(a)
    assert hit.l2_pages < 6 and hit.pages == 6                  # the rest is in L3
    dst = list(range(20, 26))
    plan = split.pl.plan_load(a, dst)
    assert len(plan.l3_reads) == 6 - hit.l2_pages
    res = split.run(plan)
    assert res.ok and res.loaded_prefix == len(plan.loads)
    for i, d in enumerate(dst[:len(plan.loads)]):
        assert torch.equal(split.page(d), want[i])
    m = split.pl.metrics()
    assert m["l3_loaded_pages"] == len(plan.l3_reads) and m["load_failed_pages"] == 0
    assert m["l3_hit_pages"] == len(plan.l3_reads) and m["l2_hit_pages"] == hit.l2_pages
    assert m["l3_matched_pages"] == 6 - hit.l2_pages


def test_save_without_l3_write_keeps_l2_and_counts_the_skipped_writes(split):
    """``l3_write=False`` (the connector's ``l3_write_when_slow=False`` while L3 is slower
    than recomputing): the pages join L2 bitwise, none goes to L3, each is counted; the next
    save writes through again."""
    keys = split.pl.keys(toks(4 * 4, 9))
    src = random.Random(4).sample(range(16), 4)
    want = [split.page(p).clone() for p in src]
    plan = split.pl.plan_save(keys, src, l3_write=False)
    assert not plan.l3_writes and len(plan.backups) == 4
    assert split.run(plan).ok
    assert split.ex.store.batch_exists(keys) == 0
    assert split.pl.metrics()["cost_skipped_l3_writes"] == 4
    dst = [20, 21, 22, 23]
    assert split.run(split.pl.plan_load(keys, dst)).loaded_prefix == 4
    for w, d in zip(want, dst):
        assert torch.equal(split.page(d), w)
    more = split.pl.keys(toks(4 * 6, 9))                 # the same 4 pages and 2 more
    plan = split.pl.plan_save(more, [24, 25], start=4)
    assert len(plan.l3_writes) == 2 and split.run(plan).ok
    assert split.ex.store.batch_exists(more[4:]) == 2
    assert split.pl.metrics()["cost_skipped_l3_writes"] == 4
    with pytest.raises(InvalidArgumentError):
        split.pl.plan_save(keys, src, l3_write="no")


def test_l3_miss_fails_only_those_loads(split):
    keys = split.pl.keys(toks(4 * 3, 5))
    assert split.run(split.pl.plan_save(keys, [0, 1, 2])).ok
    split.run(split.pl.plan_evict(8))
    split.ex.store.delete([keys[1]])
    res = split.run(split.pl.plan_load(keys, [10, 11, 12]))
    assert res.l3_reads == (True, False, True) and res.loaded_prefix == 1
    assert keys[1] not in split.pl.l2_pages()


def test_a_read_never_tried_marks_nothing_unreadable(split):
    """Only a read the store was asked for says an object cannot be read: a load plan that
    never ran (failed by the integration) or ran while L3 was off leaves its L3 pages offered,
    while a real miss still marks its key."""
    keys = split.pl.keys(toks(4 * 3, 15))
    assert split.run(split.pl.plan_save(keys, [0, 1, 2])).ok
    split.run(split.pl.plan_evict(8))
    assert split.pl.lookup(keys) == Lookup(0, 0, 3)
    plan = split.pl.plan_load(keys, [10, 11, 12])
    assert len(plan.l3_reads) == 3
    split.pl.fail(plan.plan_id)                         # a worker gone: never ran
    assert split.pl.lookup(keys) == Lookup(0, 0, 3)
    assert split.pl.metrics().get("l3_unreadable_marked", 0) == 0
    split.ex.l3.fail("test: the tier is down", None)    # the data path cannot read L3
    res = split.run(split.pl.plan_load(keys, [10, 11, 12]))
    assert res.l3_reads == (False,) * 3 and res.l3_reads_tried == 0
    split.ex.l3.restart()
    assert split.pl.lookup(keys) == Lookup(0, 0, 3)
    split.ex.store.delete([keys[1]])                    # a real miss: that key is marked
    res = split.run(split.pl.plan_load(keys, [10, 11, 12]))
    assert res.l3_reads == (True, False, True) and res.l3_reads_tried == 3
    assert split.pl.metrics()["l3_unreadable_marked"] == 1
    assert split.pl.lookup(keys[1:]) == Lookup(0, 0, 0)
    with pytest.raises(InvalidArgumentError, match="l3_reads_tried"):
        bad = split.pl.plan_load(keys[:1], [20])
        split.pl.complete(PlanResult(bad.plan_id, l3_reads=(False,), loads=(False,),
                                     l3_reads_tried=2))


def test_write_back_writes_to_l3_on_l2_eviction():
    s = Split(write_policy="write_back", host_pages=4)
    try:
        keys = s.pl.keys(toks(4 * 4, 7))
        res = s.run(s.pl.plan_save(keys, [0, 1, 2, 3]))
        assert res.ok and not res.l3_writes                    # no write until eviction
        plan = s.pl.plan_evict(4)
        assert sorted(k for _, k in plan.l3_writes) == sorted(keys)
        assert s.run(plan).ok
        assert not s.pl.l2_pages() and s.pl.lookup(keys) == Lookup(0, 0, 4)
    finally:
        s.close()


def test_l2_only_planner_without_l3():
    s = Split(l3=False, host_pages=3)
    try:
        keys = s.pl.keys(toks(4 * 4, 9))
        res = s.run(s.pl.plan_save(keys, [0, 1, 2, 3]))
        assert len(res.backups) == 3 and not res.l3_writes     # full: one skipped
        assert s.pl.lookup(keys) == Lookup(0, 3, 0)
        assert s.pl.metrics()["backup_skipped_pages"] == 1
    finally:
        s.close()


def test_pending_pages_are_neither_hits_nor_evicted(split):
    keys = split.pl.keys(toks(4 * 2, 11))
    plan = split.pl.plan_save(keys, [0, 1])
    assert split.pl.lookup(keys).l2_pages == 0                  # in flight: not a hit yet
    assert split.pl.plan_save(keys, [2, 3]).backups == ()       # nor backed up twice
    load = split.pl.plan_load(split.pl.keys(toks(4 * 2, 11)), [4])
    assert not load.loads or load.l3_reads                      # nothing from L2 yet
    split.run(plan)
    split.pl.fail(load.plan_id)
    for pid in split.pl.pending_plans():
        split.pl.fail(pid)
    assert split.pl.lookup(keys).l2_pages == 2


def _two_part(split, plan):
    """Run a save as vLLM's worker does: the backups, reported at once with their writes
    pending, then the L3 writes, reported alone."""
    ex = split.ex
    ex.submit(wire(Plan(plan.plan_id, backups=plan.backups)))
    assert ex.wait(plan.plan_id, 10)
    (bres,) = ex.poll()
    ex.submit(wire(Plan(-plan.plan_id, l3_writes=plan.l3_writes)))
    first = PlanResult(plan.plan_id, backups=bres.backups, writes_pending=True)
    split.pl.complete(wire(first))
    split.pl.check()
    assert ex.wait(-plan.plan_id, 10)
    (wres,) = ex.poll()
    return PlanResult(plan.plan_id, l3_writes=wres.l3_writes)


def test_backed_up_pages_hit_while_their_l3_writes_run(split):
    """A save reported in two results: its pages serve L2 hits from the first (the backups),
    stay pinned -- not evicted, not written twice -- until the second (the writes) books
    them in L3; a load of them meanwhile is bitwise."""
    keys = split.pl.keys(toks(4 * 4, 21))
    src = random.Random(7).sample(range(16), 4)
    want = [split.page(p).clone() for p in src]
    plan = split.pl.plan_save(keys, src)
    assert len(plan.l3_writes) == 4
    final = _two_part(split, plan)
    assert split.pl.lookup(keys) == Lookup(0, 4, 0)              # hits now
    again = split.pl.plan_save(keys, [20, 21, 22, 23])
    assert again.empty
    split.pl.complete(again.failed())
    ev = split.pl.plan_evict(8)
    assert not ev.l3_writes and split.pl.lookup(keys).l2_pages == 4   # pinned for the writes
    split.run(ev)
    dst = [24, 25, 26, 27]
    assert split.run(split.pl.plan_load(keys, dst)).loaded_prefix == 4
    for w, d in zip(want, dst):
        assert torch.equal(split.page(d), w)
    assert split.pl.metrics()["l3_written_pages"] == 0
    split.pl.complete(wire(final))
    split.pl.check()
    assert split.pl.metrics()["l3_written_pages"] == 4 and not split.pl.pending_plans()
    split.run(split.pl.plan_evict(8))                           # unpinned: evictable now
    assert split.pl.lookup(keys) == Lookup(0, 0, 4)             # and in L3
    with pytest.raises(InvalidArgumentError):
        split.pl.complete(final)                                # booked once


@pytest.mark.parametrize("two_part", [False, True], ids=["one-result", "two-results"])
def test_a_page_a_lookup_found_in_l3_is_backed_up_but_not_written_again(two_part):
    """vLLM recomputes hit pages the split left to it (or that its own cache held) and saves
    them: those a lookup just found in L3 go to L2 without another L3 write; the others of
    the same save are written, and the booking pairs each write with its page."""
    split = Split(host_pages=6)
    try:
        keys = split.pl.keys(toks(4 * 6, 31))
        want = {k: split.page(p).clone() for k, p in zip(keys, [0, 1, 2, 13, 14, 15])}
        assert split.run(split.pl.plan_save(keys[:3], [0, 1, 2])).ok   # three in L2 and L3
        split.run(split.pl.plan_evict(6))                              # out of L2
        assert split.pl.lookup(keys) == Lookup(0, 0, 3)                # found in L3
        # saved again from other device pages (other bytes here, so that a second write of
        # the first three would show in what L3 returns)
        plan = split.pl.plan_save(keys, [10, 11, 12, 13, 14, 15])
        assert len(plan.backups) == 6
        assert [k for _, k in plan.l3_writes] == keys[3:]              # only the new ones
        assert {hp for hp, _ in plan.l3_writes} == {hp for _, hp in plan.backups[3:]}
        assert split.pl.metrics()["l3_known_skipped_writes"] == 3
        if two_part:
            split.pl.complete(wire(_two_part(split, plan)))
        else:
            assert split.run(plan).ok
        split.pl.check()
        # three written by the first save, three by this one
        assert split.pl.metrics()["l3_written_pages"] == 6 and not split.pl.pending_plans()
        split.run(split.pl.plan_evict(6))
        assert split.pl.lookup(keys) == Lookup(0, 0, 6)                # all six in L3
        dst = [20, 21, 22, 23, 24, 25]
        assert split.run(split.pl.plan_load(keys, dst)).loaded_prefix == 6
        for k, d in zip(keys, dst):
            assert torch.equal(split.page(d), want[k])
    finally:
        split.close()


def test_two_part_results_are_checked(split):
    keys = split.pl.keys(toks(4 * 2, 22))
    plan = split.pl.plan_save(keys, [0, 1])
    ok2 = (True, True)
    bad = [PlanResult(plan.plan_id, backups=ok2, l3_writes=ok2, writes_pending=True),
           PlanResult(plan.plan_id, backups=(True,), writes_pending=True),
           PlanResult(plan.plan_id, backups=ok2, writes_pending=1)]
    for res in bad:
        with pytest.raises(InvalidArgumentError):
            split.pl.complete(res)
    assert plan.plan_id in split.pl.pending_plans()             # nothing booked
    split.pl.complete(PlanResult(plan.plan_id, backups=ok2, writes_pending=True))
    for res in [PlanResult(plan.plan_id, backups=ok2, writes_pending=True),   # twice
                PlanResult(plan.plan_id, backups=ok2, l3_writes=ok2),         # backups again
                PlanResult(plan.plan_id, l3_writes=(True,))]:
        with pytest.raises(InvalidArgumentError):
            split.pl.complete(res)
    no_writes = split.pl.plan_save(split.pl.keys(toks(4, 23)), [5], l3_write=False)
    with pytest.raises(InvalidArgumentError, match="pending"):
        split.pl.complete(PlanResult(no_writes.plan_id, backups=(True,), writes_pending=True))
    split.pl.fail(no_writes.plan_id)
    split.pl.fail(plan.plan_id)                                 # its writes never came
    split.pl.check()
    assert split.pl.lookup(keys).l2_pages == 2 and not split.pl.pending_plans()
    split.run(split.pl.plan_evict(8))                           # unpinned
    assert split.pl.lookup(keys) == Lookup(0, 0, 0)             # never written to L3


def test_failed_plan_returns_its_pages(split):
    keys = split.pl.keys(toks(4 * 8, 13))
    plan = split.pl.plan_save(keys, list(range(8)))
    assert split.pl.host.free_count == 0
    split.pl.fail(plan.plan_id)
    assert split.pl.host.free_count == 8 and not split.pl.l2_pages()
    with pytest.raises(InvalidArgumentError):
        split.pl.fail(plan.plan_id)


def test_malformed_plans_are_refused_before_anything_runs(split):
    bad = [Plan(101, loads=((99, 0),)), Plan(102, backups=((0, 1), (1, 1))),
           Plan(103, loads=((0, 40),)), Plan(104, loads=((0, 3),), backups=((3, 1),)),
           Plan(105, l3_reads=(("k", 0),))]
    for plan in bad:
        with pytest.raises((PageIndexError, InvalidArgumentError)):
            split.ex.submit(plan)
    assert split.ex.poll() == []
    with pytest.raises(PageIndexError):
        split.pl.plan_load(split.pl.keys(toks(8)), [1, 1])
    with pytest.raises(InvalidArgumentError):
        split.pl.plan_save(split.pl.keys(toks(8)), [1, 2, 3])


def test_concurrent_requests_keep_invariants(split):
    rng = random.Random(4)
    prompts = [split.pl.keys(toks(4 * rng.randint(1, 6), rng.randint(0, 5))) for _ in range(40)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed):
        r = random.Random(seed)
        try:
            for keys in r.sample(prompts, 10):
                dev = r.sample(range(32), len(keys))
                with lock:
                    hit = split.pl.lookup(keys)
                    load = split.pl.plan_load(keys, dev[:hit.pages])
                    save = split.pl.plan_save(keys, dev)
                for p in (load, save):
                    split.ex.submit(wire(p))
                    split.ex.wait(p.plan_id, 10)
                for res in split.ex.poll():
                    split.pl.complete(wire(res))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors
    assert split.ex.wait_idle(10)
    for res in split.ex.poll():
        split.pl.complete(res)
    assert split.pl.pending_plans() == []
    split.pl.check()


# ---------------------------------------------------------------------------------------------
# Two real processes: the planner here, the executor in a child, a shared file L3
# ---------------------------------------------------------------------------------------------
def _worker_process(conn, root: str) -> None:
    """The worker side: owns the KV buffers, runs plans, answers with plain data."""
    dpool = DeviceKVPool.empty(SPEC, 32)
    gen = torch.Generator().manual_seed(11)
    for comp in dpool.layers:
        for t in comp:
            fill_random(t, gen)
    cfg = {"model_id": "split", "host_pool_pages": 4, "l3_io_threads": 1,
           "l3_store": "file", "l3_config": {"root": root}}
    with CacheExecutor.from_config(cfg, device_pool=dpool) as ex:
        while True:
            msg = conn.recv()
            if msg[0] == "plan":
                ex.submit(msg[1])
                ex.wait(msg[1].plan_id, 30)
                conn.send(ex.poll())
            elif msg[0] == "same":
                a, b = msg[1], msg[2]
                conn.send(all(torch.equal(raw_bytes(dpool.page(c, layer, x)),
                                          raw_bytes(dpool.page(c, layer, y)))
                              for x, y in zip(a, b) for layer in range(SPEC.num_layers)
                              for c in range(SPEC.num_components)))
            else:
                conn.send(None)
                return


def test_planner_and_executor_in_two_processes(tmp_path):
    import multiprocessing as mp

    from kvtier.l3_stores.file import FileStore
    root = str(tmp_path / "l3")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_worker_process, args=(there, root), daemon=True)
    child.start()
    # the scheduler's view of L3, presence only: the same store in the same key namespace
    from kvtier.cache import CacheConfig
    from kvtier.cache.keying import make_keyer, open_store
    cfg = CacheConfig.from_dict({"model_id": "split", "l3_store": "file",
                                 "l3_config": {"root": root}})
    probe = open_store(cfg, SPEC, make_keyer(cfg, SPEC, device_layout="nhd"))
    assert isinstance(probe, FileStore)
    try:
        pl = CachePlanner({"model_id": "split", "host_pool_pages": 4}, spec=SPEC,
                          device_layout="nhd", num_host_pages=4, l3_exists=probe.batch_exists)

        def run(plan):
            here.send(("plan", plan))
            (res,) = here.recv()
            pl.complete(res)
            return res

        keys = pl.keys(toks(4 * 6, 21))
        assert run(pl.plan_save(keys, [0, 1, 2, 3, 4, 5])).ok   # 4 fit in L2, written to L3
        hit = pl.lookup(keys)
        assert hit.pages == 4 and hit.l3_pages == 0                # L2 held 4, L3 has them
        run(pl.plan_evict(4))
        assert pl.lookup(keys) == Lookup(0, 0, 4)                  # now only in L3
        plan = pl.plan_load(keys[:4], [20, 21, 22, 23])
        assert len(plan.l3_reads) == 4
        assert run(plan).loaded_prefix == 4
        here.send(("same", [0, 1, 2, 3], [20, 21, 22, 23]))
        assert here.recv() is True                                 # bitwise, across processes
        pl.check()
    finally:
        here.send(("stop",))
        here.recv()
        child.join(30)
        probe.close()
    assert child.exitcode == 0


def test_executor_store_call_past_its_deadline_fails_the_ops_not_the_caller():
    from kvtier.host_pool import HostKVPool
    from kvtier.l3_stores.memory import MemoryStore
    from kvtier.registry import create_transfer_engine

    class Stuck(MemoryStore):
        release = threading.Event()

        def batch_get(self, keys, host_pages):
            self.release.wait()
            return super().batch_get(keys, host_pages)

    dpool = DeviceKVPool.empty(SPEC, 8)
    host = HostKVPool(SPEC, 4, allocator=TorchPinnedAllocator())
    store = Stuck(spec=SPEC)
    store.attach(host)
    engine = create_transfer_engine("torch", dpool, host)
    ex = CacheExecutor(host_pool=host, engine=engine, store=store, l3_call_timeout_s=0.3,
                       owned=(engine, store, host))
    try:
        keys = [bytes([i]) * 32 for i in range(2)]
        ex.submit(Plan(1, backups=((0, 0), (1, 1)), l3_writes=((0, keys[0]), (1, keys[1]))))
        assert ex.wait(1, 10)
        assert ex.poll()[0].ok
        ex.submit(Plan(2, l3_reads=((keys[0], 2), (keys[1], 3)), loads=((2, 4), (3, 5))))
        t0 = time.monotonic()
        assert ex.wait(2, 5)
        assert time.monotonic() - t0 < 3
        (res,) = ex.poll()
        assert res.l3_reads == (False, False) and res.loads == (False, False)
        assert sorted(res.held_host_pages) == [2, 3]      # the late call may still write
        assert ex.l3_state.startswith("degraded")
        assert ex.metrics()["l3_timeouts"] == 1
        Stuck.release.set()
        deadline = time.monotonic() + 5
        got: list = []
        while not got:
            assert time.monotonic() < deadline
            got = ex.poll()
            time.sleep(0.01)
        assert got[0].plan_id == 2 and sorted(got[0].released_host_pages) == [2, 3]
        t0 = time.monotonic()
        ex.close(timeout=1.0)
        assert time.monotonic() - t0 < 2
    finally:
        Stuck.release.set()


def test_planner_keeps_held_host_pages_out_of_use_until_released():
    pl = CachePlanner({"model_id": "split"}, spec=SPEC, device_layout="nhd", num_host_pages=4,
                      l3_exists=lambda keys: len(keys))
    keys = pl.keys(toks(4 * 3, 31))
    plan = pl.plan_load(keys, [0, 1, 2])
    assert len(plan.l3_reads) == 3 and pl.host.free_count == 1
    stuck = plan.l3_reads[1][1]
    res = PlanResult(plan.plan_id, (True, False, False), (True, False, False),
                     held_host_pages=(stuck,))
    pl.complete(res)
    assert pl.host.free_count == 2 and len(pl.l2_pages()) == 1     # one landed, one held
    assert stuck not in pl.host.alloc(2)                           # never handed out
    pl.check()
    pl.complete(PlanResult(plan.plan_id, released_host_pages=(stuck,)))
    assert pl.host.free_count == 1
    with pytest.raises(InvalidArgumentError):
        pl.complete(PlanResult(plan.plan_id, released_host_pages=(stuck,)))


def test_prefetch_reads_l3_pages_after_the_l2_run_into_l2(split):
    keys = split.pl.keys(toks(4 * 6, 11))
    src = random.Random(4).sample(range(16), 6)
    want = [split.page(p).clone() for p in src]
    assert split.run(split.pl.plan_save(keys, src)).ok
    split.run(split.pl.plan_evict(8))                     # every page now only in L3
    assert split.pl.lookup(keys) == Lookup(0, 0, 6)
    plan = split.pl.plan_prefetch(keys, 1, 3)
    assert [k for k, _ in plan.l3_reads] == keys[1:4] and not plan.loads
    assert plan.device_pages == ()
    res = split.run(plan)
    assert res.ok and res.l3_reads == (True,) * 3
    assert split.pl.lookup(keys, 1) == Lookup(1, 3, 2)   # landed in L2, L3 after them
    assert split.pl.metrics()["planned_prefetch_pages"] == 3
    dst = [20, 21, 22]
    res = split.run(split.pl.plan_load(keys, dst, start=1))
    assert res.loaded_prefix == 3
    for i, d in enumerate(dst):
        assert torch.equal(split.page(d), want[1 + i])
    # from a page in L2 on: the reads start after the L2 run, and stop at the keys' end
    plan = split.pl.plan_prefetch(keys, 1, 10)
    assert [k for k, _ in plan.l3_reads] == keys[4:6]
    assert split.run(plan).ok
    assert split.pl.lookup(keys, 1) == Lookup(1, 5, 0)


def test_prefetch_of_a_missing_object_frees_its_host_page(split):
    keys = split.pl.keys(toks(4 * 3, 12))
    assert split.run(split.pl.plan_save(keys, [0, 1, 2])).ok
    split.run(split.pl.plan_evict(8))
    split.ex.store.delete([keys[0]])
    free = split.pl.host.free_count
    res = split.run(split.pl.plan_prefetch(keys, 0, 2))
    assert res.l3_reads == (False, True)
    assert split.pl.host.free_count == free - 1 and keys[0] not in split.pl.l2_pages()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_prefetch_refuses_a_bad_page_count(split, bad):
    keys = split.pl.keys(toks(4 * 3, 13))
    with pytest.raises(InvalidArgumentError):
        split.pl.plan_prefetch(keys, 0, bad)
    with pytest.raises(InvalidArgumentError):
        split.pl.plan_prefetch(keys, 4, 1)
    assert split.pl.pending_plans() == []


def test_executor_measures_its_loads_and_store_reads(split):
    assert split.ex.rates()["l2_load_bytes_per_s"] is None
    keys = split.pl.keys(toks(4 * 5, 14))
    assert split.run(split.pl.plan_save(keys, [0, 1, 2, 3, 4])).ok
    assert split.run(split.pl.plan_load(keys, [20, 21, 22], start=1)).ok
    r = split.ex.rates()
    assert r["l2_load_bytes_per_s"] is not None and r["l2_load_bytes_per_s"] > 0
    assert r["l3_read_bytes_per_s"] is None                 # nothing read from L3 yet
    split.run(split.pl.plan_evict(8))
    assert split.run(split.pl.plan_prefetch(keys, 0, 4)).ok
    r = wire(split.ex.rates())                              # plain data, like the rest
    assert r["l3_read_bytes_per_s"] is not None and r["l3_read_bytes_per_s"] > 0
    split.ex.cost.observe_recompute(512, 0.01, num_pairs=512 * 512 / 2)
    assert split.ex.rates()["recompute_tokens_per_s"] == pytest.approx(51_200)


def test_step_timer_times_each_stopped_step_once():
    from kvtier.integrations.vllm.datapath import StepTimer
    t = StepTimer()
    t.stop()                                  # never started: nothing
    t.start(300, 4.5e4)
    time.sleep(0.02)
    t.stop()
    t.start(10, 1.0)                          # never stopped: dropped at the next start
    t.start(64, 2e3)
    t.stop()
    got = t.finished()
    assert [(n, p) for n, p, _ in got] == [(300, 4.5e4), (64, 2e3)]
    assert got[0][2] >= 0.02 and 0 <= got[1][2] < got[0][2]
    assert t.finished() == []
