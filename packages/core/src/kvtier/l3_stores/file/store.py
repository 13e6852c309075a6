"""`file`: KV pages in a directory on local disk, read straight into host pages.

Two formats share this store's directory handling, trailer, checksums, manifest and modes
(``Config.format``): ``segments`` (the default; pages appended into large preallocated
segment files with per-writer index logs, described in ``kvtier.l3_stores.file.segments``) and
``objects``, one file per page, described in ``kvtier.l3_stores.file.objects``.

Read-only (``read_only``; chosen by the store itself when its directory is on a read-only
mount or creating a file there is refused, or when a write fails with ``EROFS``): reads are
served, ``batch_set``/``delete``/``clear()`` are refused (False or 0, counted
``writes_refused``, no error) and nothing in the directory changes -- no manifest, eviction,
cleaning, removal of damaged objects or mtime refresh. One log line says why. A store
directory that does not exist on a read-only root is still a ``StoreError`` (nothing to serve).
"""

from __future__ import annotations

import functools
import os
import stat
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

from ...errors import ConfigError, StoreError
from ...interfaces import INTERFACE_VERSION, Availability
from ...layout import PAGE_FIRST, page_ranges
from . import _files
from .core import log
from .format import (_CHECKSUMS, _NAMESPACE_RE, _OBJECT_RE, _TMP_RE, DIRECT_ALIGN,
                     TRAILER_BYTES, checksum_impl, group_count, group_ends, identity_digest,
                     identity_digests, identity_record, key_filename, layer_groups)
from .objects import _ObjectFormat
from .ranged import PageChains


def _in_use(fn):
    """A public call holds the store open: ``close()`` during it defers closing the store
    directory's descriptor to the last call leaving, so no call ever works relative to a
    closed (or reused) descriptor number."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        self._enter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._leave()
    return wrapper


def auto_io_threads(medium: str) -> int:
    """``io_threads`` 0: 4 on a disk; in memory (tmpfs, ramfs), where each thread's copy runs
    at about one core's rate, one per CPU this process may use, 4 to 16."""
    if medium != "memory":
        return 4
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(4, min(16, cpus))


class FileStore(_ObjectFormat):
    """KV pages on local disk (segment files, or one file per page); checksummed,
    LRU-bounded, multi-process safe."""

    name = "file"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Directory of the store (created). Objects live under ``<root>/<spec fingerprint>``.
        root: str = ""
        #: "segments": pages appended into large preallocated segment files (few large
        #: I/O calls per batch, LRU per segment; see ``kvtier.l3_stores.file.segments``).
        #: "objects": one file per page (LRU per page, a create and a rename per write).
        format: Literal["segments", "objects"] = "segments"
        #: Size of one segment file (``segments`` format), preallocated when it is created;
        #: with a capacity, segments are made no larger than a quarter of it.
        segment_bytes: int = 256 << 20
        #: Bytes of objects (payload + trailer; segments: segment files) to keep before
        #: evicting; None = no limit.
        capacity_bytes: int | None = None
        #: Threads doing file I/O in parallel for one batch; reads and writes have this many
        #: each, so a read never queues behind the pieces of a large write. 0 (the default):
        #: 4, or where the directory is in memory (tmpfs, ramfs) one per CPU this process may
        #: use, 4 to 16: there each thread's copy runs at about one core's rate, and on an
        #: H100 host (16 cores) 16 threads read 22.7-23.0 GB/s against 8's 16.5-17.9
        #: (records/file-store-threads.md); a file L3 on tmpfs read that way took `kvtier demo`
        #: from 67-74% to 72-77% of the measured ideal, its long-context mean TTFT 6.7% lower
        #: in a same-run pair (records/demo-load-while-reading.md).
        io_threads: int = 0
        #: ``segments`` format: read and write calls in flight at once in this store, over
        #: all its threads and callers (0: one per I/O thread). With fewer than
        #: ``io_threads`` the other threads checksum while the disk sees that many large
        #: sequential calls (up to ``io_call_bytes`` each): for a disk that serves one
        #: sequential stream fastest.
        io_depth: int = 0
        #: ``segments`` format: bytes a read or write call aims at. A batch is split over
        #: the I/O threads in calls no smaller than this (where it holds that much); with
        #: ``io_depth``, in calls of this size. In memory (tmpfs) each call's checksum is
        #: taken beside it: calls of about this size, fewer round trips through the
        #: interpreter lock for larger ones (512 KiB keeps the checksum in a core's cache).
        io_call_bytes: int = 8 << 20
        #: ``segments`` format: segments this store appends to at once, each by its own
        #: writer identity, so that the write calls in flight go to different files (0:
        #: ``io_threads`` where the directory is in memory -- tmpfs, ramfs: they serialise
        #: writes to one file -- else 1: a disk takes concurrent writes to one file).
        write_lanes: int = 0
        #: Least payload bytes of a layer group: the unit of a ranged (streamed) read, with
        #: its own running checksum in the object's trailer. A page is split in up to
        #: ``min(8, num_layers)`` groups of at least this many bytes; one under twice this is
        #: one group, read whole only (``read_groups()`` is empty). Each group is one checksum
        #: call per page written, a round trip through the interpreter lock: on a 16-core
        #: H100 host 16 I/O threads wrote 1 MiB pages into tmpfs at 8.1-9.2 GB/s with 8
        #: groups and 13.3-13.9 with one (records/open-targets.md, call 2). 0: always
        #: ``min(8, num_layers)`` groups (format 3's split). Objects record their split, so
        #: stores of different settings read each other's (whole where the splits differ).
        group_bytes: int = 1 << 20
        #: fsync each object (and its directory) before it becomes visible: survives power
        #: loss. Off, a crash can lose recent objects (checksums turn them into misses).
        fsync: bool = False
        #: "auto": O_DIRECT where the filesystem and the host pool's alignment (4 KiB page
        #: addresses and sizes) allow, else the page cache -- stats say which and why; the host
        #: pool already caches pages, a second copy in the page cache only costs memory and
        #: CPU. "on": O_DIRECT or a StoreError; "off": always the page cache.
        o_direct: Literal["off", "auto", "on"] = "auto"
        #: Payload checksum written; readers accept either (the trailer says which).
        checksum: Literal["crc32", "adler32"] = "crc32"
        #: Refresh an object's (a segment's) mtime on a read hit (the LRU order shared
        #: across processes); skipped while it is under a second old (saves a metadata write
        #: per hit).
        touch_on_read: bool = True
        #: With a capacity, rescan the directory (other processes' objects count too) when
        #: a write comes this long after the last scan (objects: in the background).
        rescan_interval_s: float = 30.0
        #: Temporary files older than this are removed even if their writer may live
        #: (segments: another host's writer's newest segment is evictable once this idle).
        stale_tmp_s: float = 600.0
        #: Remove an object found corrupted (segments: zero its slot's trailer), as it
        #: would miss again on every read.
        remove_corrupted: bool = True
        #: Mode of object files (directories get the matching x bits, and the owner's rwx),
        #: set explicitly whatever the umask. Group modes (0o640; 0o660 with
        #: ``allow_shared_root``) share a store within a group.
        file_mode: int = 0o600
        #: Accept a root, store directory or file mode that other users can write to (group-
        #: or world-writable without the sticky bit), and store directories owned by another
        #: user: only for a directory deliberately shared with people trusted with the KV.
        allow_shared_root: bool = False
        #: Identity of the key namespace (e.g. ``PageKeyer.namespace_id``); stores of
        #: different namespaces live in separate directories and never read each other's
        #: objects. Letters, digits, ``_`` and ``-``.
        namespace: str = ""
        #: Serve reads only (a shared snapshot, a warm cache shipped with a model): writes,
        #: deletes and ``clear()`` are refused (False, counted ``writes_refused``) and nothing
        #: in the directory changes (no eviction, cleaning, mtime refresh or manifest). A store
        #: that cannot write its directory (a read-only mount) goes read-only by itself.
        read_only: bool = False

    def __init__(self, config: Any = None, *, spec):
        super().__init__(config, spec=spec)
        c = self.config
        if not c.root:
            raise ConfigError("file.root must name a directory for the store", key="file.root")
        if c.capacity_bytes is not None and c.capacity_bytes < spec.page_bytes + TRAILER_BYTES:
            raise ConfigError(f"file.capacity_bytes={c.capacity_bytes} holds no page of "
                              f"{spec.page_bytes} bytes", key="file.capacity_bytes",
                              value=c.capacity_bytes)
        if c.format not in ("segments", "objects"):
            raise ConfigError(f"file.format must be 'segments' or 'objects', got {c.format!r}",
                              key="file.format", value=c.format)
        if not isinstance(c.segment_bytes, int) or c.segment_bytes < DIRECT_ALIGN:
            raise ConfigError(f"file.segment_bytes must be at least {DIRECT_ALIGN}, got "
                              f"{c.segment_bytes}", key="file.segment_bytes",
                              value=c.segment_bytes)
        if isinstance(c.io_threads, bool) or not isinstance(c.io_threads, int) \
                or c.io_threads < 0:
            raise ConfigError(f"file.io_threads must be an integer >= 0 (0: by the medium), "
                              f"got {c.io_threads!r}", key="file.io_threads", value=c.io_threads)
        for key, lo in (("io_depth", 0), ("io_call_bytes", DIRECT_ALIGN), ("write_lanes", 0),
                        ("group_bytes", 0)):
            v = getattr(c, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"file.{key} must be an integer >= {lo}, got {v!r}",
                                  key=f"file.{key}", value=v)
        if not 0 <= c.file_mode <= 0o777:
            raise ConfigError(f"file.file_mode must be a permission mode, got {c.file_mode:o}",
                              key="file.file_mode", value=c.file_mode)
        if c.namespace and not _NAMESPACE_RE.match(c.namespace):
            raise ConfigError(f"file.namespace must be 1-64 letters, digits, '_' or '-', got "
                              f"{c.namespace!r}", key="file.namespace", value=c.namespace)
        self.root = os.path.abspath(c.root)
        dirname = spec.fingerprint + (f".ns-{c.namespace}" if c.namespace else "")
        self.dir = os.path.join(self.root, dirname)
        self._dir_mode = c.file_mode | ((c.file_mode & 0o444) >> 2) | 0o700
        if self._dir_mode & 0o022 and not c.allow_shared_root:
            raise ConfigError(f"file.file_mode={c.file_mode:o} makes directories other users "
                              "can write to; set file.allow_shared_root=True to share the "
                              "store that way", key="file.allow_shared_root",
                              value=c.file_mode)
        #: The umask would strip bits of file_mode: set modes explicitly after each create.
        self._fix_mode = bool(c.file_mode & _files._current_umask())
        self._host = _files.host_id()
        self._users = 0
        self._closed = False
        self._list_lock = threading.Lock()     # directory listings (see _listdir)
        self._lock = threading.Lock()          # index and counters below
        self._dfd = -1
        self._dfd = self._open_store_dir(dirname)
        #: why the store is read-only ("": it writes); see _go_read_only
        self._ro_reason = ""
        self._ro_lock = threading.Lock()
        if c.read_only:
            self._go_read_only("file.read_only is set", configured=True)
        else:
            why = self._probe_writable()
            if why:
                self._go_read_only(why)
        self.identity = identity_record(spec.fingerprint, c.namespace)
        self._identity = identity_digest(self.identity)
        self._identities = identity_digests(spec.fingerprint, c.namespace)
        n = group_count(spec.num_layers, spec.page_bytes, c.group_bytes)
        self._groups = layer_groups(spec.num_layers, n)
        self._group_ends = group_ends(spec.num_layers, spec.page_bytes, n)
        #: how many groups format 3 split these pages in (its trailers do not say)
        self._v3_groups = group_count(spec.num_layers)
        self._chains = PageChains()
        #: "memory" (tmpfs, ramfs), "disk" or "unknown": in memory, fsync does nothing and is
        #: skipped (stats say so)
        self.medium = _files.medium(self._dfd)
        if not c.io_threads:
            self.config = c = replace(c, io_threads=auto_io_threads(self.medium))
        self._sync = c.fsync and self.medium != "memory"
        self._manifest_state = self._check_manifest()
        self.object_bytes = spec.page_bytes + TRAILER_BYTES
        #: Size of an object written with O_DIRECT: the trailer's block is written whole
        #: (zero padded), which saves a truncate per object; readers accept both sizes.
        self.padded_bytes = -(-self.object_bytes // DIRECT_ALIGN) * DIRECT_ALIGN
        self._sizes = {self.object_bytes, self.padded_bytes}
        self._kind_id = _CHECKSUMS[c.checksum][0]
        self.checksum_provider = checksum_impl(self._kind_id)[1]
        self._host = _files.host_id()
        # relpath -> (mtime_ns, size on disk), least recently used first; _bytes = sum of sizes
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._bytes = 0
        self._last_scan = 0.0
        self._scanning = False
        self._pools: dict[bool, ThreadPoolExecutor] = {}
        self._local = threading.local()
        self._direct, self._direct_reason = False, "off"
        if c.o_direct != "off":
            self._direct, self._direct_reason = \
                self._probe_direct_read() if self.read_only else self._probe_direct()
            if not self._direct:
                if c.o_direct == "on":
                    raise StoreError(f"file: O_DIRECT is not possible in {self.dir}: "
                                     f"{self._direct_reason}", backend=self.name)
                log.info("file: O_DIRECT unavailable in %s (%s); using the page cache",
                         self.dir, self._direct_reason)
        self._direct_pool = False
        self._dir_error: OSError | None = None     # why a directory could not be made
        self._seg: Any = None
        if c.format == "segments":
            from .segments import SegmentFormat
            self._seg = SegmentFormat(self)
        else:
            self._scan()

    # ----- backend metadata -----------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        import tempfile
        if not all(hasattr(os, f) for f in ("preadv", "pwritev")):
            return Availability.unavailable("os.preadv/os.pwritev are missing on this platform")
        try:
            with tempfile.TemporaryDirectory(prefix="kvtier-file-probe-") as d:
                tmp, final = os.path.join(d, "a.tmp"), os.path.join(d, "a")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    _files._pwrite_all(fd, [memoryview(b"kvtier-probe")])
                finally:
                    os.close(fd)
                os.rename(tmp, final)
                buf = bytearray(12)
                fd = os.open(final, os.O_RDONLY)
                try:
                    n = _files._pread_all(fd, [memoryview(buf)])
                finally:
                    os.close(fd)
                if n != 12 or bytes(buf) != b"kvtier-probe":
                    return Availability.unavailable("file round trip read back wrong bytes")
        except OSError as exc:
            return Availability.unavailable(f"cannot write a temporary file: {exc}")
        return Availability.available("local files (pwritev/preadv, atomic rename)")

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        return {"root": os.path.join(workdir, "kvtier-file-store"), "io_threads": 2,
                "capacity_bytes": 256 << 20}

    # ----- attach ---------------------------------------------------------------------------
    def attach(self, host_pool) -> None:
        super().attach(host_pool)
        # Page p's pieces are page 0's shifted by p * stride (both layouts): precompute them
        # once over one byte view of the pool, so a page costs a few slices, not tensor ops.
        spec, n = self.spec, host_pool.num_pages
        first = page_ranges(spec, n, host_pool.layout, 0)
        stride = spec.page_bytes if host_pool.layout == PAGE_FIRST else spec.chunk_bytes
        last = page_ranges(spec, n, host_pool.layout, n - 1)
        if last != [(off + (n - 1) * stride, ln) for off, ln in first]:   # pragma: no cover
            raise StoreError("file: host pool layout is not a fixed stride per page",
                             backend=self.name)
        self._pieces, self._stride = first, stride
        self._raw = memoryview(host_pool.raw.numpy())
        # O_DIRECT needs page addresses and lengths aligned to the device block.
        self._direct_pool = False
        if self._direct:
            why = ""
            if host_pool.layout != PAGE_FIRST:
                why = "the host pool is layer_first (a page is many pieces)"
            elif host_pool.raw.data_ptr() % DIRECT_ALIGN:
                why = f"the host pool's base address is not {DIRECT_ALIGN}-byte aligned"
            elif self.spec.page_bytes % DIRECT_ALIGN:
                why = f"a page of {self.spec.page_bytes} bytes is not a multiple of " \
                      f"{DIRECT_ALIGN}"
            self._direct_pool = not why
            self._direct_reason = "in use" if not why else why
            if why:
                if self.config.o_direct == "on":
                    raise StoreError(f"file: o_direct='on' but {why}", backend=self.name)
                log.info("file: O_DIRECT not used: %s; using the page cache", why)
        if self._seg is not None:
            self._seg.reopen()         # descriptors opened for another pool's alignment

    # ----- public API -----------------------------------------------------------------------
    @_in_use
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        self._check_batch(keys)
        if self._seg is not None:
            return self._seg.exists(keys)
        n = 0
        for key in keys:
            sub, name = key_filename(key)
            sfd = self._sub_fd(sub)
            if sfd < 0:
                break
            try:
                try:
                    st = os.stat(name, dir_fd=sfd, follow_symlinks=False)  # a link is no object
                except OSError:
                    break
                if not stat.S_ISREG(st.st_mode):
                    self._count(errors=1, corrupted=1)
                    self._bump("not_regular")
                    break
                if st.st_size not in self._sizes:
                    self._count(errors=1, corrupted=1)
                    self._bump("truncated" if st.st_size < self.object_bytes else "corrupted")
                    self._remove_bad(sfd, name, st)
                    break
            finally:
                os.close(sfd)
            n += 1
        return n

    @_in_use
    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        self._check_open()
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        if self._seg is not None:
            out = self._seg.get(keys, pages)
        else:
            out = self._map(self._get_one, list(zip(keys, pages)))
            self._order(keys, out)
        hits = sum(out)
        self._count(gets=len(keys), get_hits=hits, bytes_read=hits * self.spec.page_bytes)
        return out

    def read_groups(self) -> tuple[tuple[int, int], ...]:
        """Up to ``min(8, num_layers)`` layer groups of at least ``group_bytes`` each, each
        with its own checksum in the object's trailer (``kvtier.l3_stores.file.format``);
        none where a page is one group. A subclass that overrides ``batch_get`` and not
        ``batch_get_layers`` reads whole pages only: streamed reads must not go around its
        ``batch_get``."""
        cls = type(self)
        if len(self._groups) < 2 or (cls.batch_get is not FileStore.batch_get
                                     and cls.batch_get_layers is FileStore.batch_get_layers):
            return ()
        return self._groups

    @_in_use
    def batch_get_layers(self, keys: Sequence[bytes], host_pages: Sequence[int],
                         group: int, through: int | None = None) -> list[bool]:
        """Read layer groups ``group`` through ``through`` (default: ``group`` alone) of each
        key into its host page as one range, verified on the groups' running checksum
        (``kvtier.l3_stores.file.ranged``); counted ``ranged_reads`` and ``ranged_hits``
        (key-ranges), in ``bytes_read``, and as a page's ``gets`` (its first group) and
        ``get_hits`` (a hit of its last group); the last group of a hit refreshing the
        object's LRU position as ``batch_get`` does."""
        self._check_open()
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        n = len(self.read_groups())
        through = self._check_span(group, through, n)
        a = self._group_ends[group - 1] if group else 0
        b = self._group_ends[through]
        last = through == n - 1
        span = (group, through)
        if self._seg is not None:
            marks = self._seg.get_group(keys, pages, span, a, b, last)
        else:
            marks = self._map(functools.partial(self._get_group_one, span=span, a=a, b=b,
                                                last=last), list(zip(keys, pages)))
        out = []
        changed = 0
        for key, page, m in zip(keys, pages, marks):
            ok = self._chains.settle(page, key, span, last, m)
            changed += ok is None
            out.append(bool(ok))
        if last and self._seg is None:
            self._order(keys, out)
        hits = sum(out)
        # a page read group by group is one get (at its first group), one hit (at its last)
        self._count(bytes_read=hits * (b - a), gets=0 if group else len(keys),
                    get_hits=hits if last else 0)
        self._bump("ranged_reads", len(keys))
        self._bump("ranged_hits", hits)
        if changed:
            self._bump("ranged_version_changes", changed)
        return out

    @_in_use
    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        self._check_open()
        pages = self._check_batch(keys, host_pages)
        n = len(keys)
        if self.read_only:
            self._count(sets=n)
            self._refuse_writes(n)
            return [False] * n
        cap = self.config.capacity_bytes
        size = self._write_size()
        fits = n if cap is None else min(n, cap // size)
        if self._seg is not None:
            out = self._seg.set(keys[:fits], pages[:fits]) + [False] * (n - fits)
            ok = sum(out)
            self._count(sets=n, set_ok=ok, bytes_written=ok * self.spec.page_bytes)
            if n > fits:
                self._bump("over_capacity", n - fits)
            return out
        self._maybe_rescan()
        if fits:
            self._make_room(fits * size, keep={self._rel(k) for k in keys})
        out = self._map(self._set_one, list(zip(keys[:fits], pages[:fits])), writes=True) \
            + [False] * (n - fits)
        self._order(keys, out)
        if cap is not None:
            self._make_room(0, keep=set())  # a rescan may have added other processes' objects
        ok = sum(out)
        self._count(sets=n, set_ok=ok, bytes_written=ok * self.spec.page_bytes)
        if n > fits:
            self._bump("over_capacity", n - fits)
        return out

    @_in_use
    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        self._check_batch(keys)
        if self.read_only:
            self._refuse_writes(len(keys))
            return 0
        if self._seg is not None:
            return self._seg.delete(keys)
        n = 0
        for key in keys:
            sub, name = key_filename(key)
            self._forget(f"{sub}/{name}")
            sfd = self._sub_fd(sub)
            if sfd < 0:
                continue
            try:
                if self._unlink_own(sfd, name, missing_ok=False):
                    n += 1
            finally:
                os.close(sfd)
        return n

    @_in_use
    def clear(self) -> None:
        """Remove every object (and temporary file) of this store's directory. Entries the
        store did not make (other names, directories, links, FIFOs) are left and counted.
        A read-only store removes nothing (counted ``writes_refused``)."""
        self._check_open()
        if self.read_only:
            self._refuse_writes(1)
            return
        if self._seg is not None:
            foreign = self._seg.clear()
            if foreign:
                self._bump("foreign_entries", foreign)
            return
        foreign = 0
        for sub, ok in self._subdirs(all_entries=True):
            if not ok:
                foreign += 1
                continue
            sfd = self._sub_fd(sub)
            if sfd < 0:
                continue
            try:
                for entry in self._entries(sfd):
                    if not (_OBJECT_RE.match(entry.name) or _TMP_RE.match(entry.name)) \
                            or not self._unlink_own(sfd, entry.name, missing_ok=True):
                        foreign += 1
            finally:
                os.close(sfd)
        with self._lock:
            self._index.clear()
            self._bytes = 0
        if foreign:
            self._bump("foreign_entries", foreign)

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        with self._lock:
            d.update(objects=len(self._index), bytes_stored=self._bytes,
                     o_direct=self._direct and self._direct_pool,
                     o_direct_reason=self._direct_reason, root=self.dir,
                     checksum=f"{self.config.checksum} ({self.checksum_provider})",
                     manifest=self._manifest_state, identity=self._identity.hex(),
                     read_only=self.read_only, read_only_reason=self._ro_reason,
                     medium=self.medium, fsync="skipped (in memory)" if self.config.fsync
                     and not self._sync else self.config.fsync)
        d.setdefault("writes_refused", 0)
        for k in ("ranged_reads", "ranged_hits", "ranged_version_changes"):
            d.setdefault(k, 0)
        d["format"] = self.config.format
        if self._seg is not None:
            d.update(self._seg.stats())
        return d

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()
        self._release_dir()

    def __del__(self) -> None:
        fd = getattr(self, "_dfd", -1)
        if fd >= 0:            # unreachable now: no thread can be using the descriptor
            try:
                os.close(fd)
            except OSError:
                pass

    @_in_use
    def rescan(self) -> None:
        """Re-read the directory now (objects of other processes) and enforce capacity."""
        self._check_open()
        if self._seg is not None:
            self._seg.refresh()
            evicted = self._seg.make_room(0, fresh=False)
            if evicted:
                self._count(evictions=evicted)
            return
        self._scan()
        self._make_room(0, keep=set())

    def _write_size(self) -> int:
        """Bytes one object written now takes on disk."""
        if self._seg is not None:
            return int(self._seg.slot_bytes)
        return self.padded_bytes if self._direct and self._direct_pool else self.object_bytes

    def object_nbytes(self) -> int:
        """What one page counts against ``capacity_bytes``: payload, trailer and, with
        O_DIRECT on an aligned pool, the padding to 4 KiB."""
        return self._write_size()
