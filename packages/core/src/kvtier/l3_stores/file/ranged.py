"""Ranged reads of the `file` store (``batch_get_layers``), the part both formats share.

A ranged read of layer group ``g`` (payload bytes ``[a, b)``, see ``format``) of one object
(a file of the ``objects`` format, a slot of a segment) reads those bytes straight into the
host page's bytes of those layers (the page's other bytes are not touched), *then* the
object's trailer, and checks the range against the trailer read after it: the group
checksums are running checksums, so the range's bytes continued from entry ``g-1`` must give
entry ``g``. Bytes that changed under the read (a slot rewritten in place, a trailer zeroed by
a delete) disagree with the trailer read after them: a miss, never wrong bytes. An object
without group checksums (format version 2), or with those of another split into groups (a
writer with another ``group_bytes``, format 3 where its split differs), is read whole into
scratch memory, verified whole, and the range copied from there.

With ``O_DIRECT`` a range whose ends are not 4 KiB aligned is read through an aligned scratch
block covering it (the page cache is bypassed all the same) and copied into the page.

A read may span several consecutive groups (``batch_get_layers(..., through=h)``): one
range, checked from the running checksum before its first group to its last group's entry.

One version per page (``PageChains``): a page read group by group is one version of the
key's object even if another process rewrites the key between two groups. Each range read
into a host page leaves a mark of the object version it came from (the running checksum at
its last group's end); a range that continues the page (from the next group of the same key)
counts only if its object's running checksum where the range starts equals the mark, so the
page's earlier groups are that object's bytes too. Otherwise it is a miss (counted
``ranged_version_changes``; not an error).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable, Sequence

from . import _files
from .format import (_CHECKSUM_START, DIRECT_ALIGN, TRAILER_BYTES, Trailer, _Bad, _checksum,
                     _continue)

#: What a ranged read of one object leaves: (mark where the group starts, mark where it ends)
#: -- the object version's running checksum (or, read whole, its payload checksum).
Marks = tuple[tuple[str, int], tuple[str, int]]

_tls = threading.local()


def _scratch(nbytes: int, name: str) -> memoryview:
    """A per-thread page-aligned scratch area of at least ``nbytes`` (O_DIRECT needs aligned
    buffers); one per ``name``, reused across calls."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    buf = bufs.get(name)
    if buf is None or len(buf) < nbytes:
        buf = bufs[name] = mmap.mmap(-1, -(-max(nbytes, 1) // DIRECT_ALIGN) * DIRECT_ALIGN)
    return memoryview(buf)


def sub_views(views: Sequence[memoryview], a: int, b: int) -> list[memoryview]:
    """The parts of ``views`` (a page's pieces in logical order) holding bytes ``[a, b)``."""
    out = []
    at = 0
    for v in views:
        n = len(v)
        if at + n > a and at < b:
            out.append(v[max(0, a - at):min(n, b - at)])
        at += n
        if at >= b:
            break
    return out


def _copy(dst: Sequence[memoryview], src: memoryview) -> None:
    off = 0
    for v in dst:
        v[:] = src[off:off + len(v)]
        off += len(v)


def read_group(fd: int, base: int, plen: int, views: Sequence[memoryview], a: int, b: int,
               direct: bool) -> tuple[list[memoryview], bytes]:
    """Read payload bytes ``[a, b)`` of the object at offset ``base`` of ``fd`` into the
    part of ``views`` (the host page) holding them, then the object's trailer; returns (that
    part, the trailer's bytes). Raises _Bad (truncated) or OSError."""
    dst = sub_views(views, a, b)
    if direct and (a % DIRECT_ALIGN or b % DIRECT_ALIGN):
        a0, b0 = a // DIRECT_ALIGN * DIRECT_ALIGN, -(-b // DIRECT_ALIGN) * DIRECT_ALIGN
        buf = _scratch(b0 - a0, "range")
        got = _files._pread_all(fd, [buf[:b0 - a0]], base + a0)
        if got < b - a0:
            raise _Bad("truncated", f"read {got} bytes of layers at {a0}")
        _copy(dst, buf[a - a0:b - a0])
    else:
        got = _files._pread_all(fd, dst, base + a)
        if got != b - a:
            raise _Bad("truncated", f"read {got} of {b - a} bytes at {a}")
    tail = _scratch(DIRECT_ALIGN, "tail")
    if direct:        # one aligned block (an object written without O_DIRECT ends sooner)
        got = os.preadv(fd, [tail[:DIRECT_ALIGN]], base + plen)
    else:
        got = _files._pread_all(fd, [tail[:TRAILER_BYTES]], base + plen)
    if got < TRAILER_BYTES:
        raise _Bad("truncated", f"trailer of {got} bytes")
    return dst, bytes(tail[:TRAILER_BYTES])


def check_group(fd: int, base: int, plen: int, trailer: Trailer, span: tuple[int, int],
                dst: Sequence[memoryview], a: int, b: int, direct: bool,
                parse: Callable[[bytes], Trailer], groups: int) -> Marks:
    """Verify the range ``read_group`` put in ``dst`` (layer groups ``span[0]`` through
    ``span[1]`` of the reading store's ``groups``) against ``trailer`` (read after it): the
    running checksum continued from the entry before the first group over the range must
    give the last group's entry. An object without group checksums, or with checksums of
    another split (another number of groups), is read again whole (``parse`` checks the
    trailer of that read), verified whole and the range copied into ``dst``. Returns the
    marks of the object version; raises _Bad or OSError."""
    first, through = span
    if len(trailer.group_sums) == groups:
        sums = trailer.group_sums
        start = sums[first - 1] if first else _CHECKSUM_START[trailer.kind_id]
        if _continue(trailer.kind_id, dst, start) != sums[through]:
            where = f"{first}" if first == through else f"{first}-{through}"
            raise BadRange("corrupted", f"checksum mismatch in layer group {where}")
        return ("g", start), ("g", sums[through])
    want = plen + (DIRECT_ALIGN if direct else TRAILER_BYTES)
    buf = _scratch(want, "whole")
    got = _files._pread_all(fd, [buf[:want]], base)
    if got < plen + TRAILER_BYTES:
        raise _Bad("truncated", f"read {got} of {plen + TRAILER_BYTES} bytes")
    whole = parse(bytes(buf[plen:plen + TRAILER_BYTES]))
    if _checksum(whole.kind_id, [buf[:plen]]) != whole.payload_sum:
        raise _Bad("corrupted", "payload checksum mismatch")
    _copy(dst, buf[a:b])
    return ("w", whole.payload_sum), ("w", whole.payload_sum)


class BadRange(_Bad):
    """A range that does not match its group checksum (the trailer itself checked out): the
    object is damaged there, its other groups may still read."""


class PageChains:
    """Which object version each host page holds the groups of, while it is read group by
    group (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[int, tuple[bytes, int, tuple[str, int]]] = {}

    def settle(self, page: int, key: bytes, span: tuple[int, int], last: bool,
               marks: Marks | None) -> bool | None:
        """After a ranged read of groups ``span[0]`` through ``span[1]`` of ``key`` into
        ``page`` (``marks``: None for a miss): True where it counts, None where it continued
        the page from another version of the object (a miss), False for a miss."""
        first, through = span
        with self._lock:
            prev = self._at.pop(page, None)
            if marks is None:
                return False
            before, after = marks
            if first and prev is not None and prev[1] == first - 1 and prev[0] == key \
                    and prev[2] != before:
                return None
            if not last:
                self._at[page] = (key, through, after)
            return True
