"""What every part of the `file` store shares: its logger, its state (declared here, set by
``FileStore.__init__`` and ``attach``), read-only mode, counters and error reporting, the use
count that defers closing the store directory, page views and the I/O thread pool."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ...errors import StoreError
from ...interfaces import L3Store
from ...logutil import warn_once

#: One logger for every module of the store (``kvtier.l3_stores.file``): a warning said once
#: is said once for the store.
log = logging.getLogger(__package__)
_R = TypeVar("_R")


def _warn_once(what: str, message: str) -> None:
    warn_once(log, what, message)


class _FileStoreCore(L3Store):
    """The state and helpers every part of ``FileStore`` uses."""

    config: Any
    root: str
    dir: str
    identity: dict[str, Any]
    medium: str
    object_bytes: int
    padded_bytes: int
    checksum_provider: str
    _dir_mode: int
    _fix_mode: bool
    _host: str
    _users: int
    _closed: bool
    _list_lock: threading.Lock
    _lock: threading.Lock
    _dfd: int
    _ro_reason: str
    _ro_lock: threading.Lock
    _identity: bytes
    #: identity digest of each readable object format version (the current one first)
    _identities: dict[int, bytes]
    #: the layer groups of this store's objects, and the payload offset where each ends
    #: (``format.layer_groups``, ``format.group_ends``)
    _groups: tuple[tuple[int, int], ...]
    _group_ends: list[int]
    #: the groups format 3 split these pages in (``format.group_count``)
    _v3_groups: int
    _sync: bool
    _manifest_state: str
    _sizes: set[int]
    _kind_id: int
    _index: OrderedDict[str, tuple[int, int]]
    _bytes: int
    _last_scan: float
    _scanning: bool
    _pools: dict[bool, ThreadPoolExecutor]     # by ``writes``
    _local: threading.local
    _direct: bool
    _direct_reason: str
    _direct_pool: bool
    _dir_error: OSError | None
    _seg: Any
    _pieces: list[tuple[int, int]]
    _stride: int
    _raw: memoryview

    # ----- read-only ------------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        return bool(self._ro_reason)

    def _go_read_only(self, reason: str, configured: bool = False) -> None:
        """Serve reads only from now on; said once per store."""
        with self._ro_lock:
            if self._ro_reason:
                return
            self._ro_reason = reason
        (log.info if configured else log.warning)(
            "file: store %s is read-only (%s): reads are served, writes refused and counted "
            "(writes_refused)", self.dir, reason)

    def _refuse_writes(self, n: int) -> None:
        self._bump("writes_refused", n)

    # ----- in use, closing ------------------------------------------------------------------
    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise StoreError("file: store is closed", backend=self.name)
            self._users += 1

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
        self._release_dir()

    def _release_dir(self) -> None:
        """Close the store directory's descriptor once closed and no call is using it."""
        with self._lock:
            fd = self._dfd if self._closed and self._users == 0 else -1
            if fd >= 0:
                self._dfd = -1
        if fd >= 0:
            if self._seg is not None:
                self._seg.close()
            os.close(fd)

    # ----- helpers ---------------------------------------------------------------------------
    def _views(self, page: int) -> list[memoryview]:
        """Writable byte views of one host page's pieces, in logical order (no copy)."""
        base, raw = page * self._stride, self._raw
        return [raw[base + off:base + off + ln] for off, ln in self._pieces]

    def _map(self, fn: Callable[[Any], _R], items: list, *, writes: bool = False
             ) -> list[_R]:
        """Run ``fn`` over items on the I/O threads, keeping order. Reads and writes have
        ``io_threads`` each: a read never queues behind the pieces of a large write."""
        threads = self.config.io_threads
        if len(items) <= 1 or threads == 1:
            return [fn(it) for it in items]
        pool = self._pools.get(writes)
        if pool is None:
            with self._lock:
                pool = self._pools.get(writes)
                if pool is None:
                    pool = self._pools[writes] = ThreadPoolExecutor(
                        threads, thread_name_prefix="kvtier-file-" + ("w" if writes else "r"))
        # A few items per task: less per-future overhead, still balanced across threads.
        step = max(1, -(-len(items) // (threads * 2)))
        chunks = [items[i:i + step] for i in range(0, len(items), step)]
        return [ok for part in pool.map(lambda c: [fn(it) for it in c], chunks)
                for ok in part]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("file: store is closed", backend=self.name)

    def _bump(self, counter: str, n: int = 1) -> None:
        with self._stats_lock:
            extra = self._stats.extra
            extra[counter] = extra.get(counter, 0) + n

    def _io_error(self, op: str, path: str, exc: OSError) -> None:
        if op == "write" and exc.errno == errno.EROFS:
            self._go_read_only(f"writing {path} failed: {exc.strerror}")
        self._count(errors=1)
        self._bump(f"{op}_errors")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            self._bump("disk_full")
        _warn_once(f"io:{op}:{exc.errno}", f"file: {op} of {path} failed: {exc}; counted as a "
                   "miss (further ones are only counted in stats)")

    def _write_failed(self, path: str, exc: OSError, pages: int) -> None:
        """A write of ``pages`` pages failed: each is a miss and a counted error."""
        if exc.errno == errno.EROFS:
            self._go_read_only(f"writing {path} failed: {exc.strerror}")
        self._count(errors=pages)
        self._bump("write_errors", pages)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            self._bump("disk_full", pages)
        _warn_once(f"io:write:{exc.errno}", f"file: write of {path} failed: {exc}; counted as "
                   "a miss (further ones are only counted in stats)")
