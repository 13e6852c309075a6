"""kvtier's SGLang HiCache adapter, driven through SGLang 0.5.23's own classes on the CPU."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import threading

import pytest
import torch
from conftest import (MODEL, PoolCase, attach, extra_config, make_pools, page_bytes,
                      page_indices, random_tokens, storage_config, store_config_for)

from kvtier import BackendNotFoundError, ConfigError, LayoutError
from kvtier.integrations import sglang_extra_config
from kvtier.integrations.sglang import KVTierHiCacheStorage, build_bridge, rank_suffix
from kvtier.testing.contracts import assert_bitwise_equal
from kvtier.testing.data import fill_random


def sglang_keys(tokens: list[int], page_size: int) -> list[str]:
    """Page keys exactly as SGLang's controller makes them for storage."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    return get_storage_hash_str(tokens, None, page_size=page_size)


def take_pages(host, n: int) -> list[int]:
    """``n`` pages allocated from SGLang's host pool allocator (as SGLang holds the pages it
    reads into and writes from; the legacy calls stage through free pages)."""
    idx = host.alloc(n * host.page_size)
    assert idx is not None
    return [int(i) // host.page_size for i in idx[::host.page_size]]


def random_pages(host, n: int, rng: random.Random, avoid=()) -> list[int]:
    return rng.sample([p for p in range(host.page_num) if p not in set(avoid)], n)


# --------------------------------------------------------------------------------------------
# the zero-copy v1 calls
# --------------------------------------------------------------------------------------------
def test_v1_roundtrip_is_bitwise(backend, pools, case):
    """Pages set from random host pages and read into other random pages land bitwise
    identical in SGLang's host pool (checked with SGLang's get_data_page)."""
    _, host = pools
    rng = random.Random(hash(case.id) & 0xFFFF)
    n = min(5, host.page_num // 2)
    src = random_pages(host, n, rng)
    dst = random_pages(host, n, rng, avoid=src)
    keys = sglang_keys(random_tokens(n * host.page_size, 1), host.page_size)
    assert len(keys) == n
    want = [page_bytes(host, p) for p in src]
    assert backend.batch_set_v1(keys, page_indices(host, src)) == [True] * n
    fill_random(host.kv_buffer)                       # poison every page, sources included
    assert backend.batch_exists(keys) == n
    assert backend.batch_get_v1(keys, page_indices(host, dst)) == [True] * n
    for i, p in enumerate(dst):
        assert_bitwise_equal(page_bytes(host, p), want[i], f"key {i} read into host page {p}")
    st = backend.stats()
    assert st["errors"] == 0 and st["get_hits"] == n and st["set_ok"] == n


def test_bridge_pointers_are_sglangs_for_every_page(pools):
    """The kvtier pool over SGLang's buffer has, for every page, exactly the segments SGLang's
    get_page_buffer_meta names, and a store object is SGLang's flat page."""
    _, host = pools
    bridge = build_bridge(host)
    assert bridge.pool.raw.data_ptr() == host.kv_buffer.data_ptr()      # no copy
    for page in range(host.page_num):
        ptrs, sizes = host.get_page_buffer_meta(page_indices(host, [page]))
        assert bridge.pages(ptrs, sizes, 1) == [page]
        segs = sorted(bridge.pool.page_segments(page), key=lambda s: s.data_ptr())
        assert [s.data_ptr() for s in segs] == sorted(ptrs)
        assert torch.equal(torch.cat(segs), page_bytes(host, page))


def test_exists_counts_consecutive_leading_hits(backend, pools):
    _, host = pools
    n = min(6, host.page_num)
    keys = sglang_keys(random_tokens(n * host.page_size, 2), host.page_size)
    assert backend.batch_exists(keys) == 0
    backend.batch_set_v1(keys[:n - 2], page_indices(host, list(range(n - 2))))
    assert backend.batch_exists(keys) == n - 2
    assert backend.batch_exists(keys[1:]) == n - 3
    assert backend.batch_exists([keys[-1]] + keys) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[0]) and not backend.exists(keys[-1])
    backend.store.delete([backend.storage_key(keys[1])])
    assert backend.batch_exists(keys) == 1


def test_missing_page_is_a_miss_that_leaves_the_page_alone(backend, pools):
    _, host = pools
    keys = sglang_keys(random_tokens(2 * host.page_size, 3), host.page_size)
    backend.batch_set_v1(keys[:1], page_indices(host, [0]))
    before = page_bytes(host, 1)
    assert backend.batch_get_v1([keys[1], keys[0]], page_indices(host, [1, 2])) == [False, True]
    assert_bitwise_equal(page_bytes(host, 1), before, "a miss must not touch the page")


def test_set_skips_pages_the_store_already_holds(backend, pools):
    _, host = pools
    keys = sglang_keys(random_tokens(3 * host.page_size, 4), host.page_size)
    backend.batch_set_v1(keys[:2], page_indices(host, [0, 1]))
    sets = backend.store.stats()["sets"]
    assert backend.batch_set_v1(keys, page_indices(host, [0, 1, 2])) == [True] * 3
    assert backend.store.stats()["sets"] - sets == 1
    assert backend.stats()["set_skipped_existing"] == 2


# --------------------------------------------------------------------------------------------
# SGLang's own call sites (HiCacheController's storage methods, on a minimal holder of the
# state they read: the backend, the host pool, the page size and the ack queue)
# --------------------------------------------------------------------------------------------
class ControllerState:
    """The attributes HiCacheController's storage methods read; the methods are SGLang's."""

    from sglang.srt.managers.cache_controller import HiCacheController as _C
    _page_get_zero_copy = _C._page_get_zero_copy
    _generic_page_get = _C._generic_page_get
    _page_set_zero_copy = _C._page_set_zero_copy
    _generic_page_set = _C._generic_page_set
    _page_transfer = _C._page_transfer
    _page_transfer_kv_batch = _C._page_transfer_kv_batch
    _page_backup = _C._page_backup
    _storage_hit_query = _C._storage_hit_query

    def __init__(self, backend, host, zero_copy: bool):
        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = host
        self.page_size = host.page_size
        self.prefetch_sync_queue = queue.Queue()
        self.page_get_func = self._page_get_zero_copy if zero_copy else self._generic_page_get
        self.page_set_func = self._page_set_zero_copy if zero_copy else self._generic_page_set


@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "legacy"])
def test_sglang_backup_then_prefetch(zero_copy, store_name, tmp_path):
    """SGLang's backup and prefetch code paths (batches of STORAGE_BATCH_SIZE pages, its
    storage hashing) through the adapter: 131 pages backed up, matched and fetched into
    freshly allocated host pages, bitwise."""
    from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    case = PoolCase("mha", "page_first", torch.bfloat16, 2, 2, heads=1, head_dim=8,
                    device_tokens=270)
    _, host = make_pools(case)
    extra = extra_config(store_name, store_config_for(store_name, tmp_path),
                         interface_v1=int(zero_copy))
    backend = attach(host, storage_config(extra))
    ctl = ControllerState(backend, host, zero_copy)
    n = STORAGE_BATCH_SIZE + 3
    tokens = random_tokens(n * case.page_size, 5)
    src = host.alloc(n * case.page_size)
    want = [page_bytes(host, int(i) // case.page_size) for i in src[::case.page_size]]
    backup = StorageOperation(src, tokens,
                              hash_value=get_storage_hash_str(tokens, None, case.page_size))
    ctl._page_backup(backup)
    assert backup.completed_tokens == n * case.page_size
    host.free(src)
    fill_random(host.kv_buffer)

    op = PrefetchOperation("req-1", tokens)
    hashes, hit_tokens = ctl._storage_hit_query(op)
    assert hit_tokens == n * case.page_size and len(hashes) == n
    op.hash_value = hashes
    op.host_indices = host.alloc(hit_tokens)
    assert ctl._page_transfer(op) == n
    for i, idx in enumerate(op.host_indices[::case.page_size].tolist()):
        assert_bitwise_equal(page_bytes(host, idx // case.page_size), want[i], f"page {i}")
    if not zero_copy:
        assert backend.stats()["legacy_calls"] > 0
    assert backend.stats()["errors"] == 0
    backend.close()


def test_legacy_and_v1_objects_are_the_same(pools, case, tmp_path):
    """A page written by the legacy calls (SGLang's flat data page) reads back through v1 and
    the other way round; legacy staging returns every borrowed host page."""
    _, host = pools
    backend = attach(host, storage_config(extra_config("file", store_config_for("file",
                                                                                   tmp_path)),
                                          mla=case.kind == "mla"))
    keys = sglang_keys(random_tokens(4 * host.page_size, 6), host.page_size)
    pages = take_pages(host, 6)
    free_before = host.available_size()
    flat = [host.get_data_page(p * host.page_size, flat=True).clone() for p in pages[:2]]
    assert backend.batch_set(keys[:2], flat) is True
    assert backend.batch_set_v1(keys[2:], page_indices(host, pages[2:4])) == [True, True]
    want = [page_bytes(host, p) for p in pages[:4]]
    fill_random(host.kv_buffer)
    assert backend.batch_get_v1(keys[:2], page_indices(host, pages[4:])) == [True, True]
    dummies = [host.get_dummy_flat_data_page() for _ in range(3)]
    got = backend.batch_get(keys[2:] + ["0" * 64], dummies)
    assert got[2] is None and got[0] is dummies[0]
    for i, p in enumerate(pages[4:]):
        assert_bitwise_equal(page_bytes(host, p), want[i], "legacy set -> v1 get")
    for i in range(2):
        assert_bitwise_equal(dummies[i].view(-1).view(torch.uint8), want[2 + i],
                             "v1 set -> legacy get")
    assert backend.get(keys[0], host.get_dummy_flat_data_page()) is not None
    assert backend.set(keys[0], flat[0]) is True
    assert host.available_size() == free_before
    backend.close()


# --------------------------------------------------------------------------------------------
# keys: SGLang's rank suffixes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mla,kw", [
    (False, {}), (False, dict(tp_rank=3, tp_size=4)), (True, dict(tp_rank=1, tp_size=2)),
    (False, dict(pp_rank=1, pp_size=2)), (True, dict(pp_rank=2, pp_size=3)),
    (False, dict(attn_cp_rank=1, attn_cp_size=2)),
])
def test_key_suffix_is_sglang_file_backends(mla, kw, tmp_path):
    """Keys carry exactly the TP/PP/CP/MLA suffix SGLang's own HiCacheFile gives a page."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    cfg = storage_config(extra_config("memory", {}), mla=mla, **kw)
    cfg.extra_config = {"file_storage_path": str(tmp_path / "hf")}
    hf = HiCacheFile(cfg, file_path=str(tmp_path / "hf"))
    key = "ab" * 32
    assert key + rank_suffix(cfg) == hf._get_suffixed_key(key)


def test_mha_ranks_keep_apart_and_mla_ranks_share(tmp_path):
    """Two TP ranks over one file store: MHA rank 1 never reads rank 0's pages (other heads);
    MLA pages are one object for every rank (replicated KV)."""
    for mla, shared in ((False, False), (True, True)):
        case = (PoolCase("mla", "page_first", torch.bfloat16, 3, 2, kv_lora_rank=16, rope=4)
                if mla else PoolCase("mha", "page_first", torch.bfloat16, 3, 2, heads=2,
                                     head_dim=8))
        root = {"root": str(tmp_path / f"l3-{mla}")}
        _, h0 = make_pools(case)
        _, h1 = make_pools(case)
        b0 = attach(h0, storage_config(extra_config("file", root), mla=mla, tp_rank=0,
                                       tp_size=2))
        b1 = attach(h1, storage_config(extra_config("file", root), mla=mla, tp_rank=1,
                                       tp_size=2))
        keys = sglang_keys(random_tokens(2 * case.page_size, 7), case.page_size)
        assert b0.batch_set_v1(keys, page_indices(h0, [0, 1])) == [True, True]
        assert b1.batch_exists(keys) == (2 if shared else 0)
        got = b1.batch_get_v1(keys, page_indices(h1, [3, 4]))
        assert got == [shared, shared]
        if shared:
            assert_bitwise_equal(page_bytes(h1, 3), page_bytes(h0, 0), "MLA page via rank 1")
        b0.close()
        b1.close()


def test_layouts_never_share_objects(tmp_path):
    """page_first and page_first_direct order a page's bytes differently: their keys differ."""
    root = {"root": str(tmp_path / "l3")}
    a = PoolCase("mha", "page_first", torch.bfloat16, 2, 2, heads=1, head_dim=8)
    b = PoolCase("mha", "page_first_direct", torch.bfloat16, 2, 2, heads=1, head_dim=8)
    (_, ha), (_, hb) = make_pools(a), make_pools(b)
    ba = attach(ha, storage_config(extra_config("file", root)))
    bb = attach(hb, storage_config(extra_config("file", root), layout="page_first_direct"))
    keys = sglang_keys(random_tokens(2, 8), 2)
    ba.batch_set_v1(keys, page_indices(ha, [0]))
    assert bb.batch_exists(keys) == 0
    assert ba.storage_key(keys[0]) != bb.storage_key(keys[0])
    ba.close()
    bb.close()


# --------------------------------------------------------------------------------------------
# failures are misses and counted
# --------------------------------------------------------------------------------------------
def test_store_failures_are_counted_misses(backend, pools, monkeypatch):
    _, host = pools
    keys = sglang_keys(random_tokens(2 * host.page_size, 9), host.page_size)
    a, b, c, d = take_pages(host, 4)
    backend.batch_set_v1(keys, page_indices(host, [a, b]))
    before = [page_bytes(host, p) for p in (a, b, c, d)]

    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(backend.store, "batch_get", boom)
    monkeypatch.setattr(backend.store, "batch_set", boom)
    monkeypatch.setattr(backend.store, "batch_exists", boom)
    assert backend.batch_get_v1(keys, page_indices(host, [c, d])) == [False, False]
    assert backend.batch_set_v1(keys, page_indices(host, [a, b])) == [False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get(keys, [host.get_dummy_flat_data_page()] * 2) == [None, None]
    assert backend.batch_set(keys, [host.get_dummy_flat_data_page()] * 2) is False
    monkeypatch.setattr(backend.store, "clear", boom)
    assert backend.clear() is False
    for p, want in zip((a, b, c, d), before):
        assert_bitwise_equal(page_bytes(host, p), want, "a failed call must not touch a page")
    st = backend.stats()
    assert st["errors_by_call"]["batch_get_v1"] == 1 and st["errors_by_call"]["batch_exists"] == 1
    assert "OSError" in st["last_error"]
    metrics = backend.get_stats()
    from sglang.srt.observability.metrics_collector import StorageMetrics
    assert isinstance(metrics, StorageMetrics) and metrics.kvtier["errors"] >= 5


def test_bad_host_indices_are_counted_misses(backend, pools):
    _, host = pools
    s = host.page_size
    keys = sglang_keys(random_tokens(2 * s, 10), s)
    before = host.kv_buffer.clone()
    bad = [
        page_indices(host, [0]),                              # 2 keys, 1 page of indices
        page_indices(host, [0, 1])[:-1] if s > 1 else torch.arange(1),
        "not a tensor",
    ]
    if s > 1:
        bad.append(page_indices(host, [0, 1]) + 1)            # pages not on page boundaries
    for idx in bad:
        assert backend.batch_get_v1(keys, idx) == [False, False]
        assert backend.batch_set_v1(keys, idx) == [False, False]
    assert backend.batch_get_v1([b"bytes-key", 7], page_indices(host, [0, 1])) == [False] * 2
    assert torch.equal(host.kv_buffer.view(-1).view(torch.uint8),
                       before.view(-1).view(torch.uint8))
    assert backend.batch_exists(keys) == 0
    assert backend.stats()["errors_by_call"]["batch_get_v1"] == len(bad) + 1


def test_corrupted_file_object_is_a_miss(pools, case, tmp_path):
    """A damaged object file (the objects format: one file per page; the segment format's
    damaged slots are tests/test_file_segments.py's) is a miss for its page only."""
    _, host = pools
    root = tmp_path / "l3"
    b = attach(host, storage_config(extra_config("file", {"root": str(root),
                                                          "format": "objects"}),
                                    mla=case.kind == "mla"))
    keys = sglang_keys(random_tokens(2 * host.page_size, 11), host.page_size)
    b.batch_set_v1(keys, page_indices(host, [0, 1]))
    files = sorted(p for p in root.rglob("*.kvp"))
    assert len(files) == 2
    from kvtier.l3_stores.file import key_filename
    victim = next(f for f in files if f.name == key_filename(b.storage_key(keys[1]))[1])
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    got = b.batch_get_v1(keys, page_indices(host, [2, 3]))
    assert got == [True, False]
    assert b.stats()["store"]["corrupted"] >= 1
    b.close()


def test_unregistered_and_closed_backend_miss(pools, tmp_path):
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    _, host = pools
    cfg = storage_config(extra_config("memory", {}))
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    keys = sglang_keys(random_tokens(host.page_size, 12), host.page_size)
    assert b.batch_get_v1(keys, page_indices(host, [0])) == [False]
    assert b.batch_exists(keys) == 0
    b.register_mem_pool_host(host)
    assert b.batch_set_v1(keys, page_indices(host, [0])) == [True]
    b.close()
    b.close()
    assert b.batch_get_v1(keys, page_indices(host, [1])) == [False]
    assert "closed" in b.stats()["last_error"]


def test_concurrent_prefetch_and_backup_threads(pools, case, tmp_path):
    """SGLang reads (prefetch thread) while it writes (backup thread): exact bytes both ways."""
    _, host = pools
    b = attach(host, storage_config(extra_config("file", {"root": str(tmp_path / "l3"),
                                                          "io_threads": 2}),
                                    mla=case.kind == "mla"))
    g = host.page_num // 3
    done_a, src_b, dst_c = list(range(g)), list(range(g, 2 * g)), list(range(2 * g, 3 * g))
    keys = sglang_keys(random_tokens(2 * g * host.page_size, 13), host.page_size)
    want = [page_bytes(host, p) for p in done_a + src_b]
    assert b.batch_set_v1(keys[:g], page_indices(host, done_a)) == [True] * g
    errors = []

    def backup():
        for i, p in enumerate(src_b):
            if b.batch_set_v1([keys[g + i]], page_indices(host, [p])) != [True]:
                errors.append(("set", p))

    def prefetch():
        for _ in range(4):
            if b.batch_get_v1(keys[:g], page_indices(host, dst_c)) != [True] * g:
                errors.append("get")

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, p in enumerate(dst_c):
        assert_bitwise_equal(page_bytes(host, p), want[i], f"prefetched page {p}")
    assert b.batch_get_v1(keys[g:], page_indices(host, dst_c)) == [True] * g
    for i, p in enumerate(dst_c):
        assert_bitwise_equal(page_bytes(host, p), want[g + i], f"backed-up page {p}")
    assert b.stats()["errors"] == 0
    b.close()


# --------------------------------------------------------------------------------------------
# construction: SGLang's dynamic factory and typed config
# --------------------------------------------------------------------------------------------
def test_factory_builds_from_the_documented_extra_config(pools, tmp_path):
    """The JSON the docs and sglang_extra_config() give is what SGLang's factory builds from."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    _, host = pools
    text = sglang_extra_config("file", {"root": str(tmp_path / "l3")}, key_prefix="tenant-a")
    cfg = storage_config(json.loads(text))
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(b, KVTierHiCacheStorage)
    b.register_mem_pool_host(host)
    assert b.storage_key("ab").startswith(b"tenant-a/sglang/")
    assert b.storage_key("ab").endswith(f"_{MODEL.replace('/', '-')}_0_1".encode())
    b.close()


@pytest.mark.parametrize("extra,error,key", [
    ({"bogus": 1}, ConfigError, "sglang.bogus"),
    ({"store_config": {"root": "/x", "bogus": 2}}, ConfigError, "file.bogus"),
    ({"store": "no-such-store"}, BackendNotFoundError, None),
    ({"store": None}, ConfigError, "sglang.store"),
    ({"skip_existing": "yes"}, ConfigError, "sglang.skip_existing"),
])
def test_bad_extra_config_fails_construction(extra, error, key, pools):
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    _, host = pools
    cfg = extra_config("file", {"root": "/tmp/unused"})
    cfg.update(extra)
    with pytest.raises(error) as info:
        StorageBackendFactory.create_backend("dynamic", storage_config(cfg), host)
    if key is not None:
        assert info.value.key == key


def test_missing_store_key_is_a_config_error(pools):
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    _, host = pools
    cfg = extra_config("file", {})
    del cfg["store"]
    with pytest.raises(ConfigError):
        StorageBackendFactory.create_backend("dynamic", storage_config(cfg), host)


def test_side_pools_of_hybrid_models_are_refused_at_attach(backend, pools):
    _, host = pools
    backend.register_mem_host_pool_v2(host, "kv")            # the KV pool itself is fine
    with pytest.raises(ConfigError):
        backend.register_mem_host_pool_v2(host, "mamba")


def test_v2_calls_on_the_kv_pool(backend, pools):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    _, host = pools
    keys = sglang_keys(random_tokens(2 * host.page_size, 14), host.page_size)
    put = PoolTransfer(name=PoolName.KV, host_indices=page_indices(host, [0, 1]), keys=keys)
    assert backend.batch_set_v2([put]) == {PoolName.KV: [True, True]}
    assert backend.batch_exists_v2(keys).kv_hit_pages == 2
    side = PoolTransfer(name=PoolName.MAMBA, host_indices=page_indices(host, [0]),
                        keys=keys[:1])
    assert backend.batch_exists_v2(keys, [side]).kv_hit_pages == 0
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.KV,
                                             host_indices=page_indices(host, [2, 3]),
                                             keys=keys), side])
    assert got == {PoolName.KV: [True, True], PoolName.MAMBA: [False]}


def test_unsupported_layout_is_refused_at_register(tmp_path):
    """A pool whose pages are not evenly spaced segments of one buffer cannot be bridged."""
    case = PoolCase("mha", "page_first", torch.bfloat16, 2, 2, heads=1, head_dim=8)
    _, host = make_pools(case)
    host.kv_buffer = host.kv_buffer.transpose(0, 1)          # not contiguous any more
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    b = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config("memory", {})), host)
    with pytest.raises(LayoutError):
        b.register_mem_pool_host(host)


def test_import_kvtier_imports_no_sglang():
    code = ("import sys, kvtier, kvtier.integrations, kvtier.registry; "
            "kvtier.registry.discover(); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'sglang'], 'sglang'")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
