"""The shm store: the contract suite in other settings, real processes sharing one arena,
writers and readers killed mid-copy, races on one slot, capacity across processes, hostile
files at the arena path, permissions.

Every arena here has a unique name and is removed when its test ends; every test that waits
on another process is bounded by a timeout.
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

from kvtier.errors import ConfigError, StoreError
from kvtier.l3_stores import shm as shm_mod
from kvtier.l3_stores import shm_arena, shm_format
from kvtier.l3_stores.shm import ShmStore
from kvtier.testing import L3StoreContract
from kvtier.testing.contracts import assert_bitwise_equal
from kvtier.testing.data import fill_random, make_host_pool, random_specs

import shm_store_child as child

CHILD = os.path.join(os.path.dirname(__file__), "shm_store_child.py")
TIMEOUT = 120

pytestmark = pytest.mark.skipif(not ShmStore.probe().ok,
                                reason=f"shm: {ShmStore.probe().reason}")


@pytest.fixture
def name():
    """A unique arena name; every arena of it is removed afterwards."""
    n = f"kvtier-test-{os.getpid()}-{os.urandom(4).hex()}"
    yield n
    for path in glob.glob(os.path.join(shm_mod.DEFAULT_ROOT, f"{n}-*")):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            pass


def cfg(name: str, **kw) -> dict:
    return {"name": name, "capacity_pages": 32, "remove_when_unused": True, **kw}


@pytest.fixture
def spec():
    return child.SPEC


@pytest.fixture
def pool(spec):
    p = make_host_pool(spec, 24)
    yield p
    p.close()


def arena_path(name: str, spec=child.SPEC, namespace: str = "") -> str:
    return os.path.join(shm_mod.DEFAULT_ROOT, f"{name}-u{os.geteuid()}.{spec.fingerprint}"
                        + (f".ns-{namespace}" if namespace else "") + ".arena")


def run_child(config: dict, *args: str, timeout: float = TIMEOUT) -> dict:
    r = subprocess.run([sys.executable, CHILD, json.dumps(config), *map(str, args)],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def start_child(config: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CHILD, json.dumps(config), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_line(proc: subprocess.Popen, want: str, timeout: float = TIMEOUT) -> None:
    """Wait (bounded) until the child prints ``want``."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box or box[0].strip() != want:
        proc.kill()
        raise AssertionError(f"child said {box!r}, not {want!r}: {proc.stderr.read()[-2000:]}")


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=TIMEOUT)


def check_all(config: dict, want_gen: int | None = None) -> list[bool]:
    """Read every key in this process: each a miss or a complete page (of ``want_gen``)."""
    store, pool = child.open_store(config)
    try:
        got, gens = child.read(store, pool)
        for i, (ok, g) in enumerate(zip(got, gens)):
            assert not ok or g is not None, f"key {i}: wrong bytes"
            assert not ok or want_gen is None or g == want_gen, (i, g, want_gen)
        return got
    finally:
        store.close()
        pool.close()


# ---------------------------------------------------------------------------------------------
# The contract, in settings the registry's example config does not use
# ---------------------------------------------------------------------------------------------
class TestShmChecksumTwoWays(L3StoreContract):
    """CRC-32 on (as on CPUs that reorder loads), two ways a set (evictions within sets)."""

    def pytest_generate_tests(self, metafunc) -> None:
        if "backend_name" in metafunc.fixturenames:
            metafunc.parametrize("backend_name", ["shm"])

    def make_config(self, backend_name: str, workdir: str) -> dict:
        return {**super().make_config(backend_name, workdir), "checksum": "crc32", "ways": 2,
                "populate": False}


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec_", random_specs(), ids=lambda s: s.kind + str(s.page_bytes))
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_random_pages_round_trip_bitwise(name, spec_, layout):
    rng = random.Random(zlib.crc32(f"{spec_.page_bytes}-{layout}".encode()))
    pool = make_host_pool(spec_, 40, layout)
    store = ShmStore(cfg(name, capacity_pages=64, checksum=rng.choice(["off", "crc32"])),
                     spec=spec_)
    try:
        store.attach(pool)
        keys = [os.urandom(rng.randrange(1, 80)) for _ in range(17)]
        src = rng.sample(range(40), 17)
        want = [pool.view[p].clone() for p in src]
        assert store.batch_set(keys, src) == [True] * 17
        fill_random(pool.raw)
        dst = rng.sample(range(40), 17)
        assert store.batch_get(keys, dst) == [True] * 17
        for i, p in enumerate(dst):
            assert_bitwise_equal(pool.view[p], want[i], f"key {i} into page {p}")
    finally:
        store.close()
        pool.close()
    assert not os.path.exists(store.path), "remove_when_unused: the last store removes it"


def test_two_stores_in_one_process_share_the_arena(name, spec, pool):
    a, b = ShmStore(cfg(name), spec=spec), ShmStore(cfg(name), spec=spec)
    try:
        a.attach(pool)
        b.attach(pool)
        assert a.path == b.path and a.arena.created and not b.arena.created
        want = pool.page_bytes_view(3).clone()
        assert a.batch_set([b"k"], [3]) == [True]
        assert b.batch_get([b"k"], [9]) == [True]
        assert torch.equal(pool.page_bytes_view(9), want)
        assert b.stats()["objects"] == 1
    finally:
        a.close()
        assert os.path.exists(b.path), "another store still has it open"
        b.close()
    assert not os.path.exists(b.path)


def test_stats_say_backing_path_and_capacity(name, spec, pool):
    with ShmStore(cfg(name), spec=spec) as s:
        st = s.stats()
        assert st["path"] == arena_path(name) and st["backing"].startswith("tmpfs")
        assert st["backing_reason"].startswith("not hugepages: ")
        assert st["slots"] == 32 and st["slot_bytes"] % 4096 == 0
        assert st["slot_bytes"] >= spec.page_bytes and st["capacity_bytes"] == 32 * st[
            "slot_bytes"]
        assert st["checksum"].startswith("off") == (os.uname().machine == "x86_64")
        assert s.object_nbytes() == st["slot_bytes"]


def test_capacity_in_bytes_counts_whole_slots(name, spec):
    stride = shm_format.Geometry.plan(spec.page_bytes, 1, 1).stride
    with ShmStore({"name": name, "capacity_bytes": 5 * stride + stride - 1,
                   "remove_when_unused": True}, spec=spec) as s:
        assert s.stats()["slots"] == 5


def test_lru_evicts_the_least_recently_used_in_a_set(name, spec, pool):
    with ShmStore(cfg(name, capacity_pages=4, ways=4), spec=spec) as s:
        s.attach(pool)
        keys = [b"a", b"b", b"c", b"d"]
        for k, p in zip(keys, range(4)):           # one call each: a is the oldest
            assert s.batch_set([k], [p]) == [True]
        assert s.batch_get([b"a"], [10]) == [True]  # a is now the newest; b the oldest
        assert s.batch_set([b"e"], [5]) == [True]
        assert s.batch_exists([b"a"]) == 1 and s.batch_exists([b"b"]) == 0
        assert s.batch_exists([b"c", b"d", b"e"]) == 3
        assert s.stats()["evictions"] == 1 and s.stats()["objects"] == 4


def test_a_read_overtaken_by_a_write_is_never_mixed_bytes(name, spec, pool, monkeypatch):
    """A reader half way through a copy when another store rewrites the slot detects it (the
    generation changed): it reads again and gets the new page, never a mix."""
    reader, writer = ShmStore(cfg(name), spec=spec), ShmStore(cfg(name), spec=spec)
    try:
        reader.attach(pool)
        writer.attach(pool)
        old, new = pool.page_bytes_view(0).clone(), pool.page_bytes_view(1).clone()
        assert writer.batch_set([b"k"], [0]) == [True]
        real, paused, go = shm_arena._memmove, threading.Event(), threading.Event()

        def slow(dst, src, n):
            if threading.current_thread().name == "reader" and not paused.is_set():
                real(dst, src, n // 2)
                paused.set()
                assert go.wait(TIMEOUT)
                return real(dst + n // 2, src + n // 2, n - n // 2)
            return real(dst, src, n)
        monkeypatch.setattr(shm_arena, "_memmove", slow)
        out: list = []
        t = threading.Thread(target=lambda: out.append(reader.batch_get([b"k"], [7])),
                             name="reader")
        t.start()
        assert paused.wait(TIMEOUT)
        assert writer.batch_set([b"k"], [1]) == [True]      # rewrites the slot under it
        go.set()
        t.join(TIMEOUT)
        assert out == [[True]]
        assert torch.equal(pool.page_bytes_view(7), new) and not torch.equal(new, old)
        assert reader.stats()["torn_reads"] == 1
    finally:
        reader.close()
        writer.close()


def test_damaged_slot_with_checksum_is_a_counted_miss(name, spec, pool):
    with ShmStore(cfg(name, checksum="crc32"), spec=spec) as s:
        s.attach(pool)
        assert s.batch_set([b"k"], [0]) == [True]
        slot = s.arena.find(s.arena.digest(b"k"))
        s.arena._u8[s.arena.geo.data_off + slot * s.arena.geo.stride + 100] ^= 0x5A
        assert s.batch_get([b"k"], [5]) == [False]
        st = s.stats()
        assert st["crc_mismatch"] == 1 and st["corrupted"] == 1 and st["errors"] == 1


def test_a_held_set_lock_is_a_bounded_counted_failure(name, spec, pool):
    """Another open file holding a set's lock (a stopped process) costs a counted failed
    write after lock_timeout_s, never a hang."""
    with ShmStore(cfg(name, capacity_pages=1, lock_timeout_s=0.2), spec=spec) as s:
        s.attach(pool)
        fd = os.open(s.path, os.O_RDWR)
        try:
            assert shm_arena.try_lock(fd, shm_arena._SET_LOCKS + 0)
            t0 = time.monotonic()
            assert s.batch_set([b"k"], [0]) == [False]
            assert time.monotonic() - t0 < 5
            assert s.stats()["lock_timeouts"] == 1 and s.stats()["errors"] == 1
            assert s.batch_get([b"k"], [1]) == [False]        # reads take no lock
        finally:
            os.close(fd)
        assert s.batch_set([b"k"], [0]) == [True]


def test_closed_store_refuses_calls(name, spec, pool):
    s = ShmStore(cfg(name), spec=spec)
    s.attach(pool)
    s.close()
    s.close()
    with pytest.raises(StoreError):
        s.batch_get([b"k"], [0])


@pytest.mark.parametrize("bad", [
    {"capacity_pages": 0}, {"capacity_bytes": 100},
    {"capacity_pages": 2, "capacity_bytes": 1 << 20},
    {"name": "a/b"}, {"name": ""}, {"namespace": "../x"}, {"ways": 0}, {"lock_timeout_s": -1},
    {"group": "no-such-group-kvtier"}, {"hugepages": "maybe"}, {"checksum": "md5"},
    {"no_such_setting": 1}])
def test_bad_config_is_a_config_error(name, spec, bad):
    with pytest.raises(ConfigError):
        ShmStore({**cfg(name), **bad}, spec=spec)
    assert not os.path.exists(arena_path(name))


def test_hugepages_on_without_a_mount_is_refused_and_auto_says_why(name, spec, tmp_path):
    if shm_mod.hugetlbfs_mount()[0] and (shm_mod.free_huge_pages() or 0) > 4:
        pytest.skip("this machine has hugepages: see test_hugepages_when_present")
    with pytest.raises(StoreError, match="hugepages='on'"):
        ShmStore(cfg(name, hugepages="on"), spec=spec)
    with ShmStore(cfg(name, hugepages="auto"), spec=spec) as s:
        st = s.stats()
        assert not st["backing"].startswith("hugetlbfs")
        assert st["backing_reason"].startswith("not hugepages: ") and (
            "hugetlbfs" in st["backing_reason"] or "free 2 MiB pages" in st["backing_reason"])
    with pytest.raises(StoreError):
        ShmStore(cfg(name, hugepages="on", hugetlbfs=str(tmp_path)), spec=spec)


def test_auto_takes_hugepages_where_the_host_has_them_but_joins_an_arena_in_root(
        name, spec, pool, tmp_path, monkeypatch):
    """The default, "auto": a mount with enough free 2 MiB pages takes a new arena (a
    directory stands in for the hugetlbfs mount); an arena another process made in ``root``
    (when it found no free pages) is joined there, so processes never split into two."""
    assert shm_mod.ShmStore.Config().hugepages == "auto"
    monkeypatch.setattr(shm_mod, "hugetlbfs_mount", lambda wanted="": (str(tmp_path), ""))
    monkeypatch.setattr(shm_mod, "free_huge_pages", lambda: 1 << 20)
    with ShmStore(cfg(name + "-a"), spec=spec) as s:
        assert s.stats()["backing"] == "hugetlbfs-2MiB"
        assert s.path.startswith(str(tmp_path))
    with ShmStore(cfg(name, hugepages="off"), spec=spec) as first:      # found no pages
        first.attach(pool)
        assert first.batch_set([b"k"], [1]) == [True]
        with ShmStore(cfg(name), spec=spec) as second:
            st = second.stats()
            assert second.path == first.path == arena_path(name)
            assert "already" in st["backing_reason"] and st["backing"].startswith("tmpfs")
            assert second.batch_exists([b"k"]) == 1
    assert os.listdir(tmp_path) == []                    # removed when unused, as in root


def test_hugepages_when_present(name, spec, pool):
    mount, why = shm_mod.hugetlbfs_mount()
    if not mount or (shm_mod.free_huge_pages() or 0) < 4:
        pytest.skip(f"no hugetlbfs with free 2 MiB pages here: {why or 'no free pages'}")
    with ShmStore(cfg(name, hugepages="on"), spec=spec) as s:
        s.attach(pool)
        assert s.stats()["backing"] == "hugetlbfs-2MiB"
        want = pool.page_bytes_view(2).clone()
        assert s.batch_set([b"k"], [2]) == [True] and s.batch_get([b"k"], [3]) == [True]
        assert torch.equal(pool.page_bytes_view(3), want)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a hugetlbfs")
def test_a_hugetlbfs_without_free_pages_is_found_and_explained(name, spec, tmp_path):
    """A real hugetlbfs mount: found by its path, and with too few free 2 MiB pages "auto"
    falls back to /dev/shm saying so, "on" refuses."""
    mnt = tmp_path / "huge"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mnt)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        pytest.skip(f"cannot mount a hugetlbfs here: {r.stderr.strip()}")
    try:
        assert shm_mod.hugetlbfs_mount(str(mnt)) == (str(mnt), "")
        free = shm_mod.free_huge_pages()
        if free is None or free > 2:
            pytest.skip(f"{free} free 2 MiB pages: the arena may fit (see the test above)")
        with ShmStore(cfg(name, hugepages="auto", hugetlbfs=str(mnt)), spec=spec) as s:
            st = s.stats()
            assert st["backing"].startswith("tmpfs") and "free 2 MiB pages" in \
                st["backing_reason"] and st["path"].startswith(shm_mod.DEFAULT_ROOT)
        with pytest.raises(StoreError, match="free 2 MiB pages"):
            ShmStore(cfg(name, hugepages="on", hugetlbfs=str(mnt)), spec=spec)
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=60)


def test_probe_says_why_without_dev_shm(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_mod, "DEFAULT_ROOT", str(tmp_path / "missing"))
    av = ShmStore.probe()
    assert not av.ok and "missing" in av.reason and "tmpfs" in av.hint


def test_namespaces_and_specs_open_different_arenas(name, pool, spec):
    other = random_specs()[1]
    with ShmStore(cfg(name, namespace="aa"), spec=spec) as a, \
            ShmStore(cfg(name, namespace="bb"), spec=spec) as b, \
            ShmStore(cfg(name, namespace="aa"), spec=other) as c:
        assert len({a.path, b.path, c.path}) == 3
        a.attach(pool)
        b.attach(pool)
        assert a.batch_set([b"k"], [0]) == [True]
        assert b.batch_exists([b"k"]) == 0


def test_fork_child_gets_its_own_locks(name, spec, pool):
    """A forked child shares nothing of its parent's open file: it writes and the parent
    reads, and a slot the parent holds is not the child's to take."""
    with ShmStore(cfg(name), spec=spec) as s:
        s.attach(pool)
        want = pool.page_bytes_view(4).clone()
        slot_lock = s.arena._slot_lock(0)
        assert shm_arena.try_lock(s.arena.fd, slot_lock)       # as a writer of slot 0 would
        pid = os.fork()
        if pid == 0:                                             # pragma: no cover (child)
            code = 1
            try:
                ok = s.batch_set([b"from-child"], [4]) == [True]
                code = 0 if ok and not shm_arena.try_lock(s.arena.fd, slot_lock) else 2
            finally:
                os._exit(code)
        end = time.monotonic() + TIMEOUT
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < end, "forked child hung"
            time.sleep(0.01)
        shm_arena.unlock(s.arena.fd, slot_lock)
        assert os.waitstatus_to_exitcode(status) == 0
        assert s.batch_get([b"from-child"], [11]) == [True]
        assert torch.equal(pool.page_bytes_view(11), want)


# ---------------------------------------------------------------------------------------------
# Real processes
# ---------------------------------------------------------------------------------------------
def test_one_process_writes_another_reads_bitwise(name):
    config = cfg(name, remove_when_unused=False)
    w = run_child(config, "write", 7)
    assert w["ok"] == [True] * child.NUM_KEYS and w["stats"]["created"] == 1
    r = run_child(config, "read")
    assert r["hits"] == [True] * child.NUM_KEYS and r["gens"] == [7] * child.NUM_KEYS
    assert check_all(config, 7) == [True] * child.NUM_KEYS
    assert oct(stat.S_IMODE(os.stat(arena_path(name)).st_mode)) == oct(0o600)


def test_writer_killed_mid_copy_costs_misses_then_its_slots_are_reclaimed(name):
    config = cfg(name, remove_when_unused=False)
    assert run_child(config, "write", 1)["ok"] == [True] * child.NUM_KEYS
    proc = start_child(config, "stall-write", 2)
    wait_line(proc, "stalled")            # half of key 0's new page is in its slot
    kill(proc)
    got = check_all(config)               # every other key still holds generation 1
    assert got[0] is False and got[1:] == [True] * (child.NUM_KEYS - 1)
    w = run_child(config, "write", 3)
    assert w["ok"] == [True] * child.NUM_KEYS and w["stats"]["reclaimed"] == 1
    assert check_all(config, 3) == [True] * child.NUM_KEYS


def test_reader_killed_mid_copy_leaves_nothing_behind(name):
    config = cfg(name, remove_when_unused=False)
    assert run_child(config, "write", 1)["ok"] == [True] * child.NUM_KEYS
    proc = start_child(config, "stall-read")
    wait_line(proc, "stalled")
    kill(proc)
    assert check_all(config, 1) == [True] * child.NUM_KEYS
    w = run_child(config, "write", 2)
    assert w["ok"] == [True] * child.NUM_KEYS and w["stats"]["reclaimed"] == 0
    assert check_all(config, 2) == [True] * child.NUM_KEYS


def test_writers_killed_at_random_times_while_others_read(name):
    config = cfg(name, remove_when_unused=False)
    rng = random.Random(5)
    reader = start_child(config, "loop-read", 15)
    wait_line(reader, "started")
    try:
        for _ in range(4):
            proc = start_child(config, "loop-write", 60)
            wait_line(proc, "started")
            time.sleep(rng.uniform(0.05, 0.6))
            kill(proc)
            check_all(config)
    finally:
        r = finish(reader)
    assert r["bad"] == 0 and r["hits"] > 0
    w = run_child(config, "write", 99)
    assert w["ok"] == [True] * child.NUM_KEYS
    assert check_all(config, 99) == [True] * child.NUM_KEYS


def test_readers_never_see_wrong_bytes_while_writers_run(name):
    config = cfg(name, remove_when_unused=False)
    procs = [start_child(config, "loop-write", 6), start_child(config, "loop-read", 6),
             start_child(config, "loop-read", 6)]
    outs = [finish(p) for p in procs]
    assert outs[0]["gens"] > 1
    for r in outs[1:]:
        assert r["bad"] == 0 and r["hits"] > 0


def test_processes_racing_on_one_slot(name):
    config = cfg(name, remove_when_unused=False)
    procs = [start_child(config, "race", 3, ident, 3) for ident in (1, 2, 3)]
    outs = [finish(p) for p in procs]
    assert all(o["bad"] == 0 for o in outs) and sum(o["written"] for o in outs) > 3
    store, pool = child.open_store(config)
    try:
        d = store.arena.digest(child.key(3))
        lo, hi = store.arena.bounds(d.set)
        held = [tuple(r) for r in store.arena.dig[lo:hi].tolist()].count(d.words)
        assert held == 1, "a key has one slot, whoever raced for it"
        got, gens = child.read(store, pool, 3, 1)
        assert got == [True] and gens[0] is not None and gens[0] >> 32 in (1, 2, 3)
    finally:
        store.close()
        pool.close()


def test_a_full_arena_keeps_its_capacity_across_processes(name):
    config = cfg(name, capacity_pages=8, ways=4, remove_when_unused=False)
    procs = [start_child(config, "write", 1, first, 20) for first in (0, 100, 200)]
    outs = [finish(p) for p in procs]
    assert all(all(o["ok"]) for o in outs)
    assert sum(o["stats"]["evictions"] for o in outs) >= 3 * 20 - 8
    store, pool = child.open_store(config)
    try:
        assert store.arena.used() == 8 and store.stats()["objects"] == 8
        found = 0
        for first in (0, 100, 200):
            got, gens = child.read(store, pool, first, 20)
            assert all(g is not None for ok, g in zip(got, gens) if ok)
            found += sum(got)
        assert found == 8
    finally:
        store.close()
        pool.close()


def test_processes_creating_one_arena_at_once(name):
    """Four processes open a new arena together: one creates it, all share it."""
    config = cfg(name, remove_when_unused=False)
    procs = [start_child(config, "write", 5, first, 4) for first in (0, 10, 20, 30)]
    outs = [finish(p) for p in procs]
    assert all(all(o["ok"]) for o in outs)
    assert sum(o["stats"]["created"] for o in outs) == 1
    store, pool = child.open_store(config)
    try:
        for first in (0, 10, 20, 30):
            got, gens = child.read(store, pool, first, 4)
            assert got == [True] * 4 and gens == [5] * 4
    finally:
        store.close()
        pool.close()


def test_two_last_users_closing_at_once_remove_the_arena(name, spec):
    stores = [ShmStore(cfg(name), spec=spec) for _ in range(2)]
    barrier = threading.Barrier(2)

    def close(s):
        barrier.wait(TIMEOUT)
        s.close()
    threads = [threading.Thread(target=close, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not os.path.exists(stores[0].path)


def test_the_last_process_out_removes_the_arena(name):
    config = cfg(name)                    # remove_when_unused
    reader = start_child(config, "loop-read", 8)
    wait_line(reader, "started")
    assert run_child(config, "write", 1)["ok"] == [True] * child.NUM_KEYS
    assert os.path.exists(arena_path(name)), "the reader still has it open"
    assert finish(reader)["bad"] == 0
    assert not os.path.exists(arena_path(name))


# ---------------------------------------------------------------------------------------------
# What is at the arena path
# ---------------------------------------------------------------------------------------------
def refused(name: str, spec, reason: str, **kw) -> StoreError:
    with pytest.raises(StoreError) as e:
        ShmStore(cfg(name, **kw), spec=spec)
    assert getattr(e.value, "reason", None) == reason, e.value
    return e.value


def test_symlink_at_the_arena_path_is_never_followed(name, spec, tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    os.symlink(target, arena_path(name))
    refused(name, spec, "symlink")
    assert target.read_bytes() == b"precious"
    os.unlink(arena_path(name))
    os.symlink(tmp_path / "dangling", arena_path(name))
    refused(name, spec, "symlink")
    assert not (tmp_path / "dangling").exists()


def test_fifo_at_the_arena_path_does_not_block(name, spec):
    os.mkfifo(arena_path(name), 0o600)
    code = ("import sys, json; from kvtier.l3_stores.shm import ShmStore\n"
            "import shm_store_child as c\n"
            "try:\n    ShmStore(json.loads(sys.argv[1]), spec=c.SPEC)\n"
            "except Exception as e:\n    print(type(e).__name__, getattr(e, 'reason', ''))\n")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cfg(name))], timeout=60,
                       capture_output=True, text=True, cwd=os.path.dirname(CHILD))
    assert r.stdout.split() == ["ArenaRefused", "not_regular"], r.stderr


def test_directory_at_the_arena_path_is_refused(name, spec):
    os.mkdir(arena_path(name))
    refused(name, spec, "not_regular")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_arena_is_refused(name, spec):
    with ShmStore(cfg(name, remove_when_unused=False), spec=spec):
        pass
    os.chown(arena_path(name), 65534, -1)
    refused(name, spec, "owner")


def test_a_mode_that_lets_others_in_is_refused(name, spec):
    with ShmStore(cfg(name, remove_when_unused=False), spec=spec):
        pass
    os.chmod(arena_path(name), 0o644)
    refused(name, spec, "mode")


def test_mode_is_0600_whatever_the_umask_and_0660_for_a_group(name, spec):
    old = os.umask(0)
    try:
        with ShmStore(cfg(name), spec=spec) as s:
            assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
        gid = os.getegid()
        with ShmStore(cfg(name, group=str(gid)), spec=spec) as s:
            st = os.stat(s.path)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
            assert f"-g{gid}." in s.path
    finally:
        os.umask(old)


@pytest.mark.parametrize("damage,reason", [
    ("short_garbage", "truncated"), ("garbage", "corrupted"), ("bad_crc", "corrupted"),
    ("truncated_slots", "truncated"), ("other_namespace", "foreign"),
    ("other_version", "foreign")])
def test_damaged_or_foreign_arena_is_refused(name, spec, damage, reason):
    path = arena_path(name)
    with ShmStore(cfg(name, remove_when_unused=False), spec=spec) as s:
        geo = s.arena.geo
    with open(path, "r+b") as f:
        if damage == "short_garbage":
            f.truncate(0)
            f.write(os.urandom(100))
        elif damage == "garbage":
            f.write(os.urandom(4096))
        elif damage == "bad_crc":
            f.seek(40)
            f.write(b"\x01")
        elif damage == "truncated_slots":
            f.truncate(geo.data_off + 5)
        else:
            ns = "zz" if damage == "other_namespace" else ""
            head = bytearray(shm_format.pack_header(geo, spec.fingerprint, ns, os.geteuid()))
            if damage == "other_version":
                head[8] = 9
                head[-4:] = (zlib.crc32(bytes(head[:-4])) & 0xFFFFFFFF).to_bytes(4, "little")
            f.write(head)
    refused(name, spec, reason)


def test_another_geometry_is_refused(name, spec):
    with ShmStore(cfg(name, remove_when_unused=False), spec=spec):
        pass
    e = refused(name, spec, "geometry", capacity_pages=33)
    assert "slots" in str(e)


def test_a_zeroed_arena_is_one_whose_creator_died_and_is_made_again(name, spec, pool):
    """A header of zeros (a creator killed before it wrote the header) is initialised again."""
    with open(arena_path(name), "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(bytes(12345))
    with ShmStore(cfg(name), spec=spec) as s:
        s.attach(pool)
        assert s.arena.created and s.batch_set([b"k"], [0]) == [True]


def test_a_closed_store_holds_no_lock_even_if_its_mapping_outlives_it(name, spec):
    """A view of the mapping that escaped keeps the open file alive past close(); its locks
    (the init lock its close took, its users lock) must go anyway, or the last user cannot
    remove the arena and a new opener waits on the init lock."""
    a = ShmStore(cfg(name), spec=spec)
    b = ShmStore(cfg(name), spec=spec)
    escaped = memoryview(b.arena.mm)             # keeps b's mapping, and its open file
    try:
        b.close()
        a.close()                                 # the last user: removes the arena
        assert not os.path.exists(arena_path(name))
    finally:
        escaped.release()
