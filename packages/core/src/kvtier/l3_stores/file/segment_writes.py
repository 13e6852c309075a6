"""The `file` store's ``segments`` format, its writes: write lanes (a writer identity each),
starting segments and their logs (sized, preallocated), batch writes in runs of slots (one
``pwritev`` each) followed by their index records, and deletes (tombstones). The format is
described in ``kvtier.l3_stores.file.segments``."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Sequence

from . import _files, _hotio
from ._files import _NOFOLLOW
from .format import DIRECT_ALIGN, TRAILER_BYTES, pack_trailer, running_checksums
from .segment_index import (_SET, _TOMB, _ZERO_REC, REC_BYTES, SEG_DIR, SEG_SUFFIX, _Fd,
                            _Seg, _segment_log, pack_record)
from .segment_reads import SegmentReads


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



class SegmentWrites(SegmentReads):
    """The segment format's writes and deletes (a part of ``SegmentFormat``)."""

    # ----- lanes ------------------------------------------------------------------------------
    def _new_writer(self) -> None:
        self._pid = os.getpid()
        self._lanes = [_Lane(f"{self.s._host}-{self._pid}-{os.urandom(4).hex()}")
                       for _ in range(self.lanes)]
        self._own = {lane.writer for lane in self._lanes}
        self._wlogs = {}

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
        for ok_idx in self.s._map(lambda w: self._write_run(w, keys, pages, digests), work,
                                  writes=True):
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
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW
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
                         | _NOFOLLOW, self.s.config.file_mode, dir_fd=self._sfd)
            if self.s._fix_mode:
                os.fchmod(fd, self.s.config.file_mode)
            if self._sync:
                os.fsync(self._sfd)           # the log's name survives a power loss too
            w = self._wlogs[seg] = [fd, 0, 0]
        need = w[1] + room * REC_BYTES
        if need > w[2]:
            need = -(-need // DIRECT_ALIGN) * DIRECT_ALIGN
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

        def seal(j: int, sums: list[int]) -> None:
            i = idx[j]
            smv[j * tb:j * tb + TRAILER_BYTES] = pack_trailer(
                s.spec.fingerprint, keys[i], plen, s._kind_id, sums[-1], s._identity, sums)
        try:
            if self.hot:
                hot = [(s._views(pages[i]), smv[j * tb:(j + 1) * tb])
                       for j, i in enumerate(idx)]
            else:
                for j, i in enumerate(idx):
                    views = s._views(pages[i])
                    seal(j, running_checksums(s._kind_id, views, s._group_ends))
                    bufs += views
                    bufs.append(smv[j * tb:(j + 1) * tb])
            path = os.path.join(s.dir, SEG_DIR, seg)
            try:
                with self._io_gate or contextlib.nullcontext():
                    if self.hot:
                        fn, start = self._crc()
                        _hotio.write_hot(fd, first * self.slot_bytes, hot, fn, start, seal,
                                         s._group_ends, self.piece)
                    else:
                        _files._pwrite_all(fd, bufs, first * self.slot_bytes)
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
