"""The `file` store read-only: a shared snapshot, a warm cache shipped with a model, a
read-only mount. Reads are served bitwise, writes return False and are counted
(``writes_refused``), nothing in the directory changes, and the store says once why it is
read-only. Chosen by the setting ``read_only``, or by the store itself when it cannot write
its directory: tested with the setting, with ``EROFS`` injected into every call that would
write, and (as root, where mounting works) on a real read-only tmpfs -- directory mode bits
cannot simulate it, root ignores them.

Every test runs over both formats (``segments``, ``objects``)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from kvtier.host_pool import HostKVPool
from kvtier.spec import KVSpec
from kvtier.testing.data import make_host_pool

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from file_formats import FileStore, fmt, formats  # noqa: E402,F401

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=8, dtype="bfloat16")
pytest_generate_tests = formats(set())


def keys(n: int, tag: str = "") -> list[bytes]:
    return [f"ro-{tag}-{i}".encode() for i in range(n)]


def page_bytes(pool: HostKVPool, p: int) -> torch.Tensor:
    return torch.cat(pool.page_segments(p)).clone()


@pytest.fixture
def pool():
    with make_host_pool(SPEC, 16) as p:      # random bytes
        yield p


def _populate(root: str, pool: HostKVPool, n: int = 6) -> tuple[list[bytes], list]:
    """A store of ``n`` pages, closed; returns the keys and the pages' bytes."""
    s = FileStore({"root": root}, spec=SPEC)
    s.attach(pool)
    k = keys(n)
    assert s.batch_set(k, list(range(n))) == [True] * n
    want = [page_bytes(pool, p) for p in range(n)]
    s.close()
    return k, want


def _plant_dead_writers_files(store_dir: str, host: str) -> list[str]:
    """A dead writer's leftovers, which a writable store removes when it opens."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    seg = os.path.join(store_dir, "segments")
    os.makedirs(seg, exist_ok=True)
    fan = os.path.join(store_dir, "00")
    os.makedirs(fan, exist_ok=True)
    paths = [os.path.join(seg, f"{host}-{dead.pid}-0000abcd.00000001.kvs"),
             os.path.join(fan, f".00.kvp.{host}-{dead.pid}.1.tmp")]
    for p in paths:
        with open(p, "wb") as f:
            f.write(bytes(4096))
    return paths


def _tree(path: str) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under ``path``: (mode, mtime, bytes of regular files)."""
    out = {}
    for d, dirs, fs in os.walk(path):
        for name in dirs + fs:
            p = os.path.join(d, name)
            st = os.lstat(p)
            data = b""
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    data = f.read()
            out[p] = (st.st_mode, st.st_mtime_ns, data)
    return out


def _serve_and_refuse(s, pool, k, want) -> None:
    """Reads hit bitwise; every write is refused, returns False/0 and is counted."""
    n = len(k)
    assert s.stats()["read_only"] is True
    assert s.batch_exists(k) == n
    got = s.batch_get(k + [b"ro-missing"], list(range(8, 8 + n + 1)))
    assert got == [True] * n + [False]
    for i in range(n):
        assert torch.equal(page_bytes(pool, 8 + i), want[i]), f"page {i}"
    assert s.batch_set(keys(3, "new"), [0, 1, 2]) == [False] * 3
    assert s.delete(k[:2]) == 0
    s.clear()
    s.rescan()
    assert s.batch_get(k, list(range(8, 8 + n))) == [True] * n     # nothing was removed
    st = s.stats()
    assert st["writes_refused"] == 3 + 2 + 1, st
    assert st["set_ok"] == 0 and st["errors"] == 0, st


def test_read_only_setting_serves_reads_and_changes_nothing(tmp_path, pool, caplog):
    root = str(tmp_path / "store")
    k, want = _populate(root, pool)
    probe = FileStore({"root": root}, spec=SPEC)
    probe.close()
    planted = _plant_dead_writers_files(probe.dir, probe._host)
    os.unlink(os.path.join(probe.dir, "manifest.json"))      # not rewritten read-only
    before = _tree(root)
    with caplog.at_level(logging.INFO, logger="kvtier.l3_stores.file"):
        s = FileStore({"root": root, "read_only": True}, spec=SPEC)
        s.attach(pool)
        _serve_and_refuse(s, pool, k, want)
        s.close()
    assert _tree(root) == before, "a read-only store changed its directory"
    assert all(os.path.exists(p) for p in planted)
    said = [r for r in caplog.records if "read-only" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_store_goes_read_only_when_writes_are_refused_erofs(tmp_path, pool, monkeypatch,
                                                             caplog):
    """Every call that would write under the root fails with EROFS (a read-only mount,
    injected): the store opens read-only by itself and never tries to write."""
    root = str(tmp_path / "store")
    k, want = _populate(root, pool)
    before = _tree(root)
    tried: list[str] = []
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def under_root(path, dir_fd=None) -> bool:
        return dir_fd is not None or str(path).startswith(root)

    def refuse(name, real, is_open=False):
        def call(*args, **kwargs):
            path = args[0] if args else ""
            flags = args[1] if is_open and len(args) > 1 else kwargs.get("flags", 0)
            if under_root(path, kwargs.get("dir_fd")) and (not is_open or flags & write_flags):
                tried.append(f"{name} {path}")
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", refuse("open", os.open, is_open=True))
    for name in ("mkdir", "unlink", "rename", "utime", "mkfifo"):
        monkeypatch.setattr(os, name, refuse(name, getattr(os, name)))
    with caplog.at_level(logging.INFO, logger="kvtier.l3_stores.file"):
        s = FileStore({"root": root}, spec=SPEC)
        s.attach(pool)
        opened = list(tried)
        _serve_and_refuse(s, pool, k, want)
        s.close()
    assert tried == opened, f"writes tried after the store went read-only: {tried[len(opened):]}"
    assert len(opened) <= 2, opened                 # the probes that found it read-only
    monkeypatch.undo()
    assert _tree(root) == before
    said = [r for r in caplog.records if "read-only" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "read-only" in s.stats()["read_only_reason"]


def _mount(*args: str) -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0


def test_real_read_only_mount(tmp_path, pool):
    """A tmpfs written, then remounted read-only: the store opens read-only and serves it;
    a store open while the mount goes read-only turns read-only at its next write."""
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    if not _mount("-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", mnt):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights); the read_only "
                    "setting and injected EROFS tests cover the logic")
    stores = []
    try:
        root = os.path.join(mnt, "store")
        k, want = _populate(root, pool)
        live = FileStore({"root": root}, spec=SPEC)          # open while it goes read-only
        stores.append(live)
        live.attach(pool)
        assert live.stats()["read_only"] is False
        assert _mount("-o", "remount,ro", mnt), "remount read-only failed"
        s = FileStore({"root": root}, spec=SPEC)
        stores.append(s)
        s.attach(pool)
        assert "read-only" in s.stats()["read_only_reason"]
        _serve_and_refuse(s, pool, k, want)
        s.close()
        assert live.batch_set(keys(4, "late"), [0, 1, 2, 3]) == [False] * 4
        assert live.stats()["read_only"] is True
        assert live.batch_set(keys(4, "later"), [0, 1, 2, 3]) == [False] * 4
        assert live.stats()["writes_refused"] >= 4
        assert live.batch_get(k, list(range(8, 8 + len(k)))) == [True] * len(k)
        for i in range(len(k)):
            assert torch.equal(page_bytes(pool, 8 + i), want[i])
        live.close()
    finally:
        for st in stores:
            st.close()
        subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
