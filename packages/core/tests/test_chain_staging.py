"""Staging (`kvtier.l3_stores.staging`): helper processes copy the pages only a chain's slower
member (`file`) holds into its first member's shared-memory arena (`shm`), and a cache loads
them from there in place.

Pages are random bytes, keys random, host and device pages random indices, page sizes odd
and exact multiples of 4 KiB. The helpers are real processes: killed, stopped and restarted
here as an operator's machine would see them."""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import time

import pytest
import torch

from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.l3_stores import shm as shm_mod
from kvtier.l3_stores import staging
from kvtier.l3_stores.chain import ChainStore
from kvtier.l3_stores.shm import ShmStore
from kvtier.testing.contracts import assert_bitwise_equal
from kvtier.testing.data import fill_random, make_host_pool, random_specs
from test_cache_in_place import SPEC as PAGE_SPEC
from test_cache_in_place import Engine, tokens

pytestmark = pytest.mark.skipif(not ShmStore.probe().ok, reason="shm unavailable here")

#: pages of an odd size (not a multiple of 4 KiB)
ODD_SPEC = random_specs()[0]


@pytest.fixture
def pool():
    """Host pages of an odd size (not a multiple of 4 KiB)."""
    p = make_host_pool(ODD_SPEC, 40)
    yield p
    p.close()


@pytest.fixture
def shm_name():
    n = f"kvtier-test-stage-{os.getpid()}-{os.urandom(4).hex()}"
    yield n
    for path in glob.glob(os.path.join(shm_mod.DEFAULT_ROOT, f"{n}-*")):
        os.unlink(path)


def chain_config(name: str, root, *, slots: int = 64, processes: int = 2, **kw) -> dict:
    return {"stores": [{"store": "shm", "config": {"name": name, "capacity_pages": slots,
                                                    "remove_when_unused": True}},
                       {"store": "file", "config": {"root": str(root)}}],
            "stage_processes": processes, **kw}


def saved_in_file(c: ChainStore, pool, n: int, seed: int) -> tuple[list[bytes], list]:
    """``n`` random pages written to the chain's file member only (from random host
    pages); returns their keys and bytes."""
    rng = random.Random(seed)
    fill_random(pool.raw)
    keys = [os.urandom(32) for _ in range(n)]
    src = rng.sample(range(pool.num_pages), n)
    want = [pool.view[p].clone() for p in src]
    assert c.members[1].batch_set(keys, src) == [True] * n
    assert c.members[0].batch_exists(keys) == 0
    return keys, want


def test_staged_pages_are_bitwise_the_saved_ones(tmp_path, shm_name, pool):
    with ChainStore(chain_config(shm_name, tmp_path / "f", processes=3,
                                 stage_batch_pages=4), spec=ODD_SPEC) as c:
        c.attach(pool)
        keys, want = saved_in_file(c, pool, 13, seed=1)
        absent = os.urandom(32)
        t = c.stage(keys[:7] + [absent] + keys[7:])
        assert t.wait(60) and t.done()
        assert t.staged == 13 and t.failed == 1      # the absent key is no page
        assert c.members[0].batch_exists(keys) == 13
        fill_random(pool.raw)
        dst = random.Random(2).sample(range(40), 13)
        assert c.members[0].batch_get(keys, dst) == [True] * 13
        for i, p in enumerate(dst):
            assert_bitwise_equal(pool.view[p], want[i], f"key {i}")
        st = c.stats()
        assert st["stage_read_pages"] == 13 and st["staged_pages"] == 13
        # again: already in the arena, nothing is sent
        t = c.stage(keys)
        assert t.done() and t.staged == 13
        assert c.stats()["stage_read_pages"] == 13
        assert st["stage_helpers_alive"] == 3


def test_a_chain_without_staging_reads_through_l2(tmp_path, shm_name):
    with ChainStore(chain_config(shm_name, tmp_path / "f", processes=0), spec=PAGE_SPEC) as c:
        assert c.in_place_reads() is None and "stage_processes" in c.in_place_why_not
        assert c.stage([b"k"]) is None


@pytest.mark.parametrize("config, what", [
    ({"stage_processes": -1}, "stage_processes"), ({"stage_processes": True}, "stage_processes"),
    ({"stage_processes": 1.5}, "stage_processes"), ({"stage_batch_pages": 0}, "batch"),
    ({"stage_max_queued_pages": 0}, "queued"), ({"stage_timeout_s": float("nan")}, "timeout"),
    ({"stage_timeout_s": -1}, "timeout"), ({"stage_hold_fraction": -0.1}, "hold_fraction"),
    ({"stage_hold_fraction": 0.9}, "hold_fraction"),
    ({"stage_hold_fraction": float("nan")}, "hold_fraction"),
    ({"stage_hold_fraction": "1/4"}, "hold_fraction"), ({"stage_hold_s": 0}, "hold_s"),
    ({"stage_hold_s": float("inf")}, "hold_s"), ({"stage_hold_s": True}, "hold_s")])
def test_bad_staging_settings_are_config_errors(tmp_path, shm_name, config, what):
    with pytest.raises(ConfigError, match=what):
        ChainStore({**chain_config(shm_name, tmp_path / "f", processes=1), **config},
                   spec=PAGE_SPEC)


def test_staging_needs_an_arena_first_and_a_slower_member(tmp_path, shm_name):
    with pytest.raises(ConfigError, match="arena"):
        ChainStore({"stores": [{"store": "memory"}, {"store": "file",
                                                     "config": {"root": str(tmp_path)}}],
                    "stage_processes": 1}, spec=PAGE_SPEC)
    with pytest.raises(ConfigError, match="slower member"):
        ChainStore({"stores": [{"store": "shm", "config": {"name": shm_name,
                                                           "remove_when_unused": True}}],
                    "stage_processes": 1}, spec=PAGE_SPEC)


def test_outstanding_pages_are_bounded(tmp_path, shm_name, pool):
    with ChainStore(chain_config(shm_name, tmp_path / "f", processes=1,
                                 stage_max_queued_pages=5), spec=ODD_SPEC) as c:
        c.attach(pool)
        keys, _ = saved_in_file(c, pool, 12, seed=3)
        t = c.stage(keys)
        assert t.wait(60)
        assert t.staged == 5 and c.stats()["stage_refused_pages"] == 7
        assert c.members[0].batch_exists(keys) == 5


def wait_stat(c: ChainStore, counter: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while c.stats().get(counter, 0) < n:
        assert time.monotonic() < deadline, f"{counter} never reached {n}"
        time.sleep(0.02)


def wait_ready(c: ChainStore, n: int) -> None:
    wait_stat(c, "stage_helpers_ready", n)


def test_a_killed_helper_settles_its_parts_and_is_started_again(tmp_path, shm_name,
                                                                 monkeypatch, pool):
    monkeypatch.setattr(staging, "RESTART_S", 0.0)
    with ChainStore(chain_config(shm_name, tmp_path / "f", processes=1), spec=ODD_SPEC) as c:
        c.attach(pool)
        keys, want = saved_in_file(c, pool, 8, seed=4)
        wait_ready(c, 1)
        helper = c._stager.helpers[0]
        os.kill(helper.proc.pid, signal.SIGSTOP)      # it takes the part, never answers
        t = c.stage(keys)
        assert not t.wait(0.3)
        os.kill(helper.proc.pid, signal.SIGKILL)
        assert t.wait(30), "a dead helper's part must settle"
        assert t.staged == 0 and t.failed == 8
        st = c.stats()
        assert st["stage_helper_exits"] == 1 and st["stage_failed_pages"] == 8
        assert st["stage_helpers_alive"] == 0
        t = c.stage(keys)                               # started again
        assert t.wait(60) and t.staged == 8
        fill_random(pool.raw)
        assert c.members[0].batch_get(keys, list(range(8))) == [True] * 8
        for i in range(8):
            assert_bitwise_equal(pool.view[i], want[i], f"key {i}")


def test_cancel_drops_parts_a_helper_has_not_begun(tmp_path, shm_name, pool):
    with ChainStore(chain_config(shm_name, tmp_path / "f", processes=1), spec=ODD_SPEC) as c:
        c.attach(pool)
        keys, _ = saved_in_file(c, pool, 8, seed=5)
        wait_ready(c, 1)
        pid = c._stager.helpers[0].proc.pid
        os.kill(pid, signal.SIGSTOP)       # everything below waits in its pipe
        try:
            first, second = c.stage(keys[:4]), c.stage(keys[4:])
            second.cancel()
            second.cancel()                # idempotent
        finally:
            os.kill(pid, signal.SIGCONT)
        assert first.wait(60) and second.wait(60)
        assert first.staged == 4 and second.staged == 0
        assert c.stats()["stage_cancelled_pages"] == 4
        assert c.members[0].batch_exists(keys[:4]) == 4
        assert c.members[0].batch_exists(keys[4:]) == 0


def test_close_stops_the_helpers(tmp_path, shm_name):
    c = ChainStore(chain_config(shm_name, tmp_path / "f", processes=2), spec=PAGE_SPEC)
    wait_ready(c, 2)
    procs = [h.proc for h in c._stager.helpers]
    c.close()
    for p in procs:
        assert p.wait(10) == 0
    assert not glob.glob(os.path.join(shm_mod.DEFAULT_ROOT, f"{shm_name}-*"))


def test_close_copies_out_the_pages_written_into_the_arena_first(tmp_path, shm_name, pool):
    from kvtier.l3_stores.file import FileStore
    c = ChainStore(chain_config(shm_name, tmp_path / "f", processes=1), spec=ODD_SPEC)
    c.attach(pool)
    wait_ready(c, 1)
    pid = c._stager.helpers[0].proc.pid
    fill_random(pool.raw)
    keys = [os.urandom(32) for _ in range(7)]
    want = [pool.view[p].clone() for p in range(7)]
    os.kill(pid, signal.SIGSTOP)        # the copies wait in its pipe
    try:
        assert c.batch_set(keys, list(range(7))) == [True] * 7
        assert c.stats()["demoted_pages"] == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    c.close()
    with FileStore({"root": str(tmp_path / "f")}, spec=ODD_SPEC) as files:
        files.attach(pool)
        fill_random(pool.raw)
        assert files.batch_get(keys, list(range(10, 17))) == [True] * 7
        for i in range(7):
            assert_bitwise_equal(pool.view[10 + i], want[i], f"key {i}")


# ----- under a cache ----------------------------------------------------------------------
def cache_on_chain(tmp_path, name: str, seed: int, **config) -> Engine:
    store = ChainStore(chain_config(name, tmp_path / "f", slots=64, processes=2,
                                    **config.pop("chain", {})), spec=PAGE_SPEC)
    return Engine(PAGE_SPEC, store, seed=seed, l3_store="chain", **config)


def test_a_cache_loads_staged_pages_in_place_bitwise(tmp_path, shm_name):
    e = cache_on_chain(tmp_path, shm_name, seed=21, prefetch_policy="wait_complete")
    try:
        assert e.cache.in_place_why_not == ""
        wait_ready(e.store, 2)
        toks = tokens(31)
        want = e.compute(toks)
        wait_stat(e.store, "demoted_pages", len(want))   # the helpers wrote the file too
        e.cache.evict(100)
        e.cache.evict(100, tier="l2")
        arena = e.store.members[0]
        keys = e.cache.keys(toks)
        arena.delete(keys)                      # in the file only now
        m = e.cache.match(toks)
        assert m.l3_count == len(want)
        e.cache.prefetch(m)                     # staging starts here, in the helpers
        assert m.stage is not None
        dev = e.pages(m.pages_to_load)
        h = e.cache.fetch(m, dev)
        h.wait()
        assert h.pages_loaded == len(want)
        assert [e.page(d) for d in dev] == want
        e.alloc.free(e.cache.release(m))
        mc = e.cache.metrics()
        assert mc["l3_in_place_pages"] == len(want)
        assert e.cache.host_pool.free_count == 16           # nothing went through L2
        assert arena.arena.pinned() == 0
    finally:
        e.close()


@pytest.mark.parametrize("fraction", [0, 0.25])
def test_staged_pages_others_push_out_are_staged_again_unless_held(tmp_path, shm_name,
                                                                   fraction):
    """Without holds (fraction 0), pages that left the arena while the request waited are
    staged again at its fetch; with them, they cannot leave, and the holds go at release."""
    e = cache_on_chain(tmp_path, shm_name, seed=23, prefetch_policy="wait_complete",
                       chain={"stage_hold_fraction": fraction})
    try:
        wait_ready(e.store, 2)
        toks = tokens(35)
        want = e.compute(toks)
        wait_stat(e.store, "demoted_pages", len(want))
        e.cache.evict(100)
        e.cache.evict(100, tier="l2")
        arena, keys = e.store.members[0], e.cache.keys(toks)
        arena.delete(keys)
        m = e.cache.match(toks)
        e.cache.prefetch(m)
        assert m.stage.wait(30) and m.stage.staged == len(want)
        assert e.store.held_pages() == (len(want) if fraction else 0)
        gone = arena.delete(keys[2:4])          # pushed out by others before its turn
        assert gone == (0 if fraction else 2)
        dev = e.pages(m.pages_to_load)
        h = e.cache.fetch(m, dev)
        h.wait()
        assert h.pages_loaded == len(want)
        assert [e.page(d) for d in dev] == want
        assert e.cache.metrics().get("l3_stage_again_fetches", 0) == (0 if fraction else 1)
        e.alloc.free(e.cache.release(m))
        assert e.store.held_pages() == 0 and arena.arena.pinned() == 0
    finally:
        e.close()


def test_a_stuck_helper_costs_its_pages_not_a_hang(tmp_path, shm_name):
    e = cache_on_chain(tmp_path, shm_name, seed=22, prefetch_policy="wait_complete",
                       chain={"stage_timeout_s": 0.5})
    pids = []
    try:
        toks = tokens(33)
        wait_stat(e.store, "demoted_pages", len(e.compute(toks)))
        e.cache.evict(100)
        e.cache.evict(100, tier="l2")
        e.store.members[0].delete(e.cache.keys(toks))
        wait_ready(e.store, 2)
        pids = [h.proc.pid for h in e.store._stager.helpers]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        m = e.cache.match(toks)
        t0 = time.monotonic()
        h = e.cache.fetch(m, e.pages(m.pages_to_load))
        h.wait()
        assert time.monotonic() - t0 < 5
        assert h.pages_loaded == 0                        # recomputed, never wrong
        assert e.cache.metrics()["l3_stage_late_fetches"] == 1
        e.alloc.free(e.cache.release(m))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        e.close()


# ----- writes behind the arena --------------------------------------------------------------
def test_writes_reach_the_file_through_the_helpers_bitwise(tmp_path, shm_name, pool):
    with ChainStore(chain_config(shm_name, tmp_path / "f", processes=2), spec=ODD_SPEC) as c:
        c.attach(pool)
        fill_random(pool.raw)
        keys = [os.urandom(32) for _ in range(11)]
        src = random.Random(6).sample(range(40), 11)
        want = [pool.view[p].clone() for p in src]
        assert c.batch_set(keys, src) == [True] * 11
        assert c.members[0].batch_exists(keys) == 11      # the arena at once
        wait_stat(c, "demoted_pages", 11)
        st = c.stats()
        assert st["demote_missed_pages"] == 0 and st["members"][1]["set_ok"] == 0, \
            "this process wrote nothing into the file"
        assert st["members"][1]["writers"] == 1, "one helper of two writes the file"
        fill_random(pool.raw)
        dst = random.Random(7).sample(range(40), 11)
        assert c.members[1].batch_get(keys, dst) == [True] * 11
        for i, p in enumerate(dst):
            assert_bitwise_equal(pool.view[p], want[i], f"key {i}")


def test_each_helper_writes_the_file_as_one_writer_even_in_memory(shm_name, pool):
    """On tmpfs a file store writes through a lane per I/O thread; a helper uses one, so
    every existence check has one log per helper to look at, not one per helper lane."""
    root = os.path.join(shm_mod.DEFAULT_ROOT, f"kvtier-test-files-{os.urandom(4).hex()}")
    cfg = chain_config(shm_name, root, processes=2, slots=256)
    cfg["stores"][1]["config"]["io_threads"] = 4
    try:
        with ChainStore(cfg, spec=ODD_SPEC) as c:
            c.attach(pool)
            if c.members[1].stats()["medium"] != "memory":
                pytest.skip("the arena's directory is not in memory here")
            assert c.members[1].stats()["write_lanes"] == 4     # the engine's own store
            fill_random(pool.raw)
            keys = [os.urandom(32) for _ in range(48)]
            for n in range(3):              # batches: each to one helper of the two
                assert c.batch_set(keys[16 * n:16 * n + 16],
                                   random.Random(n).sample(range(40), 16)) == [True] * 16
            deadline = time.monotonic() + 60
            while c.members[1].batch_exists(keys) < 48:     # written behind the arena
                assert time.monotonic() < deadline, c.stats()
                time.sleep(0.02)
            assert c.stats()["demoted_pages"] > 0, "the helpers wrote some"
            # writers: this process's four lanes and one per helper that wrote
            assert c.stats()["members"][1]["writers"] <= 4 + 2, "one writer per helper"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("config", [{"stage_max_queued_pages": 3}, {"slots": 12},
                                    {"stage_writes": False}])
def test_writes_the_helpers_cannot_take_are_written_by_the_caller(tmp_path, shm_name, config,
                                                                pool):
    """Past the queue bound, or a quarter of the arena's slots (12 // 4 = 3) waiting to be
    copied out, or with writes behind the arena off."""
    with ChainStore(chain_config(shm_name, tmp_path / "f", processes=1, **config),
                    spec=ODD_SPEC) as c:
        c.attach(pool)
        fill_random(pool.raw)
        keys = [os.urandom(32) for _ in range(9)]
        assert c.batch_set(keys, list(range(9))) == [True] * 9
        mine = 9 if "stage_writes" in config else 6
        assert c.stats()["members"][1]["set_ok"] == mine
        if "stage_writes" not in config:
            assert c.stats()["demote_refused_pages"] == 6
            wait_stat(c, "demoted_pages", 3)
        assert c.members[1].batch_exists(keys) == 9


def test_the_two_halves_stage_off_the_callers_thread_and_load_in_place(tmp_path, shm_name):
    """As the vLLM connector runs the cache: a load plan's L3 pages that only the file holds
    are staged by the helpers while the executor's caller goes on, then loaded in place."""
    from test_executor_in_place import Half, keys_of
    l3 = chain_config(shm_name, tmp_path / "f", processes=2)
    a = Half(shm_name, seed=3, l3_store="chain", l3_config=l3)
    h = Half(shm_name, seed=4, l3_store="chain", l3_config=l3)   # a second engine process
    try:
        chain = h.ex.store
        assert h.ex.in_place is not None, h.ex.in_place_why_not
        wait_ready(chain, 2)
        keys = keys_of(a, 41)
        want = a.save(keys)
        wait_stat(a.ex.store, "demoted_pages", len(keys))
        chain.members[0].delete(keys)                   # in the file only now
        h.planner.set_in_place(True)
        hit = h.planner.lookup(keys)
        assert hit.l3_pages == len(keys), hit
        dev = h.pages(len(keys))
        plan = h.planner.plan_load(keys, dev)
        assert plan.stage and len(plan.l3_loads) == len(keys)
        t0 = time.perf_counter()
        h.ex.submit(plan)
        assert time.perf_counter() - t0 < 0.5, "the caller does not wait for the helpers"
        for layer in range(PAGE_SPEC.num_layers):     # as vLLM's forward waits, layer by layer
            assert h.ex.wait_layer(plan.plan_id, layer, timeout=30) is None
        assert [h.page(d) for d in dev] == want, "a layer was let through before it landed"
        assert h.ex.wait(plan.plan_id, 30)
        res = [r for r in h.ex.poll() if r.plan_id == plan.plan_id][0]
        h.planner.complete(res)
        assert list(res.l3_loads) == [True] * len(keys)
        assert chain.members[0].arena.pinned() == 0
        assert chain.stats()["stage_read_pages"] == len(keys)
    finally:
        h.close()
        a.close()


def running(pid: int) -> bool:
    """Is ``pid`` still running (not gone, not a zombie nobody has reaped)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_pages_an_engine_wrote_reach_the_file_after_it_dies(tmp_path, shm_name):
    """The engine process exits without closing (os._exit) right after writing, its helpers
    still starting: they copy what it wrote into the arena into the file, then exit."""
    import subprocess
    import sys
    import textwrap
    from kvtier.l3_stores.file import FileStore
    script = textwrap.dedent(f"""
        import os
        import torch
        from kvtier.l3_stores.chain import ChainStore
        from kvtier.testing.data import fill_random, make_host_pool, random_specs
        spec = random_specs()[0]
        pool = make_host_pool(spec, 8)
        fill_random(pool.raw)
        c = ChainStore({chain_config(shm_name, tmp_path / "f", processes=2)!r}, spec=spec)
        c.attach(pool)
        keys = [bytes([i + 1]) * 32 for i in range(6)]
        assert c.batch_set(keys, list(range(6))) == [True] * 6
        with open({str(tmp_path / "pids")!r}, "w") as f:
            f.write(" ".join(str(h.proc.pid) for h in c._stager.helpers))
        with open({str(tmp_path / "want")!r}, "wb") as f:
            for p in range(6):
                f.write(pool.view[p].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        os._exit(0)
        """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    keys = [bytes([i + 1]) * 32 for i in range(6)]
    # its helpers copy out what it wrote, then exit
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 120
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, "the dead engine's helpers never exited"
        time.sleep(0.1)
    pool = make_host_pool(ODD_SPEC, 8)
    try:
        with FileStore({"root": str(tmp_path / "f")}, spec=ODD_SPEC) as files:
            files.attach(pool)
            assert files.batch_get(keys, list(range(6))) == [True] * 6
        got = b"".join(pool.view[p].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                       for p in range(6))
        assert got == (tmp_path / "want").read_bytes()
    finally:
        pool.close()


def test_staging_keeps_the_pages_of_the_run_the_arena_already_holds(tmp_path, shm_name,
                                                                    pool):
    """One set of 16 slots: the run's first 8 pages are its oldest, 8 others came after;
    staging the run's other 8 pages evicts the others, not the run's own."""
    with ChainStore(chain_config(shm_name, tmp_path / "f", slots=16, processes=1),
                    spec=ODD_SPEC) as c:
        c.attach(pool)
        arena, files = c.members
        fill_random(pool.raw)
        run = [os.urandom(32) for _ in range(16)]
        others = [os.urandom(32) for _ in range(8)]
        assert arena.batch_set(run[:8], list(range(8))) == [True] * 8
        time.sleep(0.01)
        assert arena.batch_set(others, list(range(8, 16))) == [True] * 8
        assert files.batch_set(run[8:], list(range(16, 24))) == [True] * 8
        t = c.stage(run)
        assert t.wait(60) and t.staged == 16
        assert arena.batch_exists(run) == 16, "the run's own pages were evicted"
        assert arena.touch(others) == [False] * 8


def test_shm_touch_says_what_it_holds(shm_name):
    pool = make_host_pool(ODD_SPEC, 8)
    store = ShmStore({"name": shm_name, "capacity_pages": 16, "remove_when_unused": True},
                     spec=ODD_SPEC)
    try:
        store.attach(pool)
        keys = [os.urandom(32) for _ in range(3)]
        assert store.batch_set(keys[:2], [0, 1]) == [True, True]
        assert store.touch([keys[0], keys[2], keys[1]]) == [True, False, True]
        with pytest.raises(InvalidArgumentError):
            store.touch([b""])
    finally:
        store.close()
        pool.close()


def others_written(c: ChainStore, pool, n: int, seed: int) -> None:
    """``n`` pages of new keys written into the arena: the pressure of other requests."""
    rng = random.Random(seed)
    keys = [os.urandom(32) for _ in range(n)]
    for i in range(0, n, 8):
        c.members[0].batch_set(keys[i:i + 8], rng.sample(range(pool.num_pages), len(keys[i:i + 8])))


@pytest.mark.parametrize("fraction", [0.25, 0])
def test_staged_pages_are_held_until_the_ticket_is_cancelled(tmp_path, shm_name, pool, fraction):
    """Pages staged for a queued request survive the writes of others until it lets go
    (without holds, fraction 0, the same writes push them out)."""
    with ChainStore(chain_config(shm_name, tmp_path / "f", slots=64,
                                 stage_hold_fraction=fraction), spec=ODD_SPEC) as c:
        c.attach(pool)
        keys, want = saved_in_file(c, pool, 12, seed=31)
        wait_ready(c, 2)
        t = c.stage(keys)
        assert t.wait(60) and t.staged == 12
        arena = c.members[0]
        others_written(c, pool, 3 * 64, seed=32)
        if fraction:
            assert c.held_pages() == 12 and arena.arena.pinned() == 12
            assert arena.batch_exists(keys) == 12
            fill_random(pool.raw)
            dst = random.Random(33).sample(range(40), 12)
            assert arena.batch_get(keys, dst) == [True] * 12
            for i, p in enumerate(dst):
                assert_bitwise_equal(pool.view[p], want[i], f"key {i}")
        else:
            assert c.held_pages() == 0 and arena.batch_exists(keys) < 12
        t.cancel()
        t.cancel()                                 # idempotent
        assert c.held_pages() == 0 and arena.arena.pinned() == 0
        assert c.stats()["stage_held_pages"] == (12 if fraction else 0)
        others_written(c, pool, 3 * 64, seed=34)
        assert arena.batch_exists(keys) < 12       # let go: evictable again


def test_holds_are_bounded_and_a_forgotten_one_expires(tmp_path, shm_name, pool):
    with ChainStore(chain_config(shm_name, tmp_path / "f", slots=64, stage_hold_fraction=0.25,
                                 stage_hold_s=0.5), spec=ODD_SPEC) as c:
        c.attach(pool)
        keys, _ = saved_in_file(c, pool, 24, seed=35)
        wait_ready(c, 2)
        t = c.stage(keys)                          # never cancelled
        assert t.wait(60) and t.staged == 24
        st = c.stats()
        assert c.held_pages() == 16 == st["stage_holding_pages"]        # a quarter of 64
        assert st["stage_held_pages"] == 16 and st["stage_hold_refused_pages"] == 8
        # the run the arena holds whole is held at once, but there is no room left
        again = c.stage(keys[:4])
        assert again.done() and c.held_pages() == 16
        again.cancel()
        time.sleep(0.6)
        late = c.stage([os.urandom(32)])           # any stage lets the old holds go
        assert late.wait(60)
        assert c.held_pages() == 0 and c.members[0].arena.pinned() == 0
        assert c.stats()["stage_hold_expired_pages"] == 16


def test_close_lets_the_holds_go(tmp_path, shm_name, pool):
    c = ChainStore(chain_config(shm_name, tmp_path / "f", slots=64), spec=ODD_SPEC)
    c.attach(pool)
    keys, _ = saved_in_file(c, pool, 8, seed=36)
    wait_ready(c, 2)
    t = c.stage(keys)
    assert t.wait(60) and c.held_pages() == 8
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 30 and c.held_pages() == 0
    t.cancel()                                     # after close: nothing to let go, no error
    assert not glob.glob(os.path.join(shm_mod.DEFAULT_ROOT, f"{shm_name}-*"))



def test_writing_a_held_key_does_not_wait_and_reaches_the_file(tmp_path, shm_name, pool):
    """A key held for a queued request and written again (another request computed it):
    the arena refuses it at once (its slot is held), the file takes it; nothing waits for
    a lock, the held copy stays."""
    with ChainStore(chain_config(shm_name, tmp_path / "f", slots=64), spec=ODD_SPEC) as c:
        c.attach(pool)
        keys, want = saved_in_file(c, pool, 6, seed=38)
        wait_ready(c, 2)
        t = c.stage(keys)
        assert t.wait(60) and c.held_pages() == 6
        c.members[1].delete(keys[:3])                # so the write's landing there is seen
        t0 = time.monotonic()
        assert c.batch_set(keys[:3], random.Random(39).sample(range(40), 3)) == [True] * 3
        assert time.monotonic() - t0 < 0.5
        assert c.members[1].batch_exists(keys[:3]) == 3
        assert c.members[0].stats()["set_busy"] >= 3
        fill_random(pool.raw)
        dst = random.Random(40).sample(range(40), 6)
        assert c.members[0].batch_get(keys, dst) == [True] * 6
        for i, p in enumerate(dst):
            assert_bitwise_equal(pool.view[p], want[i], f"key {i}")
        t.cancel()
