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
SHA-256 of the key, payload length, payload checksum, identity digest, group checksums, CRC
of the trailer), zero-padded to a multiple of 4 KiB, so every payload starts 4 KiB-aligned
and ``O_DIRECT`` works for pages of 4 KiB multiples; other pages use the page cache
(``o_direct`` keeps its auto/on/off meaning). A segment is preallocated
(``posix_fallocate``) when it is created, and its log with room for its records, so a full
disk fails there and not after pages were written: a miss and a counted error per page. A
nearly full disk (or a file size limit) gets smaller segments, down to one slot.

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
writes to one file; a run is moved in calls of ``io_call_bytes`` with each call's checksum
taken beside it (``_hotio``); segments are sized with ``ftruncate`` while the
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
named is a miss. Ranged reads (``batch_get_layers``) group the slots the same way and read
each slot's layer range into its page, then its trailer (``kvtier.l3_stores.file.ranged``);
a range that fails its group checksum is counted, and the slot's other groups still read
unless it is zeroed (``remove_corrupted``).

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

import hashlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from . import _hotio
from .format import DIRECT_ALIGN, TRAILER_BYTES
from .segment_index import _LOG_RE, _SEAL, _SEG_RE, SEG_DIR, _Fd, _Log, _Seg, pack_record
from .segment_writes import SegmentWrites, _Lane

if TYPE_CHECKING:
    from .store import FileStore


class SegmentFormat(SegmentWrites):
    """The segment format's state and I/O, on behalf of one ``FileStore`` (its helpers:
    directory descriptor, page views, counters, I/O thread pool)."""

    def __init__(self, store: "FileStore"):
        self.s = store
        c = store.config
        spec = store.spec
        self.slot_bytes = -(-(spec.page_bytes + TRAILER_BYTES) // DIRECT_ALIGN) \
            * DIRECT_ALIGN
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
        #: in memory: checksum each call's piece beside it (``_hotio``), and segments
        #: and logs are sized with ftruncate while there is ample room (tmpfs allocates on
        #: write; preallocating is one more pass over the pages' memory; see _reserve)
        self.hot = self.medium == "memory"
        #: bytes per call there (``_hotio``): the store's ``io_call_bytes``
        self.piece = _hotio.piece_bytes(c.io_call_bytes)
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
