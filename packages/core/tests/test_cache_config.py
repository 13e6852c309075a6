"""CacheConfig: one typed config from a dict, the environment or the CLI; bad input is a
ConfigError naming the key, before anything is built."""

from __future__ import annotations

import argparse

import pytest

from kvtier import KVSpec
from kvtier.cache import CacheConfig, TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import BackendNotFoundError, ConfigError

SPEC = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16")


def build(cfg):
    dp = DeviceKVPool.empty(SPEC, 8)
    return TieredKVCache.from_config(cfg, device_pool=dp, free_device_pages=lambda p: None)


def test_defaults_and_typed_fields():
    c = CacheConfig.from_dict({"model_id": "m"})
    assert c.write_policy == "write_through" and c.prefetch_policy == "wait_complete"
    assert c.l3_store is None and c.transfer_engine == "auto"
    assert c.host_pages_for(SPEC.page_bytes, 10) == 20          # ratio 2 of L1
    c = CacheConfig.from_dict({"model_id": "m", "host_pool_bytes": 10 * SPEC.page_bytes + 5})
    assert c.host_pages_for(SPEC.page_bytes, 10) == 10


@pytest.mark.parametrize("data,key", [
    ({"model_id": "m", "bogus": 1}, "bogus"),
    ({"model_id": "m", "host_pool_pages": "many"}, "host_pool_pages"),
    ({"model_id": "m", "write_policy": "write_around"}, "write_policy"),
    ({"model_id": "m", "prefetch_policy": "eager"}, "prefetch_policy"),
    ({"model_id": "m", "host_pool_pages": 0}, "host_pool_pages"),
    ({"model_id": "m", "host_pool_pages": 4, "host_pool_bytes": 4096}, "host_pool_bytes"),
    ({"model_id": "m", "prefetch_timeout_base_s": -1.0}, "prefetch_timeout_base_s"),
    ({"model_id": "m", "l3_io_threads": 0}, "l3_io_threads"),
    ({"model_id": "m", "l3_config": "{not json"}, "l3_config"),
    ({"model_id": "m", "l3_config": [1, 2]}, "l3_config"),
    ({"model_id": "m", "close_policy": "abandon"}, "close_policy"),
    ({"model_id": "m", "selective_threshold": 0}, "selective_threshold"),
    ({"model_id": "m", "switch_interval_s": 0}, "switch_interval_s"),
    ({"model_id": "m", "switch_interval_s": -1e-4}, "switch_interval_s"),
    ({"model_id": "m", "switch_interval_s": float("nan")}, "switch_interval_s"),
    ({"model_id": "m", "switch_interval_s": 5.0}, "switch_interval_s"),
    ({"model_id": "m", "switch_interval_s": "fast"}, "switch_interval_s"),
])
def test_bad_config_is_a_config_error_naming_the_key(data, key):
    with pytest.raises(ConfigError) as ei:
        CacheConfig.from_dict(data)
    assert key in str(ei.value) and key in (ei.value.key or "")


@pytest.mark.parametrize("how", ["cache", "executor"])
def test_switch_interval_is_set_for_the_process_where_given(how):
    import sys

    from kvtier.cache import CacheExecutor
    before = sys.getswitchinterval()
    want = 0.00037 if abs(before - 0.00037) > 1e-6 else 0.00041
    try:
        if how == "cache":
            build({"model_id": "m"}).close()          # unset: left as it was
            assert sys.getswitchinterval() == before
            c = build({"model_id": "m", "switch_interval_s": want})
        else:
            c = CacheExecutor.from_config({"model_id": "m", "switch_interval_s": want},
                                          device_pool=DeviceKVPool.empty(SPEC, 8))
        c.close()
        assert abs(sys.getswitchinterval() - want) < 1e-6
    finally:
        sys.setswitchinterval(before)


def test_missing_model_id_is_a_config_error():
    with pytest.raises(ConfigError):
        CacheConfig.from_dict({})


def test_from_env():
    env = {"KVTIER_MODEL_ID": "llama", "KVTIER_HOST_POOL_PAGES": "64",
           "KVTIER_L3_STORE": "memory", "KVTIER_L3_CONFIG": '{"capacity_bytes": 4096}',
           "KVTIER_WRITE_POLICY": "write_back", "KVTIER_PREFETCH_TIMEOUT_CAP_S": "0.5",
           "KVTIER_CONFIG": "/etc/kvtier.toml", "OTHER_MODEL_ID": "x"}
    c = CacheConfig.from_env(environ=env)
    assert c.model_id == "llama" and c.host_pool_pages == 64 and c.l3_store == "memory"
    assert c.l3_config == {"capacity_bytes": 4096} and c.write_policy == "write_back"
    assert c.prefetch_timeout_cap_s == 0.5
    with pytest.raises(ConfigError) as ei:
        CacheConfig.from_env(environ={"KVTIER_MODEL_ID": "m", "KVTIER_L3_IO_THREADS": "two"})
    assert "l3_io_threads" in str(ei.value)
    with pytest.raises(ConfigError, match="KVTIER_WRITE_POLICYY .*did you mean "
                                          "KVTIER_WRITE_POLICY"):
        CacheConfig.from_env(environ={**env, "KVTIER_WRITE_POLICYY": "write_back"})
    c = CacheConfig.from_env("APP_", environ={"APP_L3_STORE": ""}, base={"model_id": "b"})
    assert c.l3_store is None and c.model_id == "b"


def test_from_cli_arguments():
    p = argparse.ArgumentParser()
    CacheConfig.add_arguments(p, prefix="kv-")
    args = p.parse_args(["--kv-model-id", "m", "--kv-host-pool-pages", "32",
                         "--kv-l3-store", "memory", "--kv-transfer-config", "{}"])
    c = CacheConfig.from_args(args, base={"write_policy": "write_back"})
    assert (c.model_id, c.host_pool_pages, c.l3_store, c.write_policy) == \
        ("m", 32, "memory", "write_back")
    args = p.parse_args(["--kv-model-id", "m", "--kv-selective-threshold", "x"])
    with pytest.raises(ConfigError):
        CacheConfig.from_args(args)


def test_backend_names_and_their_configs_are_checked_at_build():
    with pytest.raises(BackendNotFoundError):
        build({"model_id": "m", "l3_store": "no-such-store"})
    with pytest.raises(BackendNotFoundError):
        build({"model_id": "m", "transfer_engine": "no-such-engine"})
    with pytest.raises(ConfigError) as ei:
        build({"model_id": "m", "l3_store": "memory", "l3_config": {"bogus": 1}})
    assert "bogus" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        build({"model_id": "m", "tp_rank": 2, "tp_size": 2})
    assert "tp_rank" in str(ei.value)


def test_namespace_separates_caches():
    a = build({"model_id": "m", "host_pool_pages": 2})
    b = build({"model_id": "m", "salt": "tenant-b", "host_pool_pages": 2})
    try:
        assert a.keys(list(range(8))) != b.keys(list(range(8)))
        assert a.host_pool.num_pages == 2
    finally:
        a.close()
        b.close()
