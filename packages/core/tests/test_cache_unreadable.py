"""A page whose L3 read failed is not offered again: the in-process controller (`TieredKVCache`)
and the planner half (`CachePlanner`) on three stores whose existence check says yes while
their reads fail -- a filled file L3 whose segment files cannot be opened, one whose slots
carry bit flips, and a store that answers ``batch_exists`` and fails every ``batch_get``.

Each failed page costs one failed read, then plain misses (recomputed); a successful write
of the page makes it a hit again; reads that keep failing take the tier to degraded, then
failed, each change logged once. Pages are random, restored bytes compared bitwise."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CachePlanner, PlanResult, TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import TierFailureError
from kvtier.l3_stores import segments as seg_mod
from kvtier.l3_stores.file import FileStore
from kvtier.l3_stores.memory import MemoryStore
from kvtier.page_allocator import PageAllocator
from kvtier.testing import fill_random

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16")
PAGES = 4


class ExistsButUnreadable(MemoryStore):
    """Says it has every key; every read fails (a store whose index answers, reads don't)."""

    name = "memory"

    def __init__(self, config=None, *, spec):
        super().__init__(config, spec=spec)
        self.gets = 0

    def batch_exists(self, keys):
        return len(keys)

    def batch_get(self, keys, host_pages):
        self.gets += 1
        return [False] * len(keys)


def tokens(seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 30000) for _ in range(PAGES * SPEC.page_size + 2)]


class Rig:
    """A cache over random device pages and ``store``; `fill` commits a prompt and pushes it
    down to L3 only."""

    def __init__(self, store, **config):
        self.dpool = DeviceKVPool.empty(SPEC, 24)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t)
        self.alloc = PageAllocator(24)
        cfg = {"model_id": "unreadable", "host_pool_pages": 12, "l3_io_threads": 1,
               "prefetch_policy": "wait_complete", "cost_aware_fetch": False,
               "l3_error_limit": 3, **config}
        self.store = store
        self.cache = TieredKVCache.from_config(cfg, device_pool=self.dpool, store=store,
                                               allocate_device_pages=self.alloc.alloc,
                                               free_device_pages=self.alloc.free)

    def rows(self, d: int) -> list[torch.Tensor]:
        """Views of device page ``d`` in every layer's K and V (token-major rows)."""
        ps = SPEC.page_size
        return [t[d * ps:(d + 1) * ps] for comp in self.dpool.layers for t in comp]

    def page(self, d: int) -> torch.Tensor:
        return torch.cat([r.reshape(-1).view(torch.uint8) for r in self.rows(d)]).clone()

    def write(self, d: int, key: bytes) -> None:
        """The KV of page ``key`` into device page ``d``: random bytes that are a function of
        the key, as an engine's recompute of the same tokens gives the same KV."""
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        for r in self.rows(d):
            v = r.view(torch.uint8)
            v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8))

    def fill(self, toks) -> list[torch.Tensor]:
        """The engine computes ``toks`` and commits them; they end up in L3 only. Returns each
        page's bytes."""
        c = self.cache
        m = c.match(toks)
        pages = self.alloc.alloc(len(m.keys))
        for d, k in zip(pages, m.keys):
            self.write(d, k)
        want = [self.page(d) for d in pages]
        c.commit(toks, pages, match=m)
        self.alloc.free(c.release(m))
        assert c.wait_idle(20)
        c.evict(100)
        c.evict(100, tier="l2")
        assert c.wait_idle(20)
        return want

    def load(self, toks):
        """match + fetch: (l3 pages offered, pages loaded, their bytes)."""
        c = self.cache
        m = c.match(toks)
        offered = m.l3_count
        dev = self.alloc.alloc(m.pages_to_load)
        h = c.fetch(m, dev)
        h.wait()
        got = [self.page(d) for d in dev[:h.pages_loaded]]
        self.alloc.free(c.release(m))
        return offered, h.pages_loaded, got

    def close(self):
        self.cache.close()
        self.store.close()


def file_rig(tmp_path) -> Rig:
    return Rig(FileStore({"root": str(tmp_path / "l3"), "format": "segments"}, spec=SPEC))


def segment_files(store: FileStore) -> list[str]:
    d = os.path.join(store.dir, seg_mod.SEG_DIR)
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(seg_mod.SEG_SUFFIX))


def check_one_failure_then_misses(rig: Rig, toks) -> None:
    """One failed read, then no offer of those pages again."""
    offered, loaded, _ = rig.load(toks)
    assert offered == PAGES and loaded == 0                 # offered once, the read failed
    for _ in range(3):                                       # never offered again
        offered, loaded, _ = rig.load(toks)
        assert (offered, loaded) == (0, 0)
    mt = rig.cache.metrics()
    assert mt["l3_unreadable_marked"] >= 1 and mt["l3_unreadable_keys"] >= 1, mt


def test_unopenable_segment_files_are_no_hits(tmp_path):
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    rig = file_rig(tmp_path)
    toks = tokens(1)
    rig.fill(toks)
    segs = segment_files(rig.store)
    assert segs
    # a new store on the filled directory (as a restarted engine has), files made immutable:
    # opening them read-write fails with EPERM, the index logs still answer
    rig.close()
    if subprocess.run(["chattr", "+i", *segs], capture_output=True).returncode != 0:
        pytest.skip("this filesystem does not take the immutable attribute")
    try:
        rig = file_rig(tmp_path)
        # the existence check and the read agree: an entry whose segment cannot be opened
        # is no hit, so nothing is offered and no read fails
        assert rig.store.batch_exists(rig.cache.keys(toks)) == 0
        for _ in range(3):
            assert rig.load(toks)[:2] == (0, 0)
        assert rig.cache.metrics().get("l3_unreadable_marked", 0) == 0
    finally:
        subprocess.run(["chattr", "-i", *segs], capture_output=True)
    rig.close()


def test_bit_flipped_slots_cost_one_failed_read_then_a_rewrite_hits(tmp_path):
    rig = file_rig(tmp_path)
    toks = tokens(2)
    want = rig.fill(toks)
    r = random.Random(5)
    for path in segment_files(rig.store):                  # random bit flips in the data
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            for _ in range(64):
                off = r.randrange(0, max(1, size - 64))
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ (1 << r.randrange(8))]))
    rig.close()
    rig = file_rig(tmp_path)                                  # a new process's view
    offered, loaded, got = rig.load(toks)
    # whatever the flips hit, nothing wrong is loaded: a leading run of intact pages at most
    assert all(torch.equal(g, w) for g, w in zip(got, want[:loaded]))
    if loaded < offered:
        for _ in range(3):
            o2, l2, got = rig.load(toks)
            assert o2 + l2 <= loaded or o2 == 0, (o2, l2, loaded)
    # the engine recomputes the prompt and commits it: written again, a hit again
    want = rig.fill(toks)
    offered, loaded, got = rig.load(toks)
    assert (offered, loaded) == (PAGES, PAGES)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert rig.cache.metrics()["l3_unreadable_keys"] == 0
    rig.close()


def test_store_that_says_yes_and_never_reads(caplog):
    rig = Rig(ExistsButUnreadable(spec=SPEC))
    toks = tokens(3)
    rig.fill(toks)
    check_one_failure_then_misses(rig, toks)
    assert rig.store.gets == 1                                # one failed read in all
    rig.close()


def test_reads_that_keep_failing_degrade_then_fail_the_tier(caplog):
    """Each new prompt is offered once and its read fails: degraded at the first, failed at
    ``l3_error_limit`` (3) in a row, one log line per change; the cache keeps serving."""
    rig = Rig(ExistsButUnreadable(spec=SPEC))
    states = []
    with caplog.at_level(logging.INFO, logger="kvtier.cache"):
        for seed in range(10, 14):
            toks = tokens(seed)
            try:
                rig.fill(toks)
                rig.load(toks)
            except TierFailureError:          # raised once, by the call after the failure
                pass
            states.append(rig.cache.metrics()["l3_state"].split(":")[0])
    assert states[0] == "degraded" and states[2] == "failed", states
    lines = [r for r in caplog.records if "L3 store" in r.getMessage()
             and ("is degraded" in r.getMessage() or "tier failed" in r.getMessage())]
    assert len([r for r in lines if "is degraded" in r.getMessage()]) == 1, lines
    rig.close()


# ----- the planner half -----------------------------------------------------------------------
def test_planner_never_offers_a_page_whose_read_failed_until_it_is_written():
    store = ExistsButUnreadable(spec=SPEC)
    pl = CachePlanner({"model_id": "unreadable"}, spec=SPEC, device_layout="nhd",
                      num_host_pages=8,
                      l3_exists=store.batch_exists)
    keys = pl.keys(tokens(4))
    assert pl.lookup(keys).l3_pages == PAGES
    plan = pl.plan_load(keys, [0, 1, 2, 3])
    assert len(plan.l3_reads) == PAGES
    # the data path read the first page, the second failed (and the rest with it)
    pl.complete(PlanResult(plan.plan_id, (True, False, False, False),
                           (True, False, False, False)))
    hit = pl.lookup(keys)
    assert (hit.l2_pages, hit.l3_pages) == (1, 0)             # never the failed ones again
    assert pl.metrics()["l3_unreadable_marked"] == 1           # the first miss is enough
    # a save rewrites them: offered again
    save = pl.plan_save(keys, [4, 5, 6, 7])
    written = {k for _, k in save.l3_writes}
    assert written == set(keys[1:])
    pl.complete(PlanResult(save.plan_id, backups=(True,) * len(save.backups),
                          l3_writes=(True,) * len(save.l3_writes)))
    pl.plan_evict(8)
    assert pl.lookup(keys).pages == PAGES


def test_planner_stops_offering_l3_while_the_data_path_reports_it_failed(caplog):
    store = ExistsButUnreadable(spec=SPEC)
    pl = CachePlanner({"model_id": "unreadable"}, spec=SPEC, device_layout="nhd",
                      num_host_pages=8,
                      l3_exists=store.batch_exists)
    keys = pl.keys(tokens(5))
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        pl.set_l3_state("failed: reads in a row returned none of their pages")
        pl.set_l3_state("failed: reads in a row returned none of their pages")
    assert pl.lookup(keys).l3_pages == 0
    assert pl.metrics()["l3_state"].startswith("failed")
    assert len(caplog.records) == 1                       # one line per change
    pl.set_l3_state("ok")
    assert pl.lookup(keys).l3_pages == PAGES
