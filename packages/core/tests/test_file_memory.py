"""The `file` store's segment format where the directory is in memory (tmpfs, ramfs): write
lanes (one writer identity and current segment per I/O thread), the checksum taken while
each piece is cache-hot, segments sized without preallocation, fsync skipped.

Each test runs twice: on a tmpfs directory (``/dev/shm``; skipped where there is none) and on
the test's own directory with the medium forced to "memory" (the same code paths on any
filesystem). Pages are random bytes, sizes odd and aligned, larger and smaller than a hot
call; everything read back is compared bitwise."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import _files, _hotio
from kvtier.l3_stores import segments as seg_mod
from kvtier.l3_stores.file import FileStore
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
#: bytes per call of the stores below (``io_call_bytes``): pages of several calls
PIECE = 512 << 10
#: a page of 1.5 hot calls (and not a multiple of 4 KiB): pieces split inside a page
BIG_ODD = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=3 * PIECE // 4 + 6,
                     page_size=1, dtype="bfloat16")
#: 2 MiB pages: four hot calls each, O_DIRECT-aligned
BIG = KVSpec.mha(num_layers=4, num_kv_heads=4, head_dim=128, page_size=256, dtype="bfloat16")
SHM = "/dev/shm"


def _on_tmpfs(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        return _files.medium(fd) == "memory"
    finally:
        os.close(fd)


@pytest.fixture(params=["tmpfs", "forced"])
def root(request, tmp_path, monkeypatch):
    """A store root in memory: on tmpfs, or anywhere with the medium forced."""
    if request.param == "tmpfs":
        if not _on_tmpfs(SHM):
            pytest.skip(f"{SHM} is not a tmpfs here")
        d = tempfile.mkdtemp(prefix="kvtier-test-mem-", dir=SHM)
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        monkeypatch.setattr(_files, "medium", lambda fd: "memory")
        yield str(tmp_path / "store")


def open_store(root, spec=ODD, **config) -> FileStore:
    return FileStore({"root": str(root), "format": "segments", "io_threads": 3,
                      "io_call_bytes": PIECE, **config}, spec=spec)


def keys(n: int, tag: str = "") -> list[bytes]:
    salt = os.urandom(4).hex() + tag
    return [f"mem-{salt}-{i}".encode() for i in range(n)]


def page(pool: HostKVPool, p: int) -> torch.Tensor:
    return torch.cat(pool.page_segments(p)).clone()


def seg_dir(store: FileStore) -> str:
    return os.path.join(store.dir, seg_mod.SEG_DIR)


# --------------------------------------------------------------------------------------------
def test_the_medium_is_said_and_shapes_the_store(root, tmp_path):
    with HostKVPool(ODD, 4, allocator=MmapAllocator()) as pool:
        s = open_store(root, fsync=True, io_threads=4)
        s.attach(pool)
        st = s.stats()
        assert st["medium"] == "memory" and st["fsync"] == "skipped (in memory)"
        assert st["write_lanes"] == 4 and s._seg.hot
        s.close()
        s = open_store(root, write_lanes=2)
        assert s.stats()["write_lanes"] == 2 and s.stats()["fsync"] is False
        s.close()
    with pytest.raises(Exception, match="write_lanes"):
        open_store(root, write_lanes=-1)


def test_io_threads_follow_the_medium_and_the_cpus_unless_set(root, tmp_path, monkeypatch):
    """``io_threads`` 0 (the default): one per CPU this process may use, 4 to 16, in memory
    (each thread's copy runs at about one core's rate there); 4 on a disk; a set value stays.
    Bad values are typed errors before the directory is touched."""
    for cpus, want in ((2, 4), (9, 9), (64, 16)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        s = FileStore({"root": str(root), "format": "segments"}, spec=ODD)
        assert s.config.io_threads == want and s.stats()["write_lanes"] == want
        s.close()
    s = open_store(root, io_threads=6)
    assert s.config.io_threads == 6
    s.close()
    monkeypatch.undo()
    disk = tmp_path / "disk"
    s = FileStore({"root": str(disk)}, spec=ODD)
    if s.stats()["medium"] != "memory":
        assert s.config.io_threads == 4
    s.close()
    for bad in (-1, True, 2.5, "8"):
        with pytest.raises(Exception, match="io_threads"):
            FileStore({"root": str(tmp_path / "bad"), "io_threads": bad}, spec=ODD)
    assert not (tmp_path / "bad").exists()


def test_a_disk_keeps_one_lane_and_preallocation(tmp_path):
    s = open_store(tmp_path / "disk", fsync=True, io_threads=4)
    st = s.stats()
    if st["medium"] == "memory":
        pytest.skip("the test directory is itself in memory")
    assert st["write_lanes"] == 1 and st["fsync"] is True and not s._seg.hot
    s.close()


@pytest.mark.parametrize("spec", [ODD, ALIGNED, BIG_ODD, BIG],
                         ids=["odd", "aligned", "big-odd", "big-aligned"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_random_round_trips_over_lanes_and_segments(root, spec, layout):
    rng = random.Random(7)
    n_pages = 24
    with HostKVPool(spec, 2 * n_pages, layout=layout, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        slot = -(-(spec.page_bytes + 128) // 4096) * 4096
        s = open_store(root, spec, segment_bytes=3 * slot, io_call_bytes=4096)
        s.attach(pool)
        k = keys(n_pages)
        src = rng.sample(range(2 * n_pages), n_pages)
        want = {key: page(pool, p) for key, p in zip(k, src)}
        for i in range(0, n_pages, 9):
            assert s.batch_set(k[i:i + 9], src[i:i + 9]) == [True] * len(k[i:i + 9])
        writers = {n.split(".")[0] for n in os.listdir(seg_dir(s)) if n.endswith(".kvs")}
        assert len(writers) == 3, "every lane wrote"
        fill_random(pool.raw)
        order = rng.sample(range(n_pages), n_pages)
        dst = rng.sample(range(2 * n_pages), n_pages)
        assert s.batch_get([k[i] for i in order], dst) == [True] * n_pages
        for i, d in zip(order, dst):
            assert torch.equal(page(pool, d), want[k[i]]), i
        s.close()
        # a fresh store finds every lane's pages through their logs; the closed store's
        # lanes are all sealed
        s2 = open_store(root, spec)
        s2.attach(pool)
        fill_random(pool.raw)
        assert s2.batch_get(k, dst) == [True] * n_pages
        for key, d in zip(k, dst):
            assert torch.equal(page(pool, d), want[key])
        assert s2.stats()["errors"] == 0
        assert writers <= s2._seg._sealed
        s2.close()


def test_concurrent_callers_over_lanes(root):
    with HostKVPool(ODD, 64, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(root, io_threads=4, segment_bytes=5 * 4096 * 2)
        s.attach(pool)
        want = {p: page(pool, p) for p in range(32)}
        k = keys(32)
        errors: list[BaseException] = []

        def caller(part: int) -> None:
            try:
                for i in range(part * 8, part * 8 + 8, 2):
                    assert s.batch_set(k[i:i + 2], [i, i + 1]) == [True, True]
            except BaseException as exc:        # pragma: no cover - reported below
                errors.append(exc)
        threads = [threading.Thread(target=caller, args=(p,)) for p in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert s.batch_get(k, list(range(32, 64))) == [True] * 32
        for i in range(32):
            assert torch.equal(page(pool, 32 + i), want[i])
        s.close()


@pytest.mark.parametrize("spec", [ALIGNED, BIG_ODD], ids=["aligned", "big-odd"])
def test_damaged_payload_is_a_counted_miss(root, spec):
    with HostKVPool(spec, 8, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(root, spec)
        s.attach(pool)
        k = keys(4)
        assert all(s.batch_set(k, [0, 1, 2, 3]))
        path, off = s._seg.locate(k[2])
        flip(path, off + spec.page_bytes - 1)          # the page's last byte
        fill_random(pool.raw)
        got = s.batch_get(k, [4, 5, 6, 7])
        assert got == [True, True, False, True]
        assert s.stats()["corrupted"] == 1
        assert s.batch_get(k[2:3], [6]) == [False]       # now a plain miss
        assert s.stats()["corrupted"] == 1
        s.close()


def test_truncated_segment_is_a_miss(root):
    with HostKVPool(BIG_ODD, 8, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(root, BIG_ODD)
        s.attach(pool)
        k = keys(3)
        assert all(s.batch_set(k, [0, 1, 2]))
        want = [page(pool, p) for p in range(3)]
        path, off = s._seg.locate(k[2])
        os.truncate(path, off + BIG_ODD.page_bytes // 3)     # inside the last page
        s.close()
        s2 = open_store(root, BIG_ODD)
        s2.attach(pool)
        fill_random(pool.raw)
        got = s2.batch_get(k, [3, 4, 5])
        assert got == [True, True, False]
        assert torch.equal(page(pool, 3), want[0]) and torch.equal(page(pool, 4), want[1])
        assert s2.stats()["errors"] >= 1
        s2.close()


def test_pages_of_another_checksum_kind_are_verified(root):
    with HostKVPool(BIG_ODD, 6, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        w = open_store(root, BIG_ODD, checksum="adler32")
        w.attach(pool)
        k = keys(3)
        assert all(w.batch_set(k, [0, 1, 2]))
        want = [page(pool, p) for p in range(3)]
        path, off = w._seg.locate(k[1])
        w.close()
        r = open_store(root, BIG_ODD)                   # crc32 here: the trailer says adler32
        r.attach(pool)
        fill_random(pool.raw)
        assert r.batch_get(k, [3, 4, 5]) == [True] * 3
        for i in range(3):
            assert torch.equal(page(pool, 3 + i), want[i])
        flip(path, off + 5)
        assert r.batch_get(k[1:2], [4]) == [False] and r.stats()["corrupted"] == 1
        r.close()


def test_a_full_memory_filesystem_is_a_counted_miss(root, monkeypatch):
    with HostKVPool(ALIGNED, 8, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(root, ALIGNED)
        s.attach(pool)
        k = keys(4)
        assert all(s.batch_set(k[:2], [0, 1]))
        want = [page(pool, p) for p in range(2)]

        def full(*a, **kw):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(_files, "_pwrite_all", full)
        assert s.batch_set(k[2:], [2, 3]) == [False, False]
        assert s.stats()["errors"] >= 2
        monkeypatch.undo()
        fill_random(pool.raw)
        assert s.batch_get(k, [4, 5, 6, 7]) == [True, True, False, False]
        assert torch.equal(page(pool, 4), want[0]) and torch.equal(page(pool, 5), want[1])
        s.close()


@pytest.mark.parametrize("call", [8 << 20, 1 << 20, 12345], ids=["8M", "1M", "odd"])
def test_calls_in_memory_follow_io_call_bytes(root, monkeypatch, call):
    """In memory a run moves in calls of about io_call_bytes (rounded down to 4 KiB): at the
    default 8 MiB four 2 MiB pages share a call -- each call is a round trip through the
    interpreter lock -- at 1 MiB a page takes two; every page still reads back."""
    sizes: dict[str, list[int]] = {"w": [], "r": []}
    real_w, real_r = _files._pwrite_all, _files._pread_all

    def w(fd, bufs, off):
        sizes["w"].append(sum(len(b) for b in bufs))
        return real_w(fd, bufs, off)

    def r(fd, bufs, off):
        sizes["r"].append(sum(len(b) for b in bufs))
        return real_r(fd, bufs, off)
    monkeypatch.setattr(_files, "_pwrite_all", w)
    monkeypatch.setattr(_files, "_pread_all", r)
    n = 6
    with HostKVPool(BIG, 2 * n, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = open_store(root, BIG, io_threads=1, io_call_bytes=call)
        s.attach(pool)
        k = keys(n)
        want = [page(pool, p) for p in range(n)]
        assert s.batch_set(k, list(range(n))) == [True] * n
        fill_random(pool.raw[n * BIG.page_bytes:])
        assert s.batch_get(k, list(range(n, 2 * n))) == [True] * n
        assert all(torch.equal(page(pool, n + i), want[i]) for i in range(n))
        slot = s._seg.slot_bytes
        s.close()
    piece = max(4096, call // 4096 * 4096)
    for op in ("w", "r"):
        got = sizes[op]
        assert sum(got) == n * slot, op                    # every page and tail, once
        assert all(piece <= x < 2 * piece + slot - BIG.page_bytes for x in got[:-1]), (op, got)
        assert len(got) <= -(-n * slot // piece) + 1, (op, len(got))


def test_hot_reads_stop_at_an_early_end(tmp_path):
    """read_hot over a file shorter than the slots asked: the bytes read, and whole pages'
    checksums for what arrived."""
    import isal.isal_zlib as crc_mod  # noqa: F401 - any crc32 does; zlib's is the reference
    import zlib
    data = os.urandom(2 * PIECE + 100)   # ends inside the second page
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        a, b = bytearray(PIECE + 50), bytearray(PIECE * 2)
        ta, tb = bytearray(10), bytearray(10)
        got, sums = _hotio.read_hot(fd, 0, [([memoryview(a)], memoryview(ta)),
                                            ([memoryview(b)], memoryview(tb))],
                                    zlib.crc32, 0, PIECE)
    finally:
        os.close(fd)
    assert got == len(data)
    assert bytes(a) == data[:len(a)] and bytes(ta) == data[len(a):len(a) + 10]
    assert sums[0] == zlib.crc32(data[:len(a)])
    rest = data[len(a) + 10:]
    assert bytes(b[:len(rest)]) == rest


# --------------------------------------------------------------------------------------------
# other processes: a killed writer, pages of another process's lanes
# --------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    return {**os.environ, child.FORMAT_ENV: "segments"}


def test_writer_killed_in_the_middle_of_a_batch(root):
    if not root.startswith(SHM):
        pytest.skip("children detect the medium themselves: tmpfs only")
    proc = subprocess.Popen([sys.executable, CHILD, root, "stall"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        child.wait_for(proc, "stalled")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    hits, gens = child.read_all(root, format="segments")
    assert hits == child.NUM_KEYS and gens == [0] * child.NUM_KEYS, "the old pages intact"
    store, pool = child.open_store(root, format="segments")
    assert store.stats()["medium"] == "memory"
    assert all(child.write_gen(store, pool, 3))
    store.close()
    pool.close()
    assert child.read_all(root, format="segments")[1] == [3] * child.NUM_KEYS


def test_another_processes_lanes_are_found(root):
    if not root.startswith(SHM):
        pytest.skip("children detect the medium themselves: tmpfs only")
    store, pool = child.open_store(root, format="segments")
    assert store.batch_exists(child.keys()) == 0
    out = subprocess.run([sys.executable, CHILD, root, "writer", "5", "1", "0.3"],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr
    got = store.batch_get(child.keys(), list(range(child.NUM_KEYS)))
    assert got == [True] * child.NUM_KEYS
    for i in range(child.NUM_KEYS):
        assert child.check_page(pool.page_bytes_view(i), i) is not None
    assert store.delete(child.keys()) == child.NUM_KEYS
    assert child.read_all(root, format="segments")[0] == 0
    store.close()
    pool.close()
