"""Streamed L3 reads (`kvtier.cache.stream`): a plan's L3 pages land layer group by layer
group and each group's loads start as it lands, on the executor and through `TieredKVCache`.
Real CPU pools and the torch engine, random bytes; the store is the memory store with its
read groups gated and failed on demand here, so that what lands when is observed."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheExecutor, Plan, TieredKVCache
from kvtier.cache.cost import split_time
from kvtier.cache.stream import stream_groups
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import TransferError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.memory import MemoryStore
from kvtier.registry import create_transfer_engine
from kvtier.testing import fill_random

SPEC = KVSpec.mha(num_layers=5, num_kv_heads=2, head_dim=8, page_size=3, dtype="float16")
GROUPS = ((0, 2), (2, 3), (3, 5))
LB = SPEC.page_bytes // SPEC.num_layers


def layers(flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return flat[lo * LB:hi * LB]


class GatedStore(MemoryStore):
    """The memory store, reading layer groups one call at a time: a group waits for its gate
    (set by the test), and (key, group) pairs in ``fail`` come back False."""

    def __init__(self, *, spec, groups=GROUPS):
        super().__init__(spec=spec)
        self.groups = groups
        self.gates = {g: threading.Event() for g in range(len(groups))}
        for ev in self.gates.values():
            ev.set()
        self.fail: set[tuple[bytes, int]] = set()
        self.calls: list[tuple[int, int]] = []      # (group, pages) per call
        self.hang = threading.Event()               # set: group calls after 0 never return

    def read_groups(self):
        return self.groups

    def batch_get_layers(self, keys, host_pages, group, through=None):
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        last = group if through is None else through
        self.calls.append((group if through is None else (group, through), len(keys)))
        if group and self.hang.is_set():
            threading.Event().wait(30)
        for g in range(group, last + 1):
            self.gates[g].wait(10)
        lo, hi = self.groups[group][0], self.groups[last][1]
        out = []
        for key, hp in zip(keys, pages):
            with self._lock:
                obj = self._objects.get(key)
            if obj is None or any((key, g) in self.fail for g in range(group, last + 1)):
                out.append(False)
                continue
            dst = self.host_pool.page_bytes_view(hp)
            dst[lo * LB:hi * LB].copy_(layers(obj.view(torch.uint8).flatten(), lo, hi))
            out.append(True)
        return out


class Rig:
    def __init__(self, seed: int, *, store=None, **kw):
        gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.dpool = DeviceKVPool.empty(SPEC, 17)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, gen)
        self.host = HostKVPool(SPEC, 19, allocator=TorchPinnedAllocator())
        fill_random(self.host.raw, gen)
        self.store = store if store is not None else GatedStore(spec=SPEC)
        self.store.attach(self.host)
        engine = create_transfer_engine("torch", self.dpool, self.host)
        self.ex = CacheExecutor(host_pool=self.host, engine=engine, store=self.store,
                                l3_io_threads=1, owned=(engine, self.store, self.host),
                                **{"l3_stream_layers": True, **kw})

    def put(self, n: int) -> list[tuple[bytes, torch.Tensor]]:
        out = []
        for hp in self.rng.sample(range(19), n):
            key = self.rng.randbytes(32)
            assert self.store.batch_set([key], [hp]) == [True]
            out.append((key, self.host.page_bytes_view(hp).clone()))
        return out

    def first_group_then_rest(self, plan, objs, dev, hi: int) -> None:
        """With group 1 held back, the plan's layers below ``hi`` (group 0) load and the rest
        stay as they were; released, every page lands bitwise and the result is good."""
        before = [self.dpool.page_bytes(d).clone() for d in dev]
        self.store.gates[1].clear()
        h = self.ex.submit(plan)
        assert self.ex.wait_layer(plan.plan_id, hi - 1, timeout=5) is None
        for (_, want), d, old in zip(objs, dev, before):
            got = self.dpool.page_bytes(d)
            assert torch.equal(layers(got, 0, hi), layers(want, 0, hi))
            assert torch.equal(layers(got, hi, 5), layers(old, hi, 5))   # not yet
        assert not h.done()
        self.store.gates[1].set()
        h.synchronize()
        res = self.ex.poll()[0]
        n = len(objs)
        assert res.ok and res.l3_reads == (True,) * n and res.loads == (True,) * n
        for (_, want), d in zip(objs, dev):
            assert torch.equal(self.dpool.page_bytes(d), want)

    def failing(self, plan, why: str):
        """Submit ``plan``, whose loads fail for ``why``: a waiter for every layer is told
        (while the result is held back), then the plan's result."""
        hold, got = threading.Event(), []
        h = self.ex.submit(plan, on_done=lambda res: (got.append(res), hold.wait(5)))
        err = self.ex.wait_layer(plan.plan_id, None, timeout=5)
        assert isinstance(err, TransferError) and why in str(err)
        hold.set()
        h.synchronize()
        return got[0]

    def plan(self, pid: int, objs, n_dev: int | None = None):
        hps = self.rng.sample(range(19), len(objs))
        dev = self.rng.sample(range(17), len(objs) if n_dev is None else n_dev)
        return Plan(pid, l3_reads=tuple((k, hp) for (k, _), hp in zip(objs, hps)),
                    loads=tuple(zip(hps, dev))), dev


def test_the_first_group_loads_while_later_groups_are_still_read():
    r = Rig(1, l3_batch_pages=2)
    assert r.ex.read_groups == GROUPS and r.ex.stream_why_not == ""
    objs = r.put(5)
    plan, dev = r.plan(3, objs)
    r.first_group_then_rest(plan, objs, dev, 2)      # layers 0-1 are group 0
    # group-major: every batch of group 0, then of group 1, then of group 2
    assert [g for g, _ in r.store.calls] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert r.ex.metrics()["l3_streamed_pages"] == 5
    r.ex.close()


GROUPS4 = ((0, 1), (1, 2), (2, 3), (3, 5))


class OneGroupAtATimeStore(GatedStore):
    """A store written before spans: its ``batch_get_layers`` takes no ``through``."""

    def batch_get_layers(self, keys, host_pages, group):
        return super().batch_get_layers(keys, host_pages, group)


def test_read_spans_double_and_cover_every_group_once():
    from kvtier.cache.stream import read_spans
    assert read_spans(8) == [(0, 0), (1, 1), (2, 3), (4, 7)]
    assert read_spans(4) == [(0, 0), (1, 1), (2, 3)]
    assert read_spans(8, doubling=False) == [(g, g) for g in range(8)]
    for n in range(1, 40):
        spans = read_spans(n)
        assert spans[0] == (0, 0)
        assert [g for a, b in spans for g in range(a, b + 1)] == list(range(n))
        for (a, b), (c, _) in zip(spans, spans[1:]):
            assert c == b + 1 and b - a + 1 <= max(1, a)


@pytest.mark.parametrize("how", ["spans", "one group a call", "a store without through"])
def test_spans_read_and_load_the_later_groups_in_fewer_calls_bitwise(how):
    """Four groups: with spans the reads are group 0, group 1, then groups 2-3 as one call per
    batch (one load each), and the first group still loads while the rest are read; one group
    a call with ``l3_stream_spans = False`` or a store whose ``batch_get_layers`` takes no
    ``through``. Every page lands bitwise either way."""
    cls = OneGroupAtATimeStore if how == "a store without through" else GatedStore
    r = Rig(11, store=cls(spec=SPEC, groups=GROUPS4), l3_batch_pages=3,
            l3_stream_spans=how != "one group a call")
    assert r.ex.stream_spans == (how == "spans")
    objs = r.put(5)
    plan, dev = r.plan(7, objs)
    r.first_group_then_rest(plan, objs, dev, 1)      # layer 0 is group 0
    want_calls = [0, 0, 1, 1] + ([(2, 3)] * 2 if how == "spans" else [2, 2, 3, 3])
    assert [g for g, _ in r.store.calls] == want_calls
    assert r.ex.metrics()["l3_streamed_pages"] == 5
    r.ex.close()


def test_a_miss_inside_a_span_fails_that_page_never_wrong_data():
    """A page whose group 3 misses, read in the span 2-3: that page's load fails (its first
    groups loaded, it is not booked), the pages before it land bitwise."""
    r = Rig(12, store=GatedStore(spec=SPEC, groups=GROUPS4), l3_batch_pages=8)
    objs = r.put(4)
    r.store.fail.add((objs[2][0], 3))
    plan, dev = r.plan(8, objs)
    res = r.failing(plan, "2 of its pages")
    assert res.l3_reads == (True, True, False, True)
    assert res.loads == (True, True, False, False)
    for (_, want), d in zip(objs[:2], dev[:2]):
        assert torch.equal(r.dpool.page_bytes(d), want)
    assert ((2, 3), 4) in r.store.calls
    r.ex.close()


def test_a_miss_in_a_later_group_fails_that_page_and_the_rest_never_wrong_data():
    r = Rig(2, l3_batch_pages=3)
    objs = r.put(6)
    plan, dev = r.plan(4, objs)
    r.store.fail.add((objs[3][0], 1))              # page 3's middle group is bad
    res = r.failing(plan, "3 of its pages")
    # the pages after the miss are read on (as a whole read's batch would) but only the
    # leading run is loaded: a prefix cannot use the rest
    assert res.l3_reads == (True,) * 3 + (False, True, True)
    assert res.loads == (True,) * 3 + (False,) * 3
    for (_, want), d in zip(objs[:3], dev):
        assert torch.equal(r.dpool.page_bytes(d), want)
    assert sum(n for g, n in r.store.calls if g == 2) == 5
    r.ex.close()


def test_a_group_read_past_its_deadline_lets_every_waiter_go_on():
    r = Rig(3, l3_call_timeout_s=0.3, l3_error_limit=100)
    objs = r.put(4)
    plan, dev = r.plan(5, objs)
    r.store.hang.set()
    t0 = time.monotonic()
    h = r.ex.submit(plan)
    r.ex.wait_layer(5, 4, timeout=10)              # the last group: never read
    assert time.monotonic() - t0 < 5
    assert r.ex.wait(5, 5)
    res = [x for x in r.ex.poll() if x.plan_id == 5][0]
    assert not any(res.loads) and not any(res.l3_reads)
    assert set(res.held_host_pages) == {hp for _, hp in plan.l3_reads}
    assert h.done()
    r.ex.close(timeout=1)


def test_streaming_needs_groups_from_the_store_and_ranges_from_the_engine():
    host = HostKVPool(SPEC, 4, allocator=TorchPinnedAllocator())
    dpool = DeviceKVPool.empty(SPEC, 4)
    eng = create_transfer_engine("torch", dpool, host)
    assert stream_groups(None, eng, 5) == ((), "no L3 store")
    for groups, why in ((((0, 5),), "one group"), (((0, 2), (3, 5)), "do not cover"),
                        (((0, 2), (2, 4)), "do not cover 5 layers"),
                        ((), "whole pages only")):
        store = GatedStore(spec=SPEC, groups=groups)
        got, reason = stream_groups(store, eng, 5)
        assert got == () and why in reason, (groups, reason)
    store = GatedStore(spec=SPEC)
    assert stream_groups(store, eng, 5) == (GROUPS, "")

    class Whole(type(eng)):                        # an engine without layer ranges
        @classmethod
        def capabilities(cls):
            import dataclasses
            return dataclasses.replace(super().capabilities(), layer_ranges=False)
    eng.__class__ = Whole
    assert "whole pages only" in stream_groups(store, eng, 5)[1]
    ex = CacheExecutor(host_pool=host, engine=create_transfer_engine("torch", dpool, host),
                       store=store, l3_stream_layers=False)
    assert ex.read_groups == () and "off" in ex.stream_why_not
    ex.close()


def test_the_split_counts_only_the_first_group_of_a_streamed_read():
    kw = dict(l2_pages=0, l3_pages=10, compute_tokens=100, page_size=16, page_bytes=1 << 20,
              h2d_bps=40e9, l3_bps=2e9, recompute_tps=20000.0, layers=32)
    whole = split_time(10, **kw)
    streamed = split_time(10, groups=8, **kw)
    t3 = 10 * (1 << 20) / 2e9
    assert streamed == pytest.approx(whole - t3 + t3 / 8)   # the read hides behind compute
    slow = dict(kw, l3_bps=1e8)                   # a read far slower than compute: exposed
    assert split_time(10, groups=8, **slow) == pytest.approx(10 * (1 << 20) / 1e8, rel=0.05)


# ----- through TieredKVCache ----------------------------------------------------------------
def _cache(store, **cfg):
    dpool = DeviceKVPool.empty(SPEC, 24)
    freed: list[int] = []
    config = dict(model_id="stream", host_pool_pages=24, write_policy="write_through",
                  cost_aware_fetch=False, l3_stream_layers=True, l3_stream_min_read_s=0,
                  l3_io_threads=1)
    config.update(cfg)
    cache = TieredKVCache(config, device_pool=dpool, free_device_pages=freed.extend,
                          store=store)
    return cache, dpool


def _fill(dpool, pages, gen):
    for layer in dpool.chunks:
        for c in layer:
            for p in pages:
                c[p].copy_(torch.randint(0, 256, c[p].shape, dtype=torch.uint8, generator=gen))


def _only_in_l3(n: int, seed: int):
    """A cache over a gated store with ``n`` random pages committed, then held by L3 alone:
    (store, cache, device pool, tokens, the pages' bytes, the engine's free pages)."""
    store = GatedStore(spec=SPEC)
    cache, dpool = _cache(store)
    tokens = list(range(1, 3 * n + 1))
    pages = random.Random(seed).sample(range(24), n)
    _fill(dpool, pages, torch.Generator().manual_seed(seed))
    want = [dpool.page_bytes(p).clone() for p in pages]
    cache.commit(tokens, pages)
    assert cache.wait_idle(5)
    cache.evict(n, "l1")
    cache.evict(24, "l2")
    assert cache.wait_idle(5)
    return store, cache, dpool, tokens, want, [p for p in range(24) if p not in pages][:n]


def test_a_fetch_streams_its_l3_pages_and_books_them_in_l1_and_l2():
    store, cache, dpool, tokens, want, dev = _only_in_l3(7, 5)
    assert cache.streams_l3 and cache.stream_why_not == ""
    m = cache.match(tokens)
    assert (m.l1_count, m.l2_count, m.l3_count) == (0, 0, 7)
    store.gates[2].clear()
    fh = cache.fetch(m, dev)
    assert fh.pages_loaded == 7
    fh.wait_layer(2)                                 # group 1 (layer 2) landed
    for w, d in zip(want, dev):
        assert torch.equal(layers(dpool.page_bytes(d), 0, 3), layers(w, 0, 3))
    store.gates[2].set()
    fh.wait()
    for w, d in zip(want, dev):
        assert torch.equal(dpool.page_bytes(d), w)
    cache.commit(tokens, dev, match=m)
    cache.release(m)
    assert cache.wait_idle(5)
    got = cache.pages()
    assert all(got[k][0] is not None and got[k][1] is not None for k in m.keys)
    met = cache.metrics()
    assert met["l3_streamed_pages"] == 7 and met["l3_hit_pages"] == 7
    cache.check_invariants(idle=True)
    cache.close()


def test_a_fetch_whose_stream_misses_fails_and_books_nothing_wrong():
    store, cache, dpool, tokens, _, dev = _only_in_l3(5, 6)
    m = cache.match(tokens)
    store.fail.add((m.keys[2], 1))
    fh = cache.fetch(m, dev)
    with pytest.raises(TransferError):
        fh.wait()
    assert fh.error is not None
    assert sorted(cache.release(m)) == sorted(dev)      # none taken: the engine's again
    assert cache.wait_idle(5)
    got = cache.pages()
    assert all(got.get(k, (None,))[0] is None for k in m.keys)   # nothing in L1
    assert all(got[k][1] is not None for k in m.keys[:2])  # the pages read whole: in L2
    assert m.keys[2] not in got
    cache.check_invariants(idle=True)
    m2 = cache.match(tokens)                   # the bad page is not offered from L3 again
    assert (m2.l2_count, m2.l3_count) == (2, 0)
    cache.release(m2)
    cache.close()


def test_an_object_gone_before_the_first_group_shortens_the_fetch_as_a_whole_read_would():
    store, cache, dpool, tokens, want, dev = _only_in_l3(6, 7)
    m = cache.match(tokens)
    assert m.l3_count == 6
    store.delete([m.keys[3]])                      # gone between the match and the fetch
    before = [dpool.page_bytes(d).clone() for d in dev[3:]]
    fh = cache.fetch(m, dev)
    assert fh.pages_loaded == 3 and fh.unused_pages == dev[3:]
    fh.wait()
    assert fh.error is None
    for w, d in zip(want[:3], dev):
        assert torch.equal(dpool.page_bytes(d), w)
    for old, d in zip(before, dev[3:]):              # the engine's pages: never written
        assert torch.equal(dpool.page_bytes(d), old)
    cache.release(m)
    assert cache.wait_idle(5)
    cache.check_invariants(idle=True)
    cache.close()


def test_a_fetch_streams_only_a_read_long_enough_to_pay():
    """`l3_stream_min_read_s`: a read shorter than it at the measured L3 rate, or with no
    rate measured yet, is read whole before the load; longer ones stream."""
    store = GatedStore(spec=SPEC)
    cache, dpool = _cache(store, l3_stream_min_read_s=0.5)
    tokens = list(range(1, 3 * 4 + 1))
    pages = random.Random(8).sample(range(24), 4)
    _fill(dpool, pages, torch.Generator().manual_seed(8))
    want = [dpool.page_bytes(p).clone() for p in pages]
    cache.commit(tokens, pages)
    assert cache.wait_idle(5)
    dev = [p for p in range(24) if p not in pages][:4]

    def fetch_from_l3() -> int:
        cache.evict(24, "l1")
        cache.evict(24, "l2")
        assert cache.wait_idle(5)
        before = cache.metrics().get("l3_streamed_pages", 0)
        m = cache.match(tokens)
        assert m.l3_count == 4
        fh = cache.fetch(m, dev)
        fh.wait()
        assert [torch.equal(dpool.page_bytes(d), w) for d, w in zip(dev, want)] == [True] * 4
        cache.release(m)
        return cache.metrics().get("l3_streamed_pages", 0) - before

    assert cache.cost.l3_bytes_per_s is None
    assert fetch_from_l3() == 0                      # no rate yet: whole
    assert cache.cost.l3_bytes_per_s is not None     # (that read measured it)
    assert not cache.cost.stream_pays(4, SPEC.page_bytes, 0.5)
    assert fetch_from_l3() == 0                      # 4 small pages: far below 0.5 s
    assert cache.cost.stream_pays(4, SPEC.page_bytes, 0.0)
    cache.config = dataclasses.replace(cache.config, l3_stream_min_read_s=0.0)
    assert fetch_from_l3() == 4                      # 0: every read streams
    cache.check_invariants(idle=True)
    cache.close()


def test_the_wait_before_a_streamed_prefill_teaches_the_split_its_fixed_cost():
    """A streamed fetch times its wait for the first layer group: what the group's bytes do
    not explain (here: the one L3 worker busy with a slow write) becomes `l3_fixed_s`, which
    the split then pays once, before the first group, not spread over the groups."""
    store = GatedStore(spec=SPEC)
    cache, dpool = _cache(store)
    tokens = list(range(1, 3 * 4 + 1))
    pages = [3, 9, 14, 20]
    _fill(dpool, pages, torch.Generator().manual_seed(9))
    cache.commit(tokens, pages)
    assert cache.wait_idle(5)
    cache.cost.observe_load(SPEC.page_bytes, 1e-6)         # rates known: a fast L2 -> L1
    cache.cost._l3.observe(SPEC.page_bytes, 1e-6)          # and a fast L3
    cache.evict(24, "l1")
    cache.evict(24, "l2")
    assert cache.wait_idle(5)
    m = cache.match(tokens)
    slow = threading.Event()
    real_set = store.batch_set

    def batch_set(keys, host_pages):
        slow.wait(0.3)                                     # holds the only L3 worker
        return real_set(keys, host_pages)

    store.batch_set = batch_set
    other = [1, 2, 4, 5]
    _fill(dpool, other, torch.Generator().manual_seed(10))
    cache.commit(list(range(100, 112)), other)             # its L3 write goes first
    time.sleep(0.05)
    fh = cache.fetch(m, [6, 7, 8, 10])
    fh.wait()
    cache.release(m)
    assert cache.cost.l3_fixed_s > 0.1, cache.cost.l3_fixed_s
    f = cache.cost.l3_fixed_s
    kw = dict(l2_pages=0, l3_pages=4, compute_tokens=3, page_size=3,
              page_bytes=SPEC.page_bytes, h2d_bps=1e9, l3_bps=1e6, recompute_tps=1e3,
              layers=5, groups=3)
    assert split_time(4, **kw, l3_fixed_s=f) == pytest.approx(split_time(4, **kw) + f)
    assert split_time(0, **kw, l3_fixed_s=f) == split_time(0, **kw)
    assert cache.wait_idle(5)
    cache.close()
