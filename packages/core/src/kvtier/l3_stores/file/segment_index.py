"""The `file` store's ``segments`` format, its index: segment and log names, the index log
records, the in-memory index built from the logs and kept current by tailing other writers'
logs (catching up before a miss), and the cleaning of dead writers' leftovers. The format is
described in ``kvtier.l3_stores.file.segments``."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from . import _files
from ._files import _OPEN_FLAGS
from .core import _warn_once
from .format import TRAILER_BYTES

if TYPE_CHECKING:
    from .segment_writes import _Lane
    from .store import FileStore

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
_ZERO_TRAILER = bytes(TRAILER_BYTES)
_ZERO_REC = bytes(REC_BYTES)
_TAIL_CHUNK = 1 << 20
#: in memory (tmpfs, ramfs: this host's clock stamps mtimes), a log is read again unless a
#: read began this long after its last write: well over the coarse clock's tick (a jiffy,
#: 1-10 ms); elsewhere (a network filesystem's server may stamp them, coarsely) `_TOUCH_NS`
_QUIET_NS = 50_000_000
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
class _Log:
    """Another writer's log: how far it was read, and whether it can still grow (logs are
    opened only while being read, so a store of many segments holds few descriptors)."""
    offset: int = 0
    done: bool = False
    checked: float = 0.0            # when `_finished` last looked (monotonic s)
    seen: tuple[int, int] = (-1, -1)    # (size, mtime) before the last read
    read_ns: int = 0                # when that read began (wall clock, as mtimes)


def _log_segment(log: str) -> str:
    """The segment a log indexes."""
    return log[:-len(LOG_SUFFIX)] + SEG_SUFFIX


def _segment_log(seg: str) -> str:
    return seg[:-len(SEG_SUFFIX)] + LOG_SUFFIX



class SegmentIndex:
    """The segment format's index and directory (a part of ``SegmentFormat``, whose
    ``__init__`` sets the state declared here)."""

    s: "FileStore"
    slot_bytes: int
    tail_bytes: int
    seg_slots: int
    medium: str
    hot: bool
    piece: int
    lanes: int
    _io_gate: threading.Semaphore | None
    _local: threading.local
    _lock: threading.RLock
    _wlock: threading.Lock
    _index: dict[bytes, tuple[str, int, int]]
    _tombs: dict[bytes, int]
    _sealed: set[str]
    _segs: dict[str, _Seg]
    _logs: dict[str, _Log]
    _fds: dict[str, _Fd]
    _pid: int
    _sync: bool
    _lanes: list[_Lane]
    _own: set[str]
    _rr: int
    _wlogs: dict[str, list[int]]
    _last_list: float
    _dir_key: tuple[int, int]
    _last_catch_up: float
    _sfd: int

    # ----- directory ----------------------------------------------------------------------
    def _open_dir(self, count: bool = True) -> int:
        """The segment directory's descriptor (made if missing, as the store makes its fan-out
        directories), or -1: a foreign entry or a directory that cannot be made (counted)."""
        return self.s._sub_fd(SEG_DIR, create=not self.s.read_only, count=count)

    def _curs(self) -> set[str]:
        """The segments our lanes append to now."""
        return {lane.cur[0] for lane in self._lanes if lane.cur is not None}

    def _open_entry(self, name: str, flags: int) -> int:
        """Open a segment-directory entry (never a link, never blocking); -1 if missing or not
        a regular file (counted)."""
        try:
            fd = os.open(name, flags | _OPEN_FLAGS, dir_fd=self._sfd)
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
        _warn_once("bad:not_regular", f"file: {os.path.join(s.dir, SEG_DIR, name)} is not a "
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
        """Read the records other writers appended since the last look. Every existence
        check catches up, and a store written by a chain's helper processes has a log per
        helper lane: a log not written since a read that began at least `quiet_ns` after
        its last write (its size and mtime unchanged: logs are preallocated, and a write
        after that read would give it a later mtime even on a coarse clock) costs one
        ``stat``, and whether it has ended is asked at most once a second."""
        with self._lock:
            logs = [(n, lg) for n, lg in self._logs.items() if not lg.done]
        now, quiet = time.monotonic(), self.quiet_ns()
        for name, lg in logs:
            try:
                st = os.stat(name, dir_fd=self._sfd, follow_symlinks=False)
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode) \
                    and lg.seen == (st.st_size, st.st_mtime_ns) \
                    and lg.read_ns - st.st_mtime_ns > quiet:
                if now - lg.checked >= 1.0:
                    lg.checked = now
                    lg.done = self._finished(name, st.st_mtime_ns)
                continue
            fd = self._open_entry(name, os.O_RDONLY)   # (counts what is not a regular file)
            if fd < 0:
                lg.done = True              # gone, or not a regular file (counted)
                continue
            if st is not None:
                lg.seen, lg.read_ns = (st.st_size, st.st_mtime_ns), time.time_ns()
            try:
                self._tail_one(name, lg, fd)
                if not lg.done:
                    lg.checked = now
                    lg.done = self._finished(name, os.fstat(fd).st_mtime_ns)
            except OSError:
                pass
            finally:
                os.close(fd)

    def quiet_ns(self) -> int:
        """How long after a log's last write a read must begin for an unchanged size and
        mtime to say that nothing was written since."""
        return _QUIET_NS if self.medium == "memory" else _TOUCH_NS

    def _finished(self, name: str, mtime_ns: int) -> bool:
        """A log that cannot grow any more: its writer is dead or sealed, or it has moved on
        two segments and the log has been still for a while (a batch may span segments)."""
        m = _LOG_RE.match(name)
        writer = name.split(".")[0]
        if m is None or self._writer_state(writer) is False:
            return True
        seq = int(m.group(4))
        with self._lock:
            newest = max((i.seq for i in self._segs.values() if i.writer == writer), default=0)
        return seq < newest - 1 and time.time_ns() - mtime_ns > 5 * _TOUCH_NS

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
                _warn_once("bad:index", f"file: garbled records in {path}; the pages "
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
        caught = fresh or time.monotonic() - self._last_catch_up > 1.0
        if caught:
            self._catch_up()
        with self._lock:
            found = [self._index.get(d) for d in digests]
        if None in found and not caught:
            self._catch_up()
            with self._lock:
                found = [self._index.get(d) for d in digests]
        return list(zip(digests, found))

    def _forget_if(self, digest: bytes, seg: str, slot: int) -> None:
        entry = self._index.get(digest)
        if entry is not None and entry[0] == seg and entry[1] == slot:
            self._unindex(digest)
