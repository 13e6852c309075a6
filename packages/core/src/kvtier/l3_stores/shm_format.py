"""The file format of the `shm` store's arena: its layout, geometry and header.

File layout (little endian)::

    [0, 4 KiB)              header: magic, format version, identity (KVSpec fingerprint,
                            namespace, a digest of both), geometry (payload and stride of a
                            slot, slot count, ways, offsets, file size), creator, CRC-32
    [4 KiB, data_off)       slot table, 64 bytes a slot: generation, last-use stamp, the
                            key's 32-byte BLAKE2b digest, payload CRC and flags
    [data_off, file end)    slots: ``slots`` x ``stride`` bytes (a page, rounded up)

The header is written last when an arena is created, and checked by every process that opens
one: a header that is not this format, identity and geometry refuses the file
(`kvtier.l3_stores.shm_arena` says what else is refused and why).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import zlib
from dataclasses import dataclass

MAGIC = b"KVTSHMAR"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
META_BYTES = 64
SMALL_PAGE = 4096
HUGE_PAGE = 2 << 20
#: magic, version, header bytes, meta bytes, fingerprint, namespace, identity digest, payload,
#: stride, slots, ways, sets, meta offset, data offset, file bytes, alignment, created (ns),
#: creator uid -- then a CRC-32 of all of it.
_HEADER = struct.Struct("<8sHHI16s64s16sQQQQQQQQQQI")
#: In the slot's flags word (bits 32-63 of meta word 6): the low 32 bits hold a CRC-32.
HAS_CRC = 1 << 32


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Geometry:
    """Where everything is in an arena of ``slots`` slots of ``payload`` bytes."""

    payload: int
    stride: int
    slots: int
    ways: int
    sets: int
    meta_off: int
    data_off: int
    file_bytes: int
    align: int

    @classmethod
    def plan(cls, payload: int, slots: int, ways: int, align: int = SMALL_PAGE) -> "Geometry":
        stride = _round_up(payload, 64 if payload < SMALL_PAGE else SMALL_PAGE)
        meta_off = HEADER_BYTES
        data_off = _round_up(meta_off + slots * META_BYTES, align)
        ways = max(1, min(ways, slots))
        return cls(payload, stride, slots, ways, max(1, slots // ways), meta_off, data_off,
                   _round_up(data_off + slots * stride, align), align)

    def fields(self) -> tuple[int, ...]:
        return (self.payload, self.stride, self.slots, self.ways, self.sets, self.meta_off,
                self.data_off, self.file_bytes, self.align)


def identity_digest(fingerprint: str, namespace: str) -> bytes:
    blob = json.dumps({"format": FORMAT_VERSION, "spec": fingerprint, "namespace": namespace},
                      sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvtier.shm.identity" + blob).digest()[:16]


def pack_header(geo: Geometry, fingerprint: str, namespace: str, uid: int) -> bytes:
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, META_BYTES,
                        fingerprint.encode("ascii")[:16].ljust(16, b"\0"),
                        namespace.encode("ascii")[:64].ljust(64, b"\0"),
                        identity_digest(fingerprint, namespace), *geo.fields(),
                        time.time_ns(), uid)
    return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


def check_header(raw: bytes, geo: Geometry, fingerprint: str, namespace: str) -> str:
    """"" if ``raw`` is a valid header of this identity and geometry, else why not, as
    ``kind: detail`` (kind: corrupted, foreign, geometry)."""
    n = _HEADER.size
    if len(raw) < n + 4:
        return f"truncated: a header of {len(raw)} bytes"
    f = _HEADER.unpack_from(raw)
    if f[0] != MAGIC:
        return "corrupted: not a kvtier shm arena (bad magic)"
    if struct.unpack_from("<I", raw, n)[0] != zlib.crc32(raw[:n]) & 0xFFFFFFFF:
        return "corrupted: header checksum mismatch"
    if f[1] != FORMAT_VERSION or f[2] != HEADER_BYTES or f[3] != META_BYTES:
        return f"foreign: arena format version {f[1]}, this kvtier writes {FORMAT_VERSION}"
    fp, ns = f[4].rstrip(b"\0").decode("ascii", "replace"), \
        f[5].rstrip(b"\0").decode("ascii", "replace")
    if fp != fingerprint or ns != namespace or f[6] != identity_digest(fingerprint, namespace):
        return f"foreign: arena of KVSpec {fp} namespace {ns!r}, this store is {fingerprint} " \
               f"namespace {namespace!r}"
    if tuple(f[7:16]) != geo.fields():
        have = dict(zip(("payload", "stride", "slots", "ways", "sets"), f[7:12]))
        return f"geometry: arena has {have}, this store's config gives " \
               f"{dict(zip(have, geo.fields()[:5]))}"
    return ""
