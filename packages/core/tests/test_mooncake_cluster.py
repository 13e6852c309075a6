"""The `mooncake` store as a cluster: several processes, a master that dies, a full pool, a
writer killed mid-put. Real mooncake_master and clients on 127.0.0.1 (see mooncake_fixtures)."""

from __future__ import annotations

import random
import time

import pytest
from kvtier.spec import KVSpec
from kvtier.testing import make_host_pool
from kvtier.testing.contracts import assert_bitwise_equal

from mooncake_fixtures import Child, big_key, big_page_pattern, prompt_data

SPEC = KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
TIMEOUT = 2.5          # the smallest timeout_s the store accepts
SLACK = 1.0            # scheduling slack on a loaded 2-core machine


def _store(address: str, ns: str, spec: KVSpec = SPEC, **over):
    from kvtier.l3_stores.mooncake import MooncakeStore
    cfg = {"master_address": address, "global_segment_size": 64 << 20,
           "local_buffer_size": 16 << 20, "namespace": ns, **over}
    return MooncakeStore(cfg, spec=spec)


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def _until(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.2)
    pytest.fail(f"{what} within {timeout}s")


# ---------------------------------------------------------------------------------------------
def test_another_process_fetches_a_committed_prompt_bitwise(mooncake_master):
    """Process A commits a prompt's pages; this process (B, its own client) matches the prompt
    by its page keys and fetches every page, bitwise identical, into host pools of either
    layout."""
    num_pages, seed, ns = 12, 1234, "xproc"
    a = Child("commit", {"spec": SPEC.to_dict(), "num_pages": num_pages, "seed": seed,
                         "layout": "page_first",
                         "config": {"master_address": mooncake_master.address,
                                    "namespace": ns, "global_segment_size": 32 << 20}})
    tokens, keys, expected = prompt_data(SPEC, num_pages, seed, "page_first")
    b = _store(mooncake_master.address, ns)
    try:
        report = a.read()
        assert report["stored"] == [True] * num_pages
        assert report["stats"]["set_ok"] == num_pages
        # B's own keys for A's prompt: same model, geometry, rank => the same chain
        from kvtier.keys import PageKeyer
        keyer = PageKeyer(model_id=f"model-{seed}", spec=SPEC)
        bkeys = keyer.keys(tokens)
        assert bkeys == keys
        assert b.batch_exists(bkeys) == num_pages
        longer = keyer.keys(list(tokens) + [7] * (3 * SPEC.page_size))
        assert b.batch_exists(longer) == num_pages          # only the shared prefix
        assert b.batch_exists(PageKeyer(model_id="another-model", spec=SPEC).keys(tokens)) == 0
        for layout in ("page_first", "layer_first"):
            pool = make_host_pool(SPEC, num_pages + 5, layout)
            try:
                b.attach(pool)
                dst = random.Random(seed).sample(range(pool.num_pages), num_pages)
                assert b.batch_get(bkeys, dst) == [True] * num_pages
                for i, p in enumerate(dst):
                    assert_bitwise_equal(pool.view[p], expected.view[i], f"{layout} page {i}")
            finally:
                pool.close()
        b.clear()
    finally:
        b.close()
        expected.close()
        a.finish()


def test_master_killed_and_restarted(private_master):
    """Dead master: every call is a miss with a counted error, none waits past timeout_s;
    once a master is back on the address, the store works again with no action."""
    m = private_master()
    s = _store(m.address, "restart", timeout_s=TIMEOUT)
    pool = make_host_pool(SPEC, 12)
    try:
        s.attach(pool)
        keys = [f"r{i}".encode().ljust(32, b"r") for i in range(4)]
        want = [pool.view[p].clone() for p in range(4)]
        assert s.batch_set(keys, [0, 1, 2, 3]) == [True] * 4
        m.kill()
        errors = s.stats()["errors"]
        for op, args, miss in ((s.batch_exists, (keys,), 0),
                               (s.batch_get, (keys, [4, 5, 6, 7]), [False] * 4),
                               (s.batch_set, (keys, [0, 1, 2, 3]), [False] * 4),
                               (s.delete, (keys,), 0),
                               (s.batch_get, (keys[:1], [8]), [False])):
            out, took = _timed(op, *args)
            assert out == miss, op.__name__
            assert took < TIMEOUT + SLACK, f"{op.__name__} took {took:.2f}s"
        s.clear()
        assert s.stats()["errors"] >= errors + 6
        m.start()                                   # same address, empty metadata
        new = [f"n{i}".encode().ljust(32, b"n") for i in range(3)]
        _until(lambda: s.batch_set(new, [9, 10, 11]) == [True] * 3, 30,
               "writes did not recover after the master came back")
        fresh = [pool.view[p].clone() for p in (9, 10, 11)]
        assert s.batch_get(new, [4, 5, 6]) == [True] * 3
        for i, p in enumerate((4, 5, 6)):
            assert_bitwise_equal(pool.view[p], fresh[i], f"after restart, page {i}")
        # the old objects died with the master's metadata: misses, never wrong bytes
        got = s.batch_get(keys, [0, 1, 2, 3])
        for i, ok in enumerate(got):
            if ok:
                assert_bitwise_equal(pool.view[i], want[i], f"old page {i}")
        s.clear()
    finally:
        s.close()
        pool.close()


def test_hung_master_costs_at_most_the_timeout(private_master):
    """A master that accepts connections but never answers (SIGSTOP): calls come back as
    misses within timeout_s (Mooncake's RPC timeout is set from it), then recover."""
    m = private_master()
    s = _store(m.address, "hung", timeout_s=TIMEOUT)
    pool = make_host_pool(SPEC, 6)
    try:
        s.attach(pool)
        keys = [f"h{i}".encode().ljust(32, b"h") for i in range(2)]
        assert s.batch_set(keys, [0, 1]) == [True, True]
        m.pause()
        try:
            for op, args, miss in ((s.batch_exists, (keys,), 0),
                                   (s.batch_get, (keys, [2, 3]), [False, False]),
                                   (s.batch_set, (keys, [0, 1]), [False, False])):
                out, took = _timed(op, *args)
                assert out == miss, op.__name__
                assert took < TIMEOUT + SLACK, f"{op.__name__} took {took:.2f}s"
        finally:
            m.resume()
        assert s.stats()["errors"] >= 3
        new = [f"hn{i}".encode().ljust(32, b"h") for i in range(2)]
        _until(lambda: s.batch_set(new, [4, 5]) == [True, True], 30,
               "writes did not recover after the master resumed")
        want = [pool.view[p].clone() for p in (4, 5)]
        assert s.batch_get(new, [2, 3]) == [True, True]
        for i, p in enumerate((2, 3)):
            assert_bitwise_equal(pool.view[p], want[i], f"page {i}")
        s.clear()
    finally:
        s.close()
        pool.close()


def test_full_pool_rejects_puts_as_counted_misses(private_master):
    """16 MiB of pool, 40 pages of 1 MiB: Mooncake refuses what does not fit
    (NO_AVAILABLE_HANDLE); refused pages are unstored (False), counted, and read as misses."""
    m = private_master()
    spec = KVSpec.mha(num_layers=4, num_kv_heads=4, head_dim=128, page_size=128)   # 1 MiB
    s = _store(m.address, "full", spec=spec, global_segment_size=16 << 20)
    pool = make_host_pool(spec, 60)
    try:
        s.attach(pool)
        keys = [f"f{i}".encode().ljust(32, b"f") for i in range(40)]
        want = [pool.view[p].clone() for p in range(40)]
        ok = s.batch_set(keys, list(range(40)))
        refused = ok.count(False)
        assert refused >= 24, ok
        st = s.stats()
        assert st["no_space"] == refused and st["error_codes"]["NO_AVAILABLE_HANDLE"] == refused
        assert st["set_ok"] == 40 - refused and st["errors"] == refused
        got = s.batch_get(keys[:20], list(range(40, 60)))
        got += s.batch_get(keys[20:], list(range(40, 60)))
        for i, hit in enumerate(got):
            if not ok[i]:
                assert not hit, f"page {i} was refused but reads as a hit"
            if hit:
                dst = 40 + (i % 20)
                s.batch_get([keys[i]], [dst])
                assert_bitwise_equal(pool.view[dst], want[i], f"page {i}")
        assert any(got)
        s.clear()
    finally:
        s.close()
        pool.close()


def test_writer_killed_mid_put_never_exposes_half_an_object(private_master):
    """A writer is SIGKILLed while it streams a 64 MiB page into this process's segment.
    Readers see the objects it finished, bitwise, and nothing of the one it was writing --
    not during the write, not after (Mooncake discards the reservation)."""
    m = private_master(extra=("--put_start_discard_timeout_sec=2",
                              "--put_start_release_timeout_sec=3"))
    spec = KVSpec.mha(num_layers=8, num_kv_heads=8, head_dim=128, page_size=2048)   # 64 MiB
    n = spec.page_bytes
    pool = make_host_pool(spec, 1)
    mid_write_seen = False
    try:
        for attempt in range(4):
            ns = f"killed{attempt}"
            # this process holds the pool's only segment; the writer contributes none
            reader = _store(m.address, ns, spec=spec, global_segment_size=768 << 20,
                            local_buffer_size=1 << 20, timeout_s=10.0)
            reader.attach(pool)
            raw, ptr = reader._client, pool.raw.data_ptr()
            keys = [reader.object_key(big_key(i)) for i in range(4)]
            writer = Child("bigwriter", {"spec": spec.to_dict(), "count": 4, "config": {
                "master_address": m.address, "namespace": ns, "global_segment_size": 0,
                "local_buffer_size": 1 << 20, "timeout_s": 10.0}})
            times = []
            while True:
                msg = writer.read()
                if msg.get("putting") == 2:
                    break
                if "putting" in msg:
                    t0 = time.monotonic()
                else:
                    assert msg["ok"], msg
                    times.append(time.monotonic() - t0)
            # read the page while it is being written, then kill the writer about a third of
            # the way into the put
            deadline = time.monotonic() + 0.3 * min(times)
            while time.monotonic() < deadline:
                if raw.batch_get_into([keys[2]], [ptr], [n])[0] == n:
                    assert_bitwise_equal(pool.raw, big_page_pattern(n, 2), "concurrent read")
            writer.kill()
            code = raw.batch_get_into([keys[2]], [ptr], [n])[0]
            mid_write_seen |= code == -703                 # REPLICA_IS_NOT_READY
            for i in range(4):
                pool.raw.fill_(0)
                c = raw.batch_get_into([keys[i]], [ptr], [n])[0]
                if i < 2:
                    assert c == n, f"finished page {i}: {c}"
                    assert_bitwise_equal(pool.raw, big_page_pattern(n, i), f"page {i}")
                elif c == n:        # the kill came after the put finished: still whole
                    assert_bitwise_equal(pool.raw, big_page_pattern(n, i), f"page {i}")
                else:
                    assert c in (-703, -704), c
                    assert int(pool.raw.count_nonzero()) == 0, "a refused read wrote bytes"
            if code == -703:
                # through the store API: a miss; and the master drops the reservation
                assert reader.batch_exists([big_key(2)]) == 0
                assert reader.batch_get([big_key(2)], [0]) == [False]
                _until(lambda raw=raw, k=keys[2], ptr=ptr:
                       raw.batch_get_into([k], [ptr], [n])[0] == -704, 30,
                       "the dead writer's reservation was never discarded")
            reader.clear()
            reader.close()
            if code == -703:
                break
        assert mid_write_seen, "never managed to kill the writer in the middle of a put"
    finally:
        pool.close()
