"""Failures: a store that raises or lies costs misses and counted errors; a store that keeps
failing or an I/O thread that dies is reported (metrics, log, one TierFailureError from the
next call) and L3 stays off, visibly, until restart_l3(); transfer errors reach the caller."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import TierFailureError, TransferError
from kvtier.interfaces import TransferHandle
from kvtier.l3_stores.memory import MemoryStore
from kvtier.page_allocator import PageAllocator
from kvtier.testing import fill_random
from kvtier.testing.contracts import raw_bytes

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16")


class FlakyStore(MemoryStore):
    """A memory store whose operations can be told to raise, lie or kill their thread."""

    def __init__(self, config=None, *, spec):
        super().__init__(config, spec=spec)
        self.fail: dict[str, BaseException | None] = {}
        self.lie: dict[str, object] = {}

    def _maybe(self, op: str):
        exc = self.fail.get(op)
        if exc is not None:
            raise exc
        return self.lie.get(op, _NO)

    def batch_exists(self, keys):
        v = self._maybe("exists")
        return super().batch_exists(keys) if v is _NO else v

    def batch_get(self, keys, host_pages):
        v = self._maybe("get")
        return super().batch_get(keys, host_pages) if v is _NO else v

    def batch_set(self, keys, host_pages):
        v = self._maybe("set")
        return super().batch_set(keys, host_pages) if v is _NO else v


_NO = object()


class Die(BaseException):
    """Escapes ``except Exception``: kills the thread that meets it."""


class Setup:
    def __init__(self, store=None, engine=None, **config):
        self.dpool = DeviceKVPool.empty(SPEC, 16)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t)
        self.alloc = PageAllocator(16)
        cfg = {"model_id": "fail", "host_pool_pages": 8, "l3_io_threads": 1,
               "prefetch_policy": "wait_complete", "l3_error_limit": 3}
        cfg.update(config)
        self.store = store
        self.cache = TieredKVCache.from_config(cfg, device_pool=self.dpool, store=store,
                                               engine=engine,
                                               allocate_device_pages=self.alloc.alloc,
                                               free_device_pages=self.alloc.free)

    def commit(self, tokens) -> list[int]:
        c = self.cache
        m = c.match(tokens)
        pages = self.alloc.alloc(len(m.keys) - m.l1_count)
        c.commit(tokens, m.l1_pages + pages, match=m)
        self.alloc.free(c.release(m))
        return pages

    def to_l3_only(self, tokens) -> None:
        c = self.cache
        assert c.wait_idle(10)
        c.evict(100)
        c.evict(100, tier="l2")
        assert c.wait_idle(10)

    def close(self):
        self.cache.close()
        if self.store is not None:
            self.store.close()


TOKS = list(range(100, 100 + 3 * 4 + 1))


@pytest.fixture
def flaky():
    s = Setup(FlakyStore(spec=SPEC))
    yield s
    s.close()


def test_raising_exists_is_a_counted_miss(flaky, caplog):
    flaky.commit(TOKS)
    flaky.to_l3_only(TOKS)
    flaky.store.fail["exists"] = RuntimeError("exists broke")
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        m = flaky.cache.match(TOKS)
    assert m.l3_count == 0
    assert flaky.cache.metrics()["store_errors"] == 1
    assert "exists broke" in caplog.text
    flaky.cache.release(m)


def test_raising_get_is_a_counted_miss_and_never_wrong_data(flaky):
    flaky.commit(TOKS)
    flaky.to_l3_only(TOKS)
    flaky.store.fail["get"] = RuntimeError("get broke")
    c = flaky.cache
    m = c.match(TOKS)
    assert m.l3_count == 3
    dev = flaky.alloc.alloc(3)
    h = c.fetch(m, dev)
    h.wait()
    assert h.pages_loaded == 0
    assert c.metrics()["store_errors"] == 1
    assert sorted(c.release(m)) == sorted(dev)          # nothing taken: the engine's pages
    c.check_invariants()
    assert c.host_pool.free_count == 8                   # the read's host pages came back


def test_lying_stores_are_errors_not_data(flaky):
    flaky.commit(TOKS)
    flaky.to_l3_only(TOKS)
    c = flaky.cache
    flaky.store.lie["exists"] = 99                       # more hits than keys
    m = c.match(TOKS)
    assert m.l3_count == 0
    c.release(m)
    flaky.store.lie.pop("exists")
    flaky.store.lie["get"] = [True]                      # wrong length
    m = c.match(TOKS)
    h = c.fetch(m, flaky.alloc.alloc(3))
    h.wait()
    assert h.pages_loaded == 0
    flaky.alloc.free(c.release(m))
    assert c.metrics()["store_errors"] == 2


def test_partial_get_uses_only_leading_successes(flaky):
    flaky.commit(TOKS)
    keys = flaky.cache.keys(TOKS)
    flaky.to_l3_only(TOKS)
    flaky.store.delete([keys[1]])                         # the middle object is gone
    c = flaky.cache
    m = c.match(TOKS)
    assert m.l3_count == 1                                # exists stops at the gap
    c.release(m)
    # even when exists is fooled, only leading hits are used
    flaky.store.lie["exists"] = 3
    m = c.match(TOKS)
    dev = flaky.alloc.alloc(3)
    h = c.fetch(m, dev)
    h.wait()
    assert h.pages_loaded == 1
    flaky.alloc.free(c.release(m))


def test_failed_writes_are_counted_and_leave_l2_usable(flaky):
    flaky.store.fail["set"] = RuntimeError("disk full")
    flaky.commit(TOKS)
    c = flaky.cache
    assert c.wait_idle(10)
    mt = c.metrics()
    assert mt["store_errors"] == 1 and mt["l3_write_failed_pages"] == 3
    c.evict(100)
    m = c.match(TOKS)
    assert m.l2_count == 3                                # still served from L2
    flaky.alloc.free(c.release(m))


def test_a_store_that_keeps_failing_is_reported_once_and_stays_off(flaky, caplog):
    c = flaky.cache
    flaky.commit(TOKS)
    flaky.to_l3_only(TOKS)
    flaky.store.fail["exists"] = OSError("connection refused")
    with caplog.at_level(logging.ERROR, logger="kvtier.cache"):
        for _ in range(3):                                # l3_error_limit = 3
            c.release(c.match(TOKS))
    assert "connection refused" in caplog.text
    with pytest.raises(TierFailureError) as ei:
        c.match(TOKS)
    assert ei.value.tier == "l3" and "connection refused" in str(ei.value)
    assert isinstance(ei.value.cause, OSError)
    mt = c.metrics()
    assert mt["l3_state"].startswith("failed") and mt["l3_failures"] == 1
    m = c.match(TOKS)                                     # reported once; L3 is now off
    assert m.l3_count == 0
    c.release(m)
    flaky.store.fail.clear()
    c.restart_l3()
    assert c.metrics()["l3_state"] == "ok"
    m = c.match(TOKS)
    assert m.l3_count == 3
    c.release(m)


def test_a_dead_io_thread_is_reported_and_nobody_hangs(caplog):
    s = Setup(FlakyStore(spec=SPEC))
    try:
        c = s.cache
        s.commit(TOKS)
        s.to_l3_only(TOKS)
        s.store.fail["get"] = Die("worker killed")
        m = c.match(TOKS)
        dev = s.alloc.alloc(3)
        with caplog.at_level(logging.ERROR, logger="kvtier.cache"):
            t0 = time.perf_counter()
            h = c.fetch(m, dev)                           # wait_complete must not hang
            assert time.perf_counter() - t0 < 5
        h.wait()
        assert h.pages_loaded == 0
        s.alloc.free(c.release(m))
        deadline = time.time() + 5
        while c._l3.workers[0].is_alive():
            assert time.time() < deadline
            time.sleep(0.01)
        assert "died" in caplog.text
        with pytest.raises(TierFailureError) as ei:
            c.match(TOKS)
        assert "kvtier-l3-io-0" in str(ei.value) and "worker killed" in str(ei.value)
        assert c.metrics()["l3_state"].startswith("failed")
        assert c.host_pool.free_count == 8
        c.check_invariants()
        # L3 writes are skipped (counted), not silently queued forever
        s.commit(list(range(500, 509)))
        assert c.wait_idle(5)
        assert c.metrics()["l3_writes_dropped"] >= 2
        s.store.fail.clear()
        c.restart_l3()
        m = c.match(TOKS)
        assert m.l3_count == 3
        h = c.fetch(m, s.alloc.alloc(3))
        h.wait()
        assert h.pages_loaded == 3
        s.alloc.free(c.release(m))
    finally:
        s.close()


def test_a_thread_found_dead_between_calls_is_reported():
    s = Setup(MemoryStore(spec=SPEC))
    try:
        c = s.cache
        worker = c._l3.workers[0]
        c._l3.submit(_Poison())
        worker.join(5)
        assert not worker.is_alive()
        with pytest.raises(TierFailureError):
            c.match(TOKS)
    finally:
        s.close()


class _Poison:
    """A queued task whose run kills the worker before it can report anything itself."""

    is_read = True
    num_pages = 0

    def run(self, io):
        raise Die("poison")

    def abort(self, cancelled):
        pass


def test_completion_thread_death_is_reported(monkeypatch):
    s = Setup(None)
    try:
        import kvtier.cache.transfers as cache_mod
        real = cache_mod.host_wait
        calls = {"n": 0}

        def dying(handle):
            calls["n"] += 1
            if calls["n"] == 1:
                raise Die("completion thread killed")
            return real(handle)
        monkeypatch.setattr(cache_mod, "host_wait", dying)
        s.commit(TOKS)                                  # the backup's completion kills it
        s.cache._completer.thread.join(5)
        with pytest.raises(TierFailureError) as ei:
            s.cache.match(TOKS)
        assert ei.value.tier == "transfer"
        s.commit(list(range(900, 909)))                 # later completions run inline
        assert s.cache.wait_idle(5)
        s.cache.check_invariants()
    finally:
        s.close()


class FailingHandle(TransferHandle):
    def __init__(self, layers):
        self.layers = layers

    def wait(self):
        raise TransferError("DMA fault", backend="test")

    def wait_layer(self, layer):
        raise TransferError("DMA fault", backend="test")

    def done(self):
        return True

    def synchronize(self):
        raise TransferError("DMA fault", backend="test")


def test_transfer_errors_reach_the_caller_and_register_nothing():
    s = Setup(None, host_pool_pages=8)
    try:
        c = s.cache
        s.commit(TOKS)
        assert c.wait_idle(5)
        c.evict(100)
        engine = c.engine
        real_load = engine.load
        engine.load = lambda h, d: FailingHandle(SPEC.num_layers)
        m = c.match(TOKS)
        dev = s.alloc.alloc(3)
        h = c.fetch(m, dev)
        with pytest.raises(TransferError):
            h.wait()
        assert c.wait_idle(5)                           # the data path books it too
        assert c.metrics()["transfer_errors"] >= 1
        assert sorted(c.release(m)) == sorted(dev)      # nothing was taken
        s.alloc.free(dev)
        engine.load = real_load
        c.check_invariants()
        m = c.match(TOKS)
        assert m.l2_count == 3 and m.l1_count == 0      # the L2 copies are intact
        h = c.fetch(m, s.alloc.alloc(3))
        h.wait()
        before = raw_bytes(c.host_pool.view[m.l2_pages[0]])
        after = torch.cat([raw_bytes(s.dpool.page(comp, layer, h.device_pages[0]))
                           for layer in range(2) for comp in range(2)])
        assert torch.equal(before, after)
        s.alloc.free(c.release(m))
    finally:
        s.close()


def test_close_never_hangs_on_a_blocked_store():
    class Blocked(MemoryStore):
        gate = threading.Event()

        def batch_set(self, keys, host_pages):
            self.gate.wait(3)
            return super().batch_set(keys, host_pages)
    store = Blocked(spec=SPEC)
    s = Setup(store, close_timeout_s=0.5, close_policy="flush")
    s.commit(TOKS)
    t0 = time.perf_counter()
    s.cache.close()
    assert time.perf_counter() - t0 < 2.5
    Blocked.gate.set()
    store.close()


class _StuckWrites(MemoryStore):
    """A memory store whose ``batch_set`` blocks on ``gate`` once armed."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.armed = False

    def batch_set(self, keys, host_pages):
        if self.armed:
            self.gate.wait(10)
        return super().batch_set(keys, host_pages)


def test_a_write_back_past_its_deadline_keeps_its_host_pages_until_the_call_returns():
    """A ``batch_set`` past its deadline may still read its host pages: the evicted pages
    it writes stay allocated (not handed to another page) until the call comes back."""
    from test_cache import SPEC as CSPEC
    from test_cache import Rig as CacheRig
    from test_cache import toks as ctoks
    store = _StuckWrites(spec=CSPEC)
    r = CacheRig(store=store, write_policy="write_back", l3_call_timeout_s=0.3)
    try:
        r.request(ctoks(6 * CSPEC.page_size + 1, seed=3))
        r.l1_only_to_l2()                            # the pages are in L2 only, dirty
        pool = r.cache.host_pool
        before = pool.free_count
        store.armed = True
        r.cache.evict(3, tier="l2")                  # write-back first: its call sticks
        time.sleep(0.8)                              # past the deadline
        assert r.cache.metrics()["l3_timeouts"] >= 1
        assert pool.free_count == before             # nothing freed under the late call
        store.gate.set()
        assert r.cache.wait_idle(5)
        deadline = time.time() + 5
        while pool.free_count == before and time.time() < deadline:
            time.sleep(0.02)                         # the release comes when it returns
        assert pool.free_count > before
        r.cache.check_invariants()
    finally:
        store.gate.set()
        r.close()
