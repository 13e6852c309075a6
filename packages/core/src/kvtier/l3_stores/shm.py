"""`shm`: a node-local DRAM tier shared by every kvtier process of one identity on a host.

The portable form of UMBP's host pool, with no daemon: each store opens (the first creates)
one shared-memory arena file, ``<root>/<name>-u<uid>.<KVSpec fingerprint>[.ns-<namespace>]
.arena`` (``-g<gid>`` for a group arena), so a page one engine process wrote is a DRAM hit
for every other process of the same identity, and processes of another spec or namespace
never open it. The arena is fixed-size slots of a page each, with its index in the arena;
its layout is `kvtier.l3_stores.shm_format`, and its crash-safe slot protocol (lock-free
seqlock reads, OFD-locked slot claims, reclaiming a killed writer's slot) is described in
`kvtier.l3_stores.shm_arena`.

What a crash costs: nothing but misses. A reader holds no lock; a writer's locks go with its
process, and the slot it was filling reads as a miss until a later write reclaims it. Capacity
(``capacity_bytes`` or ``capacity_pages``) is the slot count, shared by every process; a full
set evicts its least recently used slot.

Backing: a file under ``root`` (``/dev/shm``, tmpfs) by default; with ``hugepages``, a
hugetlbfs mount of 2 MiB pages (``hugetlbfs``, else the first one in /proc/mounts), when one is
there with free pages ("auto"), or an error ("on"). ``stats()`` says which and why.
The arena is allocated in full when created (``posix_fallocate``: a full tmpfs is a
StoreError then, never a SIGBUS later) and mapped with ``MAP_POPULATE`` (``populate``), so
copies take no page faults.

Permissions: the arena is mode 0600 and must belong to this user; with ``group`` it is 0660,
of that group, and may belong to any member. Anything else at the path -- a symlink (never
followed), a FIFO or socket (opened without blocking, refused), another user's file, a mode
that lets others in, a header that is truncated, damaged, of another identity or of another
geometry -- is refused with a `StoreError` (``reason`` says which) when the store is built.
"""

from __future__ import annotations

import grp
import logging
import os
import platform
import re
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from ..errors import ConfigError, StoreError
from ..interfaces import (INTERFACE_VERSION, Availability, HostBuffer, InPlaceReads,
                          L3Store)
from ..layout import PAGE_FIRST, page_ranges
from . import shm_arena
from .shm_arena import BUSY, HIT, OK, TIMEOUT, TORN, Arena, ArenaRefused
from .shm_format import HAS_CRC, HUGE_PAGE, SMALL_PAGE, Geometry

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
DEFAULT_CAPACITY = 1 << 30
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
#: CPUs whose loads and stores stay in program order enough for the generation check alone.
_TSO_MACHINES = ("x86_64", "amd64", "i386", "i686")
_RETRIES = 2                                   # re-reads of a page that changed while copied


def _crc32() -> Any:
    from .file import checksum_impl
    return checksum_impl(1)         # CRC-32 as zlib defines it, the fastest provider here


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, filesystem type, options) of every mount, or [] where unknown."""
    try:
        with open("/proc/self/mounts") as f:
            rows = [ln.split() for ln in f]
    except OSError:
        return []
    return [(r[1].replace("\\040", " "), r[2], r[3]) for r in rows if len(r) >= 4]


def fs_type(path: str) -> str:
    """The filesystem type ``path`` is on ("" if unknown)."""
    real, best, kind = os.path.realpath(path), "", ""
    for mnt, fstype, _ in _mounts():
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, fstype
    return kind


def hugetlbfs_mount(wanted: str = "") -> tuple[str, str]:
    """(a hugetlbfs mount of 2 MiB pages, "") or ("", why there is none)."""
    candidates = [wanted] if wanted else \
        [mnt for mnt, fstype, _ in _mounts() if fstype == "hugetlbfs"]
    if not candidates:
        return "", "no hugetlbfs is mounted (mount -t hugetlbfs -o pagesize=2M none DIR, " \
                   "and set shm.hugetlbfs=DIR)"
    whys = []
    for mnt in candidates:
        try:
            st = os.statvfs(mnt)
        except OSError as exc:
            whys.append(f"{mnt}: {exc.strerror}")
            continue
        if fs_type(mnt) != "hugetlbfs":
            whys.append(f"{mnt} is not a hugetlbfs mount")
        elif st.f_bsize != HUGE_PAGE:
            whys.append(f"{mnt} has {st.f_bsize >> 10} KiB pages, not 2 MiB")
        elif not os.access(mnt, os.W_OK | os.X_OK):
            whys.append(f"{mnt} is not writable here")
        else:
            return mnt, ""
    return "", "; ".join(whys)


def free_huge_pages() -> int | None:
    try:
        with open("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class ShmStore(L3Store):
    """KV pages in a shared-memory arena every process of the same identity on the host
    opens; lock-free reads, crash-safe writes, LRU across processes."""

    name = "shm"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Directory of the arena file: a tmpfs (``/dev/shm``) unless hugepages are used.
        root: str = DEFAULT_ROOT
        #: First part of the arena's file name (letters, digits, ``_``, ``-``); the rest is
        #: the owner (uid, or gid with ``group``), KVSpec fingerprint and namespace.
        name: str = "kvtier"
        #: Identity of the key namespace (e.g. ``PageKeyer.namespace_id``; the cache passes
        #: its own): stores of different namespaces open different arenas.
        namespace: str = ""
        #: Bytes of slots (one page each, rounded up to 4 KiB); default 1 GiB. Or:
        capacity_bytes: int | None = None
        #: ... the number of slots (pages). Every process of the arena must agree.
        capacity_pages: int | None = None
        #: Slots per set: a key lives in one of the ``ways`` slots its digest picks, LRU
        #: within them.
        ways: int = 16
        #: Share the arena with this group (a name or gid; mode 0660) instead of keeping it
        #: to this user (mode 0600).
        group: str = ""
        #: "auto": 2 MiB hugetlbfs pages when a mount with enough free pages is there, else
        #: ``root`` (stats say why), but an arena already in ``root`` is joined there (so
        #: processes share one); "on": hugepages or a StoreError; "off": ``root``.
        hugepages: Literal["off", "auto", "on"] = "auto"
        #: The hugetlbfs mount to use ("" : the first of 2 MiB pages in /proc/mounts).
        hugetlbfs: str = ""
        #: CRC-32 of key digest and payload, written and checked: "auto" is off on x86-64
        #: (the generation check is enough there) and on elsewhere (CPUs that reorder loads).
        #: Readers check any slot that carries one, whatever their own setting.
        checksum: Literal["auto", "off", "crc32"] = "auto"
        #: Map the whole arena up front (``MAP_POPULATE``): no page faults while copying.
        populate: bool = True
        #: Longest wait for a set's lock; past it the page is a counted failed write.
        lock_timeout_s: float = 1.0
        #: Longest wait for another process that is creating the arena.
        open_timeout_s: float = 60.0
        #: Remove the arena file on close when no other process has it open (tests,
        #: short-lived jobs); otherwise it outlives its processes, as /dev/shm files do.
        remove_when_unused: bool = False

    def __init__(self, config: Any = None, *, spec):
        super().__init__(config, spec=spec)
        c = self.config
        for key in ("name", "namespace"):
            v = getattr(c, key)
            if (v or key == "name") and not _NAME_RE.match(v):
                raise ConfigError(f"shm.{key} must be 1-64 letters, digits, '_' or '-', got "
                                  f"{v!r}", key=f"shm.{key}", value=v)
        if c.capacity_bytes is not None and c.capacity_pages is not None:
            raise ConfigError("shm: set capacity_bytes or capacity_pages, not both",
                              key="shm.capacity_pages", value=c.capacity_pages)
        stride = Geometry.plan(spec.page_bytes, 1, 1).stride
        slots = c.capacity_pages if c.capacity_pages is not None else \
            (DEFAULT_CAPACITY if c.capacity_bytes is None else c.capacity_bytes) // stride
        if slots < 1:
            key = "capacity_pages" if c.capacity_pages is not None else "capacity_bytes"
            raise ConfigError(f"shm.{key} holds no page of {spec.page_bytes} bytes (a slot "
                              f"takes {stride})", key=f"shm.{key}", value=getattr(c, key))
        if not 1 <= c.ways <= 1024:
            raise ConfigError(f"shm.ways must be in [1, 1024], got {c.ways}", key="shm.ways",
                              value=c.ways)
        for key in ("lock_timeout_s", "open_timeout_s"):
            if not getattr(c, key) >= 0:
                raise ConfigError(f"shm.{key} must be >= 0, got {getattr(c, key)}",
                                  key=f"shm.{key}", value=getattr(c, key))
        gid = self._group(c.group)
        self._crc_on = c.checksum == "crc32" or (
            c.checksum == "auto" and platform.machine().lower() not in _TSO_MACHINES)
        self._crc, self._crc_provider = _crc32()
        owner = f"g{gid}" if gid is not None else f"u{os.geteuid()}"
        self.file_name = f"{c.name}-{owner}.{spec.fingerprint}" + \
            (f".ns-{c.namespace}" if c.namespace else "") + ".arena"
        mode = 0o660 if gid is not None else 0o600
        self.backing, self.backing_reason = "", ""
        self.arena = self._open_arena(slots, mode, gid)
        self.path = self.arena.path
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        self._pieces: list[tuple[int, int]] = []
        self._stride = 0
        self._base = 0

    # ----- opening ----------------------------------------------------------------------------
    @staticmethod
    def _group(group: str) -> int | None:
        if not group:
            return None
        if group.isdigit():
            return int(group)
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"shm.group: no group named {group!r}", key="shm.group",
                              value=group) from None

    def _check_root(self, root: str) -> None:
        """The user named the root (links to it are followed); it must exist, be a
        directory, and not let other users replace our file (writable by others only with
        the sticky bit, as /dev/shm is)."""
        try:
            st = os.stat(root)
        except OSError as exc:
            raise StoreError(f"shm: root {root} is unusable: {exc.strerror} (shm.root names "
                             "an existing tmpfs directory, /dev/shm by default)",
                             backend=self.name) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise StoreError(f"shm: root {root} is not a directory", backend=self.name)
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise StoreError(f"shm: root {root} is writable by other users without the sticky "
                             "bit: they could replace the arena; use a private directory or "
                             "/dev/shm", backend=self.name)

    def _open_arena(self, slots: int, mode: int, gid: int | None) -> Arena:
        c = self.config
        kw = dict(fingerprint=self.spec.fingerprint, namespace=c.namespace, mode=mode, gid=gid,
                  populate=c.populate, open_timeout_s=c.open_timeout_s)
        why = "hugepages off (shm.hugepages)"
        in_root = os.path.join(os.path.abspath(c.root), self.file_name)
        if c.hugepages == "auto" and os.path.exists(in_root):
            why = f"the arena is in {c.root} already (shared by the processes that use it)"
        elif c.hugepages != "off":
            mount, why = hugetlbfs_mount(c.hugetlbfs)
            geo = Geometry.plan(self.spec.page_bytes, slots, c.ways, HUGE_PAGE)
            free = free_huge_pages()
            if mount and free is not None and \
                    not os.path.exists(os.path.join(mount, self.file_name)) and \
                    free * HUGE_PAGE < geo.file_bytes:
                mount, why = "", f"{free} free 2 MiB pages, the arena needs " \
                    f"{geo.file_bytes // HUGE_PAGE} (raise /proc/sys/vm/nr_hugepages)"
            if mount:
                try:
                    arena = Arena(os.path.join(mount, self.file_name), geo, **kw)
                    self.backing, self.backing_reason = "hugetlbfs-2MiB", f"hugetlbfs at {mount}"
                    return arena
                except ArenaRefused as exc:
                    if c.hugepages == "on" or exc.reason != "no_space":
                        raise
                    why = str(exc)
            if c.hugepages == "on":
                raise StoreError(f"shm: hugepages='on' but {why}", backend=self.name)
            log.info("shm: no 2 MiB hugepages (%s); the arena is in %s", why, c.root)
        root = os.path.abspath(c.root)
        self._check_root(root)
        arena = Arena(os.path.join(root, self.file_name),
                      Geometry.plan(self.spec.page_bytes, slots, c.ways), **kw)
        self.backing = f"{fs_type(root) or 'unknown filesystem'} ({SMALL_PAGE >> 10} KiB pages)"
        self.backing_reason = f"not hugepages: {why}"
        return arena

    # ----- backend metadata -----------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        if shm_arena.F_OFD_SETLK < 0:
            return Availability.unavailable(
                "open file description locks (F_OFD_SETLK) are missing on this platform",
                "the shm store needs Linux 3.15 or later")
        root = DEFAULT_ROOT
        hint = f"mount a tmpfs at {root} (in a container: --shm-size / a memory volume), " \
               "or set shm.root to a tmpfs directory this user can write"
        if not os.path.isdir(root):
            return Availability.unavailable(f"{root} is missing: no POSIX shared memory here",
                                            hint)
        name = os.path.join(root, f".kvtier-shm-probe-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            return Availability.unavailable(f"cannot create a file in {root}: {exc.strerror}",
                                            hint)
        try:
            import mmap
            os.ftruncate(fd, SMALL_PAGE)
            other = os.open(name, os.O_RDWR | os.O_CLOEXEC)
            try:
                if not shm_arena.try_lock(fd, 7) or shm_arena.try_lock(other, 7):
                    return Availability.unavailable("OFD locks do not exclude two open files "
                                                    f"of one file in {root}", hint)
                a = mmap.mmap(fd, SMALL_PAGE)
                b = mmap.mmap(other, SMALL_PAGE)
                a[:12] = b"kvtier-probe"
                ok = b[:12] == b"kvtier-probe"
                a.close()
                b.close()
            finally:
                os.close(other)
            if not ok:
                return Availability.unavailable(f"two mappings of a file in {root} do not "
                                                "share memory", hint)
        except OSError as exc:
            return Availability.unavailable(f"shared mapping in {root} failed: {exc.strerror}",
                                            hint)
        finally:
            os.close(fd)
            os.unlink(name)
        return Availability.available(f"{root} ({fs_type(root) or 'unknown filesystem'}); "
                                      "OFD locks")

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        import hashlib
        tag = hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:12]
        return {"name": f"kvtier-example-{tag}", "capacity_bytes": 16 << 20,
                "remove_when_unused": True}

    def object_nbytes(self) -> int:
        """A slot: the page rounded up to 4 KiB (64 bytes for pages under 4 KiB)."""
        return self.arena.geo.stride

    # ----- attach -----------------------------------------------------------------------------
    def attach(self, host_pool) -> None:
        super().attach(host_pool)
        spec, n = self.spec, host_pool.num_pages
        first = page_ranges(spec, n, host_pool.layout, 0)
        stride = spec.page_bytes if host_pool.layout == PAGE_FIRST else spec.chunk_bytes
        if page_ranges(spec, n, host_pool.layout, n - 1) != \
                [(off + (n - 1) * stride, ln) for off, ln in first]:      # pragma: no cover
            raise StoreError("shm: host pool layout is not a fixed stride per page",
                             backend=self.name)
        self._pieces, self._stride = first, stride
        self._base = host_pool.raw.data_ptr()
        self._raw = memoryview(host_pool.raw.numpy())

    def _page(self, page: int) -> list[tuple[int, int]]:
        base = self._base + page * self._stride
        return [(base + off, ln) for off, ln in self._pieces]

    def _page_crc(self, digest: bytes, page: int) -> int:
        base, raw = page * self._stride, self._raw
        value = self._crc(digest)
        for off, ln in self._pieces:
            value = self._crc(raw[base + off:base + off + ln], value)
        return value & 0xFFFFFFFF

    # ----- reads in place -----------------------------------------------------------------------
    def in_place_reads(self) -> "_ShmInPlace | None":
        """The arena's slots as page-first host pages, for loads straight from the arena
        into device pages (no copy into L2 first); None where a slot is not exactly one page
        (pages that are not a multiple of 4 KiB)."""
        geo = self.arena.geo
        if geo.stride != self.spec.page_bytes:
            self.in_place_why_not = f"a slot ({geo.stride} B) is not exactly a page " \
                f"({self.spec.page_bytes} B): pages of a multiple of 4 KiB only"
            return None
        with self._use():
            return _ShmInPlace(self)

    # ----- public API -------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        with self._use():
            n = 0
            for key in keys:
                if not self.arena.present(self.arena.digest(key)):
                    break
                n += 1
            return n

    def touch(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the arena holds; those it holds become its most recently used
        (the first key the most recent), so that slots about to be read are not the next
        to be evicted. An LRU hint: nothing is held."""
        self._check_batch(keys)
        out = []
        with self._use():
            arena, now = self.arena, time.monotonic_ns()
            for j, key in enumerate(keys):
                i = arena.complete(arena.digest(key))
                if i >= 0:
                    arena.touch(i, now - j)
                out.append(i >= 0)
        return out

    def hold(self, keys: Sequence[bytes]) -> list[int]:
        """Pin every one of ``keys`` the arena holds complete (the shared slot lock in-place
        reads take), so that no writer of any process evicts or changes it until
        `let_go`: pages staged for a request that waits for its turn. Not a read (no read
        counters move); the slots held, in no particular order ([] once closed)."""
        self._check_batch(keys)
        return self._pin(keys, run=False)

    def _pin(self, keys: Sequence[bytes], run: bool) -> list[int]:
        """Pin ``keys``' complete slots: with ``run``, the leading run only, each touched
        (about to be read); else every one present. [] once closed."""
        try:
            self._enter()                 # held while any slot is: the arena stays mapped
        except StoreError:
            return []
        arena, slots, now = self.arena, [], time.monotonic_ns()
        try:
            for j, key in enumerate(keys):
                slot = arena.pin(arena.digest(key))
                if slot < 0 and run:
                    break
                if slot >= 0:
                    if run:
                        arena.touch(slot, now - j)
                    slots.append(slot)
        except (OSError, ValueError, TypeError) as exc:   # a broken mapping or lock call
            log.debug("shm: pinning failed: %s", exc)
            self._count(errors=1)
        finally:
            if not slots:
                self._leave()
        return slots

    def let_go(self, slots: Sequence[int]) -> None:
        """Undo one `hold` (the slots it returned, all of them)."""
        if not slots:
            return
        try:
            for slot in slots:
                self.arena.unpin(slot)
        finally:
            self._leave()

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        counts = dict.fromkeys(("torn_reads", "in_flight", "crc_mismatch", "errors"), 0)
        with self._use():
            now = time.monotonic_ns()
            out = [self._get_one(key, page, now - j, counts)
                   for j, (key, page) in enumerate(zip(keys, pages))]
        hits = sum(out)
        self._count(gets=len(keys), get_hits=hits, bytes_read=hits * self.spec.page_bytes,
                    errors=counts.pop("errors"), corrupted=counts["crc_mismatch"])
        self._bump(counts)
        return out

    def _get_one(self, key: bytes, page: int, stamp: int, counts: dict[str, int]) -> bool:
        arena = self.arena
        d = arena.digest(key)
        try:
            for _ in range(1 + _RETRIES):
                status, slot, word = arena.get(d, self._page(page))
                if status == TORN:
                    counts["torn_reads"] += 1
                    continue
                if status == BUSY:
                    counts["in_flight"] += 1
                if status != HIT:
                    return False
                if word & HAS_CRC and self._page_crc(d.raw, page) != word & 0xFFFFFFFF:
                    counts["crc_mismatch"] += 1
                    counts["errors"] += 1
                    return False
                arena.touch(slot, stamp)
                return True
        except (OSError, ValueError, TypeError) as exc:   # a closed or broken mapping
            counts["errors"] += 1
            log.debug("shm: read failed: %s", exc)
        return False

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages)
        counts = dict.fromkeys(("evictions", "reclaimed", "set_busy", "set_full",
                                "lock_timeouts", "errors"), 0)
        with self._use():
            now = time.monotonic_ns()
            out = [self._set_one(key, page, now - j, counts)
                   for j, (key, page) in enumerate(zip(keys, pages))]
        ok = sum(out)
        self._count(sets=len(keys), set_ok=ok, bytes_written=ok * self.spec.page_bytes,
                    evictions=counts.pop("evictions"), errors=counts.pop("errors"))
        self._bump(counts)
        return out

    def _set_one(self, key: bytes, page: int, stamp: int, counts: dict[str, int]) -> bool:
        arena = self.arena
        d = arena.digest(key)
        try:
            status, slot, odd, what = arena.claim(d, stamp, self.config.lock_timeout_s)
        except OSError as exc:
            counts["errors"] += 1
            log.debug("shm: claiming a slot failed: %s", exc)
            return False
        if status != OK:
            if status == TIMEOUT:
                counts["lock_timeouts"] += 1
                counts["errors"] += 1
            else:
                counts["set_busy" if status == BUSY else "set_full"] += 1
            return False
        if what:
            counts["evictions" if what == "evicted" else "reclaimed"] += 1
        done = False
        try:
            arena.fill(slot, self._page(page))
            word = HAS_CRC | self._page_crc(d.raw, page) if self._crc_on else 0
            arena.publish(slot, odd, word)
            done = True
        finally:
            if not done:
                arena.abandon(slot, odd)
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        n = timeouts = 0
        with self._use():
            for key in keys:
                gone = self.arena.remove(self.arena.digest(key), self.config.lock_timeout_s)
                if gone is None:
                    timeouts += 1
                n += bool(gone)
        if timeouts:
            self._count(errors=timeouts)
            self._bump({"lock_timeouts": timeouts})
        return n

    def clear(self) -> None:
        """Empty every slot of the arena (every process's pages of this identity); slots
        being written at that moment are left to their writers."""
        with self._use():
            _, skipped = self.arena.clear(self.config.lock_timeout_s)
        if skipped:
            self._count(errors=skipped)
            self._bump({"lock_timeouts": skipped})

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        geo = self.arena.geo
        for k in ("torn_reads", "in_flight", "crc_mismatch", "reclaimed", "set_busy",
                  "set_full", "lock_timeouts"):
            d.setdefault(k, 0)
        d.update(path=self.path, backing=self.backing, backing_reason=self.backing_reason,
                 slots=geo.slots, slot_bytes=geo.stride, ways=geo.ways, arena_sets=geo.sets,
                 capacity_bytes=geo.slots * geo.stride, arena_bytes=geo.file_bytes,
                 created=self.arena.created, populate=self.config.populate,
                 checksum=f"crc32 ({self._crc_provider})" if self._crc_on else
                 "off (generation check)")
        with self._lock:
            if not self._closed:
                used = self.arena.used()
                d.update(objects=used, bytes_stored=used * geo.stride)
        return d

    # ----- lifetime -----------------------------------------------------------------------------
    def _use(self) -> "_InUse":
        return _InUse(self)

    def _enter(self) -> None:
        """One more user of the mapping (a call, or slots pinned for reads in place)."""
        with self._lock:
            if self._closed:
                raise StoreError("shm: store is closed", backend=self.name)
            self._users += 1

    def _leave(self) -> None:
        """One user fewer; the last one after close() unmaps the arena."""
        with self._lock:
            self._users -= 1
            last = self._closed and self._users == 0
        if last:
            self._release()

    def _bump(self, counts: dict[str, int]) -> None:
        with self._stats_lock:
            extra = self._stats.extra
            for k, v in counts.items():
                if v:
                    extra[k] = extra.get(k, 0) + v

    def close(self) -> None:
        """Close the store; a call in progress finishes first (the arena is unmapped by the
        last one to leave)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = self._users == 0
        if last:
            self._release()

    def _release(self) -> None:
        self.arena.close(remove_if_unused=self.config.remove_when_unused)

    def __del__(self) -> None:
        arena = getattr(self, "arena", None)
        if arena is not None and arena.fd >= 0 and not getattr(self, "_users", 0):
            arena.close()


class _ShmInPlace(InPlaceReads):
    """`ShmStore.in_place_reads`: the arena's slot region as a host buffer; a pinned slot
    holds a shared lock that keeps every writer off it, and keeps the arena mapped."""

    def __init__(self, store: ShmStore):
        import torch
        self.store = store
        arena, geo = store.arena, store.arena.geo
        self.num_slots = geo.slots
        n = geo.slots * geo.stride
        # over the address, not an export of the mapping: an export would keep the arena
        # mapped (and its open file, with every lock on it) past close(); the store unmaps
        # only once no pinned slot is left, and pins nothing once closed
        import ctypes
        view = torch.frombuffer((ctypes.c_uint8 * n).from_address(arena.data_base),
                                dtype=torch.uint8)
        self.buffer = HostBuffer(arena.data_base, n, view, f"shm arena ({store.backing})",
                                 details={"path": store.path})

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        s = self.store
        s._check_batch(keys)
        slots = s._pin(keys, run=True)   # no unmap under a copy while any is pinned
        s._count(gets=min(len(keys), len(slots) + 1), get_hits=len(slots),
                 bytes_read=len(slots) * s.spec.page_bytes)
        s._bump({"in_place_reads": len(slots)})
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        self.store.let_go(slots)


class _InUse:
    """A public call holds the store open: ``close()`` during it unmaps the arena only when
    the last call leaves, so no copy ever touches an unmapped address."""

    def __init__(self, store: ShmStore):
        self.store = store

    def __enter__(self) -> None:
        self.store._enter()

    def __exit__(self, *exc: object) -> None:
        self.store._leave()
