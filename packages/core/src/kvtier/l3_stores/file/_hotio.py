"""Slot I/O for the `file` store's segments where the medium is memory (tmpfs, ramfs): the
payload checksum runs on each piece right next to the call that copies it.

On a disk the checksum is a pass over host memory before a write call (or after a read
call) of several MiB, and the device is the limit. In memory the copy into or out of the
file is the whole cost, so a run is moved in calls of about ``piece`` bytes (the store's
``io_call_bytes``): a write checksums each piece just before the call that copies it, a
read checksums each piece just after the call that copied it. Small pieces (512 KiB, within
a core's L2) keep the checksum's read in the cache -- on a two-core box up to 30% of the
store's rate for 1 MiB pages -- but every call is a round trip through the interpreter lock;
on a 16-core host pieces of 2-8 MiB were as fast or faster (records/file-store-threads.md),
so the default is the store's 8 MiB. Offsets stay multiples of 4 KiB wherever the pages are,
so ``O_DIRECT`` descriptors work.

Nothing changes on disk: a slot is still the page followed by its trailer block, the
trailer written in the same call as the page's last piece or after it, and the index record
only once every call of the run returned; a reader still verifies every page's checksum
before it counts as a hit (``sums`` below are the checksums of the bytes now in host memory).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from . import _files
from .format import DIRECT_ALIGN


def piece_bytes(call_bytes: int) -> int:
    """Bytes per call for a store whose calls aim at ``call_bytes``: pieces of at most this,
    and a call is made once this much is pending; a multiple of 4 KiB."""
    return max(DIRECT_ALIGN, call_bytes // DIRECT_ALIGN * DIRECT_ALIGN)


def _pieces(views: Sequence[memoryview], piece: int) -> Iterator[memoryview]:
    for v in views:
        for o in range(0, len(v), piece):
            yield v[o:o + piece]


def _cut(views: Sequence[memoryview], ends: Sequence[int], piece: int
         ) -> Iterator[tuple[memoryview, bool]]:
    """``_pieces`` also cut where a layer group ends: (piece, whether a group ends with it)."""
    at = 0
    i = 0
    for v in views:
        n = len(v)
        o = 0
        while o < n:
            stop = min(n, o + piece)
            while i < len(ends) and ends[i] - at <= o:
                i += 1           # an end at a piece boundary already passed
            if i < len(ends) and ends[i] - at < stop:
                stop = ends[i] - at
            yield v[o:stop], i < len(ends) and ends[i] - at == stop
            o = stop
        at += n


def write_hot(fd: int, offset: int, pages: Sequence[tuple[Sequence[memoryview], memoryview]],
              fn: Callable[..., int], start: int,
              seal: Callable[[int, list[int]], None], ends: Sequence[int], piece: int
              ) -> None:
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
        for part, ends_group in _cut(views, ends, piece):
            value = fn(part, value)
            if ends_group:
                sums.append(value & 0xFFFFFFFF)
            pend.append(part)
            pend_bytes += len(part)
            if pend_bytes >= piece:
                _files._pwrite_all(fd, pend, at)
                at, pend, pend_bytes = at + pend_bytes, [], 0
        seal(j, sums)
        pend.append(tail)
        pend_bytes += len(tail)
    if pend:
        _files._pwrite_all(fd, pend, at)


def read_hot(fd: int, offset: int, pages: Sequence[tuple[Sequence[memoryview], memoryview]],
             fn: Callable[..., int], start: int, piece: int) -> tuple[int, list[int]]:
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
        for part in _pieces(views, piece):
            pend.append((part, j))
            pend_bytes += len(part)
            if pend_bytes >= piece:
                if not flush():
                    return got, [v & 0xFFFFFFFF for v in sums]
                pend, pend_bytes = [], 0
        pend.append((tail, -1))
        pend_bytes += len(tail)
    if pend:
        flush()
    return got, [v & 0xFFFFFFFF for v in sums]
