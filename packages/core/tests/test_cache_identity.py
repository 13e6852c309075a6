"""Cache identity: every field that changes a page's bytes changes its keys (0 hits across
them, in a memory and a file store), and the file store's own identity (object format, KVSpec,
namespace) turns objects of another identity into misses, even when they are planted where
this store's objects would be."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.keys import HASHES, KeyNamespace, PageKeyer, reference_keys
from kvtier.l3_stores import file as file_mod
from kvtier.l3_stores.file import format as format_mod
from kvtier.l3_stores.file import key_filename
from kvtier.l3_stores.memory import MemoryStore
from kvtier.spec import KVSpec
from kvtier.testing.data import make_host_pool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from file_formats import FORMAT, FileStore, fmt, formats  # noqa: E402,F401

#: Tests of the file store: run over both its formats.
pytest_generate_tests = formats(set(), both={
    "test_changing_any_identity_field_gives_zero_hits",
    "test_store_namespace_separates_and_planted_objects_miss",
    "test_another_object_format_version_is_a_miss", "test_manifest_records_the_identity",
    "test_controller_folds_the_identity_into_keys_and_the_file_store"})
SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16")
OTHER_SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4,
                        dtype="float16")
BASE = dict(model_id="llama", spec=SPEC, tp_rank=0, tp_size=2, salt="",
            model_revision="rev-a", rope={"rope_theta": 500000.0,
                                          "rope_scaling": {"type": "llama3", "factor": 8.0}},
            device_layout="page_first", host_layout="page_first", pp_rank=0, pp_size=2,
            format_version=1, hash="sha256")
CHANGES = [
    ("model_id", "llama-70b"), ("spec", OTHER_SPEC), ("tp_rank", 1), ("tp_size", 4),
    ("salt", "lora-a"), ("model_revision", "rev-b"),
    ("rope", {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 4.0}}),
    ("rope", {"rope_theta": 10000.0}), ("device_layout", "layer_first"),
    ("host_layout", "layer_first"), ("pp_rank", 1), ("pp_size", 4), ("format_version", 2),
    ("hash", "blake2b"),
]
TOKENS = list(range(1000, 1040))


def _available(name: str) -> bool:
    try:
        HASHES[name]()
    except ConfigError:
        return False
    return True


@pytest.fixture
def pool():
    with make_host_pool(SPEC, 16) as p:      # random bytes
        yield p


def _stores(tmp_path, pool):
    mem = MemoryStore({}, spec=SPEC)
    fil = FileStore({"root": str(tmp_path / "files")}, spec=SPEC)
    for s in (mem, fil):
        s.attach(pool)
    return mem, fil


@pytest.mark.parametrize("field, value", CHANGES, ids=[f"{f}-{i}" for i, (f, _) in
                                                        enumerate(CHANGES)])
def test_changing_any_identity_field_gives_zero_hits(tmp_path, pool, field, value):
    a = PageKeyer(**BASE)
    b = PageKeyer(**{**BASE, field: value})
    assert a.namespace != b.namespace
    ka, kb = a.keys(TOKENS), b.keys(TOKENS)
    assert len(ka) == len(kb) == 10 and set(ka).isdisjoint(kb)
    for store in _stores(tmp_path, pool):
        assert store.batch_set(ka, list(range(10))) == [True] * 10
        assert store.batch_exists(ka) == 10
        assert store.batch_exists(kb) == 0
        assert store.batch_get(kb, list(range(6, 16))) == [False] * 10
        store.close()


def test_unchanged_identity_hits_and_rope_is_canonical(tmp_path, pool):
    a = PageKeyer(**BASE)
    reordered = {"rope_scaling": {"factor": 8.0, "type": "llama3"}, "rope_theta": 500000.0}
    b = PageKeyer(**{**BASE, "rope": reordered})
    assert a.keys(TOKENS) == b.keys(TOKENS)
    assert json.loads(a.namespace)["rope"] == json.dumps(reordered, sort_keys=True,
                                                         separators=(",", ":"))


def test_namespace_record_names_every_field():
    ns = PageKeyer(**BASE).identity
    assert isinstance(ns, KeyNamespace)
    rec = json.loads(ns.to_bytes())
    for name in ("model_id", "spec_fingerprint", "model_revision", "rope", "device_layout",
                 "host_layout", "tp_rank", "tp_size", "pp_rank", "pp_size", "salt",
                 "format_version", "hash"):
        assert name in rec
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.salt = "x"


@pytest.mark.parametrize("hash_name", sorted(HASHES))
def test_every_hash_follows_the_reference_chain(hash_name):
    if not _available(hash_name):
        pytest.skip(f"{hash_name} is not installed")
    k = PageKeyer(model_id="m", spec=SPEC, hash=hash_name)
    toks = list(range(7, 7 + 4 * 9 + 3))
    full = k.keys(toks)
    assert full == reference_keys(k.namespace, toks, SPEC.page_size, hash=hash_name)
    assert k.keys(toks[16:], prev=full[3]) == full[4:]
    assert all(len(x) == 32 for x in full)


@pytest.mark.parametrize("bad", [dict(hash="md5"), dict(pp_rank=2, pp_size=2),
                                 dict(pp_size=0), dict(model_revision=3), dict(rope=1.5),
                                 dict(rope={"x": float("nan")}), dict(format_version=0),
                                 dict(device_layout=None), dict(unknown_field=1)])
def test_bad_identity_fields_are_typed_errors(bad):
    with pytest.raises((ConfigError, TypeError)) as info:
        PageKeyer(model_id="m", spec=SPEC, **bad)
    if "unknown_field" not in bad:
        assert isinstance(info.value, ConfigError)


# --------------------------------------------------------------------------------------------
# the file store's own identity
# --------------------------------------------------------------------------------------------
def _plant(src: FileStore, dst: FileStore, key: bytes) -> None:
    """Copy ``src``'s object of ``key`` where ``dst`` would keep it (segment format: every
    segment and index log of ``src``, so ``dst`` finds the key in a log it did not write)."""
    if src.config.format == "segments":
        shutil.copytree(os.path.join(src.dir, "segments"), os.path.join(dst.dir, "segments"),
                        dirs_exist_ok=True)
        return
    sub, name = key_filename(key)
    os.makedirs(os.path.join(dst.dir, sub), exist_ok=True)
    shutil.copy(os.path.join(src.dir, sub, name), os.path.join(dst.dir, sub, name))


def test_store_namespace_separates_and_planted_objects_miss(tmp_path, pool):
    a = FileStore({"root": str(tmp_path), "namespace": "tenant-a"}, spec=SPEC)
    b = FileStore({"root": str(tmp_path), "namespace": "tenant-b"}, spec=SPEC)
    for s in (a, b):
        s.attach(pool)
    ks = [b"same-key-%d" % i for i in range(4)]
    assert a.batch_set(ks, [0, 1, 2, 3]) == [True] * 4
    assert a.dir != b.dir and b.batch_exists(ks) == 0
    for k in ks:
        _plant(a, b, k)                   # same key, same size, same spec: only identity
    assert b.batch_get(ks, [8, 9, 10, 11]) == [False] * 4
    assert b.stats()["foreign"] == 4
    assert a.batch_get(ks, [8, 9, 10, 11]) == [True] * 4
    a.close()
    b.close()


def test_another_object_format_version_is_a_miss(tmp_path, pool, monkeypatch):
    old = FileStore({"root": str(tmp_path)}, spec=SPEC)
    old.attach(pool)
    ks = [b"k%d" % i for i in range(3)]
    assert old.batch_set(ks, [0, 1, 2]) == [True] * 3
    old.close()
    monkeypatch.setattr(format_mod, "FORMAT_VERSION", format_mod.FORMAT_VERSION + 1)
    new = FileStore({"root": str(tmp_path)}, spec=SPEC)
    new.attach(pool)
    assert new.stats()["manifest"] == "other identity"
    assert new.batch_get(ks, [5, 6, 7]) == [False] * 3
    assert new.stats()["foreign"] == 3
    new.close()


def test_manifest_records_the_identity(tmp_path, pool):
    s = FileStore({"root": str(tmp_path), "namespace": "ns1"}, spec=SPEC)
    with open(os.path.join(s.dir, file_mod.MANIFEST)) as f:
        rec = json.load(f)
    assert rec["identity"] == {"format": file_mod.FORMAT_VERSION, "spec": SPEC.fingerprint,
                               "namespace": "ns1"}
    assert rec["spec"] == SPEC.to_dict() and rec["identity_digest"] == s.stats()["identity"]
    assert s.stats()["manifest"] == "ok"
    s.close()
    with open(os.path.join(s.dir, file_mod.MANIFEST), "w") as f:
        f.write("garbage")                           # damaged: rewritten
    s2 = FileStore({"root": str(tmp_path), "namespace": "ns1"}, spec=SPEC)
    assert s2.stats()["manifest"] == "rewritten"
    s2.close()
    with pytest.raises(ConfigError):
        FileStore({"root": str(tmp_path), "namespace": "../x"}, spec=SPEC)


def test_controller_folds_the_identity_into_keys_and_the_file_store(tmp_path) -> None:
    """Through the controller: a second cache over the same file L3 hits with the same
    identity and gets 0 hits with another revision, RoPE, PP rank or hash."""
    import torch

    from kvtier.cache import TieredKVCache
    from kvtier.device_pool import DeviceKVPool
    from kvtier.page_allocator import PageAllocator
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    tokens = list(range(33))
    base = {"model_id": "m", "host_pool_pages": 16, "l3_store": "file",
            "l3_config": {"root": str(tmp_path), "format": FORMAT["name"]},
            "model_revision": "r1"}

    def cache(**over):
        pool = DeviceKVPool.empty(spec, 16)
        for comp in pool.require_layers("test"):
            for t in comp:
                t.copy_(torch.randn(t.shape))
        alloc = PageAllocator(16)
        return TieredKVCache.from_config({**base, **over}, device_pool=pool,
                                         allocate_device_pages=alloc.alloc,
                                         free_device_pages=alloc.free), alloc

    c, alloc = cache()
    with c:
        m = c.match(tokens)
        c.commit(tokens, alloc.alloc(8), match=m)
        c.release(m)
        assert c.wait_idle(30)
    for over, hits in (({}, 8), ({"model_revision": "r2"}, 0), ({"rope": '{"factor":2}'}, 0),
                       ({"pp_rank": 1, "pp_size": 2}, 0), ({"key_hash": "blake2b"}, 0)):
        c, _ = cache(**over)
        with c:
            m = c.match(tokens)
            assert m.l3_count == hits, over
            c.release(m)
