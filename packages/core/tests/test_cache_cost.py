"""The cost-aware fetch: the split math on hand-made numbers, typed errors for bad rates, and
the controller's decisions with stores that are fast, slow, or stall mid-run."""

from __future__ import annotations

import math
import threading
import time

import pytest

from kvtier.cache import CacheConfig
from kvtier.cache.cost import (SKIP_GAIN, CostModel, ReportedCostModel, best_split, check_rate,
                              load_seconds, merge_rates, split_time)
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator

from test_cache import SPEC, Rig, SlowStore, toks

MIB = 1 << 20
BASE = dict(page_size=64, page_bytes=MIB, recompute_tps=64_000.0)   # 1 ms per page computed


def test_fast_l2_loads_every_page():
    assert best_split(l2_pages=10, l3_pages=0, compute_tokens=64, h2d_bps=10e9, l3_bps=None,
                      **BASE) == 10


def test_slow_l3_pages_are_recomputed_and_l2_ones_loaded():
    # L3 at 100 MB/s: 10.5 ms a page against 1 ms to recompute it
    kw = dict(l2_pages=4, l3_pages=6, compute_tokens=64, h2d_bps=10e9, l3_bps=100e6, **BASE)
    assert best_split(**kw) == 4
    # T(4) by hand: no L3 read; max(4 MiB / 10 GB/s, (64 + 6 * 64) / 64k) + the smaller
    t = split_time(4, **kw)
    assert t == pytest.approx(448 / 64_000 + 4 * MIB / 10e9)
    # pages the prefetch already brought into L2 are as good as L2 pages
    assert best_split(**{**kw, "l3_ready": 3}) == 7


def test_a_slow_engine_splits_between_loading_and_recomputing():
    # 0.5 GB/s: 2.1 ms a page to load, 1 ms to recompute; 32 layers overlap the two.
    # k=3: max(6.29, 8.0) + 6.29/32 = 8.20 ms; k=4: max(8.39, 7.0) + 7/32 = 8.61 ms;
    # k=2: max(4.19, 9.0) + 4.19/32 = 9.13 ms; all 10: 20.97 + 1/32 ms
    kw = dict(l2_pages=10, l3_pages=0, compute_tokens=64, h2d_bps=0.5e9, l3_bps=None,
              layers=32, **BASE)
    assert best_split(**kw) == 3
    assert split_time(3, **kw) == pytest.approx(8e-3 + 3 * MIB / 0.5e9 / 32)


def test_unknown_rates_load_everything_and_a_stalled_l3_nothing_beyond_l2():
    kw = dict(l2_pages=2, l3_pages=5, compute_tokens=1, page_size=64, page_bytes=MIB)
    assert best_split(h2d_bps=None, l3_bps=1.0, recompute_tps=1e6, **kw) == 7
    assert best_split(h2d_bps=1e9, l3_bps=1.0, recompute_tps=None, **kw) == 7
    assert best_split(h2d_bps=None, l3_bps=0.0, recompute_tps=None, l3_ready=1, **kw) == 3


@pytest.mark.parametrize("bad", [0, 0.0, -5, math.nan, math.inf, "fast", True])
def test_bad_rates_are_config_errors(bad):
    with pytest.raises(ConfigError, match="recompute_tokens_per_s"):
        CacheConfig(model_id="m", recompute_tokens_per_s=bad)
    with pytest.raises(ConfigError):
        check_rate("l3_bandwidth", bad)
    with pytest.raises(ConfigError):
        CostModel(recompute_tokens_per_s=bad)


@pytest.mark.parametrize("alpha", [0, -0.1, 1.5, math.nan])
def test_bad_ewma_weight_is_a_config_error(alpha):
    with pytest.raises(ConfigError, match="cost_ewma_alpha"):
        CacheConfig(model_id="m", cost_ewma_alpha=alpha)


def test_ewma_and_a_call_still_running_lower_the_l3_rate():
    c = CostModel(alpha=0.5)
    call = c.l3_call_started(1000)
    c.l3_call_ended(call, 1000)
    assert c.l3_bytes_per_s is not None and c.l3_bytes_per_s > 1e4
    before = c.l3_bytes_per_s
    c.l3_call_started(1000)            # never returns
    time.sleep(0.05)
    assert c.l3_bytes_per_s < min(before, 1000 / 0.05)


# --------------------------------------------------------------------------------------------
# In the controller
# --------------------------------------------------------------------------------------------
def _to_l3(r: Rig, t: list[int]) -> None:
    """Serve ``t`` once, then evict it from L1 and L2: it is in L3 only."""
    r.request(t)
    r.l1_only_to_l2()
    r.cache.evict(10_000, tier="l2")
    m = r.cache.match(t)
    assert m.l3_count == len(m.keys) and m.l2_count == 0, m
    r.cache.release(m)


def test_l3_pages_slower_than_recompute_are_computed_and_counted():
    store = SlowStore(spec=SPEC, delay=0.05)     # ~50 ms a call for a few 768-byte pages
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=1e6)
    try:
        a, b = toks(6 * SPEC.page_size, seed=1), toks(6 * SPEC.page_size, seed=2)
        _to_l3(r, a)
        _to_l3(r, b)
        m, h = r.request(a)                      # no L3 rate yet: loads all, measures it
        assert h.pages_loaded == 6
        assert r.cache.metrics()["l3_read_bytes_per_s"] > 0
        r.cache.cost._last_l3 = time.perf_counter()   # no probe read due, however slow the box
        t0 = time.perf_counter()
        m, h = r.request(b)                      # request() checks every page's bytes
        assert h.pages_loaded == 0 and m.l3_count == 6
        assert time.perf_counter() - t0 < 0.05   # the slow read was not waited for
        met = r.cache.metrics()
        assert met["cost_skipped_pages_l3"] == 6 and met["cost_skipped_pages_l2"] == 0
        assert met["recompute_tokens_per_s"] == 1e6 and met["l2_load_bytes_per_s"] > 0
        r.cache.wait_idle()
        r.cache.check_invariants(idle=True)
    finally:
        r.close()


def test_a_queued_request_reads_what_lands_before_its_turn():
    """L3 slower than recompute: an idle engine's prefetch reads none of a request's L3 pages;
    a request expected to wait long enough for its turn gets them all read during the wait,
    and its fetch then loads them with no L3 wait. A bad wait is a typed error."""
    store = SlowStore(spec=SPEC, delay=0.05)   # ~50 ms a read: slower than recomputing
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=2000)
    try:
        a, b, c = (toks(6 * SPEC.page_size, seed=s) for s in (11, 12, 13))
        for t in (a, b, c):
            _to_l3(r, t)
        r.request(a)                              # measures the L3 rate
        assert r.cache.metrics()["l3_read_bytes_per_s"] > 0
        r.cache.cost._last_l3 = time.perf_counter()   # no probe read due in this test
        m = r.cache.match(b)
        r.cache.prefetch(m)                       # idle: not worth reading
        assert m.read is None
        assert r.cache.metrics()["cost_skipped_prefetch_pages"] == 6
        r.alloc.free(r.cache.release(m))
        m = r.cache.match(c)
        with pytest.raises(InvalidArgumentError):
            r.cache.prefetch(m, expected_wait_s=float("nan"))
        r.cache.prefetch(m, expected_wait_s=30.0)     # a long queue ahead of it
        assert m.read is not None and m.read.num_pages == 6
        with m.read.cv:
            assert m.read.cv.wait_for(lambda: m.read.settled, 10)
        t0 = time.perf_counter()
        h = r.cache.fetch(m, r.take(m.pages_to_load))
        h.wait()
        assert h.pages_loaded == 6 and time.perf_counter() - t0 < 0.05
        r.verify(m.keys, h.device_pages)
        r.alloc.free(r.cache.release(m))
    finally:
        r.close()


def test_a_queued_request_counts_the_reads_ahead_of_it():
    """Reads share the store's rate: a wait that lands a request's L3 pages on an idle store
    lands none of them behind the reads of the requests queued ahead, so the split (L3
    slower than recompute) reads none; once those are done, the same wait reads them all.
    The reads held behind the store's gate land bitwise."""
    store = SlowStore(spec=SPEC, delay=0.05)
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=2000)
    try:
        a, b, c, d = (toks(6 * SPEC.page_size, seed=s) for s in (21, 22, 23, 24))
        for t in (a, b, c, d):
            _to_l3(r, t)
        r.request(a)                              # measures the L3 rate
        cost = r.cache.cost
        cost._last_l3 = time.perf_counter()       # no probe read due in this test
        pb = SPEC.page_bytes
        wait = cost.l3_fixed_s + 8.5 * pb / cost.l3_bytes_per_s   # 8 pages' read: all 6
        assert cost.pages_readable_in(wait, pb, 6) == 6
        assert cost.pages_readable_in(wait, pb, 6, behind=3) == 5
        assert cost.pages_readable_in(wait, pb, 6, behind=12) == 0
        store.gate = threading.Event()            # the reads ahead run, held at the store
        ahead = [r.cache.match(t) for t in (b, c)]
        for m in ahead:
            r.cache.prefetch(m, expected_wait_s=30.0)
            assert m.read is not None and m.read.num_pages == 6
        assert r.cache._l3.read_backlog() == 12
        m = r.cache.match(d)
        r.cache.prefetch(m, expected_wait_s=wait)   # behind 12 pages: none lands in time
        assert m.read is None
        store.gate.set()
        for x in ahead:
            read = x.read
            with read.cv:
                assert read.cv.wait_for(lambda: read.settled, 10)  # noqa: B023 (used here)
            h = r.cache.fetch(x, r.take(x.pages_to_load))
            h.wait()
            assert h.pages_loaded == 6
            r.verify(x.keys, h.device_pages)
            r.alloc.free(r.cache.release(x))
        r.cache.wait_idle()
        assert r.cache._l3.read_backlog() == 0
        cost._last_l3 = time.perf_counter()
        r.cache.prefetch(m, expected_wait_s=wait)   # nothing ahead now: all read
        assert m.read is not None and m.read.num_pages == 6
        with m.read.cv:
            assert m.read.cv.wait_for(lambda: m.read.settled, 10)
        h = r.cache.fetch(m, r.take(m.pages_to_load))
        h.wait()
        assert h.pages_loaded == 6
        r.verify(m.keys, h.device_pages)
        r.alloc.free(r.cache.release(m))
        r.cache.check_invariants(idle=True)
    finally:
        r.close()


class CountingStore(SlowStore):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.got = 0

    def batch_get(self, keys, host_pages):
        self.got += len(keys)
        return super().batch_get(keys, host_pages)


@pytest.mark.parametrize("probe_s", [1e9, 0.0])
def test_prefetch_reads_only_the_l3_pages_worth_loading(monkeypatch, probe_s):
    """L3 slower than recompute: a prefetch reads none of the pages the split would skip
    (they would only push useful pages out of L2), unless it is time for a probe read."""
    monkeypatch.setattr(CostModel, "L3_PROBE_INTERVAL_S", probe_s)
    store = CountingStore(spec=SPEC, delay=0.05)
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=1e6)
    try:
        a, b = toks(6 * SPEC.page_size, seed=1), toks(6 * SPEC.page_size, seed=2)
        _to_l3(r, a)
        _to_l3(r, b)
        r.request(a)                             # no L3 rate yet: loads all, measures it
        c = r.cache
        c.wait_idle()
        before = store.got
        written = c.metrics()["l3_written_pages"]
        m = c.match(b)
        assert m.l3_count == 6
        c.prefetch(m)
        deadline = time.perf_counter() + 5
        while probe_s == 0 and store.got == before and time.perf_counter() < deadline:
            time.sleep(0.01)                     # the probe read runs in the background
        h = c.fetch(m, r.take(m.pages_to_load))
        # a probe read that has landed by now is as good as L2
        assert h.pages_loaded == 0 or (probe_s == 0 and h.pages_loaded == 6)
        h.wait()
        new = r.take(len(m.keys) - h.pages_loaded)
        r.prefill(m.keys[h.pages_loaded:], new)
        c.commit(b, list(h.device_pages[:h.pages_loaded]) + new, match=m)
        r.alloc.free(c.release(m))
        c.wait_idle()
        met = c.metrics()
        if probe_s:
            assert store.got == before and met["cost_skipped_prefetch_pages"] == 6
        else:
            assert store.got == before + 6 and met.get("cost_skipped_prefetch_pages", 0) == 0
        assert met["cost_skipped_pages_l3"] + h.pages_loaded == 6
        # the recomputed pages are in L3 already: backed up to L2, not written again
        assert met["l3_written_pages"] == written
        c.check_invariants(idle=True)
    finally:
        r.close()


def test_policy_off_loads_the_slow_l3_pages():
    store = SlowStore(spec=SPEC, delay=0.05)
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=1e6,
            cost_aware_fetch=False)
    try:
        a, b = toks(6 * SPEC.page_size, seed=1), toks(6 * SPEC.page_size, seed=2)
        _to_l3(r, a)
        _to_l3(r, b)
        r.request(a)
        m, h = r.request(b)
        assert h.pages_loaded == 6
        assert r.cache.metrics()["cost_skipped_pages_l3"] == 0
    finally:
        r.close()


def test_fast_l2_is_always_loaded_with_the_policy_on():
    r = Rig(l3_store="memory", recompute_tokens_per_s=100.0)
    try:
        t = toks(5 * SPEC.page_size + 1, seed=3)
        for _ in range(3):
            r.request(t)
            r.l1_only_to_l2()
            m, h = r.request(t)
            assert m.l2_count == 5 and h.pages_loaded == 5
            r.l1_only_to_l2()
        assert r.cache.metrics()["cost_skipped_pages_l2"] == 0
    finally:
        r.close()


def test_a_store_that_stalls_mid_run_is_skipped_not_waited_for():
    store = SlowStore(spec=SPEC)
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=1e3)
    try:
        seqs = [toks(5 * SPEC.page_size, seed=10 + i) for i in range(4)]
        for s in seqs:
            _to_l3(r, s)
        m, h = r.request(seqs[0])                # fast store: loaded, and measured
        assert h.pages_loaded == 5
        r.request(seqs[1])
        store.gate = threading.Event()           # the disk hangs from now on
        c = r.cache
        m = c.match(seqs[2])
        c.prefetch(m)                            # queued: the read starts and hangs
        time.sleep(0.3)
        t0 = time.perf_counter()
        h = c.fetch(m, r.take(m.pages_to_load))
        assert time.perf_counter() - t0 < 0.2 and h.pages_loaded == 0
        h.wait()
        new = r.take(len(m.keys))
        r.prefill(m.keys, new)
        c.commit(seqs[2], new, match=m)
        r.alloc.free(c.release(m))
        m, h = r.request(seqs[3])                # still hung: skipped from then on
        assert h.pages_loaded == 0
        assert c.metrics()["cost_skipped_pages_l3"] == 10
        store.gate.set()
        c.wait_idle(timeout=10)
        c.check_invariants(idle=True)
    finally:
        if store.gate is not None:
            store.gate.set()
        r.close()


def test_writes_to_a_slow_l3_go_on_unless_configured_off():
    for keep in (True, False):
        store = SlowStore(spec=SPEC, delay=0.05)
        r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=1e6,
                l3_write_when_slow=keep)
        try:
            a = toks(4 * SPEC.page_size, seed=5)
            _to_l3(r, a)
            r.request(a)                         # measures L3: slower than recompute
            r.cache.wait_idle()
            written = r.cache.metrics()["l3_written_pages"]
            r.request(toks(4 * SPEC.page_size, seed=6))
            r.cache.wait_idle()
            met = r.cache.metrics()
            if keep:
                assert met["l3_written_pages"] == written + 4
                assert met.get("cost_skipped_l3_writes", 0) == 0
            else:
                assert met["l3_written_pages"] == written
                assert met["cost_skipped_l3_writes"] == 4
            r.cache.check_invariants(idle=True)
        finally:
            r.close()


def test_recompute_rate_is_marginal_not_diluted_by_the_fixed_cost():
    """On the H200 the demo's 8B prefills cost ~70 ms fixed + tokens / 75K per s; the plain
    tokens/s ratio read that as ~5K tokens/s and let a 1.65 GB/s file L3 (13K tokens/s of
    Llama-3-8B KV) through. The fit must find the marginal rate, and with it skip L3."""
    m = CostModel()
    for n in (1335, 250, 400, 180, 900, 300, 260, 1100, 220, 350) * 3:
        m.observe_recompute(n, 0.070 + n / 75_000)
    assert m.recompute_tokens_per_s == pytest.approx(75_000, rel=0.02)
    assert m.recompute_fixed_s == pytest.approx(0.070, rel=0.05)
    page_bytes = 64 * 128 * 1024                    # Llama-3-8B, 64-token pages, bf16
    m.observe_load(page_bytes * 16, page_bytes * 16 / 45e9)
    call = m.l3_call_started(page_bytes * 16)
    m._inflight[call] = (time.perf_counter() - page_bytes * 16 / 1.65e9, page_bytes * 16)
    m.l3_call_ended(call, page_bytes * 16)
    assert m.pages_to_load(l2_pages=4, l3_pages=16, l3_ready=0, compute_tokens=300,
                           page_size=64, page_bytes=page_bytes, layers=32) == 4
    diluted = CostModel()                            # what the plain ratio decided
    diluted._given_rate = sum(n for n in (1335, 250, 400, 180, 900)) / sum(
        0.070 + n / 75_000 for n in (1335, 250, 400, 180, 900))
    diluted._h2d, diluted._l3 = m._h2d, m._l3
    assert diluted.pages_to_load(l2_pages=4, l3_pages=16, l3_ready=0, compute_tokens=300,
                                 page_size=64, page_bytes=page_bytes, layers=32) == 20


def test_recompute_rate_falls_back_to_the_ratio_until_sizes_vary():
    m = CostModel()
    assert m.recompute_tokens_per_s is None and m.recompute_fixed_s is None
    for _ in range(5):
        m.observe_recompute(512, 0.01)
    assert m.recompute_tokens_per_s == pytest.approx(51_200)


def test_recompute_fit_finds_the_attention_term_of_long_contexts():
    """Prefills of the H200's 8B shape: ~30 ms fixed, 40K tokens/s, and attention over the
    context (2e-10 s per query-key pair: a 4K suffix after 24K tokens costs ~3x its tokens'
    share). With contexts reported the fit recovers all three terms; without, it stays a
    line (and no attention term)."""
    import random
    rng = random.Random(0)
    with_ctx, without = CostModel(), CostModel()
    for _ in range(60):
        c = rng.choice((256, 512, 1024, 2048, 4096))
        n = c + rng.choice((0, 1024, 8192, 24576))
        t = 0.030 + c / 40_000 + 2e-10 * (n * n - (n - c) ** 2) / 2
        with_ctx.observe_recompute(c, t, context=n)
        without.observe_recompute(c, t)
    assert with_ctx.recompute_tokens_per_s == pytest.approx(40_000, rel=1e-3)
    assert with_ctx.recompute_attn_s == pytest.approx(2e-10, rel=1e-3)
    assert with_ctx.recompute_fixed_s == pytest.approx(0.030, rel=1e-3)
    assert without.recompute_attn_s == 0.0
    assert with_ctx.rates()["recompute_attn_s_per_pair"] == with_ctx.recompute_attn_s


def test_split_loads_deep_pages_from_l3_when_attention_makes_them_dear():
    """The H200's long-context fit (49K tokens/s + 2.09 ns per query-key pair): a 4 GB/s L3
    (2.1 ms per 8 MiB page) loses to recomputing a page at position 0 (1.3 ms), but the
    pages of a 19K-token document also pay attention over the context (2.6 ms a page on
    average): loading them wins."""
    page_bytes = 64 * 128 * 1024               # 64 tokens of Llama-3-8B KV, bf16
    kw = dict(l2_pages=0, l3_pages=300, compute_tokens=160, page_size=64,
              page_bytes=page_bytes, h2d_bps=40e9, l3_bps=4e9, recompute_tps=48_868.0,
              layers=32)
    ctx = 300 * 64 + 160
    assert best_split(**kw) == 0                                # no attention term: skip L3
    k = best_split(**kw, attn_s=2.09e-9, context=ctx)
    assert 0 < k <= 300
    t = lambda k: split_time(k, **kw, attn_s=2.09e-9, context=ctx)  # noqa: E731
    assert t(k) < t(0) and t(k) <= min(t(j) for j in range(0, 301, 10))


@pytest.mark.parametrize("prefetch", [True, False])
def test_first_l3_read_is_a_probe_until_the_rate_is_known(prefetch, monkeypatch):
    """Before any L3 read was timed (here: no rate probe after the writes, as for a store
    another process filled), a fetch reads only L3_PROBE_PAGES (8) of a 12-page L3 hit (a
    slow disk must not hold the request for the whole prefix; the test's pages are small,
    so L3_PROBE_BYTES is set to 8 of them); once the rate is known (a fast store here) the
    whole hit is read and loaded."""
    from kvtier.cache import l3tasks
    monkeypatch.setattr(l3tasks, "probe_read", lambda c, keys: None)
    monkeypatch.setattr(CostModel, "L3_PROBE_BYTES", 8 * SPEC.page_bytes)
    store = CountingStore(spec=SPEC, delay=0.0)
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=1.0)
    probe = CostModel.L3_PROBE_PAGES
    try:
        a, b = toks(12 * SPEC.page_size, seed=21), toks(12 * SPEC.page_size, seed=22)
        _to_l3(r, a)
        _to_l3(r, b)
        c = r.cache
        for t, want in ((a, probe), (b, 12)):
            before = store.got
            m = c.match(t)
            assert m.l3_count == 12
            if prefetch:
                c.prefetch(m)
            h = c.fetch(m, r.take(m.pages_to_load))
            h.wait()
            assert h.pages_loaded == want and store.got - before == want
            new = r.take(len(m.keys) - want)
            r.prefill(m.keys[want:], new)
            c.commit(t, list(h.device_pages[:want]) + new, match=m)
            r.alloc.free(c.release(m))
            c.wait_idle()
        c.check_invariants(idle=True)
    finally:
        r.close()


def test_the_first_l3_write_probes_the_read_rate_so_the_first_hit_is_read_whole(monkeypatch):
    """The pages of the first L3 write are read back once into free host pages (never
    evicting L2 for it): the L3 rate is measured before any hit, so the first fetch of a
    12-page L3 hit reads and loads all of it (the first-read cap set to 8 of the test's
    small pages would cut it otherwise); the probe's host pages are free again."""
    monkeypatch.setattr(CostModel, "L3_PROBE_BYTES", 8 * SPEC.page_bytes)
    store = CountingStore(spec=SPEC, delay=0.0)
    r = Rig(store=store, prefetch_policy="wait_complete", recompute_tokens_per_s=1.0)
    try:
        c = r.cache
        assert c.cost.l3_bytes_per_s is None
        a = toks(12 * SPEC.page_size, seed=23)
        _to_l3(r, a)
        c.wait_idle()
        assert c.cost.l3_bytes_per_s is not None
        probed = c.metrics()["l3_probe_read_pages"]
        assert 0 < probed <= CostModel.L3_PROBE_PAGES
        before = store.got
        m = c.match(a)
        assert m.l3_count == 12
        h = c.fetch(m, r.take(m.pages_to_load))
        h.wait()
        assert h.pages_loaded == 12 and store.got - before == 12
        c.commit(a, list(h.device_pages), match=m)
        r.alloc.free(c.release(m))
        c.wait_idle()
        assert c.metrics()["l3_probe_read_pages"] == probed        # once only
        c.check_invariants(idle=True)
    finally:
        r.close()


# ----- rates measured in another process (vLLM: the worker's, for the scheduler) -----------
def test_reported_rates_drive_the_split_and_bad_reports_are_ignored():
    m = ReportedCostModel()
    kw = dict(l2_pages=4, l3_pages=4, l3_ready=0, compute_tokens=10, page_size=16,
              page_bytes=1 << 20, layers=8)
    assert m.pages_to_load(**kw) == 8                      # nothing known: cut nothing
    m.adopt({"recompute_tokens_per_s": 1e3, "l2_load_bytes_per_s": 1e12,
             "l3_read_bytes_per_s": 1e6})                  # L3 1 s a page, recompute 16 ms
    assert m.reports == 1 and m.pages_to_load(**kw) == 4
    m.adopt({"recompute_tokens_per_s": float("nan"), "l3_read_bytes_per_s": -5})
    assert m.recompute_tokens_per_s is None and m.l3_bytes_per_s is None
    assert m.pages_to_load(**kw) == 8                      # unknown again: cut nothing
    m.adopt({"recompute_tokens_per_s": 1e3, "l3_read_bytes_per_s": 0.0})   # stalled store
    assert m.pages_to_load(**kw) == 4
    m.adopt("not a dict")
    m.adopt({"unknown": 1.0})
    assert m.rates()["l2_load_bytes_per_s"] == 1e12 and "unknown" not in m.rates()


def test_a_configured_recompute_rate_beats_the_reported_one():
    m = ReportedCostModel.from_config(CacheConfig(model_id="m", recompute_tokens_per_s=1e12))
    m.adopt({"recompute_tokens_per_s": 1.0, "recompute_attn_s_per_pair": 1.0,
             "l2_load_bytes_per_s": 1e9})
    assert m.recompute_tokens_per_s == 1e12 and m.recompute_attn_s == 0.0
    assert m.pages_to_load(l2_pages=5, l3_pages=0, l3_ready=0, compute_tokens=1,
                           page_size=16, page_bytes=1 << 20, layers=4) == 0
    off = ReportedCostModel.from_config(CacheConfig(model_id="m", cost_aware_fetch=False))
    off.adopt({"recompute_tokens_per_s": 1e12, "l2_load_bytes_per_s": 1.0})
    assert off.pages_to_load(l2_pages=5, l3_pages=2, l3_ready=0, compute_tokens=1,
                             page_size=16, page_bytes=1 << 20, layers=4) == 7


def test_ranks_rates_merge_to_the_slowest():
    a = {"recompute_tokens_per_s": 1e4, "recompute_fixed_s": 0.01,
         "recompute_attn_s_per_pair": None, "recompute_knee_tokens": 700.0,
         "l2_load_bytes_per_s": 5e9, "l3_read_bytes_per_s": None}
    b = {"recompute_tokens_per_s": 2e4, "recompute_fixed_s": 0.03,
         "recompute_attn_s_per_pair": 1e-12, "recompute_knee_tokens": 300.0,
         "l2_load_bytes_per_s": 4e9, "l3_read_bytes_per_s": 1e9}
    m = merge_rates(a, b)
    # the lower knee: recompute is free for fewer tokens on the slower rank
    assert m == {"recompute_tokens_per_s": 1e4, "recompute_fixed_s": 0.03,
                 "recompute_attn_s_per_pair": 1e-12, "recompute_knee_tokens": 300.0,
                 "l2_load_bytes_per_s": 4e9, "l3_read_bytes_per_s": 1e9}
    assert merge_rates(a, None) is a and merge_rates(None, b) is b
    assert merge_rates(None, None) is None


def test_a_step_of_several_requests_reports_its_pairs():
    m = CostModel()
    for n in (256, 1024, 4096, 512, 2048, 8192):          # 0.02 s + n / 50K + 1e-9 s/pair
        m.observe_recompute(n, 0.02 + n / 50_000 + 1e-9 * 3 * n * n, num_pairs=3 * n * n)
    assert m.recompute_tokens_per_s == pytest.approx(50_000, rel=1e-3)
    assert m.recompute_attn_s == pytest.approx(1e-9, rel=1e-3)
    m.observe_recompute(100, 0.01, num_pairs=-5)          # nonsense pairs count as none
    assert m.recompute_tokens_per_s > 0


def test_load_time_is_the_engines_own_where_it_measures_its_copies():
    class Busy:
        def __init__(self, v):
            self.v = v

        def busy_seconds(self):
            return self.v

    t0 = time.perf_counter() - 5.0                       # "started" 5 s ago
    assert load_seconds(Busy(0.25), t0) == 0.25
    for unknown in (None, -1.0, True, "x"):             # not measured: start to now
        assert load_seconds(Busy(unknown), t0) >= 5.0
    assert load_seconds(object(), t0) >= 5.0


def test_torch_engine_reports_the_busy_time_of_host_copies():
    import torch

    from kvtier.device_pool import DeviceKVPool
    from kvtier.host_pool import HostKVPool
    from kvtier.registry import create_transfer_engine
    dpool = DeviceKVPool.empty(SPEC, 8)
    hpool = HostKVPool(SPEC, 8, allocator=TorchPinnedAllocator())
    hpool.raw.copy_(torch.randint(0, 255, hpool.raw.shape, dtype=torch.uint8))
    eng = create_transfer_engine("torch", dpool, hpool, {})
    try:
        t0 = time.perf_counter()
        h = eng.load([3, 1, 6], [0, 5, 2])
        h.synchronize()
        wall = time.perf_counter() - t0
        busy = h.busy_seconds()
        assert busy is not None and 0 < busy <= wall
        assert load_seconds(h, t0) == busy
    finally:
        eng.close()


def test_the_fixed_cost_of_waiting_for_l3_keeps_small_l3_hits_recomputed():
    m = ReportedCostModel()
    m.adopt({"recompute_tokens_per_s": 2_000.0, "l2_load_bytes_per_s": 1e9,
             "l3_read_bytes_per_s": 1e8})
    kw = dict(l2_pages=4, l3_pages=1, l3_ready=0, compute_tokens=100, page_size=128,
              page_bytes=2 << 20, layers=8)
    assert m.pages_to_load(**kw) == 5      # 21 ms to read a block, 64 ms to compute it
    m.observe_l3_wait(float("nan"), 2 << 20, 2 << 20)     # ignored
    m.observe_l3_wait(-1.0, 2 << 20, 2 << 20)             # ignored
    assert m.l3_fixed_s == 0.0
    # a request waited 171 ms for a 2 MiB read + load the rates put at 23 ms
    m.observe_l3_wait(0.171, 2 << 20, 2 << 20)
    assert m.l3_fixed_s == pytest.approx(0.171 - (2 << 20) / 1e8 - (2 << 20) / 1e9)
    assert m.rates()["l3_wait_fixed_s"] == m.l3_fixed_s
    assert m.pages_to_load(**kw) == 4      # the L3 block is now dearer than computing it
    assert m.pages_to_load(**{**kw, "l3_pages": 8}) == 12   # 8 of them still pay
    m.observe_l3_wait(0.001, 2 << 20, 2 << 20)            # faster than the rates: 0, averaged
    assert 0 < m.l3_fixed_s < 0.148


def test_l3_wait_is_not_learnt_before_the_rates_are_known():
    m = ReportedCostModel()
    m.observe_l3_wait(0.5, 1 << 20, 1 << 20)
    assert m.l3_fixed_s == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_the_recompute_fit_keeps_the_long_prompts_of_a_multi_turn_run(seed):
    """A multi-turn run prefills long first prompts, then short suffixes for many requests:
    the fit must still tell the fixed cost from the per-token one (the H200's MLA shape:
    36 ms + 80K tokens/s; with the rates' alpha it settled at 6.4K tokens/s and loaded a
    disk slower than recomputing)."""
    import random
    rng = random.Random(seed)
    m = CostModel(alpha=0.3)

    def prefill(tokens: int, context: int) -> None:
        pairs = (context ** 2 - (context - tokens) ** 2) / 2
        s = 0.036 + tokens / 80_000 + 2e-10 * pairs
        m.observe_recompute(tokens, s * (1 + rng.uniform(-0.05, 0.05)), context)

    for _ in range(8):                       # the first round: whole prompts
        t = rng.randint(900, 1100)
        prefill(t, t)
    for _ in range(56):                      # then each turn's suffix after its history
        t = rng.randint(150, 260)
        prefill(t, t + rng.randint(1000, 4000))
    assert 55_000 < m.recompute_tokens_per_s < 120_000, m.recompute_tokens_per_s
    assert 0.025 < m.recompute_fixed_s < 0.045, m.recompute_fixed_s


def test_one_split_for_every_path():
    """`CostModel.split` is the split every path makes: L3 pages loaded in place count as L2
    pages (no read), a read L3 page counts as ready, nothing is offered beyond what was hit,
    a model that is off loads everything, and a first read is capped until the L3 rate is
    known. The planner's offer and the in-process cache's fetch both go through it."""
    pb, ps, layers = 64 * 128 * 1024, 64, 32           # an 8B-shaped page
    m = CostModel(recompute_tokens_per_s=30_000)
    kw = dict(compute_tokens=100, page_size=ps, page_bytes=pb, layers=layers, context=4096)
    assert m.first_read_cap(500) == CostModel.L3_PROBE_PAGES   # no L3 rate yet
    assert m.first_read_cap(500, pb) == 8                      # 64 MiB of 8 MiB pages
    assert m.first_read_cap(500, 256 << 10) == 256             # ... of 256 KiB pages
    assert m.first_read_cap(100, 256 << 10) == 100
    assert m.first_read_cap(500, 64 << 20) == CostModel.L3_PROBE_PAGES   # at least 8
    for _ in range(3):
        m.observe_load(pb * 8, pb * 8 / 48e9)                  # L2 -> L1 at 48 GB/s
        m._l3.observe(pb * 8, pb * 8 / 1.5e9)                  # reads of a 1.5 GB/s disk
    assert m.first_read_cap(500) == 500
    k2, k3 = m.split(l2_pages=10, l3_pages=40, **kw)
    assert (k2, k3) == (10, 0)                # the disk loses to recompute; L2 is loaded
    direct = m.split(l2_pages=10, l3_pages=40, in_place=True, **kw)
    assert direct[0] == 10 and direct[1] >= 35   # in place: at the link's speed, like L2
    # pages already read into L2 are loaded as L2 pages are
    assert m.split(l2_pages=10, l3_pages=40, l3_ready=40, **kw) == direct
    assert m.split(l2_pages=50, l3_pages=0, **kw) == (direct[0] + direct[1], 0)
    assert m.split(l2_pages=0, l3_pages=0, **kw) == (0, 0)
    off = CostModel(enabled=False)
    assert off.split(l2_pages=3, l3_pages=5, **kw) == (3, 5)
    assert off.first_read_cap(500) == 500


def _h100_prefill(n: int) -> float:
    """The demo's 8B prefill on an H100 (records/demo-h100-load.md): 21-25 ms whatever it
    computes up to ~640 tokens, then 31K tokens/s."""
    return max(0.023, 0.0023 + n / 31_000)


@pytest.mark.parametrize("seed", range(4))
def test_the_recompute_fit_finds_the_prefill_floor_and_its_knee(seed):
    import random
    rng = random.Random(seed)
    m = CostModel()
    for _ in range(200):
        n = rng.choice((rng.randint(64, 400), rng.randint(400, 1600), rng.randint(900, 3000)))
        m.observe_recompute(n, _h100_prefill(n) * (1 + rng.uniform(-0.05, 0.05)))
    assert 400 < m.recompute_knee_tokens < 900, m.recompute_knee_tokens
    assert 25_000 < m.recompute_tokens_per_s < 40_000, m.recompute_tokens_per_s
    assert 0.020 < m.recompute_fixed_s < 0.026, m.recompute_fixed_s
    assert m.rates()["recompute_knee_tokens"] == m.recompute_knee_tokens
    # a line's prefills (the H200's 70 ms + 75K tokens/s) get no knee
    line = CostModel()
    for n in (1335, 250, 400, 180, 900, 300, 260, 1100, 220, 350) * 3:
        line.observe_recompute(n, (0.070 + n / 75_000) * (1 + rng.uniform(-0.03, 0.03)))
    assert line.recompute_knee_tokens == 0.0
    assert line.recompute_tokens_per_s == pytest.approx(75_000, rel=0.1)


def test_recorded_h100_prefills_never_make_the_split_skip_in_place_pages():
    """Every prefill of an H100 demo run (16 conversations x 12 rounds, in order), whose
    times at equal work vary up to 2x: after each, a typical request's split of 10 L3 pages
    loaded in place at 46 GB/s (350K tokens/s) against recomputing them (31K tokens/s above
    a ~23 ms floor). A moving-average line through these swung 9K-175M tokens/s and skipped
    pages in 59 of 192 splits; on the engine such skips cost L1+L2+L3 its hits under load
    (63.6% against 81-85%)."""
    import json
    import pathlib
    rows = json.loads((pathlib.Path(__file__).parent / "data" / "h100_8b_prefills.json")
                      .read_text())["prefills"]
    page_bytes = 64 * 128 * 1024
    m = CostModel()
    m.observe_load(page_bytes * 8, page_bytes * 8 / 46e9)
    skipped = []
    for tokens, seconds, context in rows:
        m.observe_recompute(tokens, seconds, context=context)
        _, l3 = m.split(l2_pages=0, l3_pages=10, in_place=True, compute_tokens=300,
                        page_size=64, page_bytes=page_bytes, layers=32, context=1000)
        skipped.append(10 - l3)
    assert sum(skipped) == 0, skipped


def test_a_split_skips_pages_only_for_a_gain_above_the_margin():
    # 1 MiB pages that take 1.01 ms to load against 1 ms to recompute each (one layer, no
    # overlap): skipping all 10 is modelled faster, by less than SKIP_GAIN (0.9%)
    kw = dict(l2_pages=0, l3_pages=10, compute_tokens=64, h2d_bps=MIB / 1.01e-3,
              l3_bps=None, layers=1, **BASE)
    assert best_split(**kw, skip_gain=0.0) < 10
    t_all, t_best = split_time(10, **kw), split_time(best_split(**kw, skip_gain=0.0), **kw)
    assert t_best < t_all < t_best / (1 - SKIP_GAIN)
    assert best_split(**kw) == 10
    # a slow L3 gains far more than the margin by being skipped
    assert best_split(**{**kw, "h2d_bps": 10e9, "l3_bps": 100e6, "l2_pages": 2,
                         "l3_pages": 8}) == 2


def test_loads_overlap_the_prefills_fixed_cost():
    # 10 pages at 2 GB/s (5.2 ms) against 10 ms of recompute: with a 20 ms fixed cost the
    # load hides under the prefill; without it, recomputing everything looks as good
    kw = dict(l2_pages=10, l3_pages=0, compute_tokens=64, h2d_bps=2e9, l3_bps=None,
              layers=32, **BASE)
    assert split_time(10, **kw, recompute_fixed_s=0.020) == pytest.approx(
        0.020 + 64 / 64_000 + 10 * MIB / 2e9 / 32)
    assert split_time(0, **kw, recompute_fixed_s=0.020, knee_tokens=1000) == pytest.approx(
        0.020)
    assert best_split(**kw, recompute_fixed_s=0.020) == 10


def test_the_recompute_fit_is_made_again_every_few_prefills_not_every_one(monkeypatch):
    """A serving engine observes every step; the least squares cost ~0.5 ms, so once the window
    holds REFIT_FROM prefills the fit is redone after REFIT_EVERY new ones."""
    from kvtier.cache.cost import _Marginal
    calls = []
    real = _Marginal._best
    monkeypatch.setattr(_Marginal, "_best", staticmethod(
        lambda *a: calls.append(1) or real(*a)))
    m = CostModel()
    for i in range(_Marginal.REFIT_FROM - 1):              # below REFIT_FROM: every one
        m.observe_recompute(100 + 37 * i, _h100_prefill(100 + 37 * i))
        assert m.recompute_tokens_per_s is not None
    fit, calls[:] = m._recompute._fit, []
    for i in range(_Marginal.REFIT_EVERY - 1):
        m.observe_recompute(500 + i, 0.5)                 # outliers: a refit would move
        m.rates()
    assert not calls and m._recompute._fit == fit
    m.observe_recompute(600, 0.5)
    m.rates()
    assert calls and m._recompute._fit != fit


def test_a_reader_during_a_refit_gets_the_last_fit_not_none(monkeypatch):
    """The cache reads the rates on an arriving request's thread while the engine's thread
    observes prefills and refits: a split made during a refit must see the last fit, not a
    model without one (the plain ratio, no fixed cost, no knee)."""
    import random
    from kvtier.cache.cost import _Marginal
    rng = random.Random(1)
    m = CostModel()
    for _ in range(_Marginal.REFIT_FROM):
        n = rng.randint(64, 3000)
        m.observe_recompute(n, _h100_prefill(n) * (1 + rng.uniform(-0.05, 0.05)))
    before = m.rates()
    assert before["recompute_fixed_s"] and before["recompute_tokens_per_s"]
    seen = []
    real = _Marginal._fit_of

    def fit_while_read(self, obs):
        seen.append(m.rates())          # what another thread reads while this one fits
        return real(self, obs)

    monkeypatch.setattr(_Marginal, "_fit_of", fit_while_read)
    for _ in range(_Marginal.REFIT_EVERY):
        m.observe_recompute(5000, 0.5)
    m.rates()
    assert seen == [before]
    assert m.rates() != before


@pytest.mark.parametrize("probe_due", [False, True])
@pytest.mark.parametrize("prefetched", [False, True])
def test_a_split_that_loads_part_of_the_l3_hit_loads_that_part(probe_due, prefetched):
    """The split keeps the first 4 of 6 L3 pages: the fetch loads those 4 (bitwise, from the
    read it waited for), the last 2 are recomputed. Before, any skipped L3 page made the fetch
    load none of them after waiting for their read; and where a probe read was due it read the
    first pages in place of the fetch's read, so a streamed fetch loaded nothing."""
    r = Rig(l3_store="memory", prefetch_policy="wait_complete", recompute_tokens_per_s=1e6)
    try:
        a = toks(6 * SPEC.page_size, seed=31)
        _to_l3(r, a)
        cost = r.cache.cost
        cost.split = lambda *, l2_pages, l3_pages, **kw: (l2_pages, min(l3_pages, 4))
        cost.wants_l3_probe = lambda: probe_due
        m = r.cache.match(a)
        assert m.l3_count == 6
        if prefetched:
            r.cache.prefetch(m)
        h = r.cache.fetch(m, r.take(m.pages_to_load))
        h.wait()
        assert h.pages_loaded == 4
        r.verify(m.keys[:4], h.device_pages[:4])
        new = r.take(2)
        r.prefill(m.keys[4:], new)
        r.cache.commit(a, list(h.device_pages[:4]) + new, match=m)
        r.alloc.free(r.cache.release(m))
        met = r.cache.metrics()
        assert met["cost_skipped_pages_l3"] == 2 and met["l3_hit_pages"] >= 4
        r.cache.wait_idle()
        r.cache.check_invariants(idle=True)
    finally:
        r.close()
