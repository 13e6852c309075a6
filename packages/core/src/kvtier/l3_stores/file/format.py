"""The `file` store's object format: what a page's bytes are checked against.

Each object is the page's bytes followed by a 128-byte trailer: magic, format version, the
KVSpec fingerprint, the SHA-256 of the key, the payload length, a checksum of the payload
(CRC-32 or Adler-32 as zlib defines them; the trailer says which), the store's identity digest
(objects of another format version or namespace are misses) and a CRC-32 of the
trailer itself. The payload comes first so that it starts at offset 0 (aligned for
``O_DIRECT``) and one ``preadv`` lands it in the host page without a copy; objects written
with ``O_DIRECT`` carry zeros after the trailer up to the next 4 KiB. A file that is
truncated, corrupted, foreign (another spec, another key) or of an unknown format is a miss
and a counted error, never wrong KV.

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
from typing import Any, Callable, Sequence

MAGIC = b"KVTIERPG"
FORMAT_VERSION = 2         # 2: the trailer carries the store's identity digest
MANIFEST = "manifest.json"
_MANIFEST_MAX = 1 << 16
SUFFIX = ".kvp"
TMP_SUFFIX = ".tmp"
DIRECT_ALIGN = 4096
MAX_HEX_KEY = 96           # longer keys are named by their SHA-256 (file names <= 255 bytes)

# magic, version, trailer length, checksum kind, spec fingerprint, sha256(key), payload length,
# payload checksum, identity digest -- then reserved zeros and a CRC-32 of everything before it.
_FIELDS = struct.Struct("<8sHHI16s32sQI16s")
TRAILER_BYTES = 128
_RESERVED = TRAILER_BYTES - _FIELDS.size - 4
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


def identity_record(fingerprint: str, namespace: str = "") -> dict[str, Any]:
    """What a store directory's objects depend on and the store can know: the object format,
    the KVSpec (geometry, dtype, page size) and the key namespace it was given, if any."""
    return {"format": FORMAT_VERSION, "spec": fingerprint, "namespace": namespace}


def identity_digest(record: dict[str, Any]) -> bytes:
    blob = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvtier.file.identity" + blob).digest()[:16]


def pack_trailer(fingerprint: str, key: bytes, payload_len: int, kind_id: int,
                 payload_sum: int, identity: bytes = b"") -> bytes:
    head = _FIELDS.pack(MAGIC, FORMAT_VERSION, TRAILER_BYTES, kind_id,
                        fingerprint.encode("ascii")[:16].ljust(16, b"\0"),
                        hashlib.sha256(key).digest(), payload_len, payload_sum,
                        identity[:16].ljust(16, b"\0"))
    head += bytes(_RESERVED)
    return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


class _Bad(Exception):
    """An object that must not be trusted; ``kind`` names the stats counter."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


def check_trailer(raw: bytes, fingerprint: str, key: bytes, payload_len: int,
                  identity: bytes = b"", key_digest: bytes | None = None) -> tuple[int, int]:
    """Validate a trailer (of ``key``, or of the key whose SHA-256 is ``key_digest``);
    returns (checksum kind, payload checksum) or raises _Bad."""
    if len(raw) != TRAILER_BYTES:
        raise _Bad("truncated", f"trailer of {len(raw)} bytes")
    want_digest = key_digest
    (magic, version, tlen, kind_id, fp, key_digest, plen, psum, ident) = \
        _FIELDS.unpack_from(raw)
    if magic != MAGIC:
        raise _Bad("corrupted", "bad magic")
    if struct.unpack_from("<I", raw, TRAILER_BYTES - 4)[0] != \
            zlib.crc32(raw[:TRAILER_BYTES - 4]) & 0xFFFFFFFF:
        raise _Bad("corrupted", "trailer checksum mismatch")
    if version != FORMAT_VERSION or tlen != TRAILER_BYTES or kind_id not in _CHECKSUM_NAME:
        raise _Bad("foreign", f"unknown format version {version} / checksum {kind_id}")
    if fp.rstrip(b"\0") != fingerprint.encode("ascii")[:16]:
        raise _Bad("foreign", f"KVSpec fingerprint {fp!r} is not {fingerprint}")
    if key_digest != (hashlib.sha256(key).digest() if want_digest is None else want_digest):
        raise _Bad("foreign", "object belongs to another key")
    if plen != payload_len:
        raise _Bad("foreign", f"payload of {plen} bytes, pages have {payload_len}")
    if ident != identity[:16].ljust(16, b"\0"):
        raise _Bad("foreign", "object of another store identity (namespace or format)")
    return kind_id, psum
