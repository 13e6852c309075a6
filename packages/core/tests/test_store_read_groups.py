"""Ranged ("streamed") L3 reads: `read_groups` / `batch_get_layers` of the `file` store (both
formats) and the `memory` store, beyond the contract suite (kvtier.testing.read_groups).

Random bytes (never zeros), random host pages, odd geometries (3, 5, 13 layers, odd page
sizes), both host pool layouts. On disk: the format-4 trailer's group checksums and group
count against a reference computed here, the split by ``group_bytes`` (stores of other splits
sharing a directory), a corrupted group (a miss, the others still read), objects of formats 2
and 3 (trailers built here: read whole per group, or by their group checksums where format
3's split is the store's), unknown versions, O_DIRECT with aligned
and unaligned groups, the LRU touch, and a writer process rewriting keys while groups are
read (every group reported True is bitwise one generation, and so is every page whose groups
all came back True).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import pytest
import torch

from kvtier.errors import ConfigError, InvalidArgumentError, PageIndexError
from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import FileStore, key_filename
from kvtier.l3_stores.memory import MemoryStore
from kvtier.spec import KVSpec
from kvtier.testing import fill_random, make_host_pool

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "store_groups_child.py")
sys.path.insert(0, HERE)
import store_groups_child as child  # noqa: E402

SPECS = [
    KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16"),
    KVSpec.mha(num_layers=5, num_kv_heads=1, head_dim=40, page_size=3, dtype="float32"),
    KVSpec.mla(num_layers=13, kv_lora_rank=48, rope_dim=8, page_size=7, dtype="bfloat16"),
]
SPEC13 = SPECS[2]
KINDS = ("segments", "objects", "memory")
FILE_KINDS = ("segments", "objects")
TRAILER = 128
NUM_PAGES = 24


def spec_id(spec: KVSpec) -> str:
    return f"L{spec.num_layers}-p{spec.page_size}"


def make_store(kind: str, root: str, spec: KVSpec, **config) -> FileStore | MemoryStore:
    if kind == "memory":
        return MemoryStore(spec=spec)
    # these pages are small: layer groups of any size (the default wants 1 MiB a group)
    return FileStore({"root": root, "format": kind, "io_threads": 3, "group_bytes": 0,
                      **config}, spec=spec)


@pytest.fixture
def opened(request, tmp_path):
    """(store, pool) for ``(kind, spec, layout)`` of the test's parameters."""
    made = []

    def open_(kind: str, spec: KVSpec, layout: str = "page_first", root: str | None = None,
              pool: HostKVPool | None = None, **config):
        if pool is None:
            pool = make_host_pool(spec, NUM_PAGES, layout)
            made.append(pool)
        s = make_store(kind, root or str(tmp_path / "store"), spec, **config)
        s.attach(pool)
        made.append(s)
        return s, pool
    yield open_
    for obj in reversed(made):
        obj.close()


def page(pool: HostKVPool, p: int) -> torch.Tensor:
    return torch.cat(pool.page_segments(p)).clone()


def byte_range(spec: KVSpec, group: tuple[int, int]) -> tuple[int, int]:
    per_layer = spec.page_bytes // spec.num_layers
    return group[0] * per_layer, group[1] * per_layer


def reference_groups(num_layers: int) -> list[tuple[int, int]]:
    n = min(8, num_layers)
    return [(g * num_layers // n, (g + 1) * num_layers // n) for g in range(n)]


def write_random(store, pool, n: int, rng: random.Random, tag: str = ""
                 ) -> tuple[list[bytes], list[torch.Tensor], list[int]]:
    """``n`` keys stored from random host pages; returns (keys, their bytes, free pages)."""
    src = rng.sample(range(pool.num_pages), n)
    keys = [f"rg-{tag}-{os.urandom(4).hex()}-{i}".encode() for i in range(n)]
    want = [page(pool, p) for p in src]
    assert store.batch_set(keys, src) == [True] * n
    fill_random(pool.raw)
    return keys, want, [p for p in range(pool.num_pages) if p not in src]


def read_group_checked(store, pool, keys, dst, g, want, expect=None) -> list[bool]:
    """Read group ``g`` into ``dst``; check each True range bitwise against ``want`` and that
    no byte outside the range changed (nor any byte of a page that came back False... except
    its range, which a failed read may have written)."""
    spec = store.spec
    a, b = byte_range(spec, store.read_groups()[g])
    before = [page(pool, p) for p in dst]
    got = store.batch_get_layers(keys, dst, g)
    assert isinstance(got, list) and len(got) == len(keys)
    if expect is not None:
        assert got == expect, f"group {g}: {got} (expected {expect})"
    for j, p in enumerate(dst):
        now = page(pool, p)
        assert torch.equal(now[:a], before[j][:a]) and torch.equal(now[b:], before[j][b:]), \
            f"group {g}: host page {p} changed outside layers {store.read_groups()[g]}"
        if got[j]:
            assert torch.equal(now[a:b], want[j][a:b]), f"group {g}: wrong bytes reported True"
    return got


# --------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
@pytest.mark.parametrize("kind", KINDS)
def test_groups_round_trip_bitwise_into_random_pages(opened, kind, spec, layout):
    """Every group of every key lands bitwise in random host pages, in order and shuffled,
    touching no other byte; the groups are min(8, L) ranges covering the layers in order."""
    store, pool = opened(kind, spec, layout)
    assert store.read_groups() == tuple(reference_groups(spec.num_layers))
    rng = random.Random(spec.num_layers * 7 + len(layout))
    keys, want, free = write_random(store, pool, 6, rng)
    for order in ("in order", "shuffled"):
        dst = rng.sample(free, len(keys))
        gs = list(range(len(store.read_groups())))
        if order == "shuffled":
            rng.shuffle(gs)
        for g in gs:
            read_group_checked(store, pool, keys, dst, g, want, [True] * len(keys))
        for j, p in enumerate(dst):
            assert torch.equal(page(pool, p), want[j]), f"{order}: page {p}"
    assert store.batch_get(keys, dst) == [True] * len(keys)     # whole pages as before


@pytest.mark.parametrize("kind", KINDS)
def test_misses_leave_pages_alone_and_stats_count(opened, kind):
    store, pool = opened(kind, SPEC13, "layer_first")
    rng = random.Random(3)
    keys, want, free = write_random(store, pool, 3, rng)
    before = store.stats()
    dst = rng.sample(free, 4)
    missing = [b"never-written"]
    for g in range(8):
        got = read_group_checked(store, pool, keys[:2] + missing + keys[2:], dst, g,
                                 want[:2] + [want[0]] + want[2:], [True, True, False, True])
        assert got[2] is False
    after = store.stats()
    assert after["ranged_reads"] - before["ranged_reads"] == 8 * 4
    assert after["ranged_hits"] - before["ranged_hits"] == 8 * 3
    assert after["bytes_read"] - before["bytes_read"] == 3 * SPEC13.page_bytes
    # a page read group by group is one get (its first group) and one hit (its last)
    assert after["gets"] - before["gets"] == 4 and after["get_hits"] - before["get_hits"] == 3
    assert after["errors"] == before["errors"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [True, False, -1, 8, 2**63, 1.0, "0", None, b"\x00"],
                         ids=["True", "False", "-1", "G", "2**63", "float", "str", "None",
                              "bytes"])
def test_bad_group_values_are_typed_errors_before_anything(opened, kind, bad):
    store, pool = opened(kind, SPEC13)
    keys, _, _ = write_random(store, pool, 2, random.Random(1))
    raw = pool.raw.clone()
    before = store.stats()
    with pytest.raises(InvalidArgumentError):
        store.batch_get_layers(keys, [20, 21], bad)
    with pytest.raises(PageIndexError):
        store.batch_get_layers(keys, [20, NUM_PAGES], 0)
    with pytest.raises(InvalidArgumentError):
        store.batch_get_layers(keys, [20, 20], 0)
    with pytest.raises(InvalidArgumentError):
        store.batch_get_layers([keys[0], "str"], [20, 21], 0)        # type: ignore[list-item]
    assert torch.equal(pool.raw, raw), "a refused ranged read touched the pool"
    assert store.stats()["ranged_reads"] == before["ranged_reads"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_page_read_group_by_group_is_one_version(opened, kind):
    """The key is rewritten (other bytes) after group 0 was read into a page: group 1
    continuing that page is a miss (counted), never old layers beside new ones; read from
    group 0 again, the page is the new version; a group read alone still reads."""
    store, pool = opened(kind, SPEC13)
    rng = random.Random(5)
    keys, want, free = write_random(store, pool, 1, rng)
    dst = free[:1]
    read_group_checked(store, pool, keys, dst, 0, want, [True])
    src2 = free[1]
    new = page(pool, src2)
    assert store.batch_set(keys, [src2]) == [True]
    before = store.stats()["ranged_version_changes"]
    assert store.batch_get_layers(keys, dst, 1) == [False]
    assert store.stats()["ranged_version_changes"] == before + 1
    for g in range(8):
        read_group_checked(store, pool, keys, dst, g, [new], [True])
    assert torch.equal(page(pool, dst[0]), new)
    other = free[2:3]
    read_group_checked(store, pool, keys, other, 5, [new], [True])   # alone: no chain


# --------------------------------------------------------------------------------------------
# the format on disk
# --------------------------------------------------------------------------------------------
def locate(store: FileStore, key: bytes) -> tuple[str, int]:
    """(file, offset of the object's payload) of ``key``."""
    if store.config.format == "segments":
        found = store._seg.locate(key)
        assert found is not None
        return found
    sub, name = key_filename(key)
    return os.path.join(store.dir, sub, name), 0


def read_at(path: str, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def write_at(path: str, off: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


_FIELDS = struct.Struct("<8sHHI16s32sQI16s")      # the trailer's fields, as format 2 wrote them
_FIELDS4 = struct.Struct("<8sHHHH16s32sQI16s")    # format 4: the kind's high half, the groups


def identity_digest_v(spec: KVSpec, version: int, namespace: str = "") -> bytes:
    rec = {"format": version, "spec": spec.fingerprint, "namespace": namespace}
    blob = json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvtier.file.identity" + blob).digest()[:16]


def old_trailer(spec: KVSpec, key: bytes, payload: bytes, version: int = 2,
                checksum: str = "crc32") -> bytes:
    """A trailer as format 2 wrote it: reserved zeros where format 3 has group checksums;
    as format 3 wrote it (``version=3``): the running checksums of ``min(8, num_layers)``
    groups there, and no group count."""
    kind, fn = (1, zlib.crc32) if checksum == "crc32" else (2, zlib.adler32)
    head = _FIELDS.pack(b"KVTIERPG", version, TRAILER, kind,
                        spec.fingerprint.encode()[:16].ljust(16, b"\0"),
                        hashlib.sha256(key).digest(), len(payload), fn(payload) & 0xFFFFFFFF,
                        identity_digest_v(spec, version))
    if version == 3:
        ends = [byte_range(spec, grp)[1] for grp in reference_groups(spec.num_layers)]
        sums = [fn(payload[:e]) & 0xFFFFFFFF for e in ends]
        head += struct.pack("<8I", *sums, *[0] * (8 - len(sums)))
    else:
        head += bytes(TRAILER - _FIELDS.size - 4)
    return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


@pytest.mark.parametrize("checksum", ["crc32", "adler32"])
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_trailer_carries_running_group_checksums(opened, kind, spec, checksum):
    """Format 4 on disk: the version, the checksum kind and the group count, and per group
    the payload checksum running up to the group's end (computed here with zlib), the last
    equal to the payload checksum, unused entries zero."""
    store, pool = opened(kind, spec, "layer_first", checksum=checksum)
    keys, want, _ = write_random(store, pool, 1, random.Random(9))
    path, off = locate(store, keys[0])
    payload = read_at(path, off, spec.page_bytes)
    assert payload == bytes(want[0].tolist())
    raw = read_at(path, off + spec.page_bytes, TRAILER)
    fields = _FIELDS4.unpack_from(raw)
    assert fields[1] == 4, "objects are written in format 4"
    fn = zlib.crc32 if checksum == "crc32" else zlib.adler32
    assert fields[3] == (1 if checksum == "crc32" else 2)
    sums = struct.unpack_from("<8I", raw, _FIELDS.size)
    ends = [byte_range(spec, grp)[1] for grp in reference_groups(spec.num_layers)]
    assert fields[4] == len(ends), "the trailer says how many groups it has checksums of"
    assert list(sums[:len(ends)]) == [fn(payload[:e]) & 0xFFFFFFFF for e in ends]
    assert all(s == 0 for s in sums[len(ends):])
    assert fields[8] == sums[len(ends) - 1] == fn(payload) & 0xFFFFFFFF
    assert struct.unpack_from("<I", raw, TRAILER - 4)[0] == zlib.crc32(raw[:TRAILER - 4])


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_corrupted_group_is_a_counted_miss_the_others_read(opened, kind, layout):
    """One byte of group 5 flipped on disk: that group is False and a counted corruption,
    every other group True and bitwise right, the whole page a miss for batch_get."""
    store, pool = opened(kind, SPEC13, layout, remove_corrupted=False)
    rng = random.Random(11)
    keys, want, free = write_random(store, pool, 3, rng)
    path, off = locate(store, keys[1])
    a, b = byte_range(SPEC13, store.read_groups()[5])
    at = off + rng.randrange(a, b)
    write_at(path, at, bytes([read_at(path, at, 1)[0] ^ 0x10]))
    dst = rng.sample(free, 3)
    before = store.stats()
    for g in range(8):
        want_ok = [True, g != 5, True]
        read_group_checked(store, pool, keys, dst, g, want, want_ok)
    after = store.stats()
    assert after["corrupted"] - before["corrupted"] == 1
    assert after["errors"] - before["errors"] == 1
    assert store.batch_get(keys[1:2], free[-1:]) == [False]
    assert store.batch_get(keys[::2], free[-3:-1]) == [True, True]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_span_of_groups_is_one_range_checked_as_one(opened, kind, layout):
    """``through``: groups 2-3 and 4-7 read as one range each (the streamed reads' doubling
    spans of 8 groups), bitwise into those layers only, one ranged read per key and span; a
    byte flipped in group 5 makes the 4-7 span a counted miss (its other groups are not
    reported True), the same object's groups 0-3 still read; a span continuing a page whose
    key was rewritten since its earlier groups is a version change, never a mix."""
    store, pool = opened(kind, SPEC13, layout, remove_corrupted=False)
    rng = random.Random(23)
    keys, want, free = write_random(store, pool, 3, rng, "span")
    groups = store.read_groups()
    dst = rng.sample(free, 3)
    before = store.stats()
    for g, h in ((0, 0), (1, 1), (2, 3), (4, 7)):
        a, b = byte_range(SPEC13, (groups[g][0], groups[h][1]))
        old = [page(pool, p) for p in dst]
        assert store.batch_get_layers(keys, dst, g, through=h) == [True] * 3
        for j, p in enumerate(dst):
            now = page(pool, p)
            assert torch.equal(now[a:b], want[j][a:b])
            assert torch.equal(now[:a], old[j][:a]) and torch.equal(now[b:], old[j][b:])
    for j, p in enumerate(dst):
        assert torch.equal(page(pool, p), want[j])
    after = store.stats()
    assert after["ranged_reads"] - before["ranged_reads"] == 3 * 4
    assert after["get_hits"] - before["get_hits"] == 3
    assert after["bytes_read"] - before["bytes_read"] == 3 * SPEC13.page_bytes

    path, off = locate(store, keys[1])
    a, b = byte_range(SPEC13, groups[5])
    at = off + rng.randrange(a, b)
    write_at(path, at, bytes([read_at(path, at, 1)[0] ^ 0x04]))
    fill_random(pool.raw)
    before = store.stats()
    assert store.batch_get_layers(keys, dst, 0, through=3) == [True] * 3
    assert store.batch_get_layers(keys, dst, 4, through=7) == [True, False, True]
    assert store.stats()["corrupted"] - before["corrupted"] == 1
    for j in (0, 2):
        assert torch.equal(page(pool, dst[j]), want[j])

    # rewritten between two spans: the second span continuing the page is a miss
    read_group_checked(store, pool, keys[:1], dst[:1], 0, want[:1], [True])
    assert store.batch_get_layers(keys[:1], dst[:1], 1, through=1) == [True]
    assert store.batch_set(keys[:1], [free[-1]]) == [True]
    changes = store.stats()["ranged_version_changes"]
    assert store.batch_get_layers(keys[:1], dst[:1], 2, through=7) == [False]
    assert store.stats()["ranged_version_changes"] == changes + 1


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_corrupted_group_removes_the_object_when_asked(opened, kind):
    """remove_corrupted (the default): the damaged object is gone after its bad group, so
    later groups and batch_get miss -- no wrong byte is reported True on the way."""
    store, pool = opened(kind, SPEC13)
    rng = random.Random(12)
    keys, want, free = write_random(store, pool, 1, rng)
    path, off = locate(store, keys[0])
    a, b = byte_range(SPEC13, store.read_groups()[2])
    write_at(path, off + a, bytes([read_at(path, off + a, 1)[0] ^ 0x01]))
    dst = free[:1]
    got = [read_group_checked(store, pool, keys, dst, g, want)[0] for g in range(8)]
    assert got == [True, True] + [False] * 6
    assert store.batch_get(keys, free[1:2]) == [False]


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_damaged_group_checksums_in_the_trailer_are_misses(opened, kind):
    store, pool = opened(kind, SPEC13, remove_corrupted=False)
    keys, want, free = write_random(store, pool, 1, random.Random(13))
    path, off = locate(store, keys[0])
    at = off + SPEC13.page_bytes + _FIELDS.size + 4 * 3           # group 3's checksum
    write_at(path, at, bytes([read_at(path, at, 1)[0] ^ 0x80]))
    for g in range(8):
        read_group_checked(store, pool, keys, free[:1], g, want, [False])
    assert store.batch_get(keys, free[1:2]) == [False]
    # objects: each read finds the damage; segments: the slot is forgotten once found bad
    assert store.stats()["corrupted"] == (9 if kind == "objects" else 1)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("checksum", ["crc32", "adler32"])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_format_2_objects_are_read_whole_per_group(opened, kind, checksum, layout):
    """An object with a format-2 trailer (built here): batch_get reads it as before, and
    every group of it reads True, bitwise, verified on the whole payload -- so damage
    outside the group read is still a miss."""
    store, pool = opened(kind, SPEC13, layout, remove_corrupted=False)
    rng = random.Random(17)
    keys, want, free = write_random(store, pool, 2, rng)
    for k in keys:
        path, off = locate(store, k)
        payload = read_at(path, off, SPEC13.page_bytes)
        write_at(path, off + SPEC13.page_bytes, old_trailer(SPEC13, k, payload,
                                                            checksum=checksum))
    dst = rng.sample(free, 2)
    for g in range(8):
        read_group_checked(store, pool, keys, dst, g, want, [True, True])
    for j, p in enumerate(dst):
        assert torch.equal(page(pool, p), want[j])
    assert store.batch_get(keys, free[-2:]) == [True, True]
    assert all(torch.equal(page(pool, p), w) for p, w in zip(free[-2:], want))
    path, off = locate(store, keys[0])                  # damage in group 7 only
    write_at(path, off + SPEC13.page_bytes - 1,
             bytes([read_at(path, off + SPEC13.page_bytes - 1, 1)[0] ^ 0x04]))
    before = store.stats()["corrupted"]
    read_group_checked(store, pool, keys, dst, 0, want, [False, True])
    assert store.stats()["corrupted"] == before + 1


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_unknown_format_version_is_a_foreign_miss(opened, kind):
    store, pool = opened(kind, SPEC13, remove_corrupted=False)
    keys, want, free = write_random(store, pool, 1, random.Random(19))
    path, off = locate(store, keys[0])
    payload = read_at(path, off, SPEC13.page_bytes)
    write_at(path, off + SPEC13.page_bytes, old_trailer(SPEC13, keys[0], payload, version=9))
    for g in (0, 7):
        read_group_checked(store, pool, keys, free[:1], g, want, [False])
    assert store.batch_get(keys, free[1:2]) == [False]
    assert store.stats()["foreign"] == (3 if kind == "objects" else 1)    # segments: forgotten


@pytest.mark.parametrize("version,kept", [(9, True), (1, False)])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_newer_format_version_is_left_alone_an_unknown_older_one_removed(opened, kind,
                                                                          version, kept):
    """With ``remove_corrupted`` (the default): an object of a newer format version (a newer
    kvtier's, sharing the directory) is a counted foreign miss, whole and by group, and stays
    on disk as it was; one of an unknown older version is removed (zeroed, for a slot)."""
    store, pool = opened(kind, SPEC13)
    keys, want, free = write_random(store, pool, 1, random.Random(59))
    path, off = locate(store, keys[0])
    payload = read_at(path, off, SPEC13.page_bytes)
    planted = old_trailer(SPEC13, keys[0], payload, version=version)
    write_at(path, off + SPEC13.page_bytes, planted)
    assert store.batch_get(keys, free[:1]) == [False]
    read_group_checked(store, pool, keys, free[1:2], 0, want, [False])
    assert store.stats()["foreign"] >= 1
    if kind == "objects" and not kept:
        assert not os.path.exists(path)
    else:
        assert read_at(path, off, SPEC13.page_bytes) == payload
        assert (read_at(path, off + SPEC13.page_bytes, TRAILER) == planted) == kept


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_older_format_directory_is_upgraded_and_its_objects_read(opened, tmp_path, kind,
                                                                 version):
    """A store directory whose manifest names format 2 (or 3): opening it says so
    (``upgraded from format 2``), its objects of that format stay readable, whole and by
    group."""
    root = str(tmp_path / "old")
    store, pool = opened(kind, SPEC13, root=root)
    keys, want, free = write_random(store, pool, 2, random.Random(23))
    for k in keys:
        path, off = locate(store, k)
        write_at(path, off + SPEC13.page_bytes,
                 old_trailer(SPEC13, k, read_at(path, off, SPEC13.page_bytes), version))
    mpath = os.path.join(store.dir, "manifest.json")
    with open(mpath) as f:
        rec = json.load(f)
    rec["identity"]["format"] = version
    rec["identity_digest"] = identity_digest_v(SPEC13, version).hex()
    with open(mpath, "w") as f:
        json.dump(rec, f)
    again, _ = opened(kind, SPEC13, root=root, pool=pool)
    assert again.stats()["manifest"] == f"upgraded from format {version}"
    with open(mpath) as f:
        assert json.load(f)["identity"]["format"] == 4
    assert again.batch_get(keys, free[:2]) == [True, True]
    for g in range(8):
        read_group_checked(again, pool, keys, free[2:4], g, want, [True, True])


# --------------------------------------------------------------------------------------------
# the split in layer groups (group_bytes), format 3's objects
# --------------------------------------------------------------------------------------------
def split_of(n: int, layers: int = 13) -> tuple[tuple[int, int], ...]:
    return tuple((g * layers // n, (g + 1) * layers // n) for g in range(n))


def flip_last_byte(store, key: bytes) -> None:
    """Damage the last layer of ``key``'s object (its last group in any split)."""
    path, off = locate(store, key)
    at = off + store.spec.page_bytes - 1
    write_at(path, at, bytes([read_at(path, at, 1)[0] ^ 0x04]))


def test_group_bytes_default_is_one_mib_and_bad_values_are_config_errors(tmp_path):
    spec = KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=8)  # 1 MiB pages
    s = FileStore({"root": str(tmp_path / "d")}, spec=spec)
    try:
        assert s.config.group_bytes == 1 << 20 and s.read_groups() == ()
    finally:
        s.close()
    for bad in (-1, 1.5, True, "4096", None):
        with pytest.raises(ConfigError, match="group_bytes"):
            FileStore({"root": str(tmp_path / "e"), "group_bytes": bad}, spec=spec)
    assert not os.path.exists(tmp_path / "e")


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_group_bytes_sets_the_split_and_the_trailer_says_it(opened, tmp_path, kind):
    """Groups of at least ``group_bytes``: SPEC13's 10,192-byte pages (784 bytes a layer) in
    min(8, 13, page // group_bytes) groups -- 8 at 0 and 1, 3 at 3,000 bytes, one at 6,000
    (whole reads only: no read_groups, a ranged read refused); every object's trailer counts
    its groups, and 3 groups read back bitwise into random pages."""
    rng = random.Random(41)
    for gb, n in ((0, 8), (1, 8), (3000, 3), (6000, 1)):
        store, pool = opened(kind, SPEC13, root=str(tmp_path / f"gb{gb}"), group_bytes=gb)
        assert store.read_groups() == (split_of(n) if n > 1 else ())
        keys, want, free = write_random(store, pool, 3, rng, tag=str(gb))
        for k in keys:
            path, off = locate(store, k)
            assert _FIELDS4.unpack_from(read_at(path, off + SPEC13.page_bytes, TRAILER))[4] == n
        if n == 1:
            with pytest.raises(InvalidArgumentError):
                store.batch_get_layers(keys, free[:3], 0)
        dst = rng.sample(free, 3)
        for g in range(len(store.read_groups())):
            read_group_checked(store, pool, keys, dst, g, want, [True] * 3)
        if n > 1:
            assert all(torch.equal(page(pool, p), w) for p, w in zip(dst, want))
        assert store.batch_get(keys, free[-3:]) == [True] * 3
        assert all(torch.equal(page(pool, p), w) for p, w in zip(free[-3:], want))


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_stores_of_other_splits_read_each_others_objects(opened, tmp_path, kind):
    """A store of 8 groups and one of 3 in one directory: each reads the other's objects
    whole and by its own groups, bitwise. A group of its own objects is verified on the
    group alone (damage in the last layer leaves group 0 a hit); a group of the other's
    objects on the whole payload (the same damage makes it a counted miss)."""
    root = str(tmp_path / "shared")
    rng = random.Random(43)
    eight, pool = opened(kind, SPEC13, root=root, remove_corrupted=False)
    three, _ = opened(kind, SPEC13, root=root, pool=pool, remove_corrupted=False,
                      group_bytes=3000)
    keys8, want8, _ = write_random(eight, pool, 3, rng, tag="eight")
    keys3, want3, _ = write_random(three, pool, 3, rng, tag="three")
    free = [p for p in range(pool.num_pages)]
    for reader, keys, want, n in ((three, keys8, want8, 3), (eight, keys3, want3, 8)):
        dst = rng.sample(free, 3)
        for g in range(n):
            read_group_checked(reader, pool, keys, dst, g, want, [True] * 3)
        assert all(torch.equal(page(pool, p), w) for p, w in zip(dst, want))
        dst = rng.sample(free, 3)
        assert reader.batch_get(keys, dst) == [True] * 3
        assert all(torch.equal(page(pool, p), w) for p, w in zip(dst, want))
    flip_last_byte(eight, keys8[0])
    flip_last_byte(three, keys3[0])
    dst = rng.sample(free, 3)
    read_group_checked(eight, pool, keys8, dst, 0, want8, [True] * 3)
    read_group_checked(three, pool, keys3, dst, 0, want3, [True] * 3)
    before = three.stats()["corrupted"], eight.stats()["corrupted"]
    read_group_checked(three, pool, keys8, dst, 0, want8, [False, True, True])
    read_group_checked(eight, pool, keys3, dst, 0, want3, [False, True, True])
    assert (three.stats()["corrupted"], eight.stats()["corrupted"]) == \
        (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_format_3_objects_read_by_group_where_their_split_is_the_stores(opened, tmp_path,
                                                                          kind):
    """Objects with a format-3 trailer (built here: min(8, L) running checksums, no group
    count): a store of that split reads their groups on the group checksums (damage in the
    last layer leaves group 0 a hit); one of 3 groups verifies each on the whole payload (the
    same damage: a miss); both read them whole, bitwise, until damaged."""
    root = str(tmp_path / "v3")
    rng = random.Random(47)
    eight, pool = opened(kind, SPEC13, root=root, remove_corrupted=False)
    three, _ = opened(kind, SPEC13, root=root, pool=pool, remove_corrupted=False,
                      group_bytes=3000)
    keys, want, free = write_random(eight, pool, 2, rng)
    for k in keys:
        path, off = locate(eight, k)
        payload = read_at(path, off, SPEC13.page_bytes)
        write_at(path, off + SPEC13.page_bytes, old_trailer(SPEC13, k, payload, version=3))
    for reader, n in ((eight, 8), (three, 3)):
        dst = rng.sample(free, 2)
        for g in range(n):
            read_group_checked(reader, pool, keys, dst, g, want, [True, True])
        assert all(torch.equal(page(pool, p), w) for p, w in zip(dst, want))
        assert reader.batch_get(keys, free[-2:]) == [True, True]
    flip_last_byte(eight, keys[0])
    dst = rng.sample(free, 2)
    read_group_checked(eight, pool, keys, dst, 0, want, [True, True])
    read_group_checked(three, pool, keys, dst, 0, want, [False, True])
    assert eight.batch_get(keys, free[-2:]) == [False, True]


@pytest.mark.parametrize("count", [0, 9, 3])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_wrong_group_count_in_the_trailer_is_a_miss(opened, kind, count):
    """A format-4 trailer (its own CRC made right) whose group count is out of range or
    disagrees with its checksums (3 where 8 are filled): every read of it is a counted
    corruption, never a hit."""
    store, pool = opened(kind, SPEC13, remove_corrupted=False)
    keys, want, free = write_random(store, pool, 1, random.Random(53))
    path, off = locate(store, keys[0])
    raw = bytearray(read_at(path, off + SPEC13.page_bytes, TRAILER))
    struct.pack_into("<H", raw, 14, count)
    struct.pack_into("<I", raw, TRAILER - 4, zlib.crc32(bytes(raw[:TRAILER - 4])))
    write_at(path, off + SPEC13.page_bytes, bytes(raw))
    for g in (0, 7):
        read_group_checked(store, pool, keys, free[:1], g, want, [False])
    assert store.batch_get(keys, free[1:2]) == [False]
    assert store.stats()["corrupted"] >= 1


# --------------------------------------------------------------------------------------------
# O_DIRECT, the LRU touch
# --------------------------------------------------------------------------------------------
DIRECT_SPECS = [
    # groups on 4 KiB boundaries
    KVSpec.mha(num_layers=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16"),
    # 12 layers of 1 KiB in 8 groups: most group boundaries not 4 KiB aligned
    KVSpec.mha(num_layers=12, num_kv_heads=2, head_dim=64, page_size=2, dtype="bfloat16"),
    # 8 layers of 512 B: one 4 KiB block holds every group
    KVSpec.mha(num_layers=8, num_kv_heads=1, head_dim=16, page_size=8, dtype="bfloat16"),
]


@pytest.mark.parametrize("spec", DIRECT_SPECS, ids=spec_id)
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_o_direct_ranged_reads_aligned_or_not(opened, tmp_path, kind, spec):
    pool = HostKVPool(spec, 16, allocator=MmapAllocator())       # 4 KiB aligned
    fill_random(pool.raw)
    try:
        store, _ = opened(kind, spec, pool=pool, o_direct="auto", remove_corrupted=False)
        if not store.stats()["o_direct"]:
            pytest.skip(f"no O_DIRECT here: {store.stats()['o_direct_reason']}")
        rng = random.Random(29)
        keys, want, free = write_random(store, pool, 3, rng)
        dst = rng.sample(free, 3)
        for g in range(len(store.read_groups())):
            read_group_checked(store, pool, keys, dst, g, want, [True] * 3)
        assert all(torch.equal(page(pool, p), w) for p, w in zip(dst, want))
        path, off = locate(store, keys[2])
        a, b = byte_range(spec, store.read_groups()[1])
        write_at(path, off + b - 1, bytes([read_at(path, off + b - 1, 1)[0] ^ 0x20]))
        for g in range(len(store.read_groups())):
            read_group_checked(store, pool, keys, dst, g, want, [True, True, g != 1])
        path, off = locate(store, keys[0])                  # format 2, read whole per group
        write_at(path, off + spec.page_bytes,
                 old_trailer(spec, keys[0], read_at(path, off, spec.page_bytes)))
        fill_random(pool.raw)
        for g in range(len(store.read_groups())):
            read_group_checked(store, pool, keys[:2], dst[:2], g, want, [True, True])
        assert torch.equal(page(pool, dst[0]), want[0])
    finally:
        pool.close()


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_only_the_last_group_refreshes_the_lru_time(opened, kind):
    store, pool = opened(kind, SPEC13)
    keys, want, free = write_random(store, pool, 1, random.Random(31))
    path, _ = locate(store, keys[0])
    old = time.time() - 3600
    os.utime(path, (old, old))
    for g in range(7):
        read_group_checked(store, pool, keys, free[:1], g, want, [True])
        assert os.stat(path).st_mtime == pytest.approx(old), f"group {g} touched the object"
    read_group_checked(store, pool, keys, free[:1], 7, want, [True])
    assert os.stat(path).st_mtime > old + 3000, "the last group did not refresh the LRU time"


# --------------------------------------------------------------------------------------------
# another process rewriting the keys
# --------------------------------------------------------------------------------------------
def _check_groups_against_generations(store, pool, dst: list[int], seconds: float
                                      ) -> tuple[int, int, int]:
    """Read every key group by group for ``seconds`` (longer until a whole page came back);
    every True group must be bitwise the
    range of the generation its layers name, and a page all of whose groups came back True
    one generation. Returns (true groups, whole pages, generations seen)."""
    spec = store.spec
    groups = store.read_groups()
    keys = child.keys()
    hits = pages = 0
    gens: set[int] = set()
    cache: dict[tuple[int, int], torch.Tensor] = {}

    def content(i: int, gen: int) -> torch.Tensor:
        if (i, gen) not in cache:
            cache[(i, gen)] = child.page_content(i, gen)
        return cache[(i, gen)]
    end = time.monotonic() + seconds
    # past ``seconds`` with no whole page yet (a loaded box: every read straddled a rewrite),
    # go on until one comes back -- the writer stops after its own few seconds
    while time.monotonic() < end or (pages == 0 and time.monotonic() < end + 15):
        whole = [True] * len(keys)
        for g, grp in enumerate(groups):
            a, b = byte_range(spec, grp)
            got = store.batch_get_layers(keys, dst, g)
            for i, ok in enumerate(got):
                if not ok:
                    whole[i] = False
                    continue
                data = page(pool, dst[i])
                gen, idx = child.generation_at(data, a)
                assert idx == i, f"key {i} group {g}: layers of key {idx}"
                assert torch.equal(data[a:b], content(i, gen)[a:b]), \
                    f"key {i} group {g}: True with bytes of no generation {gen}"
                hits += 1
        for i, ok in enumerate(whole):
            if ok:
                data = page(pool, dst[i])
                gen, _ = child.generation_at(data, 0)
                assert torch.equal(data, content(i, gen)), f"key {i}: a page of mixed versions"
                gens.add(gen)
                pages += 1
        if len(cache) > 200:
            cache.clear()
    return hits, pages, len(gens)


@pytest.mark.parametrize("kind,layout,medium,writer_split", [
    ("segments", "page_first", "memory", 0), ("segments", "layer_first", "disk", 0),
    ("objects", "page_first", "disk", 0), ("objects", "layer_first", "memory", 0),
    # the writer's pages are one group: every range the reader gets is verified whole
    ("segments", "layer_first", "memory", 1 << 20), ("objects", "page_first", "disk", 1 << 20)])
def test_groups_read_while_another_process_rewrites(tmp_path, kind, layout, medium,
                                                    writer_split):
    if medium == "memory" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    base = tempfile.mkdtemp(dir="/dev/shm") if medium == "memory" else str(tmp_path)
    root = os.path.join(base, "store")
    proc = subprocess.Popen([sys.executable, CHILD, root, kind, "4", str(writer_split)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "ready" in line, proc.stderr.read() if proc.stderr else line
        store, pool = child.open_store(root, kind, layout)
        try:
            dst = list(range(child.NUM_KEYS, 2 * child.NUM_KEYS))
            hits, pages, gens = _check_groups_against_generations(store, pool, dst, 3.0)
            stats = store.stats()
        finally:
            store.close()
            pool.close()
        out, err = proc.communicate(timeout=60)
        res = json.loads(out.strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if medium == "memory":
            import shutil
            shutil.rmtree(base, ignore_errors=True)
    assert res["generations"] > 10 and res["errors"] == 0, res
    assert hits > 0 and pages > 0, (hits, pages, stats)
    assert stats["ranged_hits"] == hits
