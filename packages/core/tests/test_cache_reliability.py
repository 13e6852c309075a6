"""Reliability of the controller: device pages of a fetch still in flight, meta tensors, exit
without close(), stuck store calls (deadline, health, close), and defaults that load what was
matched. (write_back with an L3 never losing pages, replayed by the simulator: kvtier-tools'
test_simulate_write_back.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvtier.errors import InvalidArgumentError, KVTierError, PageIndexError
from kvtier.l3_stores.memory import MemoryStore
from test_cache import SPEC, Rig, _l3_only, gate_transfers, toks

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "cache_exit_child.py")


# ---------------------------------------------------------------------------------------------
# Device pages lent to a fetch in flight; meta tensors
# ---------------------------------------------------------------------------------------------
def test_device_pages_of_a_fetch_in_flight_are_refused_state_unchanged():
    r = Rig()
    try:
        c = r.cache
        t, other = toks(3 * 4, seed=1), toks(3 * 4, seed=2)
        r.request(t)
        r.l1_only_to_l2()
        gate = gate_transfers(c, "load")
        m1 = c.match(t)
        pages = r.take(3)
        h1 = c.fetch(m1, pages)                           # in flight until the gate opens
        m2 = c.match(t)
        before, mt = c.pages(), c.metrics()
        with pytest.raises(InvalidArgumentError):
            c.fetch(m2, pages[1:])                        # a second fetch into them
        with pytest.raises(InvalidArgumentError):
            c.commit(other, pages)                        # a commit of other tokens
        with pytest.raises(InvalidArgumentError):
            c.commit(t, pages)                            # ... or of the same ones, unloaded
        assert c.pages() == before
        after = c.metrics()
        assert after["commit_calls"] == mt.get("commit_calls", 0)
        assert after["fetch_calls"] == mt["fetch_calls"]
        c.check_invariants()
        gate.set()
        h1.wait()
        r.verify(m1.keys, h1.device_pages)
        c.commit(t, h1.device_pages, match=m1)
        r.alloc.free(c.release(m1))
        m2b = c.match(t)                                  # now real L1 hits, right bytes
        assert m2b.l1_count == 3
        r.verify(m2b.keys, m2b.l1_pages)
        c.release(m2b)
        c.release(m2)
        assert c.wait_idle(10)
        c.check_invariants(idle=True)
    finally:
        r.close()


def test_pages_free_again_once_the_fetch_is_booked():
    r = Rig()
    try:
        c = r.cache
        t = toks(2 * 4, seed=3)
        r.request(t)
        r.l1_only_to_l2()
        m = c.match(t)
        pages = r.take(2)
        c.fetch(m, pages).wait()
        r.alloc.free(c.release(m))       # loaded pages became the cache's (L1)
        m = c.match(toks(2 * 4, seed=4))
        with pytest.raises(InvalidArgumentError):
            c.fetch(m, pages[:1])        # an L1 page: still refused, as before
        c.release(m)
    finally:
        r.close()


def test_meta_tensors_are_typed_errors():
    r = Rig()
    try:
        c = r.cache
        meta_tokens = torch.empty(8, dtype=torch.int64, device="meta")
        meta_pages = torch.empty(2, dtype=torch.int64, device="meta")
        for call in (lambda: c.match(meta_tokens), lambda: c.keys(meta_tokens),
                     lambda: c.commit(meta_tokens, [0, 1]),
                     lambda: c.commit(toks(8), meta_pages)):
            with pytest.raises(KVTierError):
                call()
        t = toks(2 * 4, seed=5)
        r.request(t)
        r.l1_only_to_l2()
        m = c.match(t)
        with pytest.raises(PageIndexError):
            c.fetch(m, meta_pages)
        c.release(m)
        c.check_invariants()
    finally:
        r.close()


# ---------------------------------------------------------------------------------------------
# Exit without close(); stuck store calls
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["busy", "blocking"])
def test_exit_without_close_is_clean(tmp_path, mode):
    runs = 12 if mode == "busy" else 2
    for i in range(runs):
        root = tmp_path / f"r{i}"
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, CHILD, str(root)] + ([mode] if mode != "busy"
                                                                   else []),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, (i, p.returncode, p.stderr[-2000:])
        assert "terminate called" not in p.stderr
        assert "exiting" in p.stdout
        assert time.monotonic() - t0 < 30


class BlockingStore(MemoryStore):
    """batch_get (or batch_exists) blocks until ``release`` is set (a wedged store)."""

    def __init__(self, config=None, *, spec):
        super().__init__(config, spec=spec)
        self.block_get = False
        self.block_exists = False
        self.release = threading.Event()

    def batch_get(self, keys, host_pages):
        if self.block_get:
            self.release.wait()
        return super().batch_get(keys, host_pages)

    def batch_exists(self, keys):
        if self.block_exists:
            self.release.wait()
        return super().batch_exists(keys)


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_a_store_call_past_its_deadline_is_a_counted_failure_not_a_hang(policy):
    store = BlockingStore(spec=SPEC)
    r = Rig(store=store, prefetch_policy=policy, l3_call_timeout_s=0.3, l3_io_threads=1,
            prefetch_timeout_cap_s=5.0, prefetch_timeout_base_s=5.0, close_timeout_s=2.0)
    try:
        c = r.cache
        t = toks(3 * 4, seed=20)
        _l3_only(r, t)
        store.block_get = True
        m = c.match(t)
        assert m.l3_count == 3
        t0 = time.monotonic()
        h = c.fetch(m, r.take(3))                          # the read is stuck
        h.wait()
        assert time.monotonic() - t0 < 3
        assert h.pages_loaded == 0
        r.alloc.free(c.release(m))
        mt = c.metrics()
        assert mt["l3_timeouts"] == 1 and mt["store_errors"] >= 1
        assert mt["l3_state"].startswith("degraded")
        store.block_get = False                            # later calls work: a new worker
        m = c.match(t)
        h = c.fetch(m, r.take(3))
        h.wait()
        assert h.pages_loaded == 3
        r.verify(m.keys, h.device_pages)
        r.alloc.free(c.release(m))
        store.release.set()                                # the stuck call returns late
        deadline = time.monotonic() + 5
        while c.metrics()["l3_state"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.metrics()["l3_late_returns"] == 1
        assert c.wait_idle(5)
        c.check_invariants(idle=True)
    finally:
        store.release.set()
        r.close()


def test_a_prefetch_whose_read_passes_its_deadline_marks_nothing_unreadable():
    """A read past its deadline is a slow store, not an unreadable object: once the late call
    returns, its keys are still offered (the executor's reads count the same way)."""
    store = BlockingStore(spec=SPEC)
    r = Rig(store=store, l3_call_timeout_s=0.3, l3_io_threads=1, close_timeout_s=2.0,
            cost_aware_fetch=False)
    try:
        c = r.cache
        t = toks(3 * 4, seed=21)
        _l3_only(r, t)
        store.block_get = True
        m = c.match(t)
        c.prefetch(m)                                      # the read sticks, nobody fetches
        deadline = time.monotonic() + 5
        while c.metrics().get("l3_timeouts", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        store.block_get = False
        store.release.set()                                # the stuck call returns late
        while c.metrics().get("l3_late_returns", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.wait_idle(5)
        r.alloc.free(c.release(m))
        assert c.metrics().get("l3_unreadable_marked", 0) == 0 and not len(c.unreadable)
        m = c.match(t)
        assert m.l3_count == 3                             # still offered, and it loads
        h = c.fetch(m, r.take(3))
        h.wait()
        assert h.pages_loaded == 3
        r.verify(m.keys, h.device_pages)
        r.alloc.free(c.release(m))
    finally:
        store.release.set()
        r.close()


def test_a_stuck_exists_call_costs_a_miss():
    store = BlockingStore(spec=SPEC)
    r = Rig(store=store, l3_call_timeout_s=0.3)
    try:
        t = toks(2 * 4, seed=21)
        _l3_only(r, t)
        store.block_exists = True
        t0 = time.monotonic()
        m = r.cache.match(t)
        assert time.monotonic() - t0 < 3
        assert m.l3_count == 0
        r.cache.release(m)
        assert r.cache.metrics()["l3_timeouts"] == 1
    finally:
        store.release.set()
        r.close()


def test_a_store_that_stays_stuck_fails_the_tier_and_close_returns_in_time():
    store = BlockingStore(spec=SPEC)
    r = Rig(store=store, prefetch_policy="wait_complete", l3_call_timeout_s=0.2,
            l3_error_limit=2, close_timeout_s=1.0)
    try:
        c = r.cache
        t = toks(2 * 4, seed=22)
        _l3_only(r, t)
        store.block_get = True
        for _ in range(2):
            m = c.match(t)
            c.fetch(m, r.take(m.pages_to_load)).wait()
            r.alloc.free(c.release(m))
        deadline = time.monotonic() + 5
        while not c.metrics()["l3_state"].startswith("failed"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        r.close()
        assert time.monotonic() - t0 < 2.5
    finally:
        store.release.set()


# ---------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------
def test_default_prefetch_loads_what_was_matched_and_metrics_say_so():
    r = Rig(store=MemoryStore(spec=SPEC))                   # default prefetch policy
    try:
        c = r.cache
        t = toks(4 * 4, seed=30)
        _l3_only(r, t)
        before = c.metrics()
        m = c.match(t)
        h = c.fetch(m, r.take(m.pages_to_load))             # no prefetch() call first
        h.wait()
        assert h.pages_loaded == 4
        r.verify(m.keys, h.device_pages)
        r.alloc.free(c.release(m))
        mt = c.metrics()
        assert mt["l3_matched_pages"] - before["l3_matched_pages"] == 4
        assert mt["l3_hit_pages"] - before.get("l3_hit_pages", 0) == 4
    finally:
        r.close()


def test_best_effort_counts_matched_but_not_loaded_apart():
    store = BlockingStore(spec=SPEC)
    r = Rig(store=store, prefetch_policy="best_effort")
    try:
        c = r.cache
        t = toks(4 * 4, seed=31)
        _l3_only(r, t)
        before = c.metrics()
        store.block_get = True
        m = c.match(t)
        h = c.fetch(m, r.take(m.pages_to_load))             # nothing landed: loads none
        h.wait()
        assert h.pages_loaded == 0
        r.alloc.free(c.release(m))
        mt = c.metrics()
        assert mt["l3_matched_pages"] - before["l3_matched_pages"] == 4
        assert mt.get("l3_hit_pages", 0) - before.get("l3_hit_pages", 0) == 0
        assert mt["prefetch_cut_pages"] - before.get("prefetch_cut_pages", 0) == 4
    finally:
        store.release.set()
        r.close()


def test_close_returns_in_time_with_a_write_stuck_and_keeps_its_host_pages():
    class StuckWrites(MemoryStore):
        release = threading.Event()

        def batch_set(self, keys, host_pages):
            self.release.wait()
            return super().batch_set(keys, host_pages)

    store = StuckWrites(spec=SPEC)
    r = Rig(store=store, write_policy="write_through", l3_call_timeout_s=0.3,
            close_timeout_s=1.0)
    try:
        r.request(toks(3 * 4, seed=40))                   # its L3 write gets stuck
        deadline = time.monotonic() + 5
        while not r.cache.metrics().get("l3_timeouts"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert r.cache.metrics()["l3_state"].startswith("degraded")
        host = r.cache.host_pool
        t0 = time.monotonic()
        r.close()
        assert time.monotonic() - t0 < 2
        assert not host.buffer.closed                     # the stuck call still reads it
    finally:
        StuckWrites.release.set()
