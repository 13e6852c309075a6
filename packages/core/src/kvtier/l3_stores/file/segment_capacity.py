"""The `file` store's ``segments`` format, its capacity: the bytes segments hold against
``capacity_bytes``, the share of it a new segment may take, and LRU eviction of whole
segments (never one a live writer may still append to). The format is described in
``kvtier.l3_stores.file.segments``."""

from __future__ import annotations

import os
import stat
import time

from .core import log
from .segment_index import SegmentIndex, _Seg, _segment_log


class SegmentCapacity(SegmentIndex):
    """The segment format's capacity and eviction (a part of ``SegmentFormat``)."""

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
                log.debug("file: evicting %s failed: %s", victim, exc)
                skip.add(victim)
                continue
            with self._lock:
                self._drop_seg(victim)
                self._logs.pop(_segment_log(victim), None)
            self._unlink(_segment_log(victim))    # its records index nothing now
        return evicted
