"""The `file` L3 store beyond the contract: faults behind its back, killed writers, several
processes on one directory, hostile keys, a full disk, LRU capacity, O_DIRECT, bad input.

Tests run over both formats (``segments``, ``objects``) unless they handle per-object files
directly (OBJECTS_ONLY); test_file_segments.py has the segment format's equivalents."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import (ConfigError, InvalidArgumentError, KVTierError, PageIndexError,
                           StoreError)
from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores import file as file_mod
from kvtier.l3_stores.file import _files as files_mod
from kvtier.l3_stores.file import format as format_mod
from kvtier.l3_stores.file import TRAILER_BYTES, key_filename
from kvtier.spec import KVSpec
from kvtier.testing.data import make_host_pool
from kvtier.testing import fill_random

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "file_store_child.py")
sys.path.insert(0, HERE)
import file_store_child as child  # noqa: E402
from file_formats import FileStore, flip as _flip, fmt, formats  # noqa: E402,F401

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16")

#: Tests that handle the per-object format's files (paths, sizes, temporary files) directly.
OBJECTS_ONLY = {
    "test_damaged_object_is_a_counted_miss", "test_damaged_object_kept_when_asked",
    "test_damaged_size_seen_by_exists", "test_foreign_fingerprint_is_a_counted_miss",
    "test_object_of_another_key_is_a_miss",
    "test_symlink_planted_at_an_object_path_is_not_followed",
    "test_hostile_keys_stay_inside_the_directory",
    "test_enospc_is_a_counted_miss_and_leaves_nothing",
    "test_writer_killed_in_the_middle_of_an_object", "test_stale_temporary_files_are_cleaned",
    "test_lru_evicts_least_recently_used", "test_a_chain_is_evicted_from_its_tail",
    "test_overwrite_does_not_evict", "test_batch_larger_than_capacity",
    "test_reads_by_another_process_count_as_use", "test_capacity_counts_other_processes_objects",
    "test_explicit_rescan_enforces_capacity", "test_index_rebuilt_from_the_directory",
    "test_o_direct_round_trip_or_reported_fallback",
    "test_capacity_counts_bytes_on_disk_for_o_direct_objects",
}
pytest_generate_tests = formats(OBJECTS_ONLY)


def keys(n: int, tag: str = "") -> list[bytes]:
    salt = os.urandom(4).hex() + tag
    return [f"key-{salt}-{i}".encode() for i in range(n)]


def page_bytes(pool: HostKVPool, p: int) -> torch.Tensor:
    return torch.cat(pool.page_segments(p)).clone()


def objects(store: FileStore) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(store.dir) for f in fs
                  if f.endswith(".kvp"))


def tmp_files(root: str) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


@pytest.fixture
def pool():
    with make_host_pool(SPEC, 16) as p:      # random bytes
        yield p


@pytest.fixture
def store(tmp_path, pool):
    s = FileStore({"root": str(tmp_path / "store"), "io_threads": 3}, spec=SPEC)
    s.attach(pool)
    yield s
    s.close()


def _path(store: FileStore, key: bytes) -> str:
    sub, name = key_filename(key)
    return os.path.join(store.dir, sub, name)


# --------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------
def test_many_segments_beyond_iov_max(tmp_path):
    """A layer_first page of 2 * 600 chunks needs several preadv/pwritev calls."""
    spec = KVSpec.mha(num_layers=600, num_kv_heads=1, head_dim=4, page_size=1, dtype="float16")
    with HostKVPool(spec, 5, layout="layer_first", allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        assert len(pool.page_segments(0)) > 1024
        store = FileStore({"root": str(tmp_path)}, spec=spec)
        store.attach(pool)
        want = [page_bytes(pool, p) for p in (3, 1)]
        k = keys(2)
        assert store.batch_set(k, [3, 1]) == [True, True]
        fill_random(pool.raw)
        assert store.batch_get(k, [0, 4]) == [True, True]
        assert torch.equal(page_bytes(pool, 0), want[0])
        assert torch.equal(page_bytes(pool, 4), want[1])
        store.close()


@pytest.mark.parametrize("checksum", ["crc32", "adler32"])
@pytest.mark.parametrize("fsync", [False, True])
def test_settings_interoperate(tmp_path, pool, checksum, fsync):
    """Objects written with one checksum / fsync setting read back under the other."""
    root = str(tmp_path)
    w = FileStore({"root": root, "checksum": checksum, "fsync": fsync}, spec=SPEC)
    r = FileStore({"root": root, "checksum": "adler32" if checksum == "crc32" else "crc32"},
                  spec=SPEC)
    w.attach(pool)
    r.attach(pool)
    k = keys(4)
    src = [9, 2, 15, 0]
    want = [page_bytes(pool, p) for p in src]
    assert w.batch_set(k, src) == [True] * 4
    fill_random(pool.raw)
    assert r.batch_get(k, [1, 3, 5, 7]) == [True] * 4
    for p, wb in zip([1, 3, 5, 7], want):
        assert torch.equal(page_bytes(pool, p), wb)
    assert not tmp_files(root)
    w.close()
    r.close()


def test_concurrent_batches_from_many_threads(store, pool):
    k = keys(12)
    src = list(range(12))
    want = {p: page_bytes(pool, p) for p in src}
    assert store.batch_set(k, src) == [True] * 12
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(20):
            i = rng.randrange(12)
            dst = 12 + seed
            if store.batch_get([k[i]], [dst]) != [True]:
                errors.append(f"miss {i}")
            elif not torch.equal(page_bytes(pool, dst), want[src[i]]):
                errors.append(f"wrong bytes for key {i}")

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_layer_first_pool_and_page_first_pool_share_objects(tmp_path):
    root = str(tmp_path)
    with HostKVPool(SPEC, 4, layout="layer_first", allocator=MmapAllocator()) as lf, \
            HostKVPool(SPEC, 4, allocator=MmapAllocator()) as pf:
        fill_random(lf.raw)
        a = FileStore({"root": root}, spec=SPEC)
        a.attach(lf)
        b = FileStore({"root": root}, spec=SPEC)
        b.attach(pf)
        k = keys(2)
        assert a.batch_set(k, [2, 1]) == [True, True]
        assert b.batch_get(k, [0, 3]) == [True, True]
        for got, src in ((0, 2), (3, 1)):
            want = lf.view[src].contiguous().view(-1).view(torch.uint8)
            assert torch.equal(pf.page_bytes_view(got), want)
        a.close()
        b.close()


# --------------------------------------------------------------------------------------------
# objects damaged behind the store's back
# --------------------------------------------------------------------------------------------
DAMAGE = {
    "payload-bit": lambda p, n: _flip(p, n // 3),
    "last-payload-byte": lambda p, n: _flip(p, n - 1),
    "magic": lambda p, n: _flip(p, n),
    "trailer-field": lambda p, n: _flip(p, n + 60),
    "trailer-crc": lambda p, n: _flip(p, n + TRAILER_BYTES - 1),
    "truncated-half": lambda p, n: os.truncate(p, n // 2),
    "truncated-trailer": lambda p, n: os.truncate(p, n + TRAILER_BYTES - 1),
    "no-trailer": lambda p, n: os.truncate(p, n),
    "empty": lambda p, n: os.truncate(p, 0),
    "grown": lambda p, n: open(p, "ab").write(b"\0"),
    "zeroed": lambda p, n: open(p, "r+b").write(bytes(n + TRAILER_BYTES)),
}

# 8 KiB pages in page-aligned (mmap) memory: the store reads and writes them with O_DIRECT.
ALIGNED = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=8,
                     dtype="bfloat16")


@pytest.fixture(params=["page-cache", "o-direct"])
def any_store(request, tmp_path):
    """(store, pool, spec) for both I/O paths."""
    spec = SPEC if request.param == "page-cache" else ALIGNED
    pool = HostKVPool(spec, 16, allocator=MmapAllocator())
    fill_random(pool.raw)
    s = FileStore({"root": str(tmp_path / "store"), "io_threads": 3,
                   "o_direct": "off" if request.param == "page-cache" else "auto"}, spec=spec)
    s.attach(pool)
    if request.param == "o-direct" and not s.stats()["o_direct"]:
        pytest.skip(f"O_DIRECT not possible here: {s.stats()['o_direct_reason']}")
    yield s, pool, spec
    s.close()
    pool.close()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_object_is_a_counted_miss(any_store, damage):
    store, pool, spec = any_store
    k = keys(3)
    want = [page_bytes(pool, p) for p in (0, 1, 2)]
    assert store.batch_set(k, [0, 1, 2]) == [True] * 3
    DAMAGE[damage](_path(store, k[1]), spec.page_bytes)
    before = store.stats()
    fill_random(pool.raw)
    got = store.batch_get(k, [5, 6, 7])
    assert got == [True, False, True]
    assert torch.equal(page_bytes(pool, 5), want[0])
    assert torch.equal(page_bytes(pool, 7), want[2])
    after = store.stats()
    assert after["corrupted"] - before["corrupted"] == 1
    assert after["errors"] - before["errors"] == 1
    assert after["get_hits"] - before["get_hits"] == 2
    # the bad object was removed, so it is now a plain miss (and exists says so)
    assert not os.path.exists(_path(store, k[1]))
    assert store.batch_exists(k) == 1
    assert store.batch_get(k[1:2], [6]) == [False]
    assert store.stats()["corrupted"] == after["corrupted"]


def test_damaged_object_kept_when_asked(tmp_path, pool):
    store = FileStore({"root": str(tmp_path), "remove_corrupted": False}, spec=SPEC)
    store.attach(pool)
    k = keys(1)
    store.batch_set(k, [0])
    DAMAGE["payload-bit"](_path(store, k[0]), SPEC.page_bytes)
    assert store.batch_get(k, [1]) == [False]
    assert store.batch_get(k, [1]) == [False]
    assert os.path.exists(_path(store, k[0]))
    assert store.stats()["corrupted"] == 2
    store.close()


def test_damaged_size_seen_by_exists(store, pool):
    k = keys(3)
    store.batch_set(k, [0, 1, 2])
    DAMAGE["truncated-half"](_path(store, k[1]), SPEC.page_bytes)
    assert store.batch_exists(k) == 1
    assert store.stats()["truncated"] == 1


def test_foreign_fingerprint_is_a_counted_miss(tmp_path, pool):
    """An object of another KVSpec with the same page size, planted where ours would be."""
    other = KVSpec.mha(num_layers=6, num_kv_heads=1, head_dim=24, page_size=5,
                       dtype="bfloat16")
    assert other.page_bytes == SPEC.page_bytes and other.fingerprint != SPEC.fingerprint
    with HostKVPool(other, 2, allocator=MmapAllocator()) as opool:
        fill_random(opool.raw)
        foreign = FileStore({"root": str(tmp_path)}, spec=other)
        foreign.attach(opool)
        ours = FileStore({"root": str(tmp_path)}, spec=SPEC)
        ours.attach(pool)
        k = keys(1)
        assert foreign.batch_set(k, [0]) == [True]
        assert ours.batch_exists(k) == 0, "specs live in separate directories"
        os.makedirs(os.path.dirname(_path(ours, k[0])), exist_ok=True)
        shutil.copy(_path(foreign, k[0]), _path(ours, k[0]))
        assert ours.batch_exists(k) == 1                 # same size: exists cannot tell
        assert ours.batch_get(k, [3]) == [False]
        s = ours.stats()
        assert s["foreign"] == 1 and s["corrupted"] == 1 and s["errors"] == 1
        foreign.close()
        ours.close()


def test_object_of_another_key_is_a_miss(store, pool):
    a, b = keys(2)
    store.batch_set([a], [0])
    os.makedirs(os.path.dirname(_path(store, b)), exist_ok=True)
    shutil.copy(_path(store, a), _path(store, b))
    assert store.batch_get([b], [4]) == [False]
    assert store.stats()["foreign"] == 1
    assert store.batch_get([a], [4]) == [True]


def test_symlink_planted_at_an_object_path_is_not_followed(store, pool, tmp_path):
    k = keys(2)
    store.batch_set(k[:1], [0])
    target = tmp_path / "outside"
    shutil.copy(_path(store, k[0]), target)
    os.makedirs(os.path.dirname(_path(store, k[1])), exist_ok=True)
    os.symlink(target, _path(store, k[1]))
    assert store.batch_get(k[1:], [3]) == [False]
    assert store.stats()["errors"] >= 1
    # writing that key replaces the link itself, not the file it points at
    before = target.read_bytes()
    assert store.batch_set(k[1:], [5]) == [True]
    assert target.read_bytes() == before and not os.path.islink(_path(store, k[1]))


# --------------------------------------------------------------------------------------------
# key -> path mapping
# --------------------------------------------------------------------------------------------
HOSTILE = [b"../../../../etc/passwd", b"/etc/shadow", b"..", b".", b"a/../../b", b"\x00",
           b"\x00/..", b"C:\\Windows\\system32", b"\n\r\t", "ключ/..".encode(),
           b"." * 300, b"/" * 97, bytes(range(256)), b"~root/.ssh/authorized_keys"]


def test_hostile_keys_stay_inside_the_directory(tmp_path, pool):
    root = tmp_path / "root"
    store = FileStore({"root": str(root)}, spec=SPEC)
    store.attach(pool)
    src = list(range(len(HOSTILE)))[:pool.num_pages]
    ks = HOSTILE[:len(src)]
    want = [page_bytes(pool, p) for p in src]
    assert store.batch_set(ks, src) == [True] * len(ks)
    outside = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
               if not os.path.realpath(os.path.join(d, f)).startswith(store.dir + os.sep)]
    assert not outside, outside
    assert len(objects(store)) == len(ks)
    fill_random(pool.raw)
    assert store.batch_get(ks, src) == [True] * len(ks)
    for p, w in zip(src, want):
        assert torch.equal(page_bytes(pool, p), w)
    assert store.delete(ks) == len(ks) and not objects(store)
    store.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=400))
def test_file_names_are_hex_and_short(key):
    sub, name = key_filename(key)
    assert len(sub) == 2 and set(sub) <= set(string.hexdigits.lower())
    stem = name.removesuffix(".kvp")
    assert set(stem) <= set("0123456789abcdefh") and "/" not in name
    assert len(name.encode()) <= 255 - 40, "room left for the temporary-file decoration"
    assert not name.startswith(".")


def test_long_keys_do_not_collide():
    a, b = b"x" * 200 + b"1", b"x" * 200 + b"2"
    assert key_filename(a) != key_filename(b)
    assert key_filename(b"k" * 96)[1] == (b"k" * 96).hex() + ".kvp"


# --------------------------------------------------------------------------------------------
# bad input: typed errors before anything is touched
# --------------------------------------------------------------------------------------------
def test_bad_arguments(store, pool, tmp_path):
    k = keys(2)
    cases = [
        (InvalidArgumentError, lambda: store.batch_set(k, [0])),
        (InvalidArgumentError, lambda: store.batch_get(k, [0, 1, 2])),
        (PageIndexError, lambda: store.batch_set(k, [0, pool.num_pages])),
        (PageIndexError, lambda: store.batch_get(k, [-1, 0])),
        (PageIndexError, lambda: store.batch_set(k, [0, 1.0])),
        (PageIndexError, lambda: store.batch_set(k, torch.tensor([0.0, 1.0]))),
        (PageIndexError, lambda: store.batch_set(k, "01")),
        (InvalidArgumentError, lambda: store.batch_set([b"", k[1]], [0, 1])),
        (InvalidArgumentError, lambda: store.batch_set(["text", k[1]], [0, 1])),
        (InvalidArgumentError, lambda: store.batch_exists(b"bytes-not-a-list")),
        (InvalidArgumentError, lambda: store.batch_exists([None])),
        (InvalidArgumentError, lambda: store.delete("key")),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
    assert store.batch_exists(k) == 0 and not objects(store)
    assert not tmp_files(str(tmp_path))
    assert store.stats()["sets"] == 0 and store.stats()["errors"] == 0


def test_pools_of_another_spec_are_refused(store):
    for other in (KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5,
                             dtype="float16"),                         # dtype
                  KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=6,
                             dtype="bfloat16"),                        # shape
                  KVSpec.mla(num_layers=3, kv_lora_rank=48, rope_dim=0, page_size=5)):
        with HostKVPool(other, 2, allocator=MmapAllocator()) as p, pytest.raises(ConfigError):
            store.attach(p)


def test_unattached_and_closed(tmp_path, pool):
    s = FileStore({"root": str(tmp_path)}, spec=SPEC)
    with pytest.raises(InvalidArgumentError):
        s.batch_get(keys(1), [0])
    assert s.batch_exists(keys(1)) == 0          # needs no pool
    s.attach(pool)
    s.close()
    s.close()
    for call in (lambda: s.batch_get(keys(1), [0]), lambda: s.batch_set(keys(1), [0]),
                 lambda: s.batch_exists(keys(1)), lambda: s.delete(keys(1)), s.clear):
        with pytest.raises(StoreError):
            call()


@pytest.mark.parametrize("config", [{}, {"root": ""}, {"root": "x", "io_threads": -1},
                                    {"root": "x", "capacity_bytes": 100},
                                    {"root": "x", "o_direct": "maybe"},
                                    {"root": "x", "checksum": "md5"},
                                    {"root": "x", "file_mode": 0o10000},
                                    {"root": "x", "bogus": 1},
                                    {"root": "x", "format": "tar"},
                                    {"root": "x", "segment_bytes": 100}])
def test_bad_config(tmp_path, config):
    config = {k: (str(tmp_path / v) if k == "root" and v else v) for k, v in config.items()}
    with pytest.raises(ConfigError):
        FileStore(config, spec=SPEC)


def test_root_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(StoreError):
        FileStore({"root": str(blocker / "store")}, spec=SPEC)


def test_example_config_is_rooted_in_workdir(tmp_path):
    cfg = FileStore.example_config(str(tmp_path))
    assert cfg["root"].startswith(str(tmp_path))
    s = FileStore(cfg, spec=SPEC)
    assert s.dir.startswith(str(tmp_path))
    s.close()


# --------------------------------------------------------------------------------------------
# a full disk
# --------------------------------------------------------------------------------------------
def test_enospc_is_a_counted_miss_and_leaves_nothing(store, pool, monkeypatch):
    k = keys(4)
    assert store.batch_set(k[:1], [0]) == [True]
    real = files_mod._pwrite_all
    calls = {"n": 0}

    def full_disk(fd, bufs, offset=0):
        calls["n"] += 1
        real(fd, [bufs[0][: len(bufs[0]) // 2]], offset)     # part written, then full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files_mod, "_pwrite_all", full_disk)
    assert store.batch_set(k, [0, 1, 2, 3]) == [False] * 4
    assert calls["n"] == 4
    s = store.stats()
    assert s["disk_full"] == 4 and s["write_errors"] == 4 and s["errors"] == 4
    assert not tmp_files(store.root)
    # the old object of k[0] is intact, the others were never created
    assert store.batch_exists(k) == 1
    monkeypatch.setattr(files_mod, "_pwrite_all", real)
    want = page_bytes(pool, 0)
    assert store.batch_get(k[:1], [9]) == [True] and torch.equal(page_bytes(pool, 9), want)
    assert store.batch_set(k[1:], [1, 2, 3]) == [True] * 3, "the store keeps working"


def test_file_size_limit_in_a_real_process(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the write (EFBIG) part way through an object."""
    out = subprocess.run([sys.executable, CHILD, str(tmp_path), "rlimit"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"] == [False] * child.NUM_KEYS
    assert res["stats"]["disk_full"] == child.NUM_KEYS and res["tmp"] == []
    store, pool = child.open_store(str(tmp_path))
    assert store.batch_exists(child.keys()) == 0
    store.close()
    pool.close()


def _mount_tmpfs(path: str, size: str) -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("path", ["page-cache", "o-direct"])
def test_really_full_filesystem(tmp_path, path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not _mount_tmpfs(str(mnt), "24k" if path == "page-cache" else "64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights); the "
                    "fault-injection and RLIMIT_FSIZE tests cover the logic")
    spec = SPEC if path == "page-cache" else ALIGNED
    pool = HostKVPool(spec, 16, allocator=MmapAllocator())
    fill_random(pool.raw)
    try:
        store = FileStore({"root": str(mnt), "io_threads": 1,
                           "o_direct": "off" if path == "page-cache" else "auto"}, spec=spec)
        store.attach(pool)
        n = pool.num_pages
        k = keys(n)
        want = [page_bytes(pool, p) for p in range(n)]
        ok = store.batch_set(k, list(range(n)))
        assert True in ok and False in ok, ok
        assert store.stats()["disk_full"] == ok.count(False)
        assert not tmp_files(str(mnt))
        fill_random(pool.raw)
        got = store.batch_get(k, list(range(n)))
        assert got == ok
        for p in range(n):
            if got[p]:
                assert torch.equal(page_bytes(pool, p), want[p])
        store.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        pool.close()


# --------------------------------------------------------------------------------------------
# killed writers and several processes
# --------------------------------------------------------------------------------------------


def test_writer_killed_in_the_middle_of_an_object(tmp_path):
    root = str(tmp_path)
    proc = subprocess.Popen([sys.executable, CHILD, root, "stall"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        child.wait_for(proc, "stalled")
        half_written = tmp_files(root)
        assert len(half_written) == 1, "the child stopped inside one object's write"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    hits, gens = child.read_all(root)       # opening a store also cleans the dead writer's tmp
    assert hits == child.NUM_KEYS and gens == [0] * child.NUM_KEYS, "old objects intact"
    assert tmp_files(root) == []


def test_writer_killed_at_random_times(tmp_path):
    root = str(tmp_path)
    rng = random.Random(5)
    for _attempt in range(2):
        proc = subprocess.Popen([sys.executable, CHILD, root, "loop"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            child.wait_for(proc, "ready")
            time.sleep(rng.uniform(0.05, 0.4))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        print(f"killed with {len(tmp_files(root))} unfinished objects")
        hits, gens = child.read_all(root)
        assert hits == child.NUM_KEYS, "every key had a complete generation before the kill"
        assert tmp_files(root) == []


def test_processes_sharing_one_directory(tmp_path):
    """Two writers overwrite the same keys with their own generations while a third process
    reads: every read is a complete page of some generation, never a mix."""
    root = str(tmp_path)
    seconds = "1.5"
    store, pool = child.open_store(root)
    assert all(child.write_gen(store, pool, 1_000_000))          # something to read at once
    procs = [subprocess.Popen([sys.executable, CHILD, root, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for args in (["writer", "0", "2", seconds], ["writer", "1", "2", seconds],
                          ["reader", seconds])]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    w0, w1, r = outs
    assert w0["written"] > 0 and w1["written"] > 0 and w0["errors"] == w1["errors"] == 0
    assert r["wrong"] == 0 and r["hits"] > 0
    assert r["stats"]["corrupted"] == 0
    # this process sees what the others wrote, and deletes for everyone
    hits, gens = child.read_all(root)
    assert hits == child.NUM_KEYS
    assert store.delete(child.keys()) == child.NUM_KEYS
    assert child.read_all(root)[0] == 0
    store.close()
    pool.close()


def test_stale_temporary_files_are_cleaned(tmp_path):
    s = FileStore({"root": str(tmp_path)}, spec=SPEC)
    sub = os.path.join(s.dir, "ab")
    os.makedirs(sub)
    tag = s._host
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    files = {
        "dead": f".aa.kvp.{tag}-{dead.pid}.0000.tmp",            # writer gone: removed
        "alive": f".bb.kvp.{tag}-{os.getppid()}.0000.tmp",       # writer alive: kept
        "other-host": ".cc.kvp.ffffffff-1.0000.tmp",             # unknown: kept while young
        "old": ".dd.kvp.ffffffff-1.0001.tmp",                    # unknown but old: removed
    }
    for name in files.values():
        with open(os.path.join(sub, name), "wb") as f:
            f.write(b"partial")
    old = time.time() - 3600
    os.utime(os.path.join(sub, files["old"]), (old, old))
    s.close()
    s2 = FileStore({"root": str(tmp_path), "stale_tmp_s": 600}, spec=SPEC)
    left = set(os.listdir(sub))
    assert left == {files["alive"], files["other-host"]}
    assert s2.stats()["tmp_cleaned"] == 2
    s2.close()


# --------------------------------------------------------------------------------------------
# capacity and LRU
# --------------------------------------------------------------------------------------------
def _capped(tmp_path, pool, n: int, **extra) -> FileStore:
    s = FileStore({"root": str(tmp_path), "capacity_bytes": n * (SPEC.page_bytes +
                                                                   TRAILER_BYTES), **extra},
                  spec=SPEC)
    s.attach(pool)
    return s


def test_lru_evicts_least_recently_used(tmp_path, pool):
    s = _capped(tmp_path, pool, 4)
    k = keys(6)
    for i in range(4):
        assert s.batch_set([k[i]], [i]) == [True]
        time.sleep(0.01)
    assert s.batch_get([k[0]], [10]) == [True]            # k0 is now the most recent
    assert s.batch_set([k[4]], [4]) == [True]             # evicts k1
    assert [s.batch_exists([x]) for x in k[:5]] == [1, 0, 1, 1, 1]
    assert s.batch_set(k[1:2] + k[5:6], [1, 5]) == [True, True]   # evicts k2, k3
    assert [s.batch_exists([x]) for x in k] == [1, 1, 0, 0, 1, 1]
    st_ = s.stats()
    assert st_["evictions"] == 3 and st_["objects"] == 4 and len(objects(s)) == 4
    s.close()


def test_a_chain_is_evicted_from_its_tail(tmp_path, pool):
    """Within one batch the first keys count as most recent: a chain loses its tail first."""
    s = _capped(tmp_path, pool, 4)
    chain = keys(4)
    assert s.batch_set(chain, [0, 1, 2, 3]) == [True] * 4
    assert s.batch_get(chain, [4, 5, 6, 7]) == [True] * 4
    other = keys(2, "other")
    assert s.batch_set(other, [8, 9]) == [True, True]
    assert s.batch_exists(chain) == 2 and s.batch_exists(other) == 2
    s.close()


def test_overwrite_does_not_evict(tmp_path, pool):
    s = _capped(tmp_path, pool, 3)
    k = keys(3)
    s.batch_set(k, [0, 1, 2])
    assert s.batch_set(k, [3, 4, 5]) == [True] * 3
    assert s.batch_exists(k) == 3 and s.stats()["evictions"] == 0
    s.close()


def test_batch_larger_than_capacity(tmp_path, pool):
    s = _capped(tmp_path, pool, 3)
    k = keys(5)
    assert s.batch_set(k, [0, 1, 2, 3, 4]) == [True, True, True, False, False]
    assert s.batch_exists(k) == 3 and s.stats()["over_capacity"] == 2
    s.close()


def test_reads_by_another_process_count_as_use(tmp_path, pool):
    """Instance B (another process, as far as A knows) reads k0; A then evicts k1, not k0."""
    a = _capped(tmp_path, pool, 3)
    b = FileStore({"root": str(tmp_path)}, spec=SPEC)
    b.attach(pool)
    k = keys(4)
    for i in range(3):
        a.batch_set([k[i]], [i])
        old = time.time() - 60 + i             # written a while ago (reads refresh mtimes
        os.utime(_path(a, k[i]), (old, old))   # older than a second)
    time.sleep(0.05)    # B's refresh must be a later (coarse, per-tick) file time than A's write
    assert b.batch_get([k[0]], [9]) == [True]
    time.sleep(0.02)
    assert a.batch_set([k[3]], [3]) == [True]
    assert [a.batch_exists([x]) for x in k] == [1, 0, 1, 1]
    a.close()
    b.close()


def test_capacity_counts_other_processes_objects(tmp_path, pool):
    a = _capped(tmp_path, pool, 4, rescan_interval_s=0.0)
    b = FileStore({"root": str(tmp_path)}, spec=SPEC)
    b.attach(pool)
    kb = keys(3, "b")
    b.batch_set(kb, [0, 1, 2])                 # A's index does not know these
    for i, k in enumerate(kb):                 # distinct ages: one batch can share an mtime
        old = time.time() - 60 + i
        os.utime(_path(b, k), (old, old))
    ka = keys(3, "a")
    assert a.batch_set(ka, [3, 4, 5]) == [True] * 3      # starts a background rescan
    end = time.monotonic() + 20
    while len(objects(a)) > 4 and time.monotonic() < end:
        time.sleep(0.05)
    assert len(objects(a)) == 4, "A rescanned and evicted B's oldest objects"
    assert [b.batch_exists([k]) for k in kb] == [0, 0, 1]
    assert a.batch_exists(ka) == 3
    a.close()
    b.close()


def test_explicit_rescan_enforces_capacity(tmp_path, pool):
    a = _capped(tmp_path, pool, 2, rescan_interval_s=3600)
    b = FileStore({"root": str(tmp_path)}, spec=SPEC)
    b.attach(pool)
    kb = keys(4)
    for i, k in enumerate(kb):
        b.batch_set([k], [i])
        time.sleep(0.01)
    a.rescan()
    assert [b.batch_exists([k]) for k in kb] == [0, 0, 1, 1]
    assert a.stats()["evictions"] == 2
    a.close()
    b.close()


def test_index_rebuilt_from_the_directory(tmp_path, pool):
    s = _capped(tmp_path, pool, 10)
    s.batch_set(keys(5), [0, 1, 2, 3, 4])
    s.close()
    s2 = _capped(tmp_path, pool, 10)
    assert s2.stats()["objects"] == 5
    s2.clear()
    assert s2.stats()["objects"] == 0 and not objects(s2)
    s2.close()


# --------------------------------------------------------------------------------------------
# O_DIRECT
# --------------------------------------------------------------------------------------------
def test_o_direct_round_trip_or_reported_fallback(tmp_path):
    with HostKVPool(ALIGNED, 6, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        s = FileStore({"root": str(tmp_path), "o_direct": "auto"}, spec=ALIGNED)
        s.attach(pool)
        st_ = s.stats()
        if not st_["o_direct"]:
            assert st_["o_direct_reason"] not in ("", "in use")
        k = keys(3)
        want = [pool.page_bytes_view(p).clone() for p in (4, 0, 2)]
        assert s.batch_set(k, [4, 0, 2]) == [True] * 3
        for path in objects(s):     # O_DIRECT objects keep their trailer block whole
            assert os.path.getsize(path) == (s.padded_bytes if st_["o_direct"] else
                                             ALIGNED.page_bytes + TRAILER_BYTES)
        assert s.stats()["bytes_stored"] == 3 * os.path.getsize(objects(s)[0])
        fill_random(pool.raw)
        assert s.batch_get(k, [1, 3, 5]) == [True] * 3
        for p, w in zip((1, 3, 5), want):
            assert torch.equal(pool.page_bytes_view(p), w)
        # objects written with O_DIRECT read back without it, and the other way round
        plain = FileStore({"root": str(tmp_path)}, spec=ALIGNED)
        plain.attach(pool)
        assert plain.batch_get(k, [0, 1, 2]) == [True] * 3
        assert plain.batch_set(keys(1), [0]) == [True]
        s.close()
        plain.close()


def test_o_direct_needs_aligned_pages(tmp_path, pool):
    s = FileStore({"root": str(tmp_path), "o_direct": "auto"}, spec=SPEC)
    if not s._direct:
        pytest.skip(f"O_DIRECT unsupported here: {s._direct_reason}")
    s.attach(pool)                         # SPEC pages are 1200 bytes: not 4 KiB multiples
    st_ = s.stats()
    assert st_["o_direct"] is False and st_["o_direct_reason"] != "in use"
    k = keys(1)
    assert s.batch_set(k, [0]) == [True] and s.batch_get(k, [1]) == [True]
    s.close()
    strict = FileStore({"root": str(tmp_path), "o_direct": "on"}, spec=SPEC)
    with pytest.raises(StoreError):
        strict.attach(pool)
    strict.close()


def test_store_errors_are_kvtier_errors():
    assert issubclass(StoreError, KVTierError)


# --------------------------------------------------------------------------------------------
# checksum implementations
# --------------------------------------------------------------------------------------------
def test_fast_and_stdlib_checksums_read_each_other(tmp_path, pool, monkeypatch):
    import zlib
    k = keys(2)
    want = [page_bytes(pool, p) for p in (3, 4)]
    for writer in ("fast", "stdlib"):
        if writer == "stdlib":
            monkeypatch.setattr(format_mod, "_impl_cache",
                                {1: (zlib.crc32, "zlib"), 2: (zlib.adler32, "zlib")})
        s = FileStore({"root": str(tmp_path / writer)}, spec=SPEC)
        s.attach(pool)
        assert s.batch_set(k, [3, 4]) == [True, True]
        s.close()
    monkeypatch.undo()
    for reader in ("stdlib", "fast"):
        if reader == "stdlib":
            monkeypatch.setattr(format_mod, "_impl_cache",
                                {1: (zlib.crc32, "zlib"), 2: (zlib.adler32, "zlib")})
        for writer in ("fast", "stdlib"):
            s = FileStore({"root": str(tmp_path / writer)}, spec=SPEC)
            s.attach(pool)
            fill_random(pool.raw)
            assert s.batch_get(k, [0, 1]) == [True, True], (writer, reader)
            assert torch.equal(page_bytes(pool, 0), want[0])
            assert torch.equal(page_bytes(pool, 1), want[1])
            s.close()
        monkeypatch.undo()


def test_checksum_provider_falls_back_to_zlib(monkeypatch):
    import zlib
    monkeypatch.setattr(format_mod, "_impl_cache", {})
    monkeypatch.setattr(format_mod, "_PROVIDERS", (("missing", "no_such_checksum_module"),
                                                 ("zlib", "zlib")))
    fn, provider = file_mod.checksum_impl(1)
    assert provider == "zlib" and fn is zlib.crc32


def test_capacity_counts_bytes_on_disk_for_o_direct_objects(tmp_path):
    with HostKVPool(ALIGNED, 8, allocator=MmapAllocator()) as pool:
        fill_random(pool.raw)
        probe = FileStore({"root": str(tmp_path)}, spec=ALIGNED)
        probe.attach(pool)
        size = probe.padded_bytes if probe.stats()["o_direct"] else probe.object_bytes
        probe.close()
        s = FileStore({"root": str(tmp_path), "capacity_bytes": 3 * size}, spec=ALIGNED)
        s.attach(pool)
        k = keys(5)
        assert s.batch_set(k[:3], [0, 1, 2]) == [True] * 3
        assert s.stats()["bytes_stored"] == 3 * size
        assert s.batch_set(k[3:], [3, 4]) == [True, True]
        assert s.stats()["evictions"] == 2                 # the first batch's tail: k1, k2
        assert [s.batch_exists([x]) for x in k] == [1, 0, 0, 1, 1]
        assert sum(os.path.getsize(p) for p in objects(s)) == s.stats()["bytes_stored"]
        s.close()
