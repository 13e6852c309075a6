"""The `mooncake` L3 store against a real mooncake_master on 127.0.0.1.

Skipped (with the probe's reason) only where the Mooncake client cannot be imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvtier.errors import ConfigError, InvalidArgumentError, KVTierError, StoreError
from kvtier.interfaces import L3_STORES
from kvtier.spec import KVSpec
from kvtier.testing import L3StoreContract, backend_params, fill_random, make_host_pool
from kvtier.testing.contracts import assert_bitwise_equal

from mooncake_fixtures import Child, free_port, mooncake_import_error

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=40, page_size=7, dtype="bfloat16")


def _store(master, ns: str, spec: KVSpec = SPEC, **over):
    """A store on ``master`` (a MasterProcess or an address)."""
    from kvtier.l3_stores.mooncake import MooncakeStore
    cfg = {"master_address": getattr(master, "address", master), "global_segment_size": 64 << 20,
           "local_buffer_size": 16 << 20, "namespace": ns, **over}
    return MooncakeStore(cfg, spec=spec)


def _keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b"~") for i in range(n)]


@pytest.fixture(scope="module")
def segment_holder(mooncake_master):
    """Another process contributing the pool's only segment (128 MiB)."""
    holder = Child("hold", {"spec": SPEC.to_dict(), "config": {
        "master_address": mooncake_master.address, "global_segment_size": 128 << 20,
        "namespace": "holder"}})
    assert holder.read()["ready"]
    yield holder
    holder.finish()


# ---------------------------------------------------------------------------------------------
class TestMooncakeContractRemoteSegment(L3StoreContract):
    """The L3 contract with every byte crossing TCP: this client contributes no memory, so the
    pool's only segment is another process's."""

    distribution = "kvtier-core"

    def pytest_generate_tests(self, metafunc):
        if "backend_name" in metafunc.fixturenames:
            metafunc.parametrize("backend_name", [
                p for p in backend_params(L3_STORES, self.distribution)
                if p.values[0] == "mooncake"])

    @pytest.fixture(autouse=True)
    def _holder(self, segment_holder):
        pass

    def make_config(self, backend_name, workdir):
        cfg = super().make_config(backend_name, workdir)
        cfg["global_segment_size"] = 0
        return cfg


# ---------------------------------------------------------------------------------------------
def test_config_is_typed_and_validated():
    from kvtier.l3_stores.mooncake import MooncakeStore
    with pytest.raises(ConfigError) as e:
        MooncakeStore({"master_adress": "x:1"}, spec=SPEC)
    assert e.value.key == "mooncake.master_adress"
    for bad in ({"namespace": "has space"}, {"namespace": "a/b"}, {"timeout_s": 1.0},
                {"global_segment_size": 1 << 20}, {"replica_num": 0},
                {"master_address": "nohostport"}, {"protocol": "udp"}, {"io_threads": 0}):
        with pytest.raises(ConfigError):
            MooncakeStore(bad, spec=SPEC)


def test_config_from_environment():
    from kvtier.l3_stores.mooncake import MooncakeStore
    env = {"KVTIER_MOONCAKE_MASTER_ADDRESS": "10.1.2.3:5555",
           "KVTIER_MOONCAKE_GLOBAL_SEGMENT_SIZE": "0x4000000",
           "KVTIER_MOONCAKE_REPLICA_NUM": "2", "KVTIER_MOONCAKE_FORCE_REMOVE": "yes",
           "KVTIER_MOONCAKE_TIMEOUT_S": "7.5", "OTHER": "ignored"}
    c = MooncakeStore.config_from_env(env)
    assert (c.master_address, c.global_segment_size, c.replica_num, c.force_remove,
            c.timeout_s) == ("10.1.2.3:5555", 64 << 20, 2, True, 7.5)
    with pytest.raises(ConfigError):
        MooncakeStore.config_from_env({"KVTIER_MOONCAKE_REPLICA_NUM": "two"})


def test_registry_creates_it_from_the_environment(mooncake_master, monkeypatch):
    from kvtier.registry import create_l3_store
    monkeypatch.setenv("KVTIER_MOONCAKE_MASTER_ADDRESS", mooncake_master.address)
    monkeypatch.setenv("KVTIER_MOONCAKE_NAMESPACE", "from-env")
    monkeypatch.setenv("KVTIER_MOONCAKE_GLOBAL_SEGMENT_SIZE", str(64 << 20))
    monkeypatch.setenv("KVTIER_MOONCAKE_LOCAL_BUFFER_SIZE", str(16 << 20))
    s = create_l3_store("mooncake", spec=SPEC)
    pool = make_host_pool(SPEC, 4)
    try:
        assert s.config.namespace == "from-env"
        s.attach(pool)
        keys = _keys(2, "env")
        want = [pool.view[p].clone() for p in (0, 1)]
        assert s.batch_set(keys, [0, 1]) == [True, True]
        assert s.batch_get(keys, [2, 3]) == [True, True]
        for i, p in enumerate((2, 3)):
            assert_bitwise_equal(pool.view[p], want[i], f"page {i}")
        s.clear()
    finally:
        s.close()
        pool.close()


def test_unreachable_master_is_a_loud_error(mooncake_master):
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="could not start a client"):
        _store(f"127.0.0.1:{free_port()}", "nomaster", connect_retries=1)
    assert time.monotonic() - t0 < 15


def test_keys_are_namespaced_per_deployment_and_geometry(mooncake_master):
    a, b = _store(mooncake_master, "ns-a"), _store(mooncake_master, "ns-b")
    other = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=40, page_size=8)
    c = _store(mooncake_master, "ns-a", spec=other)
    pa, pc = make_host_pool(SPEC, 4), make_host_pool(other, 4)
    try:
        a.attach(pa)
        b.attach(pa)           # one pool, two stores sharing a client: registered once
        c.attach(pc)
        keys = _keys(3, "ns")
        assert a.object_key(keys[0]) == f"ns-a/{SPEC.fingerprint}/{keys[0].hex()}"
        assert a.batch_set(keys, [0, 1, 2]) == [True] * 3
        assert a.batch_exists(keys) == 3
        assert b.batch_exists(keys) == 0          # another namespace
        assert c.batch_exists(keys) == 0          # same namespace, another KV geometry
        b.clear()
        c.clear()
        assert a.batch_exists(keys) == 3          # their clear() left ours alone
        a.clear()
        assert a.batch_exists(keys) == 0
    finally:
        for s in (a, b, c):
            s.close()
        pa.close()
        pc.close()


def test_page_first_writer_layer_first_reader_bitwise(mooncake_master):
    """An object is a page's bytes in logical order, whatever the host layout on each side."""
    w, r = _store(mooncake_master, "xlayout"), _store(mooncake_master, "xlayout")
    pw, pr = make_host_pool(SPEC, 9, "page_first"), make_host_pool(SPEC, 9, "layer_first")
    try:
        w.attach(pw)
        r.attach(pr)
        keys = _keys(5, "x")
        src, dst = [8, 0, 3, 5, 1], [2, 7, 4, 0, 6]
        want = [pw.view[p].clone() for p in src]
        assert w.batch_set(keys, src) == [True] * 5
        got = r.batch_get(keys, dst)
        assert got == [True] * 5
        for i, p in enumerate(dst):
            assert_bitwise_equal(pr.view[p], want[i], f"page {i}")
        # and back: layer_first writer (through the local buffer), page_first reader
        fill_random(pr.raw)
        want = [pr.view[p].clone() for p in dst]
        assert r.batch_set(keys, dst) == [True] * 5
        assert w.batch_get(keys, src) == [True] * 5
        for i, p in enumerate(src):
            assert_bitwise_equal(pw.view[p], want[i], f"page {i} back")
        w.clear()
    finally:
        w.close()
        r.close()
        pw.close()
        pr.close()


def test_wrong_size_object_is_a_counted_corrupt_miss(mooncake_master):
    s = _store(mooncake_master, "corrupt")
    pool = make_host_pool(SPEC, 3)
    try:
        s.attach(pool)
        k = _keys(2, "short")
        for key, n in zip(k, (SPEC.page_bytes - 1, SPEC.page_bytes + 64)):
            assert s._client.upsert(s.object_key(key), bytes(range(256)) * (n // 256)
                                    + bytes(n % 256)) == 0
        before = s.stats()
        assert s.batch_get(k, [0, 1]) == [False, False]
        after = s.stats()
        assert after["corrupted"] - before["corrupted"] == 1      # the short one was read
        assert after["errors"] - before["errors"] == 2             # the long one refused too
        assert after["get_hits"] == before["get_hits"]
        s.clear()
    finally:
        s.close()
        pool.close()


def test_layer_first_pool_needs_a_page_sized_local_buffer(mooncake_master):
    big = KVSpec.mha(num_layers=4, num_kv_heads=8, head_dim=128, page_size=512)   # 8 MiB
    s = _store(mooncake_master, "lb", spec=big, local_buffer_size=4 << 20)
    pool = make_host_pool(big, 1, "layer_first")
    try:
        with pytest.raises(ConfigError) as e:
            s.attach(pool)
        assert e.value.key == "mooncake.local_buffer_size"
        with pytest.raises(InvalidArgumentError):      # still unattached
            s.batch_get(_keys(1, "lb"), [0])
    finally:
        s.close()
        pool.close()


def test_duplicate_destination_pages_are_refused(mooncake_master):
    s = _store(mooncake_master, "dup")
    pool = make_host_pool(SPEC, 3)
    try:
        s.attach(pool)
        with pytest.raises(InvalidArgumentError):
            s.batch_get(_keys(2, "d"), [1, 1])
    finally:
        s.close()
        pool.close()


def test_read_leases_hold_deletes_until_they_lapse(mooncake_master, private_master):
    """Mooncake leases an object to whoever queried it; delete waits, then gives up (counted)
    unless told to force."""
    m = private_master(lease_ttl_ms=60_000)
    s = _store(m, "lease", lease_wait_s=0.3)
    f = _store(m, "lease", lease_wait_s=0.3, force_remove=True, io_threads=2)
    pool = make_host_pool(SPEC, 4)
    try:
        s.attach(pool)
        f.attach(pool)
        keys = _keys(2, "l")
        assert s.batch_set(keys, [0, 1]) == [True, True]
        assert s.batch_exists(keys) == 2                   # takes a 60 s read lease
        t0 = time.monotonic()
        assert s.delete(keys[:1]) == 0
        assert 0.25 < time.monotonic() - t0 < 3
        assert s.stats()["leased"] == 1
        assert s.batch_exists(keys) == 2
        assert f.delete(keys[:1]) == 1                     # forced after the wait
        assert s.batch_exists(keys) == 0 and s.batch_exists(keys[1:]) == 1
        s.clear()
    finally:
        s.close()
        f.close()
        pool.close()


def test_closed_store_refuses_calls(mooncake_master):
    s = _store(mooncake_master, "closed")
    s.close()
    s.close()                                              # idempotent
    with pytest.raises(KVTierError):
        s.batch_exists(_keys(1, "c"))


def test_clients_are_shared_and_reused(mooncake_master):
    a, b = _store(mooncake_master, "share-a"), _store(mooncake_master, "share-b")
    try:
        assert a._client is b._client
    finally:
        a.close()
        b.close()
    t0 = time.monotonic()
    c = _store(mooncake_master, "share-c")
    assert time.monotonic() - t0 < 0.5
    c.close()


def test_watchdog_returns_misses_and_undoes_late_puts(mooncake_master):
    """A call that overruns timeout_s is a miss at the deadline; a put that completes late is
    removed (its pages may have changed since the caller was told it failed)."""
    s = _store(mooncake_master, "late", timeout_s=2.5, io_threads=1)
    pool = make_host_pool(SPEC, 4)
    real = s._client

    class Slow:            # the real client, with a stall before the call
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name not in ("batch_upsert_from", "batch_get_into"):
                return fn

            def slow(*a, **kw):
                time.sleep(3.5)
                return fn(*a, **kw)
            return slow
    try:
        s.attach(pool)
        keys = _keys(2, "w")
        s._client = Slow()
        t0 = time.monotonic()
        assert s.batch_set(keys, [0, 1]) == [False, False]
        assert 2.4 < time.monotonic() - t0 < 3.2
        st = s.stats()
        assert st["timeouts"] == 1 and st["stuck_calls"] == 1
        t0 = time.monotonic()
        assert s.batch_exists(keys) == 0                  # io_threads=1 all stuck: refused
        assert time.monotonic() - t0 < 0.2 and s.stats()["wedged"] == 1
        deadline = time.monotonic() + 10
        while s.stats()["stuck_calls"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.stats()["late_completions"] == 1
        s._client = real
        assert s.batch_exists(keys) == 0, "a late put must not leave its objects behind"
        s.clear()
    finally:
        s._client = real
        s.close()
        pool.close()


def test_probe_reports_a_missing_client(monkeypatch):
    from kvtier.l3_stores.mooncake import MooncakeStore
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    av = MooncakeStore.probe()
    assert not av.ok and "import" in av.reason and "kvtier-core[mooncake]" in av.hint


def test_importing_kvtier_and_the_store_module_imports_no_mooncake():
    code = ("import sys, kvtier, kvtier.registry, kvtier.l3_stores.mooncake; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'mooncake'], "
            "sorted(m for m in sys.modules if m.startswith('mooncake'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mooncake_tests_run_in_a_loopback_only_namespace(mooncake_netns):
    """Mooncake's transport listens on every interface: where the fixtures could make a
    private network namespace, nothing but loopback exists in it."""
    import socket
    if not mooncake_netns:
        pytest.skip("no private network namespace (KVTIER_MOONCAKE_NETNS=0, or no CAP_SYS_ADMIN)")
    assert [name for _, name in socket.if_nameindex()] == ["lo"]


def test_the_client_is_installed_in_ci():
    """CI installs kvtier-core[mooncake] and libibverbs1: there, a client that cannot be
    imported fails the run instead of skipping every Mooncake test."""
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        pytest.skip("not CI: without the client the Mooncake tests skip with its reason")
    assert mooncake_import_error() is None


def test_capabilities():
    from kvtier.l3_stores.mooncake import MooncakeStore
    caps = MooncakeStore.capabilities()
    assert caps.host_layouts == ("page_first", "layer_first")
