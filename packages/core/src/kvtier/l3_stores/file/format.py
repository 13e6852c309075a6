"""The `file` store's object format: what a page's bytes are checked against.

Each object is the page's bytes followed by a 128-byte trailer: magic, format version, the
KVSpec fingerprint, the SHA-256 of the key, the payload length, a checksum of the payload
(CRC-32 or Adler-32 as zlib defines them; the trailer says which), the store's identity digest
(objects of another format version or namespace are misses), the group checksums and a CRC-32
of the trailer itself. The payload comes first so that it starts at offset 0 (aligned for
``O_DIRECT``) and one ``preadv`` lands it in the host page without a copy; objects written
with ``O_DIRECT`` carry zeros after the trailer up to the next 4 KiB. A file that is
truncated, corrupted, foreign (another spec, another key) or of an unknown format is a miss
and a counted error, never wrong KV.

Group checksums: the payload is the page in logical order, layer-major
(``[layer][component][token][head][dim]``), so layers ``lo..hi-1`` are one contiguous byte
range. The layers are split into ``G`` groups, group ``g`` = layers ``[g*L//G, (g+1)*L//G)``,
and the trailer's 32 formerly reserved bytes carry, per group, the payload checksum *running*
up to the end of that group (the checksum, of the payload's kind, of bytes 0 .. end of group
``g``; unused entries zero). Group ``g`` alone is verified by continuing the checksum from
entry ``g-1`` (from the checksum's start value for ``g = 0``) over its bytes; the last entry is
the payload checksum; a writer takes all of them in its one pass over the page, one checksum
call per group. Format version 4 records ``G`` in the trailer (the high half of the former
32-bit checksum-kind field, zero in older versions) and the writer chooses it: up to
``min(8, num_layers)`` groups of at least the store's ``group_bytes`` (one group, the whole
page, for small pages: each group is a call through the interpreter lock per page written,
and 8 of them per 1 MiB page halved a 16-thread store's write rate on tmpfs). Version 3 always
had ``min(8, num_layers)`` groups. A ranged read uses an object's group checksums where its
``G`` is the reading store's; otherwise (another writer's ``group_bytes``, version 3 objects
of another split, version 2 objects, which have none) it reads and verifies the whole
payload. Older versions are still read; an older reader takes version 4 objects for foreign
ones: misses, which with its ``remove_corrupted`` (the default) it removes as it reads them.
From version 4 on a reader leaves objects of a newer version alone (misses, counted
``foreign``, never removed): a newer kvtier sharing the directory keeps its objects.

Also here: the names of objects and fan-out directories (hex digits only), the checksum
implementations (the fastest bit-compatible one importable), and the store's identity record
and digest (what ``manifest.json`` records and every trailer carries).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import struct
import zlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

MAGIC = b"KVTIERPG"
#: 4: the trailer says how many layer groups it has checksums of; 3: per-group checksums of
#: min(8, num_layers) groups (ranged reads); 2: the store's identity digest.
FORMAT_VERSION = 4
#: Older object formats still read (a trailer of version 2 has no group checksums).
OLDER_VERSIONS = (3, 2)
#: Layer groups of an object: at most this many (each with a checksum in the trailer).
MAX_GROUPS = 8
MANIFEST = "manifest.json"
_MANIFEST_MAX = 1 << 16
SUFFIX = ".kvp"
TMP_SUFFIX = ".tmp"
DIRECT_ALIGN = 4096
MAX_HEX_KEY = 96           # longer keys are named by their SHA-256 (file names <= 255 bytes)

# magic, version, trailer length, checksum kind, group count (version 4; older versions wrote
# the kind as 32 bits, so zero here), spec fingerprint, sha256(key), payload length, payload
# checksum, identity digest -- then the group checksums (version 2: reserved zeros) and a
# CRC-32 of everything before it.
_FIELDS = struct.Struct("<8sHHHH16s32sQI16s")
TRAILER_BYTES = 128
_RESERVED = TRAILER_BYTES - _FIELDS.size - 4
_GROUP_SUMS = struct.Struct(f"<{MAX_GROUPS}I")
assert _GROUP_SUMS.size == _RESERVED
#: Checksum kinds recorded in the trailer: name -> (id, initial value).
_CHECKSUMS: dict[str, tuple[int, int]] = {"crc32": (1, 0), "adler32": (2, 1)}
_CHECKSUM_NAME = {kid: name for name, (kid, _) in _CHECKSUMS.items()}
_CHECKSUM_START = {kid: start for kid, start in _CHECKSUMS.values()}
#: Bit-compatible implementations, fastest first: ISA-L and zlib-ng compute the very same
#: CRC-32/Adler-32 several times faster than the system zlib (ISA-L is a dependency where it
#: has wheels), so objects stay readable by every installation.
_PROVIDERS = (("isal", "isal.isal_zlib"), ("zlib-ng", "zlib_ng.zlib_ng"), ("zlib", "zlib"))
_impl_cache: dict[int, tuple[Callable[..., int], str]] = {}
#: Names the store creates in a fan-out directory: objects (hex of the key, or "h" + its
#: SHA-256) and temporary files (a leading dot). Anything else is a foreign entry, left alone.
_OBJECT_RE = re.compile(r"(?:[0-9a-f]{2,%d}|h[0-9a-f]{64})\.kvp\Z" % (2 * MAX_HEX_KEY))
_TMP_RE = re.compile(r"\.[0-9a-z.]+-[0-9]+\.[0-9a-z]+\.tmp\Z")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}\Z")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")


def key_filename(key: bytes) -> tuple[str, str]:
    """(fan-out directory, file name) of a key: hex digits only, never a path separator."""
    name = key.hex() if len(key) <= MAX_HEX_KEY else "h" + hashlib.sha256(key).hexdigest()
    return f"{zlib.crc32(key) & 0xFF:02x}", name + SUFFIX


def checksum_impl(kind_id: int) -> tuple[Callable[..., int], str]:
    """(function, provider) computing checksum ``kind_id``: the fastest bit-compatible one
    importable here, checked against the stdlib on a known input before it is trusted."""
    hit = _impl_cache.get(kind_id)
    if hit is not None:
        return hit
    name = _CHECKSUM_NAME[kind_id]
    ref = getattr(zlib, name)
    probe = bytes(range(256)) * 40
    for provider, module in _PROVIDERS:
        try:
            fn = getattr(importlib.import_module(module), name)
            if fn(probe) == ref(probe) and fn(probe[7:], fn(probe[:7])) == ref(probe):
                _impl_cache[kind_id] = (fn, provider)
                return fn, provider
        except (ImportError, OSError, AttributeError, TypeError):
            continue
    _impl_cache[kind_id] = (ref, "zlib")
    return ref, "zlib"


def _checksum(kind_id: int, bufs: Sequence[memoryview]) -> int:
    fn = checksum_impl(kind_id)[0]
    value = _CHECKSUM_START[kind_id]
    for b in bufs:
        value = fn(b, value)
    return value & 0xFFFFFFFF


def _continue(kind_id: int, bufs: Sequence[memoryview], value: int) -> int:
    """Checksum ``kind_id`` continued from ``value`` over ``bufs``."""
    fn = checksum_impl(kind_id)[0]
    for b in bufs:
        value = fn(b, value)
    return value & 0xFFFFFFFF


def group_count(num_layers: int, page_bytes: int = 0, group_bytes: int = 0) -> int:
    """How many layer groups an object of ``page_bytes`` has: ``min(MAX_GROUPS, num_layers)``,
    fewer where groups would hold under ``group_bytes`` each (at least one; ``group_bytes``
    0: no such bound -- format 3's split)."""
    n = min(MAX_GROUPS, num_layers)
    if group_bytes > 0:
        n = max(1, min(n, page_bytes // group_bytes))
    return n


def layer_groups(num_layers: int, groups: int = 0) -> tuple[tuple[int, int], ...]:
    """The layer groups of an object: ``groups`` (default ``min(MAX_GROUPS, num_layers)``)
    ranges ``(lo, hi)``, group ``g`` = layers ``[g*L//G, (g+1)*L//G)``."""
    n = groups or min(MAX_GROUPS, num_layers)
    return tuple((g * num_layers // n, (g + 1) * num_layers // n) for g in range(n))


def group_ends(num_layers: int, page_bytes: int, groups: int = 0) -> list[int]:
    """The payload offset where each layer group ends (the last: ``page_bytes``); a layer is
    ``page_bytes // num_layers`` contiguous bytes of the payload (logical order)."""
    per_layer = page_bytes // num_layers
    return [hi * per_layer for _, hi in layer_groups(num_layers, groups)]


def running_checksums(kind_id: int, bufs: Sequence[memoryview], ends: Sequence[int]
                      ) -> list[int]:
    """The checksum of ``bufs`` (a page's pieces in logical order) running up to each offset
    of ``ends`` (increasing; the last is the total length, so the last value is the
    checksum of everything): one pass, each piece split where a group ends."""
    fn = checksum_impl(kind_id)[0]
    value = _CHECKSUM_START[kind_id]
    out: list[int] = []
    at = 0
    i = 0
    for b in bufs:
        n = len(b)
        off = 0
        while i < len(ends) and ends[i] <= at + n:
            cut = ends[i] - at
            if cut > off:
                value = fn(b[off:cut], value)
                off = cut
            out.append(value & 0xFFFFFFFF)
            i += 1
        if off < n:
            value = fn(b[off:] if off else b, value)
        at += n
    if len(out) != len(ends):
        raise ValueError(f"group ends {list(ends)} beyond {at} bytes")
    return out


def identity_record(fingerprint: str, namespace: str = "",
                    version: int | None = None) -> dict[str, Any]:
    """What a store directory's objects depend on and the store can know: the object format
    (``version``, the current one if None), the KVSpec (geometry, dtype, page size) and the
    key namespace it was given, if any."""
    return {"format": FORMAT_VERSION if version is None else version, "spec": fingerprint,
            "namespace": namespace}


def identity_digest(record: dict[str, Any]) -> bytes:
    blob = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvtier.file.identity" + blob).digest()[:16]


def identity_digests(fingerprint: str, namespace: str = "") -> dict[int, bytes]:
    """The identity digest objects of each readable format version carry: the current one's
    first, then the older versions'."""
    return {v: identity_digest(identity_record(fingerprint, namespace, v))
            for v in (FORMAT_VERSION, *OLDER_VERSIONS)}


def pack_trailer(fingerprint: str, key: bytes, payload_len: int, kind_id: int,
                 payload_sum: int, identity: bytes = b"", group_sums: Sequence[int] = ()
                 ) -> bytes:
    """A trailer of the current format version. ``group_sums``: the running checksum at
    the end of each layer group (1 to MAX_GROUPS values; the last is ``payload_sum``)."""
    if not 0 < len(group_sums) <= MAX_GROUPS or group_sums[-1] != payload_sum:
        raise ValueError(f"group checksums {list(group_sums)} do not end with the payload "
                         f"checksum {payload_sum}")
    head = _FIELDS.pack(MAGIC, FORMAT_VERSION, TRAILER_BYTES, kind_id, len(group_sums),
                        fingerprint.encode("ascii")[:16].ljust(16, b"\0"),
                        hashlib.sha256(key).digest(), payload_len, payload_sum,
                        identity[:16].ljust(16, b"\0"))
    head += _GROUP_SUMS.pack(*group_sums, *[0] * (MAX_GROUPS - len(group_sums)))
    return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


class _Bad(Exception):
    """An object that must not be trusted; ``kind`` names the stats counter. ``keep``: not the
    store's to remove even with ``remove_corrupted`` (an object of a newer format version: a
    newer kvtier's, sharing the directory)."""

    def __init__(self, kind: str, why: str, keep: bool = False):
        super().__init__(why)
        self.kind = kind
        self.keep = keep


class Trailer(NamedTuple):
    """A verified trailer: its format version, checksum kind, payload checksum and group
    checksums (running, one per layer group of the object's split; empty for a version
    without them)."""

    version: int
    kind_id: int
    payload_sum: int
    group_sums: tuple[int, ...]


def parse_trailer(raw: bytes, fingerprint: str, key: bytes, payload_len: int,
                  identities: Mapping[int, bytes], key_digest: bytes | None = None,
                  v3_groups: int = 0) -> Trailer:
    """Validate a trailer (of ``key``, or of the key whose SHA-256 is ``key_digest``) of any
    readable format version, ``identities`` giving the identity digest each version's objects
    carry; ``v3_groups``: how many layer groups format 3 split these pages in
    (``min(MAX_GROUPS, num_layers)``; format 4 says it in the trailer). The group checksums
    are checked for consistency: the last is the payload checksum, unused entries are zero.
    Raises _Bad."""
    if len(raw) != TRAILER_BYTES:
        raise _Bad("truncated", f"trailer of {len(raw)} bytes")
    want_digest = key_digest
    (magic, version, tlen, kind_id, count, fp, key_digest, plen, psum, ident) = \
        _FIELDS.unpack_from(raw)
    if magic != MAGIC:
        raise _Bad("corrupted", "bad magic")
    if version > FORMAT_VERSION:      # before the trailer's own checksum: its layout may differ
        raise _Bad("foreign", f"format version {version}, newer than this kvtier's "
                   f"{FORMAT_VERSION}", keep=True)
    if struct.unpack_from("<I", raw, TRAILER_BYTES - 4)[0] != \
            zlib.crc32(raw[:TRAILER_BYTES - 4]) & 0xFFFFFFFF:
        raise _Bad("corrupted", "trailer checksum mismatch")
    if (version != FORMAT_VERSION and version not in OLDER_VERSIONS) \
            or tlen != TRAILER_BYTES or kind_id not in _CHECKSUM_NAME:
        raise _Bad("foreign", f"unknown format version {version} / checksum {kind_id}")
    if fp.rstrip(b"\0") != fingerprint.encode("ascii")[:16]:
        raise _Bad("foreign", f"KVSpec fingerprint {fp!r} is not {fingerprint}")
    if key_digest != (hashlib.sha256(key).digest() if want_digest is None else want_digest):
        raise _Bad("foreign", "object belongs to another key")
    if plen != payload_len:
        raise _Bad("foreign", f"payload of {plen} bytes, pages have {payload_len}")
    if ident != identities.get(version, b"")[:16].ljust(16, b"\0"):
        raise _Bad("foreign", "object of another store identity (namespace or format)")
    if version == 2:
        return Trailer(version, kind_id, psum, ())
    if version == 3:
        if count:
            raise _Bad("corrupted", f"format 3 trailer with a group count ({count})")
        groups = v3_groups
    elif not 0 < count <= MAX_GROUPS:
        raise _Bad("corrupted", f"trailer with {count} layer groups")
    else:
        groups = count
    sums = _GROUP_SUMS.unpack_from(raw, _FIELDS.size)
    if groups and (not 0 < groups <= MAX_GROUPS or sums[groups - 1] != psum
                   or any(sums[groups:])):
        raise _Bad("corrupted", "group checksums disagree with the payload checksum")
    return Trailer(version, kind_id, psum, sums[:groups] if groups else sums)


def check_trailer(raw: bytes, fingerprint: str, key: bytes, payload_len: int,
                  identity: bytes = b"", key_digest: bytes | None = None) -> tuple[int, int]:
    """Validate a trailer of the current format version (of ``key``, or of the key whose
    SHA-256 is ``key_digest``); returns (checksum kind, payload checksum) or raises _Bad."""
    t = parse_trailer(raw, fingerprint, key, payload_len, {FORMAT_VERSION: identity},
                      key_digest)
    if t.version != FORMAT_VERSION:
        raise _Bad("foreign", f"format version {t.version} is not {FORMAT_VERSION}")
    return t.kind_id, t.payload_sum
