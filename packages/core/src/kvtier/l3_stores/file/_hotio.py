"""Slot I/O for the `file` store's segments where the medium is memory (tmpfs, ramfs): the
payload checksum runs on each piece while it is in the CPU cache.

On a disk the checksum is a pass over host memory before a write call (or after a read
call) of several MiB, and the device is the limit. In memory the copy into or out of the
file is the whole cost, and the checksum's own pass over a run of pages -- read back from
DRAM after the run's copy -- costs as much again per byte as the copy (ISA-L's CRC-32 runs at
13 GB/s per core from DRAM, at 90-100 from L2). So here a run is moved in calls of about
``HOT_BYTES``: a write checksums each piece just before the call that copies it (the copy
then reads the piece from the cache too), a read checksums each piece just after the call
that copied it. Calls are small (the copy is the cost; a syscall per 512 KiB is noise), and
offsets stay multiples of 4 KiB wherever the pages are, so ``O_DIRECT`` descriptors work.

Nothing changes on disk: a slot is still the page followed by its trailer block, the
trailer written in the same call as the page's last piece or after it, and the index record
only once every call of the run returned; a reader still verifies every page's checksum
before it counts as a hit (``sums`` below are the checksums of the bytes now in host memory).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from . import _files

#: Bytes per call: pieces of at most this, and a call is made once this much is pending, so
#: at most about twice this is in flight between checksum and copy (within a core's L2).
HOT_BYTES = 512 << 10


def _pieces(views: Sequence[memoryview]) -> Iterator[memoryview]:
    for v in views:
        for o in range(0, len(v), HOT_BYTES):
            yield v[o:o + HOT_BYTES]


def _cut(views: Sequence[memoryview], ends: Sequence[int]
         ) -> Iterator[tuple[memoryview, bool]]:
    """``_pieces`` also cut where a layer group ends: (piece, whether a group ends with it)."""
    at = 0
    i = 0
    for v in views:
        n = len(v)
        o = 0
        while o < n:
            stop = min(n, o + HOT_BYTES)
            while i < len(ends) and ends[i] - at <= o:
                i += 1           # an end at a piece boundary already passed
            if i < len(ends) and ends[i] - at < stop:
                stop = ends[i] - at
            yield v[o:stop], i < len(ends) and ends[i] - at == stop
            o = stop
        at += n


def write_hot(fd: int, offset: int, pages: Sequence[tuple[Sequence[memoryview], memoryview]],
              fn: Callable[..., int], start: int,
              seal: Callable[[int, list[int]], None], ends: Sequence[int]) -> None:
    """Write consecutive slots from ``offset``: per page its views then its tail block;
    ``seal(j, sums)`` fills page j's tail (its trailer) once its running checksums at
    ``ends`` (where each layer group ends; the last is the page's checksum) are known,
    before the tail is written. Raises OSError as ``_pwrite_all`` does."""
    pend: list[memoryview] = []
    pend_bytes = 0
    at = offset
    for j, (views, tail) in enumerate(pages):
        value = start
        sums: list[int] = []
        for piece, ends_group in _cut(views, ends):
            value = fn(piece, value)
            if ends_group:
                sums.append(value & 0xFFFFFFFF)
            pend.append(piece)
            pend_bytes += len(piece)
            if pend_bytes >= HOT_BYTES:
                _files._pwrite_all(fd, pend, at)
                at, pend, pend_bytes = at + pend_bytes, [], 0
        seal(j, sums)
        pend.append(tail)
        pend_bytes += len(tail)
    if pend:
        _files._pwrite_all(fd, pend, at)


def read_hot(fd: int, offset: int, pages: Sequence[tuple[Sequence[memoryview], memoryview]],
             fn: Callable[..., int], start: int) -> tuple[int, list[int]]:
    """Read consecutive slots from ``offset`` into each page's views and tail block; returns
    (bytes read, each page's checksum of what is now in its views). A read that ends early
    (end of file) stops there: pages past ``bytes read`` are incomplete, their checksums
    partial. Raises OSError as ``_pread_all`` does."""
    sums = [start] * len(pages)
    pend: list[tuple[memoryview, int]] = []
    pend_bytes = 0
    got = 0

    def flush() -> bool:
        nonlocal got
        n = _files._pread_all(fd, [v for v, _ in pend], offset + got)
        left = n
        for v, j in pend:
            if j >= 0:
                sums[j] = fn(v[:left] if left < len(v) else v, sums[j])
            left -= len(v)
            if left <= 0:
                break
        got += n
        return n == pend_bytes

    for j, (views, tail) in enumerate(pages):
        for piece in _pieces(views):
            pend.append((piece, j))
            pend_bytes += len(piece)
            if pend_bytes >= HOT_BYTES:
                if not flush():
                    return got, [v & 0xFFFFFFFF for v in sums]
                pend, pend_bytes = [], 0
        pend.append((tail, -1))
        pend_bytes += len(tail)
    if pend:
        flush()
    return got, [v & 0xFFFFFFFF for v in sums]
