"""L3 stores against a hostile neighbour and a careless caller: non-regular files and symlinks
in the file store's tree, foreign entries, modes whatever the umask, roots other users can
write to, and a host page named twice in one ``batch_get``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
import threading

import pytest
import torch

from kvtier.errors import ConfigError, InvalidArgumentError, StoreError
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import TRAILER_BYTES, key_filename
from kvtier.l3_stores.memory import MemoryStore
from kvtier.spec import KVSpec
from kvtier.testing.data import make_host_pool
from kvtier.testing import fill_random

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from file_formats import FileStore, fmt, formats  # noqa: E402,F401

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16")
#: Tests that plant entries at per-object paths (test_file_segments.py: the segment format's).
OBJECTS_ONLY = {
    "test_fifo_at_an_object_path_is_a_counted_miss_never_a_hang",
    "test_other_non_regular_entries_at_object_paths",
    "test_symlinked_fanout_directory_is_never_followed",
    "test_clear_and_eviction_remove_only_the_stores_own_objects",
    "test_group_file_mode_is_applied_whatever_the_umask",
    "test_fanout_directory_that_cannot_be_made_is_a_counted_failed_write",
}
pytest_generate_tests = formats(OBJECTS_ONLY)


def keys(n: int, tag: str = "") -> list[bytes]:
    salt = os.urandom(4).hex() + tag
    return [f"hostile-{salt}-{i}".encode() for i in range(n)]


def page_bytes(pool: HostKVPool, p: int) -> torch.Tensor:
    return torch.cat(pool.page_segments(p)).clone()


def _path(store: FileStore, key: bytes) -> str:
    sub, name = key_filename(key)
    return os.path.join(store.dir, sub, name)


@pytest.fixture
def pool():
    with make_host_pool(SPEC, 8) as p:      # random bytes
        yield p


@pytest.fixture
def store(tmp_path, pool):
    s = FileStore({"root": str(tmp_path / "store"), "io_threads": 2}, spec=SPEC)
    s.attach(pool)
    yield s
    s.close()


def _tree(path) -> dict[str, bytes]:
    """Every regular file under ``path`` (not following links) with its bytes."""
    out = {}
    for d, _, fs in os.walk(path):
        for f in fs:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[p] = fh.read()
    return out


def _bounded(fn, timeout: float = 10.0):
    """Run ``fn`` on a thread; fail (not hang) if it has not returned within ``timeout``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:      # noqa: BLE001 -- re-raised in the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call blocked for more than {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _unblock(fifo: str) -> None:
    """Release a reader stuck in open() on a FIFO (so a failing run does not leak it)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# 1. non-regular files at an object's path
# --------------------------------------------------------------------------------------------
def test_fifo_at_an_object_path_is_a_counted_miss_never_a_hang(store, pool):
    k = keys(2)
    assert store.batch_set(k[:1], [0]) == [True]
    fifo = _path(store, k[1])
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo, 0o600)
    before = page_bytes(pool, 3)
    try:
        assert _bounded(lambda: store.batch_get(k[1:], [3])) == [False]
        assert _bounded(lambda: store.batch_get(k, [2, 3])) == [True, False]
        assert _bounded(lambda: store.batch_exists(k[1:])) == 0
        _bounded(store.rescan)
    finally:
        _unblock(fifo)
    assert torch.equal(page_bytes(pool, 3), before), "a miss leaves the page untouched"
    s = store.stats()
    assert s["not_regular"] >= 2 and s["corrupted"] >= 2 and s["errors"] >= 2
    # clear() leaves what is not the store's own; a write replaces the FIFO with an object
    _bounded(store.clear)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert store.batch_set(k[1:], [4]) == [True]
    assert stat.S_ISREG(os.lstat(fifo).st_mode)
    assert store.batch_get(k[1:], [5]) == [True]
    assert torch.equal(page_bytes(pool, 5), page_bytes(pool, 4))


@pytest.mark.parametrize("kind", ["directory", "socket"])
def test_other_non_regular_entries_at_object_paths(store, pool, kind, tmp_path):
    import socket
    k = keys(1)
    path = _path(store, k[0])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "directory":
        os.mkdir(path)
    else:
        sock = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(os.path.dirname(path))              # a full path may be too long for AF_UNIX
        try:
            sock.bind(os.path.basename(path))
        finally:
            os.chdir(cwd)
            sock.close()
    assert _bounded(lambda: store.batch_get(k, [1])) == [False]
    assert store.batch_exists(k) == 0
    assert store.stats()["errors"] >= 1
    _bounded(store.clear)                 # copes with the foreign entry, leaves it
    assert os.path.lexists(path)


# --------------------------------------------------------------------------------------------
# 2. never outside the root: symlinked directories, foreign entries
# --------------------------------------------------------------------------------------------
def test_symlinked_store_directory_is_refused(tmp_path, pool):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(mode=0o700)
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    os.symlink(outside, root / SPEC.fingerprint)
    with pytest.raises(StoreError) as info:
        FileStore({"root": str(root)}, spec=SPEC)
    assert info.value.reason == "symlinked_directory"
    assert "symlink" in str(info.value)
    assert _tree(outside) == {str(outside / "precious"): b"keep me"}


def test_store_directory_that_is_a_file_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (root / SPEC.fingerprint).write_bytes(b"x")
    with pytest.raises(StoreError):
        FileStore({"root": str(root)}, spec=SPEC)


def test_symlinked_fanout_directory_is_never_followed(tmp_path, pool):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    s = FileStore({"root": str(root), "capacity_bytes": 3 * (SPEC.page_bytes + TRAILER_BYTES)},
                  spec=SPEC)
    s.attach(pool)
    k = keys(6)
    sub, name = key_filename(k[0])
    # a valid object of k[0] sits in the link's target: reading it would be "right" bytes,
    # but it is outside the store, so it must not be read, replaced or deleted
    helper = FileStore({"root": str(tmp_path / "helper")}, spec=SPEC)
    helper.attach(pool)
    assert helper.batch_set(k[:1], [0]) == [True]
    shutil.copy(_path(helper, k[0]), outside / name)
    (outside / "unrelated.kvp").write_bytes(b"not ours")
    helper.close()
    os.symlink(outside, os.path.join(s.dir, sub))
    before = _tree(outside)
    assert s.batch_get(k[:1], [1]) == [False]
    assert s.batch_exists(k[:1]) == 0
    assert s.batch_set(k[:1], [2]) == [False]
    assert s.stats()["foreign_entries"] >= 1
    others = [x for x in k[1:] if key_filename(x)[0] != sub]
    for i in range(0, len(others), 2):                                 # fills, evicts
        assert s.batch_set(others[i:i + 2], [i % 8, (i + 1) % 8][:len(others[i:i + 2])]) \
            == [True] * len(others[i:i + 2])
    assert s.stats()["evictions"] >= 1
    s.rescan()
    s.clear()
    assert s.delete(k) == 0
    assert _tree(outside) == before, "nothing outside the root read, written or deleted"
    assert os.path.islink(os.path.join(s.dir, sub))
    s.close()


def test_clear_and_eviction_remove_only_the_stores_own_objects(tmp_path, pool):
    s = FileStore({"root": str(tmp_path), "capacity_bytes": 2 * (SPEC.page_bytes +
                                                                   TRAILER_BYTES)}, spec=SPEC)
    s.attach(pool)
    k = keys(4)
    assert s.batch_set(k[:2], [0, 1]) == [True, True]
    sub, name = key_filename(k[2])
    d = os.path.join(s.dir, sub)
    os.makedirs(d, exist_ok=True)
    os.mkdir(os.path.join(d, name))                                  # a directory named
    with open(os.path.join(d, name, "inside"), "wb") as f:           # like an object
        f.write(b"x")
    with open(os.path.join(d, "README"), "wb") as f:                 # a foreign file
        f.write(b"mine")
    big = os.path.join(d, "ab" * 4 + ".kvp")                         # right name, ours? no:
    with open(big, "wb") as f:                                       # wrong size
        f.write(b"\0" * (SPEC.page_bytes + TRAILER_BYTES))
    os.symlink("/etc/hostname", os.path.join(d, "cd" * 4 + ".kvp"))  # a link named like one
    s.rescan()
    assert s.batch_set(k[3:], [3]) == [True]                         # eviction runs
    s.clear()                                                        # no IsADirectoryError
    left = sorted(os.listdir(d))
    assert name in left and "README" in left and "cd" * 4 + ".kvp" in left
    assert os.path.exists(os.path.join(d, name, "inside"))
    assert not [p for p in _tree(s.dir) if p.endswith(".kvp") and os.path.basename(p)
                in {key_filename(x)[1] for x in k}]
    assert s.stats()["foreign_entries"] >= 2
    s.close()


# --------------------------------------------------------------------------------------------
# 3. modes whatever the umask; roots other users can write to
# --------------------------------------------------------------------------------------------
def _modes(path) -> dict[str, int]:
    out = {}
    for d, ds, fs in os.walk(path):
        for n in ds + fs:
            p = os.path.join(d, n)
            out[os.path.relpath(p, path)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o022])
def test_modes_do_not_depend_on_the_umask(tmp_path, pool, umask):
    old = os.umask(umask)
    try:
        s = FileStore({"root": str(tmp_path / "a" / "b" / "root")}, spec=SPEC)
        s.attach(pool)
        assert s.batch_set(keys(3), [0, 1, 2]) == [True] * 3
        s.close()
    finally:
        os.umask(old)
    modes = _modes(tmp_path)
    assert modes, "store created nothing"
    for rel, mode in modes.items():
        full = os.path.join(tmp_path, rel)
        want = 0o700 if os.path.isdir(full) else 0o600
        assert mode == want, f"{rel}: {mode:o}, want {want:o} (umask {umask:o})"


def test_group_file_mode_is_applied_whatever_the_umask(tmp_path, pool):
    old = os.umask(0o077)
    try:
        s = FileStore({"root": str(tmp_path / "root"), "file_mode": 0o640}, spec=SPEC)
        s.attach(pool)
        k = keys(1)
        assert s.batch_set(k, [0]) == [True]
        assert stat.S_IMODE(os.stat(_path(s, k[0])).st_mode) == 0o640
        assert stat.S_IMODE(os.stat(s.dir).st_mode) == 0o750
        s.close()
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_root_other_users_can_write_to_is_refused(tmp_path, pool, mode):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(ConfigError) as info:
        FileStore({"root": str(root)}, spec=SPEC)
    assert "allow_shared_root" in str(info.value) and "writable" in str(info.value)
    assert info.value.key == "file.allow_shared_root"
    assert os.listdir(root) == [], "nothing created in a refused root"
    s = FileStore({"root": str(root), "allow_shared_root": True}, spec=SPEC)   # opted in
    s.attach(pool)
    assert s.batch_set(keys(1), [0]) == [True]
    s.close()


def test_sticky_world_writable_root_is_accepted(tmp_path, pool):
    root = tmp_path / "tmpdir"
    root.mkdir()
    os.chmod(root, 0o1777)
    s = FileStore({"root": str(root)}, spec=SPEC)
    s.attach(pool)
    assert s.batch_set(keys(1), [0]) == [True]
    assert stat.S_IMODE(os.stat(s.dir).st_mode) == 0o700
    s.close()


def test_store_directory_others_can_write_to_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (root / SPEC.fingerprint).mkdir()
    os.chmod(root / SPEC.fingerprint, 0o777)
    with pytest.raises(ConfigError) as info:
        FileStore({"root": str(root)}, spec=SPEC)
    assert "allow_shared_root" in str(info.value)


# --------------------------------------------------------------------------------------------
# 4. one host page twice in a batch_get
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_batch_get_with_a_host_page_twice_is_refused_before_anything(tmp_path, pool, kind):
    s = MemoryStore({}, spec=SPEC) if kind == "memory" else \
        FileStore({"root": str(tmp_path)}, spec=SPEC)
    s.attach(pool)
    k = keys(2)
    assert s.batch_set(k, [0, 1]) == [True, True]
    fill_random(pool.raw)
    before = pool.raw.clone()
    stats = s.stats()
    with pytest.raises(InvalidArgumentError) as info:
        s.batch_get(k, [5, 5])
    assert "twice" in str(info.value)
    assert torch.equal(pool.raw, before) and s.stats() == stats
    assert s.batch_get(k, [5, 6]) == [True, True]    # distinct pages are fine
    assert s.batch_set(k, [2, 2]) == [True, True]    # one page under two keys is fine
    s.close()


# --------------------------------------------------------------------------------------------
# close() while a call is in flight
# --------------------------------------------------------------------------------------------
def test_close_during_a_call_defers_closing_the_directory(tmp_path, pool, monkeypatch):
    """The rest of an in-flight batch still works relative to the store directory (not to a
    closed, possibly reused, descriptor number); the descriptor is closed by the last call."""
    from kvtier.l3_stores.file import _files as files_mod
    s = FileStore({"root": str(tmp_path), "io_threads": 1, "o_direct": "off"}, spec=SPEC)
    s.attach(pool)
    k = keys(3)
    assert s.batch_set(k, [0, 1, 2]) == [True] * 3
    started, release = threading.Event(), threading.Event()
    real = files_mod._pread_all

    def slow(fd, bufs, offset=0):
        if not started.is_set():
            started.set()
            release.wait(10)
        return real(fd, bufs, offset)

    monkeypatch.setattr(files_mod, "_pread_all", slow)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("got", s.batch_get(k, [3, 4, 5])))
    t.start()
    assert started.wait(10)
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    assert s._dfd >= 0, "closed under a call in flight"
    fresh = os.open(str(tmp_path), os.O_RDONLY)       # would take a freed descriptor number
    release.set()
    t.join(10)
    os.close(fresh)
    assert box["got"] == [True, True, True] and s.stats()["errors"] == 0
    assert s._dfd == -1
    with pytest.raises(StoreError):
        s.batch_get(k, [3, 4, 5])


# --------------------------------------------------------------------------------------------
# names carrying a pid no process can have; a deeply nested manifest; an unmakeable directory
# --------------------------------------------------------------------------------------------
#: pids no process can have: os.kill raises OverflowError beyond pid_t, and pid 0 would
#: signal the caller's own process group (so its files looked alive forever)
IMPOSSIBLE_PIDS = [2**31, 9_999_999_999, 0]


def _plant_impossible_writer(store: FileStore, pid: int, tag: str) -> list[str]:
    """Files named for a writer of this host with ``pid``: a segment no record names and its
    empty log (segments format), a temporary object (objects format)."""
    host = store._host
    if store.config.format == "segments":
        d = os.path.join(store.dir, "segments")
        os.makedirs(d, exist_ok=True)
        names = [f"{host}-{pid}-{tag}.00000001.kvs", f"{host}-{pid}-{tag}.00000001.kvl"]
    else:
        d = os.path.join(store.dir, "00")
        os.makedirs(d, exist_ok=True)
        names = [f".00.kvp.{host}-{pid}.{tag}.tmp"]
    paths = [os.path.join(d, n) for n in names]
    for p in paths:
        with open(p, "wb") as f:
            f.write(bytes(4096))
    return paths


@pytest.mark.parametrize("pid", IMPOSSIBLE_PIDS)
def test_files_of_a_writer_that_cannot_exist_are_garbage_never_an_error(tmp_path, pool, pid):
    """A name with this host and an impossible pid is a dead writer's file: removed as
    garbage at open (and by a rescan), never an OverflowError at open or in any call."""
    root = str(tmp_path / "store")
    s = FileStore({"root": root}, spec=SPEC)
    s.attach(pool)
    k = keys(3)
    assert s.batch_set(k[:2], [0, 1]) == [True, True]
    want = [page_bytes(pool, p) for p in (0, 1)]
    s.close()
    planted = _plant_impossible_writer(s, pid, "0000abcd")
    s2 = FileStore({"root": root}, spec=SPEC)              # opening cleans them
    s2.attach(pool)
    assert [p for p in planted if os.path.exists(p)] == []
    assert s2.stats()["tmp_cleaned"] == len(planted)
    # planted while the store is open: every call still answers
    planted = _plant_impossible_writer(s2, pid, "0000abce")
    assert s2.batch_exists(k) == 2
    assert s2.batch_get(k, [4, 5, 6]) == [True, True, False]
    assert torch.equal(page_bytes(pool, 4), want[0]) and torch.equal(page_bytes(pool, 5), want[1])
    assert s2.batch_set(k[2:], [2]) == [True]
    s2.rescan()
    s2.close()
    s3 = FileStore({"root": root}, spec=SPEC)
    assert [p for p in planted if os.path.exists(p)] == []
    s3.close()


def test_a_live_writers_files_are_kept_whatever_the_pid_check(tmp_path, pool):
    """The other side of the same check: this host's live process (the test's parent) keeps
    its files (a live writer's data is never deleted)."""
    root = str(tmp_path / "store")
    s = FileStore({"root": root}, spec=SPEC)
    s.attach(pool)
    s.close()
    planted = _plant_impossible_writer(s, os.getppid(), "0000abcd")
    s2 = FileStore({"root": root}, spec=SPEC)
    s2.rescan()
    assert all(os.path.exists(p) for p in planted)
    s2.close()


def test_deeply_nested_manifest_is_damaged_and_rewritten(tmp_path, pool):
    """JSON nested deeper than the parser recurses, under the manifest's size limit: damaged,
    rewritten, never a RecursionError at open."""
    root = str(tmp_path / "store")
    s = FileStore({"root": root}, spec=SPEC)
    s.attach(pool)
    k = keys(2)
    assert s.batch_set(k, [0, 1]) == [True, True]
    s.close()
    path = os.path.join(s.dir, "manifest.json")
    depth = 30_000                  # 60 KB: under the 64 KiB limit, far over the recursion limit
    for blob in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
        with open(path, "w") as f:
            f.write(blob)
        s2 = _bounded(lambda: FileStore({"root": root}, spec=SPEC))
        s2.attach(pool)
        assert s2.stats()["manifest"] == "rewritten"
        assert s2.batch_get(k, [2, 3]) == [True, True]
        s2.close()
        with open(path) as f:
            assert json.load(f)["identity"] == s2.identity
    # nested just within what the parser takes: a manifest of another identity, reported
    with open(path, "w") as f:
        f.write('{"identity":' + "[" * 900 + "]" * 900 + "}")
    s2 = _bounded(lambda: FileStore({"root": root}, spec=SPEC))
    assert s2.stats()["manifest"] == "other identity"
    s2.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO, errno.EDQUOT])
def test_fanout_directory_that_cannot_be_made_is_a_counted_failed_write(tmp_path, pool,
                                                                        monkeypatch, err):
    """Objects format: mkdir of a fan-out directory refused (inodes exhausted, an I/O error):
    False for those pages and counted, never an exception; pages in existing directories are
    still written."""
    s = FileStore({"root": str(tmp_path / "store"), "format": "objects", "io_threads": 2},
                  spec=SPEC)
    s.attach(pool)
    k = keys(6)
    made = {key_filename(x)[0] for x in k[:3]}
    assert s.batch_set(k[:3], [0, 1, 2]) == [True] * 3
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if kwargs.get("dir_fd") is not None:
            raise OSError(err, os.strerror(err))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    want = [key_filename(x)[0] in made for x in k]
    before = s.stats()
    got = s.batch_set(k, list(range(6)))
    assert got == want, (got, want)
    after = s.stats()
    failed = want.count(False)
    assert failed and after["errors"] - before["errors"] == failed
    assert after.get("write_errors", 0) - before.get("write_errors", 0) == failed
    assert after["set_ok"] - before["set_ok"] == 6 - failed
    monkeypatch.undo()
    assert s.batch_set(k, list(range(6))) == [True] * 6
    s.close()
