"""The `file` store's ``segments`` format, its reads: existence checks, batch reads in runs
of contiguous slots (one ``preadv`` each, sized for the I/O threads and depth), the cache of
segment descriptors, the check of every slot, zeroing bad slots and the LRU touch. The format
is described in ``kvtier.l3_stores.file.segments``."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import Any, Sequence

from . import _files, _hotio
from ._files import _IOV_MAX
from .core import _warn_once
from .format import (_CHECKSUM_START, DIRECT_ALIGN, TRAILER_BYTES, Trailer, _Bad, _checksum,
                     checksum_impl, parse_trailer)
from .ranged import BadRange, Marks, check_group, read_group
from .segment_capacity import SegmentCapacity
from .segment_index import _FD_CACHE, _TOUCH_NS, _ZERO_TRAILER, SEG_DIR, _Fd


class SegmentReads(SegmentCapacity):
    """The segment format's reads (a part of ``SegmentFormat``)."""

    # ----- reads ------------------------------------------------------------------------------
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
        for done in self.s._map(self._read_run, self._runs(keys, pages)):
            for i in done:
                out[i] = True
        return out

    def _runs(self, keys: Sequence[bytes], pages: list[int]
              ) -> list[tuple[str, list[tuple[int, int, bytes, int]]]]:
        """The keys the index holds, as runs of contiguous slots of one segment, each
        (segment, [(slot, key's position, digest, host page)]), split into calls sized for
        the I/O threads and depth."""
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
        return work

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
        return max(1, _IOV_MAX // (pieces + 1))

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

    def _acquire_run(self, seg: str, run: list[tuple[int, int, bytes, int]]) -> Any:
        """The open segment a run of slots is read from; None (its slots forgotten) when it
        cannot be opened."""
        e = self._acquire(seg)
        if e is None:
            with self._lock:
                for slot, _, digest, _ in run:
                    self._forget_if(digest, seg, slot)
        return e

    def _read_run(self, item: tuple[str, list[tuple[int, int, bytes, int]]]) -> list[int]:
        seg, run = item
        s = self.s
        path = os.path.join(s.dir, SEG_DIR, seg)
        e = self._acquire_run(seg, run)
        if e is None:
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
                             for j, (_, _, _, page) in enumerate(run)], fn, start,
                            self.piece)
                    else:
                        got = _files._pread_all(fd, bufs, first * self.slot_bytes)
            except OSError as exc:
                s._io_error("read", path, exc)
                return []
            done = []
            plen = s.spec.page_bytes
            for j, (slot, i, digest, page) in enumerate(run):
                if got < (j + 1) * self.slot_bytes:
                    self._bad(seg, fd, slot, digest, _Bad("truncated", "segment ends "
                                                             f"before slot {slot}"), path)
                    continue
                raw = bytes(smv[j * self.tail_bytes:j * self.tail_bytes + TRAILER_BYTES])
                if raw == _ZERO_TRAILER:          # deleted (or never completed): plain miss
                    with self._lock:
                        self._forget_if(digest, seg, slot)
                    continue
                try:
                    t = parse_trailer(raw, s.spec.fingerprint, b"", plen, s._identities,
                                      key_digest=digest, v3_groups=s._v3_groups)
                    # the checksum of the bytes in the page now: taken as they arrived
                    # (hot), or over the page (another checksum kind, or not in memory)
                    have = sums[j] if sums and t.kind_id == s._kind_id else \
                        _checksum(t.kind_id, s._views(page))
                    if have != t.payload_sum:
                        raise _Bad("corrupted", "payload checksum mismatch")
                except _Bad as bad:
                    self._bad(seg, fd, slot, digest, bad, path)
                    continue
                done.append(i)
            if done:
                self._touch(seg, fd)
            return done
        finally:
            del bufs
            self._release(e)

    def get_group(self, keys: Sequence[bytes], pages: list[int], span: tuple[int, int],
                  a: int, b: int, last: bool) -> list[Marks | None]:
        """Ranged reads of layer groups ``span[0]`` through ``span[1]`` (payload bytes
        ``[a, b)``) of each key (``kvtier.l3_stores.file.ranged``): each key's marks, or None
        for a miss. Runs as ``get``'s (threads, calls in flight); a hit of the last group
        touches its segment."""
        out: list[Marks | None] = [None] * len(keys)
        part = (span, a, b, last)
        for done in self.s._map(lambda w: self._read_run_group(w, *part),
                                self._runs(keys, pages)):
            for i, marks in done:
                out[i] = marks
        return out

    def _read_run_group(self, item: tuple[str, list[tuple[int, int, bytes, int]]],
                        span: tuple[int, int], a: int, b: int, last: bool
                        ) -> list[tuple[int, Marks]]:
        seg, run = item
        s = self.s
        path = os.path.join(s.dir, SEG_DIR, seg)
        e = self._acquire_run(seg, run)
        if e is None:
            return []
        fd = e.fd
        direct = s._direct and s._direct_pool
        plen = s.spec.page_bytes
        got: list[tuple[list[memoryview], bytes] | _Bad] = []
        try:
            # the reads (within the calls-in-flight gate), then the checks
            with self._io_gate or contextlib.nullcontext():
                for slot, _, _, page in run:
                    try:
                        got.append(read_group(fd, slot * self.slot_bytes, plen,
                                              s._views(page), a, b, direct))
                    except _Bad as bad:
                        got.append(bad)
            done = []
            for (slot, i, digest, _), res in zip(run, got):
                def parse(raw: bytes, digest: bytes = digest) -> Trailer:
                    return parse_trailer(raw, s.spec.fingerprint, b"", plen, s._identities,
                                         key_digest=digest, v3_groups=s._v3_groups)
                try:
                    if isinstance(res, _Bad):
                        raise res
                    dst, raw = res
                    if raw == _ZERO_TRAILER:          # deleted (or never completed)
                        with self._lock:
                            self._forget_if(digest, seg, slot)
                        continue
                    marks = check_group(fd, slot * self.slot_bytes, plen, parse(raw), span,
                                        dst, a, b, direct, parse, len(s._groups))
                except _Bad as bad:
                    # a damaged range: the slot's other groups may still read, unless it is
                    # removed (remove_corrupted)
                    self._bad(seg, fd, slot, digest, bad, path,
                              forget=not isinstance(bad, BadRange))
                    continue
                done.append((i, marks))
            if done and last:
                self._touch(seg, fd)
            return done
        except OSError as exc:
            s._io_error("read", path, exc)
            return []
        finally:
            del got
            self._release(e)

    def _scratch(self, nbytes: int) -> memoryview:
        """A per-thread page-aligned scratch area of ``nbytes`` (trailer blocks; O_DIRECT
        needs aligned buffers), reused across calls."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.scratch = mmap.mmap(-1, max(nbytes, DIRECT_ALIGN))
        return memoryview(buf)[:nbytes]

    def _bad(self, seg: str, fd: int, slot: int, digest: bytes, bad: _Bad,
             path: str, forget: bool = True) -> None:
        """A slot found untrusted: counted, forgotten here (``forget``) and, where damaged
        (``remove_corrupted``), made a plain miss for everyone (then forgotten anyway)."""
        s = self.s
        s._count(errors=1, corrupted=1)
        s._bump(bad.kind)
        _warn_once(f"bad:{bad.kind}", f"file: untrusted slot {slot} of {path} ({bad}); "
                      "treated as a miss (further ones are only counted in stats)")
        remove = s.config.remove_corrupted and bad.kind != "truncated" and not s.read_only \
            and not bad.keep
        if forget or remove:
            with self._lock:
                self._forget_if(digest, seg, slot)
        if remove:
            self._zero_trailer(fd, slot)

    def _zero_trailer(self, fd: int, slot: int) -> None:
        """Make a slot a plain miss for every process (delete, or a corrupted slot)."""
        blk = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            n = -(-self.tail_bytes // DIRECT_ALIGN) * DIRECT_ALIGN
            off = slot * self.slot_bytes + self.s.spec.page_bytes
            if off % DIRECT_ALIGN == 0 and n == self.tail_bytes:
                os.pwritev(fd, [memoryview(blk)[:DIRECT_ALIGN]] * (n // DIRECT_ALIGN),
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

    def _crc(self) -> tuple[Any, int]:
        """The store's own checksum: (function, start value)."""
        kind = self.s._kind_id
        return checksum_impl(kind)[0], _CHECKSUM_START[kind]
