"""The `file` store's ``segments`` format: pages appended into large preallocated files.

The per-object format pays a create, a rename and journalled directory updates for every
page; this format pays them once per segment (``segment_bytes``, 256 MiB by default), so a
batch is a few large ``pwritev``/``preadv`` calls with no per-page metadata.

Layout, in ``<store directory>/segments/`` (opened below the store directory's descriptor
with ``O_NOFOLLOW``, like every entry of the store)::

    <writer>.<seq>.kvs   segment: an array of fixed slots
    <writer>.<seq>.kvl   its index log: append-only 64-byte records

``<writer>`` is ``<host id>-<pid>-<random>``: every process (every store instance) appends
only to its own segments and their logs, so writers never coordinate. A log lives and dies
with its segment (created after it, removed with it), so the logs are bounded by the live
data and opening a store reads only the records of segments that still exist. A slot is the page's
bytes followed by the object format's 128-byte trailer (magic, version, KVSpec fingerprint,
SHA-256 of the key, payload length, payload checksum, identity digest, CRC of the trailer),
zero-padded to a multiple of 4 KiB, so every payload starts 4 KiB-aligned and ``O_DIRECT``
works for pages of 4 KiB multiples; other pages use the page cache (``o_direct`` keeps its
auto/on/off meaning). A segment is preallocated (``posix_fallocate``) when it is created,
and its log with room for its records, so a full disk fails there and not after
pages were written: a miss and a counted error per page. A nearly full disk (or a file size
limit) gets smaller segments, down to one slot.

Writes: ``batch_set`` takes consecutive slots of the writer's current segment (new segments
as it fills) and writes each run of slots with one ``pwritev`` straight from the host pages
(iovecs: page, trailer block, page, ...), runs spread over ``io_threads``; then (``fsync``:
after the data is durable) it appends one index record per page to the segment's log: SHA-256 of the
key -> (segment, slot, time), each record with its own CRC-32; the log is preallocated, so
its records end at the first all-zero one. A page is visible only once its record is, so a
writer killed mid-batch leaves slots no record names: they are never read, and the dead
writer's segment is sealed (nothing appends to it again).

In memory (tmpfs, ramfs; ``statfs`` tells, stats say ``medium``) three things change, none on
disk: a store appends to ``write_lanes`` segments at once (default: one per I/O thread), each
lane a writer identity of its own (own segments, logs and seal), since tmpfs serialises the
writes to one file; a run is moved in calls of 512 KiB with the checksum taken while each
piece is in the CPU cache (``_hotio``); segments are sized with ``ftruncate`` while the
filesystem has ample room (preallocated when nearly full). ``fsync`` is skipped there.

Reads: an in-memory index (SHA-256 of the key -> segment, slot) built at open from the logs
-- no slot is read to open a store. A key the index misses makes the reader tail the other
writers' logs (``fstat`` each, read the new bytes) before it is declared a miss, so pages
another process wrote are found without a rescan. ``batch_get`` groups hits by segment and
contiguous slots and reads each run with one ``preadv`` into the host pages (trailers into
4 KiB-aligned scratch), runs spread over ``io_threads``. Every slot's trailer (key, identity,
length) and payload checksum are verified before it counts as a hit, so a stale or wrong
index entry, a damaged or truncated segment, can only cost a miss (counted), never wrong KV.
A garbled or torn log record is skipped and counted (``index_bad_records``); the page it
named is a miss.

``delete()`` first catches up with every log, then zeroes the key's latest slot's trailer
block (every process then reads a plain miss -- an all-zero trailer is "no page", not
corruption) and appends a tombstone record; re-setting a key writes a new slot and the
record with the latest time wins. A process whose index still names an *older* slot of the
key (it has not tailed the newer record) can read that older, intact page until it catches
up (at least once a second, and on every miss) -- a valid page of the key, never another
key's. A slot found corrupted is zeroed the same way (``remove_corrupted``), so it misses
once as corruption, then plainly. As in the object format, a page whose slot was read but
did not check out (or was deleted since this process indexed it) holds unspecified bytes;
a key the index does not know leaves its page untouched.

Capacity counts segment bytes (preallocated size). Eviction removes whole segments, least
recently used first -- LRU is per segment, not per page. "Use" is the segment's mtime,
written by appends and refreshed on a read hit at most once a second (``touch_on_read``), so
processes sharing the directory share one LRU order; a victim's mtime is re-checked before
it is removed. A segment a live writer may still append to (the newest segment of a writer
whose process is alive on this host, or of another host's writer, younger than
``stale_tmp_s``) is never evicted; segments of dead writers, and of writers whose log ends
with the seal record ``close()`` appends, are sealed and evictable. Segment files of dead
(or sealed) writers that no record names, and logs whose segment is gone, are removed when
a store opens the directory.

The capacity holds across writer processes sharing the directory, although each live
writer's current segment cannot be evicted: a writer sizes each new segment when it starts
it, as its share of the capacity -- ``capacity / (2 * live writers)``, no more than a quarter
of the capacity, at least one slot -- so the live writers' current segments hold at most
about half of it and sealed segments the rest. Starting a segment: create its file empty (a
claim every other writer sees), list the directory, evict least recently used sealed segments
until the new one fits, and make it no larger than the room left; another writer's empty
segment counts as the largest it may become, so two writers starting segments at once never
take the same room. The files then stay within the capacity (plus the index logs, 64 bytes
per slot), except where the live writers outnumber the slots it holds (one slot each at
least). A segment read within the last second is evicted too if it is still the least
recently used once its mtime is re-read: a busy store must not outgrow its capacity.

Read-only (``read_only``, or a directory the store cannot write): segments and logs are opened
``O_RDONLY``; nothing is written, evicted, cleaned, zeroed or touched.

Anything else in ``segments/`` (foreign names, links, FIFOs, directories) is never followed
or opened blocking; it is counted (``foreign_entries``, ``not_regular``) and left alone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from . import _files, _hotio
from . import file as _f

if TYPE_CHECKING:
    from .file import FileStore

SEG_DIR = "segments"
SEG_SUFFIX = ".kvs"
LOG_SUFFIX = ".kvl"
_WRITER = r"([0-9a-f]{8})-([0-9]{1,10})-([0-9a-f]{8})"
_SEG_RE = re.compile(_WRITER + r"\.([0-9]{8})\.kvs\Z")
_LOG_RE = re.compile(_WRITER + r"\.([0-9]{8})\.kvl\Z")
#: magic, kind, segment sequence number, slot, time (ns), SHA-256 of the key; reserved; CRC-32.
_REC = struct.Struct("<4sB3xIIQ32s")
REC_BYTES = 64
_REC_MAGIC = b"KVIX"
_SET, _TOMB, _SEAL = 1, 2, 3      # a page; a delete; the writer closed (appends no more)
_TOUCH_NS = 1_000_000_000
_ZERO_TRAILER = bytes(_f.TRAILER_BYTES)
_ZERO_REC = bytes(REC_BYTES)
_TAIL_CHUNK = 1 << 20
_FD_CACHE = 64                      # idle segment descriptors kept open


def pack_record(kind: int, seq: int, slot: int, t_ns: int, digest: bytes) -> bytes:
    head = _REC.pack(_REC_MAGIC, kind, seq, slot, t_ns, digest)
    head += bytes(REC_BYTES - 4 - len(head))
    return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


def unpack_record(raw: bytes) -> tuple[int, int, int, int, bytes] | None:
    """(kind, seq, slot, time, digest) of a record, or None if it is garbled."""
    if struct.unpack_from("<I", raw, REC_BYTES - 4)[0] != \
            zlib.crc32(raw[:REC_BYTES - 4]) & 0xFFFFFFFF:
        return None
    magic, kind, seq, slot, t_ns, digest = _REC.unpack_from(raw)
    if magic != _REC_MAGIC or kind not in (_SET, _TOMB, _SEAL):
        return None
    return kind, seq, slot, t_ns, digest


@dataclass
class _Seg:
    writer: str
    seq: int
    size: int
    used_ns: int                    # last use known here (mtime, or a read / write by us)
    touched_ns: int = 0             # when this process last refreshed its mtime
    members: set = field(default_factory=set)   # key digests whose latest slot is here


class _Fd:
    """A segment's descriptor shared by the I/O threads: closed only once it is dropped
    (evicted, the store closing) and no call is using it, so no thread ever reads or writes
    through a descriptor number that was closed and reused."""

    __slots__ = ("fd", "refs", "writes", "dropped")

    def __init__(self, fd: int):
        self.fd, self.refs, self.writes, self.dropped = fd, 1, 0, False


@dataclass
class _Lane:
    """A write lane: a writer identity of this store instance and the segment it appends to
    (slots ``next`` to ``slots``). Each lane is a writer of its own on disk (own segments, own
    logs, own seal), so other processes need no notion of lanes."""
    writer: str
    seq: int = 0
    cur: tuple[str, _Fd] | None = None      # (segment name, its descriptor)
    next: int = 0
    slots: int = 0


@dataclass
class _Log:
    """Another writer's log: how far it was read, and whether it can still grow (logs are
    opened only while being read, so a store of many segments holds few descriptors)."""
    offset: int = 0
    done: bool = False


def _log_segment(log: str) -> str:
    """The segment a log indexes."""
    return log[:-len(LOG_SUFFIX)] + SEG_SUFFIX


def _segment_log(seg: str) -> str:
    return seg[:-len(SEG_SUFFIX)] + LOG_SUFFIX


class SegmentFormat:
    """The segment format's state and I/O, on behalf of one ``FileStore`` (its helpers:
    directory descriptor, page views, counters, I/O thread pool)."""

    def __init__(self, store: "FileStore"):
        self.s = store
        c = store.config
        spec = store.spec
        self.slot_bytes = -(-(spec.page_bytes + _f.TRAILER_BYTES) // _f.DIRECT_ALIGN) \
            * _f.DIRECT_ALIGN
        self.tail_bytes = self.slot_bytes - spec.page_bytes
        slots = max(1, c.segment_bytes // self.slot_bytes)
        if c.capacity_bytes is not None:
            slots = min(slots, max(1, c.capacity_bytes // self.slot_bytes // 4))
        self.seg_slots = slots
        #: at most io_depth read/write calls in flight (None: one per I/O thread)
        depth = c.io_depth if 0 < c.io_depth < c.io_threads else 0
        self._io_gate = threading.Semaphore(depth) if depth else None
        self._local = threading.local()
        self._lock = threading.RLock()          # index, segments, logs
        self._wlock = threading.Lock()          # slot allocation and our log
        self._index: dict[bytes, tuple[str, int, int]] = {}     # digest -> (seg, slot, t)
        self._tombs: dict[bytes, int] = {}      # digest -> time of its latest delete
        self._sealed: set[str] = set()          # writers whose log says they closed
        self._segs: dict[str, _Seg] = {}
        self._logs: dict[str, _Log] = {}
        self._fds: dict[str, _Fd] = {}          # segment name -> its descriptor
        self._pid = -1
        #: sync calls do nothing where the medium is memory (tmpfs): skipped, said in stats
        self.medium = store.medium
        self._sync = store._sync
        #: in memory: checksum each piece while it is cache-hot (``_hotio``), and segments
        #: and logs are sized with ftruncate while there is ample room (tmpfs allocates on
        #: write; preallocating is one more pass over the pages' memory; see _reserve)
        self.hot = self.medium == "memory"
        #: write lanes: each its own writer, appending to its own current segment
        self.lanes = c.write_lanes or (c.io_threads if self.medium == "memory" else 1)
        self._lanes: list[_Lane] = []
        self._own: set[str] = set()             # our lanes' writer names
        self._rr = 0                            # the lane the next run goes to
        #: our segments' logs: segment name -> [descriptor, end of records, preallocated end]
        self._wlogs: dict[str, list[int]] = {}
        self._last_list = 0.0
        self._dir_key = (0, 0)
        self._last_catch_up = 0.0
        self._sfd = self._open_dir()
        self._new_writer()
        self.refresh(clean=not store.read_only)

    # ----- directory ----------------------------------------------------------------------
    def _open_dir(self, count: bool = True) -> int:
        """The segment directory's descriptor (made if missing, as the store makes its fan-out
        directories), or -1: a foreign entry or a directory that cannot be made (counted)."""
        return self.s._sub_fd(SEG_DIR, create=not self.s.read_only, count=count)

    def _new_writer(self) -> None:
        self._pid = os.getpid()
        self._lanes = [_Lane(f"{self.s._host}-{self._pid}-{os.urandom(4).hex()}")
                       for _ in range(self.lanes)]
        self._own = {lane.writer for lane in self._lanes}
        self._wlogs = {}

    def _curs(self) -> set[str]:
        """The segments our lanes append to now."""
        return {lane.cur[0] for lane in self._lanes if lane.cur is not None}

    def reopen(self) -> None:
        """Close the segment descriptors (the next I/O reopens them for the pool now attached)
        and seal the current segment."""
        with self._wlock:
            with self._lock:
                for lane in self._lanes:
                    if lane.cur is not None:
                        self._release(lane.cur[1])
                        lane.cur = None
                for name in list(self._fds):
                    self._retire(name)

    def close(self) -> None:
        if self._wlogs and self._sfd >= 0 and self._pid == os.getpid() \
                and not self.s.read_only:
            for lane in self._lanes:   # other processes may now evict our last segments
                seg = max((n for n in self._wlogs if n.startswith(lane.writer + ".")),
                          default=None)
                if seg is None:
                    continue            # nothing written by this lane: nothing to seal
                try:
                    self._append([pack_record(_SEAL, 0, 0, time.time_ns(), bytes(32))], seg)
                except OSError:
                    pass
        self.reopen()
        with self._wlock, self._lock:
            fds = [w[0] for w in self._wlogs.values()]
            if self._sfd >= 0:
                fds.append(self._sfd)
            self._logs.clear()
            self._wlogs.clear()
            self._sfd = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def _open_entry(self, name: str, flags: int) -> int:
        """Open a segment-directory entry (never a link, never blocking); -1 if missing or not
        a regular file (counted)."""
        try:
            fd = os.open(name, flags | _f._OPEN_FLAGS, dir_fd=self._sfd)
        except FileNotFoundError:
            return -1
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
                self._not_regular(name)
            else:
                self.s._io_error("open", os.path.join(self.s.dir, SEG_DIR, name), exc)
            return -1
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return -1
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            self._not_regular(name)
            return -1
        return fd

    def _not_regular(self, name: str) -> None:
        s = self.s
        s._count(errors=1, corrupted=1)
        s._bump("not_regular")
        _f._warn_once("bad:not_regular", f"file: {os.path.join(s.dir, SEG_DIR, name)} is not a "
                      "regular file; never followed, a miss (further ones are only counted)")

    # ----- index ------------------------------------------------------------------------------
    def refresh(self, clean: bool = False) -> None:
        """List the segment directory (segments and logs of every writer), tail every log and,
        with ``clean``, remove dead writers' orphan segments and logs."""
        if self._sfd < 0:
            return
        try:
            entries = [(e.name, e.is_file(follow_symlinks=False))
                       for e in self.s._listdir(self._sfd)]
        except OSError:
            return
        now_ns = time.time_ns()
        seen_segs: set[str] = set()
        foreign = 0
        for name, regular in entries:
            m = _SEG_RE.match(name)
            if m:
                if not regular:
                    foreign += 1
                    continue
                seen_segs.add(name)
                known = self._segs.get(name)
                if known is not None and known.size == 0:    # a claim: its size now
                    try:
                        known.size = os.stat(name, dir_fd=self._sfd,
                                             follow_symlinks=False).st_size
                    except OSError:
                        pass
                elif known is None:
                    try:
                        st = os.stat(name, dir_fd=self._sfd, follow_symlinks=False)
                    except OSError:
                        continue
                    with self._lock:
                        self._segs.setdefault(name, _Seg(
                            f"{m.group(1)}-{m.group(2)}-{m.group(3)}", int(m.group(4)),
                            st.st_size, st.st_mtime_ns))
            elif _LOG_RE.match(name):
                if not regular:
                    foreign += 1
                elif name not in self._logs and name.split(".")[0] not in self._own:
                    with self._lock:
                        self._logs.setdefault(name, _Log())
            else:
                foreign += 1
        if foreign and clean:
            self.s._bump("foreign_entries", foreign)
        with self._lock:
            for name in [n for n in self._segs if n not in seen_segs]:
                self._drop_seg(name)
            listed = {n for n, _ in entries}
            for name in [n for n in self._logs if n not in listed]:
                del self._logs[name]
        self.tail()
        self._last_list = time.monotonic()
        if clean and not self.s.read_only:
            self._clean_dead(now_ns)

    def _catch_up(self) -> None:
        """Before declaring a miss: list the directory again if entries came or went (a new
        writer's log; one fstat tells: its mtime and ctime, or a change under a second old,
        as timestamps are coarse), then read what every log gained."""
        try:
            st = os.fstat(self._sfd) if self._sfd >= 0 else None
        except OSError:
            st = None
        self._last_catch_up = time.monotonic()
        key = (st.st_mtime_ns, st.st_ctime_ns) if st is not None else (0, 0)
        if key != self._dir_key or time.time_ns() - max(key) < _TOUCH_NS:
            self._dir_key = key
            self.refresh()
        else:
            self.tail()

    def tail(self) -> None:
        """Read the records other writers appended since the last look."""
        with self._lock:
            logs = [(n, lg) for n, lg in self._logs.items() if not lg.done]
        for name, lg in logs:
            fd = self._open_entry(name, os.O_RDONLY)
            if fd < 0:
                lg.done = True              # gone, or not a regular file (counted)
                continue
            try:
                self._tail_one(name, lg, fd)
                if not lg.done:
                    lg.done = self._finished(name, fd)
            finally:
                os.close(fd)

    def _finished(self, name: str, fd: int) -> bool:
        """A log that cannot grow any more: its writer is dead or sealed, or it has moved on
        two segments and the log has been still for a while (a batch may span segments)."""
        m = _LOG_RE.match(name)
        writer = name.split(".")[0]
        if m is None or self._writer_state(writer) is False:
            return True
        seq = int(m.group(4))
        with self._lock:
            newest = max((i.seq for i in self._segs.values() if i.writer == writer), default=0)
        try:
            still = time.time_ns() - os.fstat(fd).st_mtime_ns > 5 * _TOUCH_NS
        except OSError:
            return False
        return seq < newest - 1 and still

    def _tail_one(self, name: str, lg: _Log, fd: int) -> None:
        writer = name.split(".")[0]
        path = os.path.join(self.s.dir, SEG_DIR, name)
        while True:
            try:
                size = os.fstat(fd).st_size
                if size - lg.offset < REC_BYTES:
                    return
                want = min(size - lg.offset, _TAIL_CHUNK) // REC_BYTES * REC_BYTES
                raw = os.pread(fd, want, lg.offset)
            except OSError as exc:
                self.s._io_error("read", path, exc)
                return
            raw = raw[:len(raw) // REC_BYTES * REC_BYTES]
            # Logs are preallocated: the records end at the first all-zero one. A garbled
            # record at the very end of a live writer's records may be one being written:
            # it is looked at again next time, not skipped.
            end = 0
            while end < len(raw) and raw[end:end + REC_BYTES] != _ZERO_REC:
                end += REC_BYTES
            last_bad = end >= REC_BYTES and unpack_record(raw[end - REC_BYTES:end]) is None
            if last_bad and self._writer_state(writer) is not False:
                end -= REC_BYTES
            with self._lock:
                if self._logs.get(name) is not lg:
                    return
                bad = self._apply(writer, raw[:end])
                lg.offset += end
            if bad:
                self.s._count(errors=bad)
                self.s._bump("index_bad_records", bad)
                _f._warn_once("bad:index", f"file: garbled records in {path}; the pages "
                              "they named are misses (further ones are only counted)")
            if end < len(raw) or end == 0:
                return

    def _apply(self, writer: str, raw: bytes) -> int:
        """Apply a run of records (lock held); returns how many were garbled."""
        bad = bad_slots = 0
        for off in range(0, len(raw), REC_BYTES):
            rec = unpack_record(raw[off:off + REC_BYTES])
            if rec is None:
                bad += 1
                continue
            kind, seq, slot, t_ns, digest = rec
            if kind == _SEAL:
                self._sealed.add(writer)
                continue
            old = self._index.get(digest)
            if (old is not None and old[2] > t_ns) or self._tombs.get(digest, -1) > t_ns:
                continue                        # a later record already won
            if kind == _TOMB:
                self._tombs[digest] = t_ns
                self._unindex(digest)
                continue
            seg = f"{writer}.{seq:08d}{SEG_SUFFIX}"
            info = self._segs.get(seg)
            if info is None or (slot + 1) * self.slot_bytes > info.size:
                info = self._stat_seg(seg, writer, seq)   # new since the listing, or grown
                if info is None:
                    continue                    # evicted (or not a file): a miss
                if (slot + 1) * self.slot_bytes > info.size:
                    bad_slots += 1              # a truncated segment
                    continue
            self._put(digest, seg, slot, t_ns)
        if bad_slots:
            self.s._count(errors=bad_slots, corrupted=bad_slots)
            self.s._bump("truncated", bad_slots)
        return bad

    def _stat_seg(self, seg: str, writer: str, seq: int) -> _Seg | None:
        """(Re)register a segment from its directory entry (lock held)."""
        try:
            st = os.stat(seg, dir_fd=self._sfd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        info = self._segs.get(seg)
        if info is None:
            info = self._segs[seg] = _Seg(writer, seq, st.st_size, st.st_mtime_ns)
        info.size = st.st_size
        return info

    def _put(self, digest: bytes, seg: str, slot: int, t_ns: int) -> None:
        self._tombs.pop(digest, None)
        self._unindex(digest)
        self._index[digest] = (seg, slot, t_ns)
        info = self._segs.get(seg)
        if info is not None:
            info.members.add(digest)

    def _unindex(self, digest: bytes) -> None:
        old = self._index.pop(digest, None)
        if old is not None:
            info = self._segs.get(old[0])
            if info is not None:
                info.members.discard(digest)

    def _drop_seg(self, name: str) -> None:
        """Forget a segment (lock held): its pages, its read descriptor."""
        info = self._segs.pop(name, None)
        if info is not None:
            for d in info.members:
                self._index.pop(d, None)
        self._retire(name)

    def _retire(self, name: str) -> None:
        """Drop a segment's descriptor (lock held); closed when its last user is done."""
        e = self._fds.pop(name, None)
        if e is not None:
            e.dropped = True
            if e.refs == 0:
                os.close(e.fd)

    def _release(self, e: _Fd) -> None:
        with self._lock:
            e.refs -= 1
            if e.refs == 0 and e.dropped:
                os.close(e.fd)

    def _writer_state(self, writer: str) -> bool | None:
        """Whether a writer may still append: True, False, or None (another host's)."""
        host, pid, _ = writer.split("-")
        if writer in self._own:
            return True
        if writer in self._sealed:
            return False
        return _files.writer_alive(host, pid, self.s._host)

    def _clean_dead(self, now_ns: int) -> None:
        """Remove dead (or sealed) writers' segments no record names, with their logs, and
        logs whose segment is gone (a segment is created before its log, removed before it)."""
        with self._lock:
            victims = [n for n, i in self._segs.items()
                       if not i.members and self._writer_state(i.writer) is False]
        for name in victims:
            if self._unlink(name):
                self.s._bump("tmp_cleaned")
            with self._lock:
                self._drop_seg(name)
        with self._lock:
            logs = [n for n in self._logs if _log_segment(n) not in self._segs]
        for name in logs:
            if self._unlink(name):
                self.s._bump("tmp_cleaned")
            with self._lock:
                self._logs.pop(name, None)

    def _unlink(self, name: str) -> bool:
        try:
            st = os.stat(name, dir_fd=self._sfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return False
            os.unlink(name, dir_fd=self._sfd)
            return True
        except OSError:
            return False

    def lookup(self, keys: Sequence[bytes], fresh: bool = False
               ) -> list[tuple[bytes, tuple[str, int, int] | None]]:
        """(digest, index entry or None) per key. Catches up with the directory and the logs
        once if any key misses, if ``fresh``, or if it has not for a second (segments
        evicted by others are forgotten and their descriptors closed)."""
        digests = [hashlib.sha256(k).digest() for k in keys]
        if fresh or time.monotonic() - self._last_catch_up > 1.0:
            self._catch_up()
        with self._lock:
            found = [self._index.get(d) for d in digests]
        if None in found:
            self._catch_up()
            with self._lock:
                found = [self._index.get(d) for d in digests]
        return list(zip(digests, found))

    # ----- public operations ------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> int:
        """Leading keys the index holds in a segment this store can open: the existence
        check and the read agree (an entry whose segment cannot be opened is forgotten, as
        a read of it would, and is no hit)."""
        n = 0
        opens: dict[str, bool] = {}
        for digest, entry in self.lookup(keys, fresh=True):  # evictions by others count
            if entry is None:
                break
            seg = entry[0]
            if seg not in opens:
                e = self._acquire(seg)        # cached: one open per segment, not per key
                opens[seg] = e is not None
                if e is not None:
                    self._release(e)
            if not opens[seg]:
                with self._lock:
                    self._forget_if(digest, seg, entry[1])
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes], pages: list[int]) -> list[bool]:
        out = [False] * len(keys)
        runs: dict[str, list[tuple[int, int, bytes, int]]] = {}
        for i, (digest, entry) in enumerate(self.lookup(keys)):
            if entry is not None:
                runs.setdefault(entry[0], []).append((entry[1], i, digest, pages[i]))
        work = []
        step = self._chunk(sum(len(v) for v in runs.values()))
        for seg, items in runs.items():
            items.sort()
            contiguous: list[list[tuple[int, int, bytes, int]]] = []
            for it in items:     # a key named twice starts a run of its own: read twice
                if not contiguous or it[0] != contiguous[-1][-1][0] + 1:
                    contiguous.append([])
                contiguous[-1].append(it)
            for run in contiguous:
                at = 0
                for size in self._split(len(run), step):
                    work.append((seg, run[at:at + size]))
                    at += size
        for done in self.s._map(self._read_run, work):
            for i in done:
                out[i] = True
        return out

    def _chunk(self, n: int) -> int:
        """Slots per I/O call, within IOV_MAX iovecs: two calls per I/O thread (so one
        thread's checksums overlap another's transfer), but none smaller than
        ``io_call_bytes`` where the batch holds that much (a disk serves small calls below
        its sequential rate: a batch of small pages would otherwise make 2 MiB calls); with
        an I/O depth below the thread count, calls of about ``io_call_bytes`` (the disk
        sees few, large calls; the threads waiting for their turn checksum meanwhile)."""
        threads = self.s.config.io_threads
        least = self.s.config.io_call_bytes // self.slot_bytes
        if self._io_gate is not None:
            return max(1, min(self._cap(), n, least))
        share = -(-n // (threads * 2)) if threads > 1 else n
        return max(1, min(self._cap(), n, max(least, share)))

    def _cap(self) -> int:
        """The most slots one call may hold: a page's pieces and its tail within IOV_MAX."""
        pieces = len(self.s._pieces) if self.s.host_pool is not None else 1
        return max(1, _f._IOV_MAX // (pieces + 1))

    def _split(self, length: int, step: int) -> list[int]:
        """``length`` contiguous slots as balanced calls of about ``step`` slots: none smaller
        than ``step`` without an I/O depth (64 pages at 31 a call are two calls of 32, not
        31 + 31 + 2), none larger with one, none over the iovec limit."""
        calls = length // step if self._io_gate is None else -(-length // step)
        calls = max(1, calls, -(-length // self._cap()))
        base, extra = divmod(length, calls)
        return [base + 1] * extra + [base] * (calls - extra)

    def _acquire(self, seg: str) -> _Fd | None:
        """The segment's descriptor, held until ``_release``; None if it cannot be opened."""
        with self._lock:
            e = self._fds.pop(seg, None)
            if e is not None:
                self._fds[seg] = e          # most recently used last
                e.refs += 1
                return e
        direct = self.s._direct and self.s._direct_pool
        mode = os.O_RDONLY if self.s.read_only else os.O_RDWR
        fd = self._open_entry(seg, mode | (os.O_DIRECT if direct else 0))
        if fd < 0:
            return None
        with self._lock:
            if seg not in self._segs:
                os.close(fd)
                return None
            e = self._fds.get(seg)
            if e is not None:
                os.close(fd)
                e.refs += 1
                return e
            e = self._fds[seg] = _Fd(fd)
            self._trim_fds()
            return e

    def _trim_fds(self) -> None:
        """Keep at most _FD_CACHE idle segment descriptors open, least recently used go
        (lock held); a store of thousands of segments stays far below the open-file limit."""
        excess = len(self._fds) - _FD_CACHE
        if excess <= 0:
            return
        curs = self._curs()
        for name in [n for n, e in self._fds.items()
                     if n not in curs and not e.writes and not e.refs][:excess]:
            self._retire(name)

    def _read_run(self, item: tuple[str, list[tuple[int, int, bytes, int]]]) -> list[int]:
        seg, run = item
        s = self.s
        path = os.path.join(s.dir, SEG_DIR, seg)
        e = self._acquire(seg)
        if e is None:
            with self._lock:
                for slot, _, digest, _ in run:
                    self._forget_if(digest, seg, slot)
            return []
        fd = e.fd
        n = len(run)
        smv = self._scratch(n * self.tail_bytes)
        tb = self.tail_bytes
        bufs: list[memoryview] = []
        sums: list[int] = []
        for j, (_, _, _, page) in enumerate(run):
            bufs += s._views(page)
            bufs.append(smv[j * tb:(j + 1) * tb])
        first = run[0][0]
        try:
            try:
                with self._io_gate or contextlib.nullcontext():
                    if self.hot:
                        fn, start = self._crc()
                        got, sums = _hotio.read_hot(
                            fd, first * self.slot_bytes,
                            [(s._views(page), smv[j * tb:(j + 1) * tb])
                             for j, (_, _, _, page) in enumerate(run)], fn, start)
                    else:
                        got = _f._pread_all(fd, bufs, first * self.slot_bytes)
            except OSError as exc:
                s._io_error("read", path, exc)
                return []
            done = []
            plen = s.spec.page_bytes
            for j, (slot, i, digest, page) in enumerate(run):
                if got < (j + 1) * self.slot_bytes:
                    self._bad(seg, fd, slot, digest, _f._Bad("truncated", "segment ends "
                                                             f"before slot {slot}"), path)
                    continue
                raw = bytes(smv[j * self.tail_bytes:j * self.tail_bytes + _f.TRAILER_BYTES])
                if raw == _ZERO_TRAILER:          # deleted (or never completed): plain miss
                    with self._lock:
                        self._forget_if(digest, seg, slot)
                    continue
                try:
                    kind_id, want = _f.check_trailer(raw, s.spec.fingerprint, b"", plen,
                                                     s._identity, key_digest=digest)
                    # the checksum of the bytes in the page now: taken as they arrived
                    # (hot), or over the page (another checksum kind, or not in memory)
                    have = sums[j] if sums and kind_id == s._kind_id else \
                        _f._checksum(kind_id, s._views(page))
                    if have != want:
                        raise _f._Bad("corrupted", "payload checksum mismatch")
                except _f._Bad as bad:
                    self._bad(seg, fd, slot, digest, bad, path)
                    continue
                done.append(i)
            if done:
                self._touch(seg, fd)
            return done
        finally:
            del bufs
            self._release(e)

    def _scratch(self, nbytes: int) -> memoryview:
        """A per-thread page-aligned scratch area of ``nbytes`` (trailer blocks; O_DIRECT
        needs aligned buffers), reused across calls."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.scratch = mmap.mmap(-1, max(nbytes, _f.DIRECT_ALIGN))
        return memoryview(buf)[:nbytes]

    def _forget_if(self, digest: bytes, seg: str, slot: int) -> None:
        entry = self._index.get(digest)
        if entry is not None and entry[0] == seg and entry[1] == slot:
            self._unindex(digest)

    def _bad(self, seg: str, fd: int, slot: int, digest: bytes, bad: "_f._Bad",
             path: str) -> None:
        s = self.s
        s._count(errors=1, corrupted=1)
        s._bump(bad.kind)
        _f._warn_once(f"bad:{bad.kind}", f"file: untrusted slot {slot} of {path} ({bad}); "
                      "treated as a miss (further ones are only counted in stats)")
        with self._lock:
            self._forget_if(digest, seg, slot)
        if s.config.remove_corrupted and bad.kind != "truncated" and not s.read_only:
            self._zero_trailer(fd, slot)

    def _zero_trailer(self, fd: int, slot: int) -> None:
        """Make a slot a plain miss for every process (delete, or a corrupted slot)."""
        blk = mmap.mmap(-1, _f.DIRECT_ALIGN)
        try:
            n = -(-self.tail_bytes // _f.DIRECT_ALIGN) * _f.DIRECT_ALIGN
            off = slot * self.slot_bytes + self.s.spec.page_bytes
            if off % _f.DIRECT_ALIGN == 0 and n == self.tail_bytes:
                os.pwritev(fd, [memoryview(blk)[:_f.DIRECT_ALIGN]] * (n // _f.DIRECT_ALIGN),
                           off)
            else:             # an odd page size: the descriptor is not O_DIRECT
                os.pwrite(fd, _ZERO_TRAILER, off)
        except OSError as exc:
            self.s._io_error("write", os.path.join(self.s.dir, SEG_DIR), exc)
        finally:
            blk.close()

    def _touch(self, seg: str, fd: int) -> None:
        now = time.time_ns()
        with self._lock:
            info = self._segs.get(seg)
            if info is None:
                return
            info.used_ns = max(info.used_ns, now)
            if not self.s.config.touch_on_read or self.s.read_only \
                    or now - info.touched_ns < _TOUCH_NS:
                return
            info.touched_ns = now
        try:
            os.utime(fd)
        except OSError:
            pass

    # ----- writes -----------------------------------------------------------------------------
    def set(self, keys: Sequence[bytes], pages: list[int]) -> list[bool]:
        if os.getpid() != self._pid:            # a forked child: its own writer identity
            with self._wlock:
                self._new_writer()
        n = len(keys)
        if self._sfd < 0:
            with self._wlock:               # it could not be made at open: try again
                if self._sfd < 0:
                    self._sfd = self._open_dir(count=False)   # each page is counted
                    if self._sfd >= 0:
                        self.refresh(clean=True)
        if self._sfd < 0:
            self.s._write_failed(os.path.join(self.s.dir, SEG_DIR), self.s._dir_error or
                                 OSError(errno.ENOTDIR, "segment directory unusable"), n)
            return [False] * n
        out = [False] * n
        work = []
        step = self._chunk(n)
        with self._wlock:
            for lane in self._lanes:
                self._check_current(lane)
            i = 0
            while i < n:
                # runs go to the lanes in turn (across calls too): the runs in flight at
                # once write different files (tmpfs serialises writes to one file)
                lane = self._lanes[self._rr % len(self._lanes)]
                if lane.cur is None or lane.next >= lane.slots:
                    if not self._rotate(lane, n - i):
                        break
                assert lane.cur is not None
                take = self._split(min(n - i, lane.slots - lane.next), step)[0]
                e = lane.cur[1]
                with self._lock:
                    e.refs += 1
                    e.writes += 1
                work.append((lane.cur[0], e, lane.next, list(range(i, i + take))))
                lane.next += take
                i += take
                self._rr += 1
        if i < n:
            self.s._write_failed(os.path.join(self.s.dir, SEG_DIR), self._rotate_error,
                                 n - i)
        digests = [hashlib.sha256(k).digest() for k in keys]
        for ok_idx in self.s._map(lambda w: self._write_run(w, keys, pages, digests), work):
            for j in ok_idx:
                out[j] = True
        with self._wlock:
            self._close_old_wlogs()
        return out

    _rotate_error: OSError = OSError(errno.EIO, "no segment")

    def _check_current(self, lane: "_Lane") -> None:
        """A lane's current segment or log removed behind our back (eviction, clear): it
        starts anew."""
        if lane.cur is not None:
            try:
                gone = os.fstat(lane.cur[1].fd).st_nlink == 0
            except OSError:
                gone = True
            w = self._wlogs.get(lane.cur[0])
            if not gone and w is not None:
                try:
                    gone = os.fstat(w[0]).st_nlink == 0
                except OSError:
                    gone = True
            if gone:
                self._release(lane.cur[1])
                self._close_wlog(lane.cur[0])
                lane.cur = None

    def _close_wlog(self, seg: str) -> None:
        w = self._wlogs.pop(seg, None)
        if w is not None:
            os.close(w[0])

    def _close_old_wlogs(self) -> None:
        """After a batch: keep only the current segment's log open (wlock held)."""
        keep = self._curs()
        with self._lock:
            busy = {n for n, e in self._fds.items() if e.writes}   # another batch's runs
        for seg in [n for n in self._wlogs if n not in keep and n not in busy]:
            self._close_wlog(seg)

    def _rotate(self, lane: "_Lane", want: int) -> bool:
        """Seal a lane's current segment and start a new, preallocated one (wlock held)."""
        s = self.s
        lane.seq += 1
        name = f"{lane.writer}.{lane.seq:08d}{SEG_SUFFIX}"
        size = self.seg_slots * self.slot_bytes
        direct = s._direct and s._direct_pool
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _f._NOFOLLOW
        try:      # empty for now: the claim other writers count (see _committed)
            fd = os.open(name, flags | (os.O_DIRECT if direct else 0), s.config.file_mode,
                         dir_fd=self._sfd)
        except OSError as exc:
            self._rotate_error = exc
            return False
        try:
            if s._fix_mode:
                os.fchmod(fd, s.config.file_mode)
            if s.config.capacity_bytes is not None:
                self._claim = name
                try:
                    size = self._fit(size)
                finally:
                    self._claim = ""
            while True:
                try:
                    self._reserve(fd, 0, size)
                    break
                except OSError as exc:
                    # nearly full (or a file size limit): a smaller segment, down to one slot
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
                            or size <= self.slot_bytes:
                        raise
                    size = max(self.slot_bytes, size // 2 // self.slot_bytes * self.slot_bytes)
                    os.ftruncate(fd, 0)
            if self._sync:
                os.fsync(self._sfd)
        except OSError as exc:
            os.close(fd)
            try:
                os.unlink(name, dir_fd=self._sfd)
            except OSError:
                pass
            self._rotate_error = exc
            return False
        e = _Fd(fd)                     # its one reference: being the current segment
        with self._lock:
            info = self._segs.get(name)
            if info is None:
                self._segs[name] = _Seg(lane.writer, lane.seq, size, time.time_ns())
            else:                       # listed while it was a claim
                info.size, info.used_ns = size, time.time_ns()
            self._fds[name] = e
        if lane.cur is not None:
            self._release(lane.cur[1])
        lane.cur, lane.next = (name, e), 0
        lane.slots = size // self.slot_bytes
        try:
            while True:
                try:
                    self._ensure_log(name, lane.slots)
                    break
                except OSError as exc:
                    # the segment took the last free space: give some back for its records
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or lane.slots <= 1:
                        raise
                    lane.slots //= 2
                    os.ftruncate(fd, lane.slots * self.slot_bytes)
                    with self._lock:
                        self._segs[name].size = lane.slots * self.slot_bytes
        except OSError as exc:
            self._rotate_error = exc
            with self._lock:
                self._drop_seg(name)
            self._unlink(name)
            self._close_wlog(name)
            self._unlink(_segment_log(name))
            self._release(e)
            lane.cur = None
            return False
        return True

    def _ensure_log(self, seg: str, room: int = 0) -> list[int]:
        """Segment ``seg``'s log (ours), with space reserved (preallocated) for ``room`` more
        records, so a full disk fails when a segment is created, not after its pages were
        written (wlock held). Readers stop at the first all-zero record."""
        w = self._wlogs.get(seg)
        if w is None:
            fd = os.open(_segment_log(seg), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                         | _f._NOFOLLOW, self.s.config.file_mode, dir_fd=self._sfd)
            if self.s._fix_mode:
                os.fchmod(fd, self.s.config.file_mode)
            if self._sync:
                os.fsync(self._sfd)           # the log's name survives a power loss too
            w = self._wlogs[seg] = [fd, 0, 0]
        need = w[1] + room * REC_BYTES
        if need > w[2]:
            need = -(-need // _f.DIRECT_ALIGN) * _f.DIRECT_ALIGN
            self._reserve(w[0], w[2], need - w[2])
            w[2] = need
        return w

    def _reserve(self, fd: int, off: int, length: int) -> None:
        """Give a file its size: preallocated on a disk; in memory a plain size while the
        filesystem has room for it several times over (nearly full, it is preallocated too,
        so what does not fit fails here and the segment shrinks to what does)."""
        if self.hot:
            try:
                st = os.fstatvfs(fd)
                roomy = st.f_bavail * st.f_frsize >= 4 * length
            except OSError:
                roomy = False
            if roomy:
                if os.fstat(fd).st_size < off + length:
                    os.ftruncate(fd, off + length)
                return
        os.posix_fallocate(fd, off, length)

    def _reopen_wlog(self, seg: str) -> list[int]:
        """Open one of our segments' logs again (closed after an earlier batch): its records
        end at the first all-zero one (wlock held)."""
        fd = self._open_entry(_segment_log(seg), os.O_RDWR)
        if fd < 0:
            raise OSError(errno.ENOENT, f"the log of {seg} is gone")
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, size, 0)
        except OSError:
            os.close(fd)
            raise
        end = 0
        while end + REC_BYTES <= len(raw) and raw[end:end + REC_BYTES] != _ZERO_REC:
            end += REC_BYTES
        w = self._wlogs[seg] = [fd, end, size]
        return w

    def _append(self, records: list[bytes], seg: str | None = None) -> None:
        """Append records to segment ``seg``'s log (None: our newest segment's, if any)."""
        with self._wlock:
            if seg is None:
                seg = max(self._wlogs, default=None)
                if seg is None:
                    return              # nothing written here: nothing to record
            w = self._wlogs.get(seg)
            if w is None:
                w = self._reopen_wlog(seg)
            blob = b"".join(records)
            fd, off = w[0], w[1]
            while blob:
                n = os.pwrite(fd, blob, off)
                blob, off = blob[n:], off + n
            w[1] = off
            if self._sync:
                os.fdatasync(fd)

    def _write_run(self, w: tuple[str, _Fd, int, list[int]], keys: Sequence[bytes],
                   pages: list[int], digests: list[bytes]) -> list[int]:
        seg, e, first, idx = w
        try:
            return self._write_slots(seg, e.fd, first, idx, keys, pages, digests)
        finally:
            with self._lock:
                e.writes -= 1
            self._release(e)

    def _write_slots(self, seg: str, fd: int, first: int, idx: list[int],
                     keys: Sequence[bytes], pages: list[int], digests: list[bytes]
                     ) -> list[int]:
        s = self.s
        plen = s.spec.page_bytes
        smv = self._scratch(len(idx) * self.tail_bytes)
        smv[:] = bytes(len(smv))            # padding after each trailer: zeros
        bufs: list[memoryview] = []
        tb = self.tail_bytes
        hot: list[tuple[list[memoryview], memoryview]] = []

        def seal(j: int, value: int) -> None:
            i = idx[j]
            smv[j * tb:j * tb + _f.TRAILER_BYTES] = _f.pack_trailer(
                s.spec.fingerprint, keys[i], plen, s._kind_id, value, s._identity)
        try:
            if self.hot:
                hot = [(s._views(pages[i]), smv[j * tb:(j + 1) * tb])
                       for j, i in enumerate(idx)]
            else:
                for j, i in enumerate(idx):
                    views = s._views(pages[i])
                    seal(j, _f._checksum(s._kind_id, views))
                    bufs += views
                    bufs.append(smv[j * tb:(j + 1) * tb])
            path = os.path.join(s.dir, SEG_DIR, seg)
            try:
                with self._io_gate or contextlib.nullcontext():
                    if self.hot:
                        fn, start = self._crc()
                        _hotio.write_hot(fd, first * self.slot_bytes, hot, fn, start, seal)
                    else:
                        _f._pwrite_all(fd, bufs, first * self.slot_bytes)
                if self._sync:
                    os.fdatasync(fd)
            except OSError as exc:
                s._write_failed(path, exc, len(idx))
                return []
            t_ns = time.time_ns()
            seq = int(seg.rsplit(".", 2)[1])
            recs = [pack_record(_SET, seq, first + j, t_ns, digests[i])
                    for j, i in enumerate(idx)]
            try:
                self._append(recs, seg)
            except OSError as exc:
                s._write_failed(os.path.join(s.dir, SEG_DIR, _segment_log(seg)), exc,
                                len(idx))
                return []
            with self._lock:
                for j, i in enumerate(idx):
                    self._put(digests[i], seg, first + j, t_ns)
                info = self._segs.get(seg)
                if info is not None:
                    info.used_ns = max(info.used_ns, t_ns)
            return idx
        finally:
            del bufs, hot

    def _crc(self) -> tuple[Any, int]:
        """The store's own checksum: (function, start value)."""
        kind = self.s._kind_id
        return _f.checksum_impl(kind)[0], _f._CHECKSUM_START[kind]

    def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        recs = []
        t_ns = time.time_ns()
        for digest, entry in self.lookup(keys, fresh=True):   # whoever wrote the latest
            if entry is None:
                continue
            seg, slot, _ = entry
            e = self._acquire(seg)
            if e is not None:
                try:
                    self._zero_trailer(e.fd, slot)
                finally:
                    self._release(e)
            with self._lock:
                self._forget_if(digest, seg, slot)
            t = max(t_ns, entry[2] + 1)
            with self._lock:
                self._tombs[digest] = t
            recs.append(pack_record(_TOMB, 0, 0, t, digest))
            n += 1
        if recs and self._sfd >= 0:
            try:
                self._append(recs)
            except OSError as exc:
                self.s._io_error("write", os.path.join(self.s.dir, SEG_DIR), exc)
        return n

    def clear(self) -> int:
        """Remove every segment and log; returns how many foreign entries were left."""
        if self._sfd < 0:
            return 1
        foreign = 0
        names = [e.name for e in self.s._entries(self._sfd)]
        for name in names:
            if not (_SEG_RE.match(name) or _LOG_RE.match(name)) or not self._unlink(name):
                foreign += 1
        with self._wlock:
            for lane in self._lanes:
                self._check_current(lane)
            for seg in list(self._wlogs):
                self._close_wlog(seg)
        with self._lock:
            for name in list(self._segs):
                self._drop_seg(name)
            self._index.clear()
            self._tombs.clear()
            self._logs.clear()
        return foreign

    # ----- capacity ---------------------------------------------------------------------------
    def bytes_stored(self) -> int:
        with self._lock:
            return sum(i.size for i in self._segs.values())

    def _protected(self, name: str, info: _Seg, now_ns: int,
                   newest: dict[str, int] | None = None) -> bool:
        """A segment its writer may still append to (lock held); ``newest``: each writer's
        highest segment number, if the caller has it."""
        if name in self._curs() or name == self._claim:
            return True
        e = self._fds.get(name)
        if e is not None and e.writes:
            return True                 # a batch of ours is writing into it
        if info.writer in self._own:
            return False
        alive = self._writer_state(info.writer)
        if alive is False:
            return False
        top = newest.get(info.writer, -1) if newest is not None else \
            max(i.seq for i in self._segs.values() if i.writer == info.writer)
        if info.seq != top:
            return False
        return alive is True or now_ns - info.used_ns < self.s.config.stale_tmp_s * 1e9

    def _fit(self, size: int) -> int:
        """The size of the segment this writer starts now, with a capacity (wlock held; its
        file exists, empty, as ``self._claim``): its share of the capacity among the live
        writers, after evicting what that needs, and no more than the room left."""
        s = self.s
        cap = s.config.capacity_bytes
        assert cap is not None
        self.refresh()                    # every writer's segments and claims, now
        with self._lock:
            live = {i.writer for i in self._segs.values()
                    if self._writer_state(i.writer) is not False} | self._own
        share = cap // (2 * len(live)) // self.slot_bytes * self.slot_bytes
        size = max(self.slot_bytes, min(size, share))
        evicted = self.make_room(size, fresh=False)
        if evicted:
            s._count(evictions=evicted)
        room = (cap - self._committed()) // self.slot_bytes * self.slot_bytes
        return max(self.slot_bytes, min(size, room))

    def _committed(self) -> int:
        """Bytes the segments hold against the capacity: their size; another live writer's
        empty segment (a claim: its size is being decided) counts as the largest segment it
        may become, so writers starting segments at once never both take the same room."""
        with self._lock:
            total = 0
            for name, i in self._segs.items():
                if i.size or name == self._claim or i.writer in self._own:
                    total += i.size
                elif self._writer_state(i.writer) is not False:
                    total += self.seg_slots * self.slot_bytes
            return total

    _claim = ""

    def make_room(self, need: int, fresh: bool = True) -> int:
        """Evict least recently used segments until ``need`` more bytes fit (``fresh``: list
        the directory first); returns how many were removed."""
        cap = self.s.config.capacity_bytes
        if cap is None or self.s.read_only:
            return 0
        if fresh:
            self.refresh()
        evicted = 0
        skip: set[str] = set()
        for _ in range(2 * len(self._segs) + 2):
            now = time.time_ns()
            if self._committed() + need <= cap:
                break
            with self._lock:
                newest: dict[str, int] = {}
                for i in self._segs.values():
                    newest[i.writer] = max(newest.get(i.writer, -1), i.seq)
                cands = [(i.used_ns, n) for n, i in self._segs.items()
                         if n not in skip and not self._protected(n, i, now, newest)]
                if not cands:
                    break
                _, victim = min(cands)
                recorded = self._segs[victim].used_ns
            try:
                st = os.stat(victim, dir_fd=self._sfd, follow_symlinks=False)
            except OSError:
                with self._lock:
                    self._drop_seg(victim)
                continue
            if not stat.S_ISREG(st.st_mode):
                with self._lock:
                    self._drop_seg(victim)
                continue
            if st.st_mtime_ns > recorded:     # used by another process since: look again
                with self._lock:
                    info = self._segs.get(victim)
                    if info is not None:
                        info.used_ns = st.st_mtime_ns
                continue                      # (still the least recently used: it goes)
            try:
                os.unlink(victim, dir_fd=self._sfd)
                evicted += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.s._count(errors=1)
                _f.log.debug("file: evicting %s failed: %s", victim, exc)
                skip.add(victim)
                continue
            with self._lock:
                self._drop_seg(victim)
                self._logs.pop(_segment_log(victim), None)
            self._unlink(_segment_log(victim))    # its records index nothing now
        return evicted

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"objects": len(self._index), "bytes_stored": sum(
                i.size for i in self._segs.values()), "segments": len(self._segs),
                "live_slots": len(self._index), "slot_bytes": self.slot_bytes,
                "segment_slots": self.seg_slots, "writers": len(
                    {n.split(".")[0] for n in self._logs} | self._own),
                "write_lanes": self.lanes}

    def locate(self, key: bytes) -> tuple[str, int] | None:
        """(segment path, byte offset of the slot) holding ``key`` here, for tests/tools."""
        digest = hashlib.sha256(key).digest()
        with self._lock:
            entry = self._index.get(digest)
        if entry is None:
            return None
        return os.path.join(self.s.dir, SEG_DIR, entry[0]), entry[1] * self.slot_bytes
