"""The `file` store's segment format where tests must handle its files directly: damaged
slots, planted and foreign segments, garbled index logs, non-regular entries, killed writers,
full disks, several processes sharing one directory, LRU per segment, cleaning at open.

Pages are random bytes (never zeros), page indices random, sizes odd and aligned; everything
read back is compared bitwise."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import _files as files_mod
from kvtier.l3_stores.file import segment_index as seg_mod
from kvtier.l3_stores.file import TRAILER_BYTES, FileStore
from kvtier.spec import KVSpec
from kvtier.testing import fill_random

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "file_store_child.py")
sys.path.insert(0, HERE)
import file_store_child as child  # noqa: E402
from file_formats import flip  # noqa: E402

ODD = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16")
ALIGNED = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=8,
                     dtype="bfloat16")


def keys(n: int, tag: str = "") -> list[bytes]:
    salt = os.urandom(4).hex() + tag
    return [f"seg-{salt}-{i}".encode() for i in range(n)]


def page(pool: HostKVPool, p: int) -> torch.Tensor:
    return torch.cat(pool.page_segments(p)).clone()


def open_store(root, spec=ODD, **config) -> FileStore:
    return FileStore({"root": str(root), "format": "segments", "io_threads": 3, **config},
                     spec=spec)


def seg_dir(store: FileStore) -> str:
    return os.path.join(store.dir, seg_mod.SEG_DIR)


def files(store: FileStore, suffix: str) -> list[str]:
    d = seg_dir(store)
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(suffix))


@pytest.fixture(params=["page-cache", "o-direct"])
def rig(request, tmp_path):
    """(store, pool, spec) for both I/O paths (odd pages use the page cache)."""
    spec = ODD if request.param == "page-cache" else ALIGNED
    pool = HostKVPool(spec, 16, allocator=MmapAllocator())
    fill_random(pool.raw)
    s = open_store(tmp_path / "store", spec,
                   o_direct="off" if request.param == "page-cache" else "auto")
    s.attach(pool)
    if request.param == "o-direct" and not s.stats()["o_direct"]:
        pytest.skip(f"O_DIRECT not possible here: {s.stats()['o_direct_reason']}")
    yield s, pool, spec
    s.close()
    pool.close()


@pytest.fixture
def pool():
    p = HostKVPool(ODD, 16, allocator=MmapAllocator())
    fill_random(p.raw)
    yield p
    p.close()


# --------------------------------------------------------------------------------------------
# round trips across segments
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [ODD, ALIGNED], ids=["odd", "aligned"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_random_round_trips_across_many_segments(tmp_path, spec, layout):
    rng = random.Random(11)
    with HostKVPool(spec, 40, layout=layout, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(tmp_path, spec, segment_bytes=3 * 4096 + (spec.page_bytes // 4096)
                       * 3 * 4096)             # three slots a segment: batches cross them
        s.attach(pool)
        assert s.stats()["segment_slots"] == 3
        k = keys(20)
        src = rng.sample(range(40), 20)
        want = {key: page(pool, p) for key, p in zip(k, src)}
        for i in range(0, 20, 7):
            assert s.batch_set(k[i:i + 7], src[i:i + 7]) == [True] * len(k[i:i + 7])
        assert s.stats()["segments"] == 7 and s.stats()["live_slots"] == 20
        fill_random(pool.raw)
        order = rng.sample(range(20), 20)
        dst = rng.sample(range(40), 20)
        assert s.batch_get([k[i] for i in order], dst) == [True] * 20
        for i, d in zip(order, dst):
            assert torch.equal(page(pool, d), want[k[i]]), i
        # a fresh store finds them all through the index logs
        s.close()
        s2 = open_store(tmp_path, spec)
        s2.attach(pool)
        fill_random(pool.raw)
        assert s2.batch_get(k, dst) == [True] * 20
        for key, d in zip(k, dst):
            assert torch.equal(page(pool, d), want[key])
        assert s2.stats()["errors"] == 0
        s2.close()


def test_overwrite_latest_wins_across_instances(tmp_path, pool):
    a, b = open_store(tmp_path), open_store(tmp_path)
    a.attach(pool)
    b.attach(pool)
    k = keys(3)
    assert a.batch_set(k, [0, 1, 2]) == [True] * 3
    assert b.batch_set(k[1:2], [7]) == [True]          # b's newer page for k[1]
    newest = page(pool, 7)
    olds = [page(pool, 0), page(pool, 2)]
    time.sleep(0.01)
    a.close()
    c = open_store(tmp_path)
    c.attach(pool)
    fill_random(pool.raw)
    assert c.batch_get(k, [10, 11, 12]) == [True] * 3
    assert torch.equal(page(pool, 11), newest)
    assert torch.equal(page(pool, 10), olds[0]) and torch.equal(page(pool, 12), olds[1])
    b.close()
    c.close()


def test_opening_reads_the_logs_not_the_slots(tmp_path, pool, monkeypatch):
    s = open_store(tmp_path)
    s.attach(pool)
    assert s.batch_set(keys(12), list(range(12))) == [True] * 12
    s.close()
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(len(a[1])) or real(*a))
    s2 = open_store(tmp_path, o_direct="off")         # (no O_DIRECT probe either)
    assert s2.stats()["objects"] == 12 and calls == []
    s2.close()


# --------------------------------------------------------------------------------------------
# damaged slots, segments and logs
# --------------------------------------------------------------------------------------------
DAMAGE = {
    "payload-bit": lambda path, off, n: flip(path, off + n // 3),
    "last-payload-byte": lambda path, off, n: flip(path, off + n - 1),
    "magic": lambda path, off, n: flip(path, off + n),
    "trailer-field": lambda path, off, n: flip(path, off + n + 60),
    "trailer-crc": lambda path, off, n: flip(path, off + n + TRAILER_BYTES - 1),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_slot_is_a_counted_miss_then_a_plain_one(rig, damage):
    store, pool, spec = rig
    k = keys(3)
    want = [page(pool, p) for p in (4, 9, 2)]
    assert store.batch_set(k, [4, 9, 2]) == [True] * 3
    path, off = store._seg.locate(k[1])
    DAMAGE[damage](path, off, spec.page_bytes)
    before = store.stats()
    fill_random(pool.raw)
    assert store.batch_get(k, [5, 6, 7]) == [True, False, True]
    assert torch.equal(page(pool, 5), want[0]) and torch.equal(page(pool, 7), want[2])
    after = store.stats()
    assert after["corrupted"] - before["corrupted"] == 1
    assert after["errors"] - before["errors"] == 1
    assert store.batch_exists(k[1:2]) == 0
    # its trailer was zeroed: a fresh store (another process) misses it plainly
    other = open_store(os.path.dirname(store.dir), spec)
    other.attach(pool)
    assert other.batch_get(k, [8, 9, 10]) == [True, False, True]
    assert other.stats()["corrupted"] == 0
    assert torch.equal(page(pool, 8), want[0]) and torch.equal(page(pool, 10), want[2])
    other.close()


def test_damaged_slot_kept_when_asked(tmp_path, pool):
    s = open_store(tmp_path, remove_corrupted=False)
    s.attach(pool)
    k = keys(1)
    assert s.batch_set(k, [3]) == [True]
    path, off = s._seg.locate(k[0])
    flip(path, off + 17)
    for _ in range(2):
        fresh = open_store(tmp_path, remove_corrupted=False)
        fresh.attach(pool)
        assert fresh.batch_get(k, [4]) == [False]
        assert fresh.stats()["corrupted"] == 1
        fresh.close()
    s.close()


@pytest.mark.parametrize("cut", ["mid-slot", "mid-trailer", "empty"])
def test_truncated_segment_is_counted_misses_for_what_is_gone(rig, cut):
    store, pool, spec = rig
    k = keys(4)
    want = [page(pool, p) for p in range(4)]
    assert store.batch_set(k, [0, 1, 2, 3]) == [True] * 4
    path, off = store._seg.locate(k[2])
    slot = store._seg.slot_bytes
    size = {"mid-slot": off + slot // 3, "mid-trailer": off + spec.page_bytes + 7,
            "empty": 0}[cut]
    os.truncate(path, size)
    fresh = open_store(os.path.dirname(store.dir), spec)
    fresh.attach(pool)
    fill_random(pool.raw)
    got = fresh.batch_get(k, [8, 9, 10, 11])
    lost = 4 if cut == "empty" else 2
    assert got == [True] * (4 - lost) + [False] * lost
    for i in range(4 - lost):
        assert torch.equal(page(pool, 8 + i), want[i])
    st_ = fresh.stats()
    assert st_["truncated"] == lost and st_["errors"] == lost
    # the same running store finds the short read too
    assert store.batch_get(k[2:], [12, 13]) == [False, False]
    assert store.stats()["truncated"] >= 1
    fresh.close()


def test_garbled_and_torn_log_records(tmp_path, pool):
    s = open_store(tmp_path, io_threads=1)          # one write: records in key order
    s.attach(pool)
    k = keys(5)
    want = [page(pool, p) for p in range(5)]
    assert s.batch_set(k, [0, 1, 2, 3, 4]) == [True] * 5
    s.close()
    (log,) = files(s, seg_mod.LOG_SUFFIX)
    flip(log, 1 * seg_mod.REC_BYTES + 20)                # record of k[1]: garbled
    fresh = open_store(tmp_path)
    fresh.attach(pool)
    fill_random(pool.raw)
    assert fresh.batch_get(k, [10, 11, 12, 13, 14]) == [True, False, True, True, True]
    for i in (0, 2, 3, 4):
        assert torch.equal(page(pool, 10 + i), want[i])
    assert fresh.stats()["index_bad_records"] == 1 and fresh.stats()["corrupted"] == 0
    fresh.close()
    # a torn last record (its writer is dead: this instance closed) is a counted miss too
    with open(log, "r+b") as f:
        f.truncate(4 * seg_mod.REC_BYTES + 30)
    fresh = open_store(tmp_path)
    fresh.attach(pool)
    assert fresh.batch_get(k, [10, 11, 12, 13, 14]) == [True, False, True, True, False]
    fresh.close()


def test_record_naming_another_keys_slot_is_a_miss(tmp_path, pool):
    """A log record pointing key B at key A's slot (a planted or stale index entry)."""
    s = open_store(tmp_path)
    s.attach(pool)
    a, b = keys(2)
    assert s.batch_set([a], [0]) == [True]
    seg, slot, t = s._seg._index[seg_mod.hashlib.sha256(a).digest()]
    writer = seg.split(".")[0]
    plant = os.path.join(seg_dir(s), seg.replace(writer, "5bce98f7-1-00000000")
                         .replace(seg_mod.SEG_SUFFIX, seg_mod.LOG_SUFFIX))
    with open(plant, "wb") as f:
        f.write(seg_mod.pack_record(1, int(seg.split(".")[1]), slot, t + 1,
                                    seg_mod.hashlib.sha256(b).digest()))
    # the record names the planted writer's segment: give it one (a copy of the real one)
    shutil.copy(os.path.join(seg_dir(s), seg),
                os.path.join(seg_dir(s), seg.replace(writer, "5bce98f7-1-00000000")))
    fresh = open_store(tmp_path)
    fresh.attach(pool)
    assert fresh.batch_get([b], [5]) == [False]
    assert fresh.stats()["foreign"] == 1
    assert fresh.batch_get([a], [5]) == [True]
    assert torch.equal(page(pool, 5), page(pool, 0))
    fresh.close()
    s.close()


def test_foreign_segments_and_garbage_open_and_miss(tmp_path, pool):
    """Another KVSpec's segment and log (same page size), random bytes under segment and
    log names, and foreign files: the store opens, serves its own pages, misses the rest."""
    other = KVSpec.mha(num_layers=6, num_kv_heads=1, head_dim=24, page_size=5,
                       dtype="bfloat16")
    assert other.page_bytes == ODD.page_bytes and other.fingerprint != ODD.fingerprint
    ours = open_store(tmp_path)
    ours.attach(pool)
    mine = keys(2, "mine")
    assert ours.batch_set(mine, [6, 7]) == [True, True]
    want = [page(pool, 6), page(pool, 7)]
    with HostKVPool(other, 2, allocator=MmapAllocator()) as opool:
        fill_random(opool.raw)
        foreign = open_store(tmp_path, other)
        foreign.attach(opool)
        k = keys(2)
        assert foreign.batch_set(k, [0, 1]) == [True, True]
        foreign.close()
    shutil.copytree(seg_dir(foreign), seg_dir(ours), dirs_exist_ok=True)
    d = seg_dir(ours)
    with open(os.path.join(d, "00000000-1-00000000.00000001.kvs"), "wb") as f:
        f.write(os.urandom(3 * 4096 + 5))
    with open(os.path.join(d, "00000000-1-00000000.00000001.kvl"), "wb") as f:
        f.write(os.urandom(1000))
    with open(os.path.join(d, "README"), "wb") as f:
        f.write(b"not the store's")
    fresh = open_store(tmp_path)
    fresh.attach(pool)
    assert fresh.batch_get(k, [2, 3]) == [False, False]
    st_ = fresh.stats()
    assert st_["foreign"] == 2 and st_["index_bad_records"] >= 1
    assert st_["foreign_entries"] >= 1
    fill_random(pool.raw)
    assert fresh.batch_get(mine, [8, 9]) == [True, True]
    assert torch.equal(page(pool, 8), want[0]) and torch.equal(page(pool, 9), want[1])
    fresh.clear()
    assert os.path.exists(os.path.join(d, "README"))
    fresh.close()
    ours.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "socket"])
@pytest.mark.parametrize("where", ["segment", "log"])
def test_non_regular_entries_under_store_names(tmp_path, pool, kind, where):
    s = open_store(tmp_path / "root")
    s.attach(pool)
    k = keys(2)
    assert s.batch_set(k[:1], [0]) == [True]
    s.close()
    (seg,) = files(s, seg_mod.SEG_SUFFIX)
    (log,) = files(s, seg_mod.LOG_SUFFIX)
    target = seg if where == "segment" else log
    outside = tmp_path / "outside"
    shutil.copy(target, outside)
    os.unlink(target)
    if kind == "fifo":
        os.mkfifo(target, 0o600)
    elif kind == "symlink":
        os.symlink(outside, target)
    elif kind == "directory":
        os.mkdir(target)
    else:
        sock = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(os.path.dirname(target))
        try:
            sock.bind(os.path.basename(target))
        finally:
            os.chdir(cwd)
            sock.close()
    before = outside.read_bytes()
    t0 = time.monotonic()
    fresh = open_store(tmp_path / "root")
    fresh.attach(pool)
    assert fresh.batch_get(k[:1], [3]) == [False]             # never followed, no hang
    assert fresh.batch_set(k[1:], [4]) == [True]              # the store keeps working
    assert fresh.batch_get(k[1:], [5]) == [True]
    assert torch.equal(page(pool, 5), page(pool, 4))
    fresh.clear()
    fresh.close()
    assert time.monotonic() - t0 < 30
    assert os.path.lexists(target), "not the store's to delete"
    assert outside.read_bytes() == before


def test_symlinked_segment_directory_is_never_followed(tmp_path, pool):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    s = open_store(root)
    s.close()
    shutil.rmtree(seg_dir(s))
    (outside / "x.kvs").write_bytes(b"keep")
    os.symlink(outside, seg_dir(s))
    s = open_store(root)
    s.attach(pool)
    k = keys(2)
    assert s.batch_set(k, [0, 1]) == [False, False]
    assert s.batch_get(k, [2, 3]) == [False, False]
    assert s.stats()["foreign_entries"] >= 1 and s.stats()["errors"] >= 2
    s.clear()
    s.close()
    assert sorted(os.listdir(outside)) == ["x.kvs"] and os.path.islink(seg_dir(s))


# --------------------------------------------------------------------------------------------
# full disks and I/O errors
# --------------------------------------------------------------------------------------------
def test_preallocation_failing_is_a_counted_miss(tmp_path, pool, monkeypatch):
    s = open_store(tmp_path)
    s.attach(pool)
    k = keys(4)
    assert s.batch_set(k[:1], [0]) == [True]
    want = page(pool, 0)
    s._seg.reopen()                           # seal: the next write needs a new segment

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert s.batch_set(k, [0, 1, 2, 3]) == [False] * 4
    st_ = s.stats()
    assert st_["disk_full"] == 4 and st_["write_errors"] == 4 and st_["errors"] == 4
    assert len(files(s, seg_mod.SEG_SUFFIX)) == 1, "the failed segment was removed"
    assert s.batch_exists(k) == 1
    monkeypatch.undo()
    fill_random(pool.raw)
    assert s.batch_get(k[:1], [9]) == [True] and torch.equal(page(pool, 9), want)
    assert s.batch_set(k[1:], [1, 2, 3]) == [True] * 3, "the store keeps working"
    s.close()


def test_write_failing_mid_run_keeps_the_old_pages(tmp_path, pool, monkeypatch):
    s = open_store(tmp_path, io_threads=1)
    s.attach(pool)
    k = keys(3)
    assert s.batch_set(k, [0, 1, 2]) == [True] * 3
    want = [page(pool, p) for p in range(3)]
    real = files_mod._pwrite_all

    def eio(fd, bufs, offset=0):
        real(fd, bufs[:1], offset)           # part of the run lands, then the disk fails
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(files_mod, "_pwrite_all", eio)
    fill_random(pool.raw)
    assert s.batch_set(k, [3, 4, 5]) == [False] * 3
    assert s.stats()["write_errors"] == 3
    monkeypatch.undo()
    for store in (s, open_store(tmp_path)):
        store.attach(pool)
        assert store.batch_get(k, [6, 7, 8]) == [True] * 3
        for i in range(3):
            assert torch.equal(page(pool, 6 + i), want[i]), "old pages, no record of new ones"
        store.close()


def test_read_error_is_a_counted_miss(tmp_path, pool, monkeypatch):
    s = open_store(tmp_path)
    s.attach(pool)
    k = keys(2)
    assert s.batch_set(k, [0, 1]) == [True, True]

    def eio(fd, bufs, offset=0):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(files_mod, "_pread_all", eio)
    assert s.batch_get(k, [2, 3]) == [False, False]
    assert s.stats()["read_errors"] >= 1
    monkeypatch.undo()
    assert s.batch_get(k, [2, 3]) == [True, True]
    s.close()


# --------------------------------------------------------------------------------------------
# killed writers, dead writers' files, several processes
# --------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    return {**os.environ, child.FORMAT_ENV: "segments"}


def _read_all(root: str) -> tuple[int, list[int]]:
    return child.read_all(root, format="segments")


def test_writer_killed_in_the_middle_of_a_batch(tmp_path):
    root = str(tmp_path)
    proc = subprocess.Popen([sys.executable, CHILD, root, "stall"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        child.wait_for(proc, "stalled")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    hits, gens = _read_all(root)
    assert hits == child.NUM_KEYS and gens == [0] * child.NUM_KEYS, "the old pages intact"
    # the dead writer's segment is sealed: a new writer appends elsewhere, and it can go
    store, pool = child.open_store(root, format="segments")
    assert all(child.write_gen(store, pool, 3))
    sd = os.path.join(store.dir, seg_mod.SEG_DIR)
    dead = [n for n in os.listdir(sd) if n.endswith(".kvs") and f"-{proc.pid}-" in n]
    assert dead and not store._seg._protected(dead[0], store._seg._segs[dead[0]],
                                              time.time_ns())
    store.close()
    pool.close()
    assert _read_all(root)[1] == [3] * child.NUM_KEYS


def test_other_processes_pages_found_without_a_rescan(tmp_path):
    """A store opened before another process wrote: its misses tail the other writer's log."""
    root = str(tmp_path)
    store, pool = child.open_store(root, format="segments")
    assert store.batch_exists(child.keys()) == 0
    out = subprocess.run([sys.executable, CHILD, root, "writer", "5", "1", "0.3"],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr
    got = store.batch_get(child.keys(), list(range(child.NUM_KEYS)))
    assert got == [True] * child.NUM_KEYS
    for i in range(child.NUM_KEYS):
        assert child.check_page(pool.page_bytes_view(i), i) is not None
    assert store.stats()["writers"] >= 2
    # and deletes for everyone: the other process's pages miss for a fresh reader too
    assert store.delete(child.keys()) == child.NUM_KEYS
    assert _read_all(root)[0] == 0
    store.close()
    pool.close()


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_existence_checks_stat_quiet_logs_and_still_see_new_writes(tmp_path, pool, request,
                                                                   monkeypatch, where):
    """Every existence check catches up with other writers' logs: one that was not written
    since it was read costs a stat, not a read; one written after that is read again. (In
    memory a log is quiet 50 ms after its last write, elsewhere after a second.)"""
    root = tmp_path
    if where == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm here")
        root = f"/dev/shm/kvtier-test-quiet-{os.getpid()}-{os.urandom(4).hex()}"
        request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
        monkeypatch.setattr(seg_mod, "_TOUCH_NS", 10**12)    # must not be what is waited
    a, b = open_store(root), open_store(root)
    if where == "shm":
        assert b._seg.medium == "memory"
    a.attach(pool)
    b.attach(pool)
    k = keys(6)
    assert a.batch_set(k[:2], [0, 1]) == [True] * 2
    assert b.batch_exists(k[:2]) == 2            # b reads a's log
    time.sleep(b._seg.quiet_ns() / 1e9 + 0.05)
    assert b.batch_exists(k[:2]) == 2            # read once more: the write was recent
    opened: list[str] = []
    real_open = os.open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", counting_open)
    for _ in range(3):
        assert b.batch_exists(k[:2]) == 2 and b.batch_exists(k[2:]) == 0
    assert not [p for p in opened if p.endswith(seg_mod.LOG_SUFFIX)], opened
    for i in range(2, 6):                        # each write right after b's last look
        assert a.batch_set(k[i:i + 1], [i]) == [True]
        assert b.batch_exists(k[:i + 1]) == i + 1
    fill_random(pool.raw)
    assert b.batch_get(k, [10, 11, 12, 13, 14, 15]) == [True] * 6
    a.close()
    b.close()


def test_dead_writers_orphans_are_cleaned_at_open(tmp_path, pool):
    s = open_store(tmp_path)
    s.attach(pool)
    assert s.batch_set(keys(2), [0, 1]) == [True, True]
    s.close()
    d = seg_dir(s)
    host = s._host
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {
        "dead-seg": f"{host}-{dead.pid}-0000abcd.00000001.kvs",     # no record names it
        "dead-log": f"{host}-{dead.pid}-0000abce.00000001.kvl",    # its segment is gone
        "alive-seg": f"{host}-{os.getppid()}-0000abcd.00000001.kvs",
        "other-host": f"ffffffff-{dead.pid}-0000abcd.00000001.kvs",
    }
    for n in names.values():
        with open(os.path.join(d, n), "wb") as f:
            f.write(os.urandom(4096))
    s2 = open_store(tmp_path)
    left = set(os.listdir(d))
    assert names["dead-seg"] not in left and names["dead-log"] not in left
    assert names["alive-seg"] in left and names["other-host"] in left
    assert s2.stats()["tmp_cleaned"] == 2 and s2.stats()["objects"] == 2
    s2.close()


# --------------------------------------------------------------------------------------------
# capacity: LRU per segment, across processes
# --------------------------------------------------------------------------------------------
def _capped(root, pool, segments: int, **extra) -> FileStore:
    """A store of ``segments`` two-slot segments' capacity (the quarter rule makes segments
    of capacity // 4 slots: 8 slots -> 2)."""
    slot = -(-(ODD.page_bytes + TRAILER_BYTES) // 4096) * 4096
    s = open_store(root, capacity_bytes=segments * 2 * slot, **extra)
    s.attach(pool)
    assert s.stats()["segment_slots"] == (2 if segments == 4 else s.stats()["segment_slots"])
    return s


def test_lru_evicts_whole_least_recently_used_segments(tmp_path, pool):
    s = _capped(tmp_path, pool, 4)
    k = keys(10)
    for i in range(0, 8, 2):                  # four segments: (k0 k1) (k2 k3) (k4 k5) (k6 k7)
        assert s.batch_set(k[i:i + 2], [i, i + 1]) == [True, True]
        time.sleep(0.02)
    want = page(pool, 0)
    assert s.batch_get(k[:1], [12]) == [True]           # segment (k0 k1) is now the newest
    assert s.batch_set(k[8:10], [8, 9]) == [True, True]  # evicts (k2 k3), whole
    assert [s.batch_exists([x]) for x in k] == [1, 1, 0, 0, 1, 1, 1, 1, 1, 1]
    st_ = s.stats()
    assert st_["evictions"] == 1 and st_["segments"] == 4 and st_["bytes_stored"] <= \
        s.config.capacity_bytes
    fill_random(pool.raw)
    assert s.batch_get(k[:1], [12]) == [True] and torch.equal(page(pool, 12), want)
    s.close()


def test_eviction_across_processes_shares_the_lru_and_spares_live_writers(tmp_path, pool):
    a = _capped(tmp_path, pool, 4, rescan_interval_s=0.0)
    b = open_store(tmp_path, segment_bytes=2 * a._seg.slot_bytes)
    b.attach(pool)
    kb = keys(6, "b")
    for i in range(0, 6, 2):                  # three of b's segments; the last is b's current
        assert b.batch_set(kb[i:i + 2], [i, i + 1]) == [True, True]
        time.sleep(0.02)
    b_segs = sorted(files(b, ".kvs"))
    old = time.time() - 60                    # b's segments were written long ago ...
    for i, p in enumerate(b_segs):
        os.utime(p, (old + i, old + i))
    assert b.batch_get(kb[:1], [10]) == [True]    # ... but b just read its first one
    time.sleep(0.02)
    ka = keys(4, "a")
    assert a.batch_set(ka[:2], [6, 7]) == [True, True]
    assert a.batch_set(ka[2:], [8, 9]) == [True, True]
    # a counted b's segments, evicted b's least recently used one (the second), kept the
    # one b read, and never b's current segment
    assert [b.batch_exists([x]) for x in kb] == [1, 1, 0, 0, 1, 1]
    assert a.batch_exists(ka) == 4
    assert os.path.exists(b_segs[2]) and not os.path.exists(b_segs[1])
    assert b.batch_set(keys(1, "more"), [0]) == [True], "b keeps writing"
    a.close()
    b.close()


def test_explicit_rescan_counts_other_writers(tmp_path, pool):
    a = _capped(tmp_path, pool, 4, rescan_interval_s=3600)
    b = open_store(tmp_path, segment_bytes=2 * a._seg.slot_bytes)
    b.attach(pool)
    kb = keys(12)
    for i in range(0, 12, 2):
        assert b.batch_set(kb[i:i + 2], [i, i + 1]) == [True, True]
        time.sleep(0.02)
    a.rescan()
    assert a.stats()["evictions"] == 2 and a.stats()["bytes_stored"] <= a.config.capacity_bytes
    assert [b.batch_exists([x]) for x in kb] == [0] * 4 + [1] * 8
    a.close()
    b.close()


def test_segment_bytes_and_capacity_shape_segments(tmp_path, pool):
    s = open_store(tmp_path, segment_bytes=10 * 4096)
    assert s.stats()["segment_slots"] == 10
    s.close()
    s = open_store(tmp_path, segment_bytes=1 << 30, capacity_bytes=40 * 4096)
    assert s.stats()["segment_slots"] == 10          # a quarter of the capacity
    s.close()


def test_stats_keep_their_keys_and_add_the_formats(tmp_path, pool):
    objects = FileStore({"root": str(tmp_path / "o"), "format": "objects"}, spec=ODD)
    segs = open_store(tmp_path / "s")
    for s in (objects, segs):
        s.attach(pool)
        assert s.batch_set(keys(2), [0, 1]) == [True, True]
    assert set(objects.stats()) <= set(segs.stats())
    assert {"segments", "live_slots", "slot_bytes", "segment_slots"} <= set(segs.stats())
    assert segs.stats()["format"] == "segments" and json.dumps(segs.stats())
    for s in (objects, segs):
        s.close()


def test_modes_of_segment_files(tmp_path, pool):
    old = os.umask(0o077)
    try:
        s = open_store(tmp_path / "root", file_mode=0o640)
        s.attach(pool)
        assert s.batch_set(keys(1), [0]) == [True]
        for p in files(s, ".kvs") + files(s, ".kvl"):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
        assert stat.S_IMODE(os.stat(seg_dir(s)).st_mode) == 0o750
        s.close()
    finally:
        os.umask(old)


def test_delete_is_a_miss_for_a_store_that_already_indexed_the_page(tmp_path, pool):
    """b found the page before a deleted it: b's index still names the slot, whose zeroed
    trailer makes it a plain miss (not corruption); a re-set is found again."""
    a, b = open_store(tmp_path), open_store(tmp_path)
    a.attach(pool)
    b.attach(pool)
    k = keys(3)
    assert a.batch_set(k, [0, 1, 2]) == [True] * 3
    assert b.batch_get(k, [3, 4, 5]) == [True] * 3
    assert a.delete(k[1:2]) == 1
    assert b.batch_get(k, [6, 7, 8]) == [True, False, True]
    assert b.stats()["corrupted"] == 0 and b.stats()["errors"] == 0
    assert a.batch_set(k[1:2], [9]) == [True]
    want = page(pool, 9)
    assert b.batch_get(k[1:2], [10]) == [True] and torch.equal(page(pool, 10), want)
    a.close()
    b.close()


def test_a_closed_writers_last_segment_becomes_evictable(tmp_path, pool):
    """close() seals the writer in its log: its newest segment, protected while it could
    still append, may go -- even though its process (this one) is alive."""
    a = open_store(tmp_path)
    a.attach(pool)
    assert a.batch_set(keys(2), [0, 1]) == [True, True]
    b = open_store(tmp_path)
    (name,) = [os.path.basename(p) for p in files(a, ".kvs")]
    b._seg._catch_up()
    with b._seg._lock:
        assert b._seg._protected(name, b._seg._segs[name], time.time_ns())
    a.close()
    b._seg.refresh()
    with b._seg._lock:
        assert not b._seg._protected(name, b._seg._segs[name], time.time_ns())
    b.close()


def test_each_segment_has_its_own_log_removed_with_it(tmp_path, pool):
    """Index records live and die with their segment: logs stay bounded by the live data."""
    s = _capped(tmp_path, pool, 4)
    k = keys(24)
    for i in range(0, 24, 2):
        assert s.batch_set(k[i:i + 2], [i % 16, (i + 1) % 16]) == [True, True]
    segs = [os.path.basename(p)[:-4] for p in files(s, ".kvs")]
    logs = [os.path.basename(p)[:-4] for p in files(s, ".kvl")]
    assert len(segs) == 4 and segs == logs
    assert s.stats()["evictions"] == 8
    s.close()
    fresh = _capped(tmp_path, pool, 4)
    assert fresh.stats()["objects"] == 8 and fresh.batch_exists(k[16:]) == 8
    fresh.close()


def test_a_key_named_twice_is_read_into_both_pages(tmp_path, pool):
    s = open_store(tmp_path)
    s.attach(pool)
    k = keys(3)
    assert s.batch_set(k, [0, 1, 2]) == [True] * 3
    want = page(pool, 1)
    assert s.batch_get([k[1], k[0], k[1]], [5, 6, 7]) == [True] * 3
    assert torch.equal(page(pool, 5), want) and torch.equal(page(pool, 7), want)
    s.close()


def test_concurrent_batches_across_segment_rotations(tmp_path):
    """Several threads' batch_set calls share one writer: slots, rotations and the logs of
    segments another batch is still writing into stay consistent."""
    import threading
    with HostKVPool(ODD, 48, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(tmp_path, segment_bytes=3 * 4096, io_threads=2)
        s.attach(pool)
        ks = [keys(6, f"t{t}") for t in range(4)]
        want = {k: page(pool, 6 * t + i) for t in range(4) for i, k in enumerate(ks[t])}
        errors: list = []

        def writer(t: int) -> None:
            for r in range(5):
                got = s.batch_set(ks[t], [6 * t + i for i in range(6)])
                if got != [True] * 6:
                    errors.append((t, r, got))

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and s.stats()["errors"] == 0
        s.close()
        fresh = open_store(tmp_path)
        fresh.attach(pool)
        flat = [k for t in range(4) for k in ks[t]]
        pool.raw[24 * ODD.page_bytes:].fill_(0x5A)
        assert fresh.batch_get(flat, list(range(24, 48))) == [True] * 24
        for j, k in enumerate(flat):
            assert torch.equal(page(pool, 24 + j), want[k])
        fresh.close()


def test_descriptors_stay_bounded_with_many_segments(tmp_path):
    """Hundreds of segments (and logs) written by another store, read by this one: only a
    bounded number of descriptors stay open."""
    with HostKVPool(ODD, 8, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        w = open_store(tmp_path, segment_bytes=4096, io_threads=1)       # one slot each
        w.attach(pool)
        k = keys(300)
        for i in range(0, 300, 4):
            assert w.batch_set(k[i:i + 4], [0, 1, 2, 3]) == [True] * 4
        w.close()
        before = len(os.listdir("/proc/self/fd"))
        r = open_store(tmp_path, io_threads=1)
        r.attach(pool)
        for i in range(0, 300, 4):
            assert r.batch_get(k[i:i + 4], [4, 5, 6, 7]) == [True] * 4
        assert r.stats()["segments"] == 300
        assert len(os.listdir("/proc/self/fd")) - before < 100
        r.close()


# --------------------------------------------------------------------------------------------
# I/O depth: how many read/write calls the disk sees at once
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth, call_bytes", [(1, 4 * 4096), (2, 8 * 4096), (0, 8 << 20)])
def test_io_depth_bounds_calls_in_flight_over_all_callers(tmp_path, monkeypatch, depth,
                                                           call_bytes):
    """With io_depth below io_threads at most that many pwritev/preadv calls run at once,
    over every thread and caller, each of about io_call_bytes; without it every I/O thread
    issues its own (so the bound is observable). Data round-trips bitwise either way."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    state = {"now": 0, "peak": 0, "sizes": []}
    lock = threading.Lock()

    def gated(real):
        def call(fd, bufs, offset=0):
            with lock:
                state["now"] += 1
                state["peak"] = max(state["peak"], state["now"])
                state["sizes"].append(sum(len(b) for b in bufs))
            time.sleep(0.01)
            try:
                return real(fd, bufs, offset)
            finally:
                with lock:
                    state["now"] -= 1
        return call

    monkeypatch.setattr(files_mod, "_pwrite_all", gated(files_mod._pwrite_all))
    monkeypatch.setattr(files_mod, "_pread_all", gated(files_mod._pread_all))
    spec = ALIGNED
    rng = random.Random(depth)
    with HostKVPool(spec, 96, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(tmp_path, spec, io_threads=4, io_depth=depth, io_call_bytes=call_bytes)
        s.attach(pool)
        src = rng.sample(range(48), 48)
        want = {p: page(pool, p) for p in src}
        ks = keys(48)
        batches = [(ks[i:i + 12], src[i:i + 12]) for i in range(0, 48, 12)]
        with ThreadPoolExecutor(3) as ex:
            assert all(all(r) for r in ex.map(lambda b: s.batch_set(*b), batches))
        dst = rng.sample(range(48, 96), 48)
        reads = [(ks[i:i + 12], dst[i:i + 12]) for i in range(0, 48, 12)]
        with ThreadPoolExecutor(3) as ex:
            assert all(all(r) for r in ex.map(lambda b: s.batch_get(*b), reads))
        for p, d in zip(src, dst):
            assert torch.equal(page(pool, d), want[p])
        s.close()
    slot = -(-(spec.page_bytes + TRAILER_BYTES) // 4096) * 4096
    if depth:
        assert state["peak"] == depth
        assert max(state["sizes"]) <= max(1, call_bytes // slot) * slot
    else:
        assert state["peak"] > 2


@pytest.mark.parametrize("call_slots, want", [(8, [8] * 4), (1, [4] * 8), (32, [32]),
                                              (64, [32]), (12, [16, 16]),
                                              (5, [5, 5, 5, 5, 6, 6])])
def test_batches_split_in_calls_no_smaller_than_io_call_bytes(tmp_path, monkeypatch,
                                                              call_slots, want):
    """Without io_depth a batch is spread over the I/O threads (two calls each), but in calls
    of at least io_call_bytes where the batch holds that much: small pages would otherwise
    reach the disk as many small calls. What does not divide evenly is spread over the calls
    (no short last call). Data round-trips bitwise."""
    sizes: dict[str, list[int]] = {"w": [], "r": []}

    def counted(real, kind):
        def call(fd, bufs, offset=0):
            sizes[kind].append(sum(len(b) for b in bufs))
            return real(fd, bufs, offset)
        return call

    monkeypatch.setattr(files_mod, "_pwrite_all", counted(files_mod._pwrite_all, "w"))
    monkeypatch.setattr(files_mod, "_pread_all", counted(files_mod._pread_all, "r"))
    spec = ALIGNED
    slot = -(-(spec.page_bytes + TRAILER_BYTES) // 4096) * 4096
    rng = random.Random(call_slots)
    with HostKVPool(spec, 64, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(tmp_path, spec, io_threads=4, io_call_bytes=call_slots * slot)
        s.attach(pool)
        src = rng.sample(range(32), 32)
        want_pages = {p: page(pool, p) for p in src}
        ks = keys(32)
        assert s.batch_set(ks, src) == [True] * 32
        dst = list(range(32, 64))
        assert s.batch_get(ks, dst) == [True] * 32
        for p, d in zip(src, dst):
            assert torch.equal(page(pool, d), want_pages[p])
        s.close()
    # 32 pages over 4 threads: 8 calls of 4 slots unless io_call_bytes asks for more
    assert sorted(sizes["w"]) == [w * slot for w in want]
    assert sorted(sizes["r"]) == [w * slot for w in want]


@pytest.mark.parametrize("key, bad", [("io_depth", -1), ("io_depth", True), ("io_depth", "2"),
                                      ("io_call_bytes", 100), ("io_call_bytes", 1.5e6)])
def test_io_depth_settings_are_checked(tmp_path, key, bad):
    from kvtier.errors import ConfigError
    with pytest.raises(ConfigError) as ei:
        open_store(tmp_path, ALIGNED, **{key: bad})
    assert ei.value.key == f"file.{key}"


def test_concurrent_directory_listings_lose_nothing(tmp_path, pool):
    """Threads that catch up with the directory at the same moment list it through one
    descriptor; each must see every segment, or the pages of the ones it missed would be
    forgotten (the per-second catch-up of concurrent readers did that under load)."""
    import threading
    s = open_store(tmp_path, ODD, segment_bytes=3 * 4096)       # many small segments
    s.attach(pool)
    ks = keys(16)
    assert s.batch_set(ks, list(range(16))) == [True] * 16
    want = {p: page(pool, p) for p in range(16)}
    start = threading.Barrier(6)

    def refresher() -> None:
        start.wait()
        for _ in range(200):
            s._seg.refresh()

    threads = [threading.Thread(target=refresher) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.batch_exists(ks) == 16
    for i in range(16):
        assert s.batch_get([ks[i]], [0]) == [True]
        assert torch.equal(page(pool, 0), want[i])
    s.close()


def test_segment_directory_that_cannot_be_made_is_counted_then_retried(tmp_path, pool,
                                                                       monkeypatch):
    """mkdir of ``segments/`` refused at open (no inodes left): the store opens, its writes
    are counted failures (never an exception), and the next write after the disk recovers
    makes the directory and succeeds."""
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if kwargs.get("dir_fd") is not None and path == seg_mod.SEG_DIR:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    s = open_store(tmp_path)
    s.attach(pool)
    k = keys(3)
    assert s.batch_set(k, [0, 1, 2]) == [False] * 3
    st_ = s.stats()
    assert st_["write_errors"] >= 3 and st_["disk_full"] >= 3 and not st_["read_only"]
    assert s.batch_get(k, [3, 4, 5]) == [False] * 3
    monkeypatch.undo()
    assert s.batch_set(k, [0, 1, 2]) == [True] * 3
    want = [page(pool, p) for p in range(3)]
    assert s.batch_get(k, [3, 4, 5]) == [True] * 3
    assert all(torch.equal(page(pool, 3 + i), want[i]) for i in range(3))
    s.close()


def _dir_bytes(path: str) -> int:
    """Bytes of the files in a directory tree now (files removed meanwhile count nothing)."""
    total = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def test_capacity_holds_across_live_writer_processes(tmp_path):
    """Six processes writing (and reading each other's pages) in one directory under one
    capacity: the files on disk (segments, logs, manifest) stay within 1.25x the capacity at
    every sample, and every read that hits is bitwise the page written under that key."""
    root = str(tmp_path)
    slot = -(-(child.SPEC.page_bytes + TRAILER_BYTES) // 4096) * 4096
    capacity = 48 * slot
    writers, seconds = 6, 6.0
    procs = [subprocess.Popen([sys.executable, CHILD, root, "capacity", str(capacity),
                               str(seconds), str(w), str(writers)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env())
             for w in range(writers)]
    peak = samples = 0
    try:
        for p in procs:
            child.wait_for(p, "ready", timeout=120)
        end = time.monotonic() + seconds + 120
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            peak = max(peak, _dir_bytes(root))
            samples += 1
            time.sleep(0.01)
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"peak {peak / capacity:.2f}x capacity over {samples} samples; {results}")
    assert sum(r["written"] for r in results) > 2 * 48, "the writers overflowed the capacity"
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["hits"] for r in results) > 0
    assert peak <= 1.25 * capacity, f"{peak / capacity:.2f}x the capacity on disk"
    assert _dir_bytes(root) <= 1.25 * capacity


@pytest.mark.parametrize("fmt", ["segments", "objects"])
def test_a_read_does_not_queue_behind_a_large_write(tmp_path, pool, fmt):
    """Reads and writes have ``io_threads`` each: a batch_get comes back, bitwise right,
    while every write thread is held inside a batch_set."""
    import threading
    extra = {"write_lanes": 2, "io_call_bytes": 4096} if fmt == "segments" else {}
    s = open_store(tmp_path / "store", io_threads=2, format=fmt, o_direct="off", **extra)
    s.attach(pool)
    old = keys(2, "old")
    assert s.batch_set(old, [3, 11]) == [True, True]
    want = [page(pool, 3), page(pool, 11)]
    gate, inside = threading.Event(), threading.Semaphore(0)
    hold = s._seg if fmt == "segments" else s
    name = "_write_run" if fmt == "segments" else "_set_one"
    real = getattr(hold, name)

    def held(*a, **k):
        inside.release()
        gate.wait(20)
        return real(*a, **k)

    setattr(hold, name, held)
    new = keys(8, "new")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("ok", s.batch_set(new, list(range(8)))))
    t.start()
    try:
        assert inside.acquire(timeout=5) and inside.acquire(timeout=5)   # both write threads
        t0 = time.monotonic()
        assert s.batch_get(old, [0, 1]) == [True, True]
        assert time.monotonic() - t0 < 5
    finally:
        gate.set()
        t.join(20)
        setattr(hold, name, real)
    assert box["ok"] == [True] * 8
    assert [torch.equal(page(pool, p), w) for p, w in zip([0, 1], want)] == [True, True]
    s.close()
