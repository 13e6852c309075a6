"""The `umbp` L3 store over the FAKE mori.umbp: naming, config mapping, zero-copy registration,
depths, write-once/delete semantics, failure handling and bad input."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch
from kvtier import KVSpec, registry
from kvtier.errors import (BackendUnavailableError, ConfigError, InvalidArgumentError,
                           LayoutError, PageIndexError, StoreError)
from kvtier.host_pool import HostKVPool
from kvtier.keys import PageKeyer
from kvtier.testing import fill_random, make_host_pool

from kvtier_amd_umbp.host_allocator import UmbpHostAllocator
from kvtier_amd_umbp.l3_store import UmbpStore

MHA = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16")
MLA = KVSpec.mla(num_layers=3, kv_lora_rank=48, rope_dim=8, page_size=7, dtype="bfloat16")


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def keys(n: int, tag: str = "") -> list[bytes]:
    salt = os.urandom(8)
    return [salt + f"{tag}{i}".encode().ljust(24, b".") for i in range(n)]


def client(mod):
    return mod.FAKE.clients[-1]


@pytest.fixture
def pool():
    p = make_host_pool(MHA, 31)
    yield p
    p.close()


@pytest.fixture
def store(fake_umbp, pool):
    s = UmbpStore({"dram": {"capacity_bytes": 4 << 20, "prefault": False}}, spec=MHA)
    s.attach(pool)
    yield s
    s.close()


# ----- naming -----------------------------------------------------------------------------------
def test_mha_names_carry_the_tp_rank(fake_umbp, pool):
    k = keys(2)
    for rank in (0, 3):
        with UmbpStore({"tp_rank": rank}, spec=MHA) as s:
            s.attach(pool)
            assert s.batch_set(k, [0, 1]) == [True, True]
            assert sorted(client(fake_umbp)._fake_objects()) == sorted(
                f"{x.hex()}_{rank}_kv" for x in k)


def test_mla_names_are_shared_by_all_ranks(fake_umbp):
    p = make_host_pool(MLA, 4)
    try:
        names = []
        for rank in (0, 5):
            with UmbpStore({"tp_rank": rank}, spec=MLA) as s:
                names.append(s.object_name(b"\x01" * 32))
        assert names == ["01" * 32 + "__kv"] * 2
    finally:
        p.close()


def test_page_keys_from_the_keyer_round_trip(fake_umbp):
    """Real chained page keys, an MLA pool on umbp-allocated memory, random pages, random
    data, compared byte for byte."""
    fake_umbp.FAKE.deny_hugetlb = True
    pool = HostKVPool(MLA, 40, allocator=UmbpHostAllocator())
    fill_random(pool.raw)
    keyer = PageKeyer(model_id="m", spec=MLA)
    tokens = torch.randint(0, 50_000, (MLA.page_size * 17 + 3,))
    ks = keyer.keys(tokens)
    assert len(ks) == 17
    rng = random.Random(7)
    src = rng.sample(range(40), 17)
    dst = rng.sample([p for p in range(40) if p not in src], 17)
    want = [raw(pool.view[p]).clone() for p in src]
    with UmbpStore(spec=MLA) as s:
        s.attach(pool)
        assert s.batch_set(ks, src) == [True] * 17
        fill_random(pool.raw)
        assert s.batch_exists(ks) == 17
        assert s.batch_get(ks, dst) == [True] * 17
        for i, p in enumerate(dst):
            assert torch.equal(raw(pool.view[p]), want[i]), f"page {i}"
    pool.close()


# ----- config mapping ---------------------------------------------------------------------------
def test_config_maps_onto_umbpconfig(fake_umbp, pool):
    cfg = {"tp_rank": 1, "role": "shared_ssd_leader",
           "dram": {"capacity_bytes": 8 << 20, "high_watermark": 0.8, "low_watermark": 0.5,
                    "hugepages": True, "hugepage_size": 1 << 30, "numa_nodes": [0],
                    "numa_strict": True, "prefault": False},
           "eviction": {"policy": "lru", "candidate_window": 4, "promote_on_read": False}}
    with UmbpStore(cfg, spec=MHA):
        c = fake_umbp.FAKE.last_config
        M = fake_umbp
        assert c.dram.capacity_bytes == 8 << 20 and c.dram.high_watermark == 0.8
        assert c.dram.low_watermark == 0.5 and c.dram.use_hugepages
        assert c.dram.hugepage_size == 1 << 30 and c.dram.numa_nodes == [0]
        assert c.dram.numa_strict and not c.dram.prefault
        assert c.ssd.enabled is False
        assert c.eviction.policy == "lru" and c.eviction.candidate_window == 4
        assert c.eviction.auto_promote_on_read is False
        assert c.role == M.UMBPRole.SharedSSDLeader
        d = c.distributed
        assert d.master_config.master_address == "" and d.master_config.node_id
        assert d.master_config.node_address == "127.0.0.1"
        assert d.master_config.auto_heartbeat is False and d.io_engine.host == ""
        assert d.peer_service_port == 0 and d.cache_remote_fetches is False
        assert d.medium == M.UMBPMedium.DRAM
        assert d.dram_page_size == MHA.page_bytes       # one UMBP page per kvtier page
        assert client(fake_umbp).page_size == MHA.page_bytes


def test_ssd_medium_config(fake_umbp, tmp_path):
    cfg = {"medium": "ssd", "ssd": {"storage_dir": str(tmp_path), "capacity_bytes": 1 << 30,
                                    "segment_size_bytes": 64 << 20, "io_backend": "posix",
                                    "durability": "relaxed", "verify_crc": True,
                                    "direct_io": False, "background_gc": False}}
    with UmbpStore(cfg, spec=MHA) as s:
        c, M = fake_umbp.FAKE.last_config, fake_umbp
        assert c.ssd.enabled and c.ssd.storage_dir == str(tmp_path)
        assert c.ssd.capacity_bytes == 1 << 30 and c.ssd.segment_size_bytes == 64 << 20
        assert c.ssd.io.backend == M.UMBPIoBackend.Posix
        assert c.ssd.durability.mode == M.UMBPDurabilityMode.Relaxed
        assert not c.ssd.durability.enable_background_gc
        assert c.ssd.verify_crc and not c.ssd.direct_io
        assert c.distributed.medium == M.UMBPMedium.SSD
        assert s.stats()["medium"] == "ssd"


def test_distributed_master(fake_umbp, pool):
    cfg = {"distributed": {"master_address": "10.0.0.1:50051", "node_id": "n1",
                           "node_address": "10.0.0.2", "io_engine_host": "10.0.0.2",
                           "io_engine_port": 4000, "peer_service_port": 5000}}
    with pytest.raises(StoreError) as err:              # no master to reach
        UmbpStore(cfg, spec=MHA)
    assert "PoolClient::Init() failed" in str(err.value)
    fake_umbp.FAKE.master_reachable = True
    with UmbpStore(cfg, spec=MHA) as s:
        d = fake_umbp.FAKE.last_config.distributed
        assert d.master_config.master_address == "10.0.0.1:50051"
        assert d.master_config.node_id == "n1" and d.master_config.auto_heartbeat
        assert d.io_engine.host == "10.0.0.2" and d.io_engine.port == 4000
        assert d.peer_service_port == 5000 and d.cache_remote_fetches
        assert s.stats()["deployment"] == "distributed"


@pytest.mark.parametrize("cfg, key", [
    ({"dram": {"capacity_bytes": 100}}, "umbp.dram.capacity_bytes"),
    ({"dram": {"low_watermark": 0.95}}, "umbp.dram.low_watermark"),
    ({"dram": {"hugepage_size": 3 << 20}}, "umbp.dram.hugepage_size"),
    ({"dram": {"numa_nodes": [-1]}}, "umbp.dram.numa_nodes"),
    ({"medium": "ssd"}, "umbp.ssd.storage_dir"),
    ({"medium": "ssd", "ssd": {"storage_dir": "/x", "segment_size_bytes": 5000}},
     "umbp.ssd.segment_size_bytes"),
    ({"medium": "hbm"}, "umbp.medium"),
    ({"eviction": {"policy": "fifo"}}, "umbp.eviction.policy"),
    ({"eviction": {"candidate_window": 0}}, "umbp.eviction.candidate_window"),
    ({"tp_rank": -1}, "umbp.tp_rank"),
    ({"distributed": {"io_engine_port": 70000}}, "umbp.distributed"),
    ({"dram_capacity_bytes": 1 << 30}, "umbp.dram_capacity_bytes"),        # unknown key
    ({"dram": {"capacity": 1}}, "umbp.dram.capacity"),                      # unknown nested
])
def test_bad_config_is_config_error(fake_umbp, cfg, key):
    n = len(fake_umbp.FAKE.clients)
    with pytest.raises(ConfigError) as err:
        UmbpStore(cfg, spec=MHA)
    assert err.value.key == key
    assert len(fake_umbp.FAKE.clients) == n             # rejected before UMBP was started


# ----- attach / zero-copy -----------------------------------------------------------------------
def test_attach_registers_the_pool_and_close_deregisters(fake_umbp, pool):
    s = UmbpStore(spec=MHA)
    s.attach(pool)
    c = client(fake_umbp)
    assert c._registered == {pool.raw.data_ptr(): pool.nbytes}
    assert s.stats()["zero_copy"] is True
    other = make_host_pool(MHA, 5)
    s.attach(other)                                    # re-attach moves the registration
    assert c._registered == {other.raw.data_ptr(): other.nbytes}
    s.close()
    assert c._registered == {}
    s.close()
    other.close()


def test_zero_copy_off_does_not_register(fake_umbp, pool):
    with UmbpStore({"zero_copy": "off"}, spec=MHA) as s:
        s.attach(pool)
        assert client(fake_umbp)._registered == {} and s.stats()["zero_copy"] is False
        assert s.batch_set(keys(1), [0]) == [True]


def test_refused_registration_warns_and_still_moves_data(fake_umbp, pool, caplog):
    fake_umbp.FAKE.register_ok = False
    with UmbpStore(spec=MHA) as s, caplog.at_level(logging.WARNING):
        s.attach(pool)
        assert s.stats()["zero_copy"] is False
        assert any("register_memory" in r.getMessage() for r in caplog.records)
        k = keys(2)
        want = raw(pool.view[3]).clone()
        assert s.batch_set(k, [3, 4]) == [True, True]
        assert s.batch_get(k[:1], [9]) == [True]
        assert torch.equal(raw(pool.view[9]), want)


def test_unregistered_memory_with_zero_copy_required_is_an_error(fake_umbp, pool):
    fake_umbp.FAKE.register_ok = False
    with UmbpStore({"zero_copy": "required"}, spec=MHA) as s:
        with pytest.raises(StoreError) as err:
            s.attach(pool)
        assert "register_memory" in str(err.value)
        with pytest.raises(InvalidArgumentError):      # left unattached: no I/O into it
            s.batch_get(keys(1), [0])


def test_layer_first_pool_is_refused_at_attach(fake_umbp):
    p = make_host_pool(MHA, 4, "layer_first")
    with UmbpStore(spec=MHA) as s:
        with pytest.raises(LayoutError) as err:
            s.attach(p)
        assert "page_first" in str(err.value)
        assert s.host_pool is None and client(fake_umbp)._registered == {}
    p.close()
    assert UmbpStore.capabilities().host_layouts == ("page_first",)


def test_foreign_spec_pool_is_refused(store):
    p = make_host_pool(MLA, 2)
    with pytest.raises(ConfigError):
        store.attach(p)
    p.close()


# ----- depths (prefix-aware eviction) -----------------------------------------------------------
def test_depths_default_to_position_in_the_call(store, fake_umbp):
    k = keys(4)
    store.batch_set(k[:2], [0, 1])
    store.batch_set(k[2:], [2, 3], start_depth=10)
    objs = client(fake_umbp)._fake_objects()
    assert [objs[store.object_name(x)].depth for x in k] == [0, 1, 10, 11]
    k2 = keys(3)
    store.batch_set(k2, [4, 5, 6], depths=[7, 3, 9])
    objs = client(fake_umbp)._fake_objects()
    assert [objs[store.object_name(x)].depth for x in k2] == [7, 3, 9]


@pytest.mark.parametrize("kwargs", [{"depths": [1]}, {"depths": [1, -1]}, {"depths": [1, True]},
                                    {"depths": "ab"}, {"depths": [1.0, 2]},
                                    {"start_depth": -1}, {"start_depth": 1.5}])
def test_bad_depths_are_typed_errors_before_anything_is_stored(store, fake_umbp, kwargs):
    with pytest.raises(InvalidArgumentError):
        store.batch_set(keys(2), [0, 1], **kwargs)
    assert client(fake_umbp)._fake_objects() == {}


@pytest.mark.parametrize("policy, kept", [("prefix_aware_lru", 6), ("lru", 0)])
def test_prefix_aware_eviction_drops_the_deepest_pages(fake_umbp, policy, kept):
    """A 12-page medium (evicts at 99% down to 60%) holding one 16-page chain: with depths
    passed, prefix-aware eviction keeps the chain's head; plain LRU drops it first."""
    spec = MHA
    pool = make_host_pool(spec, 30)
    cfg = {"dram": {"capacity_bytes": 12 * spec.page_bytes, "prefault": False,
                    "high_watermark": 0.99, "low_watermark": 0.6},
           "eviction": {"policy": policy, "candidate_window": 16}}
    with UmbpStore(cfg, spec=spec) as s:
        s.attach(pool)
        chain = keys(16, "c")
        assert s.batch_set(chain[:11], list(range(11))) == [True] * 11
        assert s.batch_set(chain[11:], list(range(11, 16)), start_depth=11) == [True] * 5
        assert len(client(fake_umbp).evicted) == 5
        assert s.batch_exists(chain) == kept
        assert s.batch_exists(chain[11:]) == 5          # the newest pages are all there
    pool.close()


# ----- write-once UMBP, kvtier overwrite/delete semantics ---------------------------------------
def test_overwrite_replaces_bytes_under_a_new_generation(store, pool, fake_umbp):
    k = keys(1)
    store.batch_set(k, [1])
    first = store.object_name(k[0])
    want = raw(pool.view[2]).clone()
    assert store.batch_set(k, [2]) == [True]
    assert store.object_name(k[0]) == first + "_g1"
    fill_random(pool.raw)
    assert store.batch_get(k, [3]) == [True]
    assert torch.equal(raw(pool.view[3]), want)
    assert first in client(fake_umbp)._fake_objects()  # UMBP still holds (never reads) it


def test_keep_mode_trusts_content_addressing(fake_umbp, pool):
    with UmbpStore({"on_existing": "keep"}, spec=MHA) as s:
        s.attach(pool)
        k = keys(2)
        first = raw(pool.view[1]).clone()
        assert s.batch_set(k[:1], [1]) == [True]
        assert s.batch_set(k, [2, 3]) == [True, True]  # k[0] exists: not written again
        assert s.stats()["set_skipped_existing"] == 1
        assert s.batch_get(k[:1], [9]) == [True]
        assert torch.equal(raw(pool.view[9]), first)


def test_delete_then_set_never_resurrects_old_bytes(store, pool):
    k = keys(3)
    store.batch_set(k, [1, 2, 3])
    assert store.delete([k[1], b"never-set"]) == 1
    assert store.batch_exists(k) == 1
    before = raw(pool.view[8]).clone()
    assert store.batch_get([k[1]], [8]) == [False]
    assert torch.equal(raw(pool.view[8]), before)
    want = raw(pool.view[5]).clone()
    assert store.batch_set([k[1]], [5]) == [True]
    fill_random(pool.raw)
    assert store.batch_get([k[1]], [6]) == [True]
    assert torch.equal(raw(pool.view[6]), want)
    assert store.batch_exists(k) == 3
    store.clear()
    assert store.batch_exists(k) == 0 and store.stats()["relocated_keys"] == 0


# ----- failures are misses and counted errors ---------------------------------------------------
def test_client_exceptions_are_counted_misses(store, fake_umbp):
    k = keys(2)
    store.batch_set(k, [0, 1])
    F = fake_umbp.FAKE
    F.raise_on["batch_get_into_ptr"] = RuntimeError("io failure")
    F.raise_on["batch_exists_consecutive"] = RuntimeError("rpc failure")
    assert store.batch_get(k, [2, 3]) == [False, False]
    assert store.batch_exists(k) == 0
    st = store.stats()
    assert st["errors"] == 2 and "batch_exists_consecutive" in st["last_error"]
    F.raise_on.clear()
    assert store.batch_get(k, [2, 3]) == [True, True]


def test_unknown_existence_fails_the_set_and_still_deletes(store, fake_umbp, pool):
    k = keys(2)
    store.batch_set(k, [0, 1])
    fake_umbp.FAKE.raise_on["batch_exists"] = RuntimeError("rpc failure")
    # an overwrite could silently keep the old bytes: refuse rather than claim success
    assert store.batch_set(k[:1], [5]) == [False]
    assert store.delete(k[:1]) == 0                    # count unknown, but the key is gone
    fake_umbp.FAKE.raise_on.clear()
    assert store.batch_exists(k) == 0 and store.batch_exists(k[1:]) == 1
    assert store.stats()["errors"] == 2


def test_failed_puts_are_counted_errors(store, fake_umbp):
    fake_umbp.FAKE.fail_puts = True
    assert store.batch_set(keys(3), [0, 1, 2]) == [False] * 3
    st = store.stats()
    assert st["errors"] == 3 and st["set_ok"] == 0 and st["bytes_written"] == 0


def test_object_bigger_than_the_medium_is_a_failed_put(fake_umbp, pool):
    with UmbpStore({"dram": {"capacity_bytes": MHA.page_bytes, "prefault": False}},
                   spec=MHA) as s:
        s.attach(pool)
        ok = s.batch_set(keys(3), [0, 1, 2])
        assert ok[0] is True and s.batch_exists(keys(1)) == 0


def test_clear_failure_raises(store, fake_umbp):
    fake_umbp.FAKE.raise_on["clear"] = RuntimeError("full-sync failed")
    with pytest.raises(StoreError):
        store.clear()


def test_unstartable_client_is_store_error(fake_umbp):
    fake_umbp.FAKE.raise_on["__init__"] = RuntimeError("invalid UMBP config: ssd watermarks")
    with pytest.raises(StoreError) as err:
        UmbpStore(spec=MHA)
    assert "invalid UMBP config" in str(err.value)


# ----- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_keys", [["str-key"], [b""], [7], b"abc", "abc", None,
                                      [b"ok", bytearray(b"no")]])
def test_keys_of_the_wrong_type(store, fake_umbp, bad_keys):
    n = len(bad_keys) if isinstance(bad_keys, list) else 1
    with pytest.raises(InvalidArgumentError):
        store.batch_set(bad_keys, list(range(n)))
    with pytest.raises(InvalidArgumentError):
        store.batch_exists(bad_keys)
    with pytest.raises(InvalidArgumentError):
        store.delete(bad_keys)
    assert client(fake_umbp)._fake_objects() == {}


def test_bad_pages(store, pool):
    with pytest.raises(PageIndexError):
        store.batch_get(keys(1), [pool.num_pages])
    with pytest.raises(PageIndexError):
        store.batch_set(keys(1), [1.5])
    with pytest.raises(InvalidArgumentError):
        store.batch_set(keys(2), [1])


def test_empty_batches(store):
    assert store.batch_exists([]) == 0
    assert store.batch_get([], []) == [] and store.batch_set([], []) == []
    assert store.delete([]) == 0


def test_closed_store_refuses_io(fake_umbp, pool):
    s = UmbpStore(spec=MHA)
    s.attach(pool)
    s.close()
    for call in (lambda: s.batch_exists(keys(1)), lambda: s.batch_get(keys(1), [0]),
                 lambda: s.batch_set(keys(1), [0]), lambda: s.clear()):
        with pytest.raises(StoreError):
            call()


# ----- availability -----------------------------------------------------------------------------
def test_registry_creates_it_over_the_fake(fake_umbp):
    s = registry.create_l3_store("umbp", {"tp_rank": 2}, spec=MHA)
    assert isinstance(s, UmbpStore) and s.config.tp_rank == 2
    s.close()


def test_no_gpu_refuses_construction(install_fake):
    install_fake(gpus=0)
    with pytest.raises(BackendUnavailableError) as err:
        UmbpStore(spec=MHA)
    assert "no AMD GPU" in err.value.reason
