"""`file`: KV pages in a directory on local disk, read straight into host pages.

Two formats share this module's directory handling, trailer, checksums, manifest and modes
(``Config.format``): ``segments`` (the default; pages appended into large preallocated
segment files with per-writer index logs, described in ``kvtier.l3_stores.segments``) and
``objects``, one file per page, described here.

Layout of the ``objects`` format:
``<root>/<KVSpec fingerprint>[.ns-<namespace>]/<xx>/<hex of key>.kvp`` (``xx`` = 256-way
fan-out from a CRC of the key; keys longer than 96 bytes are named by their SHA-256 instead).
File names are hex digits only, so no key can name a path outside the directory.
``manifest.json`` in the store directory records its identity (object format version, KVSpec
fingerprint and geometry, key namespace).

Nothing outside the root is ever read, written or deleted: below the root every entry is
opened relative to a directory descriptor with ``O_NOFOLLOW`` (directories also
``O_DIRECTORY``), so a symlinked store directory is refused (``StoreError.reason``) and a
symlinked fan-out directory is a foreign entry whose keys miss. Opens never wait
(``O_NONBLOCK``): a FIFO, socket, device or directory at an object's path is a counted
corruption and a miss. ``clear()``, eviction and ``delete()`` unlink only regular files named
like the store's objects or temporary files, and count what else they find. Directories are
created 0700 and objects 0600 (``file_mode``) whatever the umask; a root or store directory
other users can write to (group/world-writable without the sticky bit), or a store directory
of another user, is refused unless ``allow_shared_root`` is set.

Each object is the page's bytes followed by a 128-byte trailer: magic, format version, the
KVSpec fingerprint, the SHA-256 of the key, the payload length, a checksum of the payload
(CRC-32 or Adler-32 as zlib defines them; the trailer says which), the store's identity digest
(objects of another format version or namespace are misses) and a CRC-32 of the
trailer itself. The payload comes first so that it starts at offset 0 (aligned for
``O_DIRECT``) and one ``preadv`` lands it in the host page without a copy; objects written
with ``O_DIRECT`` carry zeros after the trailer up to the next 4 KiB. A file that is
truncated, corrupted, foreign (another spec, another key) or of an unknown format is a miss
and a counted error, never wrong KV.

Writes are atomic: a temporary file in the object's directory (``fsync`` if configured), then
``rename`` over the final name, so a reader sees the old object, the new one or none -- never a
torn one, even if the writer is killed. Failed writes (a full disk, a quota) remove the
temporary file and are a miss plus a counted error. Temporary files of dead writers are cleaned
when a store opens the directory (a name whose pid no process can have is a dead writer's:
``kvtier.l3_stores._files``). A damaged manifest (not JSON, not an object, nested deeper than
the parser goes) is rewritten.

Capacity is enforced by evicting the least recently used objects; "use" is the file's mtime,
refreshed on every read hit, so several processes sharing one directory share one LRU order.
Each process keeps an in-memory index (built by scanning the directory at open, and again in
the background every ``rescan_interval_s`` while writing) and re-checks a victim's mtime before
deleting it. A page whose read fails after it started (corrupted object) holds unspecified
bytes; a plain miss leaves the page untouched.

Read-only (``read_only``; chosen by the store itself when its directory is on a read-only
mount or creating a file there is refused, or when a write fails with ``EROFS``): reads are
served, ``batch_set``/``delete``/``clear()`` are refused (False or 0, counted
``writes_refused``, no error) and nothing in the directory changes -- no manifest, eviction,
cleaning, removal of damaged objects or mtime refresh. One log line says why. A store
directory that does not exist on a read-only root is still a ``StoreError`` (nothing to serve).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import importlib
import json
import logging
import mmap
import os
import re
import reprlib
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence, TypeVar


from ..errors import ConfigError, StoreError
from ..logutil import warn_once
from ..interfaces import INTERFACE_VERSION, Availability, L3Store
from ..layout import PAGE_FIRST, page_ranges
from . import _files

log = logging.getLogger(__name__)
_R = TypeVar("_R")

MAGIC = b"KVTIERPG"
FORMAT_VERSION = 2         # 2: the trailer carries the store's identity digest
MANIFEST = "manifest.json"
_MANIFEST_MAX = 1 << 16
SUFFIX = ".kvp"
TMP_SUFFIX = ".tmp"
DIRECT_ALIGN = 4096
MAX_HEX_KEY = 96           # longer keys are named by their SHA-256 (file names <= 255 bytes)
_IOV_MAX = 1024

# magic, version, trailer length, checksum kind, spec fingerprint, sha256(key), payload length,
# payload checksum, identity digest -- then reserved zeros and a CRC-32 of everything before it.
_FIELDS = struct.Struct("<8sHHI16s32sQI16s")
TRAILER_BYTES = 128
_PAD_ZEROS = bytes(DIRECT_ALIGN - TRAILER_BYTES)
_TOUCH_NS = 1_000_000_000
_RESERVED = TRAILER_BYTES - _FIELDS.size - 4
#: Checksum kinds recorded in the trailer: name -> (id, initial value).
_CHECKSUMS: dict[str, tuple[int, int]] = {"crc32": (1, 0), "adler32": (2, 1)}
_CHECKSUM_NAME = {kid: name for name, (kid, _) in _CHECKSUMS.items()}
_CHECKSUM_START = {kid: start for kid, start in _CHECKSUMS.values()}
#: Bit-compatible implementations, fastest first: ISA-L and zlib-ng compute the very same
#: CRC-32/Adler-32 several times faster than the system zlib (ISA-L is a dependency where it
#: has wheels), so objects stay readable by every installation.
_PROVIDERS = (("isal", "isal.isal_zlib"), ("zlib-ng", "zlib_ng.zlib_ng"), ("zlib", "zlib"))
_impl_cache: dict[int, tuple[Callable[..., int], str]] = {}
#: Names the store creates in a fan-out directory: objects (hex of the key, or "h" + its
#: SHA-256) and temporary files (a leading dot). Anything else is a foreign entry, left alone.
_OBJECT_RE = re.compile(r"(?:[0-9a-f]{2,%d}|h[0-9a-f]{64})\.kvp\Z" % (2 * MAX_HEX_KEY))
_TMP_RE = re.compile(r"\.[0-9a-z.]+-[0-9]+\.[0-9a-z]+\.tmp\Z")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}\Z")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: Opening any entry: never follow a link, never wait (a FIFO opens at once, fstat tells).
_OPEN_FLAGS = os.O_CLOEXEC | _NOFOLLOW | os.O_NONBLOCK
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS
#: A directory the store cannot write (a read-only mount, no permission): read-only.
_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)



def _warn_once(what: str, message: str) -> None:
    warn_once(log, what, message)


def key_filename(key: bytes) -> tuple[str, str]:
    """(fan-out directory, file name) of a key: hex digits only, never a path separator."""
    name = key.hex() if len(key) <= MAX_HEX_KEY else "h" + hashlib.sha256(key).hexdigest()
    return f"{zlib.crc32(key) & 0xFF:02x}", name + SUFFIX


def checksum_impl(kind_id: int) -> tuple[Callable[..., int], str]:
    """(function, provider) computing checksum ``kind_id``: the fastest bit-compatible one
    importable here, checked against the stdlib on a known input before it is trusted."""
    hit = _impl_cache.get(kind_id)
    if hit is not None:
        return hit
    name = _CHECKSUM_NAME[kind_id]
    ref = getattr(zlib, name)
    probe = bytes(range(256)) * 40
    for provider, module in _PROVIDERS:
        try:
            fn = getattr(importlib.import_module(module), name)
            if fn(probe) == ref(probe) and fn(probe[7:], fn(probe[:7])) == ref(probe):
                _impl_cache[kind_id] = (fn, provider)
                return fn, provider
        except (ImportError, OSError, AttributeError, TypeError):
            continue
    _impl_cache[kind_id] = (ref, "zlib")
    return ref, "zlib"


def _checksum(kind_id: int, bufs: Sequence[memoryview]) -> int:
    fn = checksum_impl(kind_id)[0]
    value = _CHECKSUM_START[kind_id]
    for b in bufs:
        value = fn(b, value)
    return value & 0xFFFFFFFF


def identity_record(fingerprint: str, namespace: str = "") -> dict[str, Any]:
    """What a store directory's objects depend on and the store can know: the object format,
    the KVSpec (geometry, dtype, page size) and the key namespace it was given, if any."""
    return {"format": FORMAT_VERSION, "spec": fingerprint, "namespace": namespace}


def identity_digest(record: dict[str, Any]) -> bytes:
    blob = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvtier.file.identity" + blob).digest()[:16]


def pack_trailer(fingerprint: str, key: bytes, payload_len: int, kind_id: int,
                 payload_sum: int, identity: bytes = b"") -> bytes:
    head = _FIELDS.pack(MAGIC, FORMAT_VERSION, TRAILER_BYTES, kind_id,
                        fingerprint.encode("ascii")[:16].ljust(16, b"\0"),
                        hashlib.sha256(key).digest(), payload_len, payload_sum,
                        identity[:16].ljust(16, b"\0"))
    head += bytes(_RESERVED)
    return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


class _Bad(Exception):
    """An object that must not be trusted; ``kind`` names the stats counter."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


def check_trailer(raw: bytes, fingerprint: str, key: bytes, payload_len: int,
                  identity: bytes = b"", key_digest: bytes | None = None) -> tuple[int, int]:
    """Validate a trailer (of ``key``, or of the key whose SHA-256 is ``key_digest``);
    returns (checksum kind, payload checksum) or raises _Bad."""
    if len(raw) != TRAILER_BYTES:
        raise _Bad("truncated", f"trailer of {len(raw)} bytes")
    want_digest = key_digest
    (magic, version, tlen, kind_id, fp, key_digest, plen, psum, ident) = \
        _FIELDS.unpack_from(raw)
    if magic != MAGIC:
        raise _Bad("corrupted", "bad magic")
    if struct.unpack_from("<I", raw, TRAILER_BYTES - 4)[0] != \
            zlib.crc32(raw[:TRAILER_BYTES - 4]) & 0xFFFFFFFF:
        raise _Bad("corrupted", "trailer checksum mismatch")
    if version != FORMAT_VERSION or tlen != TRAILER_BYTES or kind_id not in _CHECKSUM_NAME:
        raise _Bad("foreign", f"unknown format version {version} / checksum {kind_id}")
    if fp.rstrip(b"\0") != fingerprint.encode("ascii")[:16]:
        raise _Bad("foreign", f"KVSpec fingerprint {fp!r} is not {fingerprint}")
    if key_digest != (hashlib.sha256(key).digest() if want_digest is None else want_digest):
        raise _Bad("foreign", "object belongs to another key")
    if plen != payload_len:
        raise _Bad("foreign", f"payload of {plen} bytes, pages have {payload_len}")
    if ident != identity[:16].ljust(16, b"\0"):
        raise _Bad("foreign", "object of another store identity (namespace or format)")
    return kind_id, psum


def _pwrite_all(fd: int, bufs: list[memoryview], offset: int = 0) -> None:
    """pwritev every byte of ``bufs`` (retrying short writes).

    A short write on an O_DIRECT descriptor (a resource limit was hit part way) would leave
    the rest unaligned, so the descriptor drops O_DIRECT first: the retry then either
    finishes or fails with the real reason (ENOSPC, EFBIG), not EINVAL."""
    while bufs:
        n = os.pwritev(fd, bufs[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:]] + bufs[1:]
        if bufs and offset % DIRECT_ALIGN:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & getattr(os, "O_DIRECT", 0):
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)


def _pread_all(fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """preadv into ``bufs`` until full or end of file; returns bytes read (an O_DIRECT read
    that reached an end of file not on a block boundary ends there)."""
    total = 0
    while bufs:
        try:
            n = os.preadv(fd, bufs[:_IOV_MAX], offset)
        except OSError as exc:
            if total and exc.errno == errno.EINVAL:
                return total     # O_DIRECT, stopped at an unaligned end of file
            raise
        if n <= 0:
            return total
        total += n
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:]] + bufs[1:]
    return total


def _current_umask() -> int:
    """This process's umask, read without changing it (os.umask would race other threads);
    where it cannot be read, assume the strictest so modes are always set explicitly."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777


_host_id = _files.host_id
_pid_alive = _files.pid_alive


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


class FileStore(L3Store):
    """KV pages on local disk (segment files, or one file per page); checksummed,
    LRU-bounded, multi-process safe."""

    name = "file"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Directory of the store (created). Objects live under ``<root>/<spec fingerprint>``.
        root: str = ""
        #: "segments": pages appended into large preallocated segment files (few large
        #: I/O calls per batch, LRU per segment; see ``kvtier.l3_stores.segments``).
        #: "objects": one file per page (LRU per page, a create and a rename per write).
        format: Literal["segments", "objects"] = "segments"
        #: Size of one segment file (``segments`` format), preallocated when it is created;
        #: with a capacity, segments are made no larger than a quarter of it.
        segment_bytes: int = 256 << 20
        #: Bytes of objects (payload + trailer; segments: segment files) to keep before
        #: evicting; None = no limit.
        capacity_bytes: int | None = None
        #: Threads doing file I/O in parallel for one batch.
        io_threads: int = 4
        #: ``segments`` format: read and write calls in flight at once in this store, over
        #: all its threads and callers (0: one per I/O thread). With fewer than
        #: ``io_threads`` the other threads checksum while the disk sees that many large
        #: sequential calls (up to ``io_call_bytes`` each): for a disk that serves one
        #: sequential stream fastest.
        io_depth: int = 0
        #: ``segments`` format: bytes a read or write call aims at. A batch is split over
        #: the I/O threads in calls no smaller than this (where it holds that much); with
        #: ``io_depth``, in calls of this size.
        io_call_bytes: int = 8 << 20
        #: ``segments`` format: segments this store appends to at once, each by its own
        #: writer identity, so that the write calls in flight go to different files (0:
        #: ``io_threads`` where the directory is in memory -- tmpfs, ramfs: they serialise
        #: writes to one file -- else 1: a disk takes concurrent writes to one file).
        write_lanes: int = 0
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
        if c.io_threads < 1:
            raise ConfigError(f"file.io_threads must be >= 1, got {c.io_threads}",
                              key="file.io_threads", value=c.io_threads)
        for key, lo in (("io_depth", 0), ("io_call_bytes", DIRECT_ALIGN), ("write_lanes", 0)):
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
        self._fix_mode = bool(c.file_mode & _current_umask())
        self._host = _host_id()
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
        #: "memory" (tmpfs, ramfs), "disk" or "unknown": in memory, fsync does nothing and is
        #: skipped (stats say so)
        self.medium = _files.medium(self._dfd)
        self._sync = c.fsync and self.medium != "memory"
        self._manifest_state = self._check_manifest()
        self.object_bytes = spec.page_bytes + TRAILER_BYTES
        #: Size of an object written with O_DIRECT: the trailer's block is written whole
        #: (zero padded), which saves a truncate per object; readers accept both sizes.
        self.padded_bytes = -(-self.object_bytes // DIRECT_ALIGN) * DIRECT_ALIGN
        self._sizes = {self.object_bytes, self.padded_bytes}
        self._kind_id = _CHECKSUMS[c.checksum][0]
        self.checksum_provider = checksum_impl(self._kind_id)[1]
        self._host = _host_id()
        # relpath -> (mtime_ns, size on disk), least recently used first; _bytes = sum of sizes
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._bytes = 0
        self._last_scan = 0.0
        self._scanning = False
        self._pool: ThreadPoolExecutor | None = None
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
                    _pwrite_all(fd, [memoryview(b"kvtier-probe")])
                finally:
                    os.close(fd)
                os.rename(tmp, final)
                buf = bytearray(12)
                fd = os.open(final, os.O_RDONLY)
                try:
                    n = _pread_all(fd, [memoryview(buf)])
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

    # ----- the root, the store directory, the manifest --------------------------------------
    def _refuse(self, message: str, reason: str) -> StoreError:
        err = StoreError(f"file: {message}", backend=self.name)
        err.reason = reason          # type: ignore[attr-defined]
        return err

    def _check_dir(self, fd: int, path: str, created: bool, what: str) -> None:
        """A directory of the store must be ours and writable by no one else (unless the user
        opted in); one this store created gets its modes set explicitly."""
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):                      # pragma: no cover (O_DIRECTORY)
            raise self._refuse(f"{path} is not a directory", "not_a_directory")
        if created:
            os.fchmod(fd, self._dir_mode)
            return
        if self.config.allow_shared_root:
            return
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_mode & 0o022 and not (what == "root" and sticky):
            who = "everyone" if st.st_mode & 0o002 else "its group"
            raise ConfigError(f"file: {what} {path} is writable by {who} (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): another user could plant or "
                              "swap objects; use a private directory, or set "
                              "file.allow_shared_root=True to share it deliberately",
                              key="file.allow_shared_root", value=path)
        if what != "root" and st.st_uid != os.geteuid():
            raise ConfigError(f"file: {what} {path} belongs to uid {st.st_uid}, not to this "
                              "process; set file.allow_shared_root=True to share it",
                              key="file.allow_shared_root", value=path)

    def _open_root(self) -> int:
        """Open (creating with explicit modes) the root; the user named it, so links on the
        way to it are followed -- nothing below it ever is."""
        missing = []
        path = self.root
        while not os.path.isdir(path):
            if os.path.lexists(path) and not os.path.islink(path):
                raise StoreError(f"file: cannot create store root {self.root}: {path} is not "
                                 "a directory", backend=self.name)
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for path in reversed(missing):
            try:
                os.mkdir(path, self._dir_mode)
            except FileExistsError:
                continue
            except OSError as exc:
                raise StoreError(f"file: cannot create store root {self.root}: {exc}",
                                 backend=self.name) from exc
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | _NOFOLLOW)
            try:
                os.fchmod(fd, self._dir_mode)
            finally:
                os.close(fd)
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(f"file: cannot open store root {self.root}: {exc}",
                             backend=self.name) from exc
        try:
            self._check_dir(fd, self.root, self.root in missing, "root")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_store_dir(self, name: str) -> int:
        rfd = self._open_root()
        try:
            created = False
            refused: OSError | None = None
            try:
                os.mkdir(name, self._dir_mode, dir_fd=rfd)
                created = True
            except FileExistsError:
                pass
            except OSError as exc:
                if exc.errno not in _READ_ONLY_ERRNOS:
                    raise StoreError(f"file: cannot create store directory {self.dir}: "
                                     f"{exc}", backend=self.name) from exc
                refused = exc          # a read-only root: an existing directory still serves
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=rfd)
            except FileNotFoundError as exc:
                raise StoreError(f"file: cannot create store directory {self.dir}: "
                                 f"{refused or exc}", backend=self.name) from exc
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = "a symlink" if os.path.islink(self.dir) else "not a directory"
                    raise self._refuse(
                        f"store directory {self.dir} is {kind}; refusing to follow it (a "
                        "store never reads, writes or deletes outside its root)",
                        "symlinked_directory" if kind == "a symlink" else "not_a_directory"
                    ) from exc
                raise StoreError(f"file: cannot open store directory {self.dir}: {exc}",
                                 backend=self.name) from exc
            try:
                self._check_dir(fd, self.dir, created, "store directory")
            except BaseException:
                os.close(fd)
                raise
            return fd
        finally:
            os.close(rfd)

    def _read_manifest(self) -> dict | None:
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | _OPEN_FLAGS, dir_fd=self._dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return {"unreadable": str(exc)}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MANIFEST_MAX:
                return {"unreadable": "not a small regular file"}
            raw = os.pread(fd, _MANIFEST_MAX, 0)
        finally:
            os.close(fd)
        try:
            rec = json.loads(raw)
            return rec if isinstance(rec, dict) else {"unreadable": "not a JSON object"}
        except ValueError:
            return {"unreadable": "not JSON"}
        except RecursionError:        # nested deeper than the parser goes: damaged too
            return {"unreadable": "nested too deeply"}

    def _write_manifest(self) -> None:
        rec = {"kvtier_file_store": True, "identity": self.identity,
               "identity_digest": self._identity.hex(), "spec": self.spec.to_dict(),
               "object": {"payload_bytes": self.spec.page_bytes,
                          "trailer_bytes": TRAILER_BYTES, "suffix": SUFFIX}}
        blob = (json.dumps(rec, indent=1, sort_keys=True) + "\n").encode()
        tmp = f".{MANIFEST}.{self._host}-{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS,
                     self.config.file_mode, dir_fd=self._dfd)
        try:
            if self._fix_mode:
                os.fchmod(fd, self.config.file_mode)
            os.write(fd, blob)
            if self._sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, MANIFEST, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        except OSError:
            os.unlink(tmp, dir_fd=self._dfd)
            raise

    def _check_manifest(self) -> str:
        """The directory's manifest names the identity of its objects; write ours if there is
        none (or it is unreadable). Another identity's manifest is kept and reported: its
        objects (and any of ours of another identity) are misses through their trailers."""
        rec = self._read_manifest()
        if rec is not None and "unreadable" not in rec:
            if rec.get("identity") == self.identity:
                return "ok"
            _warn_once("manifest", f"file: {self.dir} holds objects of another identity "
                       f"({reprlib.repr(rec.get('identity'))}, this store is "
                       f"{self.identity!r}); they "
                       "are misses")
            return "other identity"
        if self.read_only:
            return "missing (read-only)" if rec is None else "damaged (read-only)"
        try:
            self._write_manifest()
        except OSError as exc:
            log.warning("file: cannot write the manifest of %s: %s", self.dir, exc)
            return f"not written: {exc.strerror}"
        return "ok" if rec is None else "rewritten"

    def _probe_writable(self) -> str:
        """Why this store cannot write its directory ("" if it can): a read-only mount, or
        creating a file there refused (EROFS, EACCES, EPERM). Other failures (a full disk)
        are not read-only: writes then fail and are counted, and may succeed later."""
        try:
            if os.fstatvfs(self._dfd).f_flag & getattr(os, "ST_RDONLY", 0):
                return f"{self.dir} is on a read-only filesystem"
        except OSError:
            pass
        name = f".write-probe.{self._host}-{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600,
                         dir_fd=self._dfd)
        except OSError as exc:
            if exc.errno in _READ_ONLY_ERRNOS:
                return f"cannot write {self.dir} ({exc.strerror}): read-only"
            return ""
        os.close(fd)
        try:
            os.unlink(name, dir_fd=self._dfd)
        except OSError:
            pass
        return ""

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

    def _probe_direct_read(self) -> tuple[bool, str]:
        """O_DIRECT for a read-only store: an aligned read of the manifest, if any."""
        if not hasattr(os, "O_DIRECT"):
            return False, "this platform has no O_DIRECT"
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | os.O_DIRECT | _OPEN_FLAGS, dir_fd=self._dfd)
        except OSError as exc:
            return False, f"no O_DIRECT read of {MANIFEST} to try ({exc.strerror})"
        blk = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            os.preadv(fd, [memoryview(blk)], 0)
        except OSError as exc:
            return False, f"O_DIRECT read refused: {exc.strerror}"
        finally:
            os.close(fd)
            blk.close()
        return True, "available"

    def _probe_direct(self) -> tuple[bool, str]:
        """Can this directory's filesystem do O_DIRECT I/O? (ok, reason)."""
        if not hasattr(os, "O_DIRECT"):
            return False, "this platform has no O_DIRECT"
        path = f".odirect-probe.{self._host}-{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        blk = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT,
                         0o600, dir_fd=self._dfd)
        except OSError as exc:
            return False, f"open with O_DIRECT refused: {exc.strerror}"
        try:
            blk[:16] = b"kvtier-o-direct!"
            if os.pwritev(fd, [memoryview(blk)], 0) != DIRECT_ALIGN:
                return False, "short O_DIRECT write"
            blk[:16] = bytes(16)
            if os.preadv(fd, [memoryview(blk)], 0) != DIRECT_ALIGN \
                    or blk[:16] != b"kvtier-o-direct!":
                return False, "O_DIRECT read back wrong data"
        except OSError as exc:
            return False, f"O_DIRECT I/O refused: {exc.strerror}"
        finally:
            os.close(fd)
            try:
                os.unlink(path, dir_fd=self._dfd)
            except OSError:
                pass
            blk.close()
        return True, "available"

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
        out = self._map(self._set_one, list(zip(keys[:fits], pages[:fits]))) + [False] * (n - fits)
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
        d["format"] = self.config.format
        if self._seg is not None:
            d.update(self._seg.stats())
        return d

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._release_dir()

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

    def __del__(self) -> None:
        fd = getattr(self, "_dfd", -1)
        if fd >= 0:            # unreachable now: no thread can be using the descriptor
            try:
                os.close(fd)
            except OSError:
                pass

    # ----- paths and the index ---------------------------------------------------------------
    def _rel(self, key: bytes) -> str:
        sub, name = key_filename(key)
        return f"{sub}/{name}"

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, self._rel(key))

    def _sub_fd(self, sub: str, create: bool = False, count: bool = True) -> int:
        """A descriptor of fan-out directory ``sub`` (opened below the store directory's
        descriptor, never through a link), or -1: missing, a foreign entry, or (``create``)
        a directory that cannot be made (counted unless not ``count``; the error is kept in
        ``_dir_error``)."""
        try:
            return os.open(sub, _DIR_FLAGS, dir_fd=self._dfd)
        except FileNotFoundError:
            if not create:
                return -1
        except OSError as exc:
            self._foreign_dir(sub, exc)
            return -1
        try:
            os.mkdir(sub, self._dir_mode, dir_fd=self._dfd)
            made = True
        except FileExistsError:
            made = False
        except OSError as exc:     # no inodes left, a read-only mount: a counted failed write
            self._dir_error = exc
            if count:
                self._io_error("write", os.path.join(self.dir, sub), exc)
            return -1
        try:
            fd = os.open(sub, _DIR_FLAGS, dir_fd=self._dfd)
        except OSError as exc:
            self._foreign_dir(sub, exc)
            return -1
        if made:
            os.fchmod(fd, self._dir_mode)
        return fd

    def _foreign_dir(self, sub: str, exc: OSError) -> None:
        self._count(errors=1)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            self._bump("foreign_entries")
            _warn_once(f"foreign-dir:{sub}", f"file: {os.path.join(self.dir, sub)} is not a "
                       "directory of this store (a link or another file); never followed, its "
                       "keys are misses")
        else:
            self._bump("io_errors")
            _warn_once(f"dir:{exc.errno}", f"file: opening {os.path.join(self.dir, sub)} "
                       f"failed: {exc}")

    def _unlink_own(self, sfd: int, name: str, missing_ok: bool = True) -> bool:
        """Unlink ``name`` in a fan-out directory only if it is a regular file (objects and
        temporary files are; a link, FIFO or directory of the same name is left alone)."""
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return False
            os.unlink(name, dir_fd=sfd)
            return True
        except FileNotFoundError:
            return missing_ok
        except OSError:
            return False

    def _subdirs(self, all_entries: bool = False) -> list:
        """Fan-out directory names (with ``all_entries``: (name, is a real directory) of every
        two-hex-digit entry, so foreign ones can be counted)."""
        try:
            found = [(e.name, e.is_dir(follow_symlinks=False)) for e in self._listdir(self._dfd)
                     if _FANOUT_RE.match(e.name)]
        except OSError:
            return []
        return found if all_entries else [name for name, ok in found if ok]

    def _listdir(self, dfd: int) -> list[os.DirEntry]:
        """The entries of the open directory ``dfd`` (OSError as raised). Listings of the
        store's directories take turns: ``os.scandir`` of a descriptor reads through a
        duplicate that shares the descriptor's offset, so two threads listing one directory
        at once each get part of it (and would take the rest for gone)."""
        with self._list_lock, os.scandir(dfd) as it:
            return list(it)

    def _entries(self, sfd: int) -> list[os.DirEntry]:
        try:
            return self._listdir(sfd)
        except OSError:
            return []

    def _scan(self) -> None:
        """Rebuild the index from the directory (LRU order = mtime); clean dead tmp files.

        Objects this process noted while the scan ran are kept with their newer times."""
        started = time.time_ns()
        found: dict[str, tuple[int, int]] = {}
        now = time.time()
        for base in self._subdirs():
            sfd = self._sub_fd(base)
            if sfd < 0:
                continue
            try:
                for e in self._entries(sfd):
                    try:
                        st = os.stat(e.name, dir_fd=sfd, follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if _OBJECT_RE.match(e.name):
                        if st.st_size in self._sizes:
                            found[f"{base}/{e.name}"] = (st.st_mtime_ns, st.st_size)
                    elif _TMP_RE.match(e.name) and not self.read_only and \
                            self._tmp_is_stale(e.name, st, now):
                        if self._unlink_own(sfd, e.name, missing_ok=False):
                            self._bump("tmp_cleaned")
            finally:
                os.close(sfd)
        with self._lock:
            for rel, (mt, size) in self._index.items():
                if mt >= started and mt > found.get(rel, (-1, 0))[0]:
                    found[rel] = (mt, size)
            self._index = OrderedDict(sorted(found.items(), key=lambda kv: kv[1][0]))
            self._bytes = sum(size for _, size in self._index.values())
            self._last_scan = time.monotonic()

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

    def _maybe_rescan(self) -> None:
        """With a capacity, rescan in the background every ``rescan_interval_s``: other
        processes' objects count against the shared capacity too."""
        if self.config.capacity_bytes is None:
            return
        with self._lock:
            if self._scanning or \
                    time.monotonic() - self._last_scan < self.config.rescan_interval_s:
                return
            self._scanning = True
            self._users += 1                  # released by the scan thread
        threading.Thread(target=self._background_scan, name="kvtier-file-scan",
                         daemon=True).start()

    def _background_scan(self) -> None:
        try:
            if not self._closed:
                self._scan()
                self._make_room(0, keep=set())
        except Exception as exc:    # surfaced in stats and the log, never lost
            self._count(errors=1)
            self._bump("scan_errors")
            log.warning("file: rescanning %s failed: %s", self.dir, exc)
        finally:
            with self._lock:
                self._scanning = False
            self._leave()

    def _tmp_is_stale(self, name: str, st: os.stat_result, now: float) -> bool:
        if now - st.st_mtime > self.config.stale_tmp_s:
            return True
        parts = name.split(".")        # .<object>.<host>-<pid>.<rand>.tmp
        if len(parts) >= 4:
            host, _, pid = parts[-3].partition("-")
            if host == self._host and pid.isdigit():
                return not _files.pid_alive(pid)
        return False

    def _make_room(self, need: int, keep: set[str]) -> None:
        """Evict least recently used objects until ``need`` more bytes fit in capacity."""
        cap = self.config.capacity_bytes
        if cap is None or self.read_only:
            return
        with self._lock:
            kept = sum(self._index[k][1] for k in keep if k in self._index)  # overwritten
            budget = 2 * len(self._index) + 1              # every victim seen at most twice
        evicted = 0
        for _ in range(budget):
            with self._lock:
                if self._bytes - kept + need <= cap:
                    break
                victim = next((k for k in self._index if k not in keep), None)
                if victim is None:
                    break
                recorded, vsize = self._index.pop(victim)
                self._bytes -= vsize
            sub, name = victim.split("/")
            sfd = self._sub_fd(sub)
            if sfd < 0:
                continue
            try:
                try:
                    st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                except OSError:
                    continue                          # another process removed it
                if not stat.S_ISREG(st.st_mode):
                    continue                          # replaced by a foreign entry: not ours
                if st.st_mtime_ns > recorded:         # read by another process since: keep it
                    self._note(victim, st.st_mtime_ns, st.st_size)
                    continue
                try:
                    os.unlink(name, dir_fd=sfd)
                    evicted += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    self._count(errors=1)
                    log.debug("file: evicting %s failed: %s", victim, exc)
            finally:
                os.close(sfd)
        if evicted:
            self._count(evictions=evicted)

    def _note(self, rel: str, mtime_ns: int, size: int) -> None:
        """Record an object as the most recently used."""
        with self._lock:
            old = self._index.pop(rel, None)
            if old is not None:
                self._bytes -= old[1]
            self._index[rel] = (mtime_ns, size)
            self._bytes += size

    def _order(self, keys: Sequence[bytes], ok: list[bool]) -> None:
        """Within a batch, earlier keys count as more recently used than later ones: a chain
        of page keys is only useful up to its first missing page, so its tail goes first."""
        with self._lock:
            for key, good in zip(reversed(keys), reversed(ok)):
                rel = self._rel(key)
                if good and rel in self._index:
                    self._index.move_to_end(rel)

    def _forget(self, rel: str) -> None:
        with self._lock:
            old = self._index.pop(rel, None)
            if old is not None:
                self._bytes -= old[1]

    def _write_size(self) -> int:
        """Bytes one object written now takes on disk."""
        if self._seg is not None:
            return int(self._seg.slot_bytes)
        return self.padded_bytes if self._direct and self._direct_pool else self.object_bytes

    def object_nbytes(self) -> int:
        """What one page counts against ``capacity_bytes``: payload, trailer and, with
        O_DIRECT on an aligned pool, the padding to 4 KiB."""
        return self._write_size()

    # ----- one object -------------------------------------------------------------------------
    def _views(self, page: int) -> list[memoryview]:
        """Writable byte views of one host page's pieces, in logical order (no copy)."""
        base, raw = page * self._stride, self._raw
        return [raw[base + off:base + off + ln] for off, ln in self._pieces]

    def _trailer_block(self) -> memoryview:
        """A per-thread page-aligned scratch block (O_DIRECT needs aligned buffers)."""
        blk = getattr(self._local, "block", None)
        if blk is None:
            blk = self._local.block = mmap.mmap(-1, DIRECT_ALIGN)
        return memoryview(blk)

    def _get_one(self, item: tuple[bytes, int]) -> bool:
        key, page = item
        sub, name = key_filename(key)
        rel = f"{sub}/{name}"
        sfd = self._sub_fd(sub)
        if sfd < 0:
            self._forget(rel)
            return False
        try:
            return self._read_object(sfd, name, rel, key, page)
        finally:
            os.close(sfd)

    def _read_object(self, sfd: int, name: str, rel: str, key: bytes, page: int) -> bool:
        path = os.path.join(self.dir, rel)
        direct = self._direct and self._direct_pool
        flags = os.O_RDONLY | _OPEN_FLAGS
        st = None
        try:
            fd = os.open(name, flags | (os.O_DIRECT if direct else 0), dir_fd=sfd)
        except FileNotFoundError:
            self._forget(rel)
            return False
        except OSError as exc:
            try:
                lst = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            except OSError:
                lst = None
            if exc.errno == errno.ELOOP or (lst is not None and not stat.S_ISREG(lst.st_mode)):
                # a link, socket or device planted at the object's path: never followed
                self._count(errors=1, corrupted=1)
                self._bump("not_regular")
                _warn_once("bad:not_regular", f"file: {path} is not a regular file; never "
                           "followed, a miss (further ones are only counted in stats)")
            else:
                self._io_error("read", path, exc)
            self._forget(rel)
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Bad("not_regular", f"not a regular file (mode {st.st_mode:o})")
            if st.st_size not in self._sizes:
                raise _Bad("truncated" if st.st_size < self.object_bytes else "corrupted",
                           f"{st.st_size} bytes, objects have {self.object_bytes}")
            # Payload and trailer in one preadv: the payload lands in the page (no copy), the
            # trailer in a scratch block; nothing counts as read until both check out.
            plen = self.spec.page_bytes
            views = self._views(page)
            blk = self._trailer_block()
            if direct:      # one call: a retry at an unaligned offset would be refused
                n = os.preadv(fd, views + [blk], 0)
            else:
                n = _pread_all(fd, views + [blk[:TRAILER_BYTES]], 0)
            if n != (min(st.st_size, plen + DIRECT_ALIGN) if direct else self.object_bytes):
                raise _Bad("truncated", f"read {n} of {st.st_size} bytes")
            kind_id, want = check_trailer(bytes(blk[:TRAILER_BYTES]), self.spec.fingerprint,
                                          key, plen, self._identity)
            if _checksum(kind_id, views) != want:
                raise _Bad("corrupted", "payload checksum mismatch")
            if self.config.touch_on_read and not self.read_only and \
                    time.time_ns() - st.st_mtime_ns > _TOUCH_NS:
                try:
                    os.utime(fd)
                except OSError:
                    pass
            self._note(rel, time.time_ns(), st.st_size)
            return True
        except _Bad as bad:
            self._count(errors=1, corrupted=1)
            self._bump(bad.kind)
            _warn_once(f"bad:{bad.kind}", f"file: untrusted object {path} ({bad}); treated as "
                       "a miss (further ones are only counted in stats)")
            if bad.kind != "not_regular":
                self._remove_bad(sfd, name, st)
            self._forget(rel)
            return False
        except OSError as exc:
            self._io_error("read", path, exc)
            return False
        finally:
            os.close(fd)

    def _set_one(self, item: tuple[bytes, int]) -> bool:
        key, page = item
        sub, name = key_filename(key)
        sfd = self._sub_fd(sub, create=True)
        if sfd < 0:
            return False
        try:
            return self._write_object(sfd, sub, name, key, page)
        finally:
            os.close(sfd)

    def _write_object(self, sfd: int, sub: str, name: str, key: bytes, page: int) -> bool:
        rel = f"{sub}/{name}"
        final = os.path.join(self.dir, rel)
        tmp = f".{name}.{self._host}-{os.getpid()}.{threading.get_ident():x}{TMP_SUFFIX}"
        direct = self._direct and self._direct_pool
        views = self._views(page)
        plen = self.spec.page_bytes
        trailer = pack_trailer(self.spec.fingerprint, key, plen, self._kind_id,
                               _checksum(self._kind_id, views), self._identity)
        # a new name (O_EXCL) cannot be a FIFO or a link: no O_NONBLOCK needed
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW
        fd = -1
        mode = self.config.file_mode
        try:
            oflags = flags | (os.O_DIRECT if direct else 0)
            try:
                fd = os.open(tmp, oflags, mode, dir_fd=sfd)
            except FileExistsError:       # left by an earlier thread of this process's id
                os.unlink(tmp, dir_fd=sfd)
                fd = os.open(tmp, oflags, mode, dir_fd=sfd)
            if self._fix_mode:
                os.fchmod(fd, mode)
            size = self.object_bytes
            if direct:
                blk = self._trailer_block()
                blk[:TRAILER_BYTES] = trailer
                blk[TRAILER_BYTES:] = _PAD_ZEROS
                try:
                    _pwrite_all(fd, views + [blk])
                    size = self.padded_bytes
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # O_DIRECT refused (e.g. a file size limit cut the write unaligned):
                    # write this object through the page cache, which reports the real error.
                    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
                    fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
                    self._bump("direct_fallbacks")
                    _pwrite_all(fd, views + [memoryview(trailer)])
                    os.ftruncate(fd, self.object_bytes)
            else:
                _pwrite_all(fd, views + [memoryview(trailer)])
            if self._sync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
            if self._sync:
                os.fsync(sfd)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=sfd)
            except OSError:
                pass
            self._io_error("write", final, exc)
            return False
        self._note(rel, time.time_ns(), size)
        return True

    # ----- helpers ---------------------------------------------------------------------------
    def _map(self, fn: Callable[[Any], _R], items: list) -> list[_R]:
        """Run ``fn`` over items on the I/O threads, keeping order."""
        threads = self.config.io_threads
        if len(items) <= 1 or threads == 1:
            return [fn(it) for it in items]
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(threads,
                                                    thread_name_prefix="kvtier-file-io")
        # A few items per task: less per-future overhead, still balanced across threads.
        step = max(1, -(-len(items) // (threads * 2)))
        chunks = [items[i:i + step] for i in range(0, len(items), step)]
        return [ok for part in self._pool.map(lambda c: [fn(it) for it in c], chunks)
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

    def _remove_bad(self, sfd: int, name: str, st: os.stat_result | None) -> None:
        """Remove an untrusted object unless another process replaced it meanwhile (or it is
        not a regular file: not the store's to delete)."""
        if not self.config.remove_corrupted or self.read_only:
            return
        try:
            now = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if stat.S_ISREG(now.st_mode) and \
                    (st is None or (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)):
                os.unlink(name, dir_fd=sfd)
        except OSError:
            pass

