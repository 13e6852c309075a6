"""The controller over a CUDA device pool (pinned L2, the torch engine's side stream and
events): every tier's pages come back bitwise, layer-wise waits order the caller's stream,
concurrent requests stay consistent. Needs a GPU; skipped (with the reason) elsewhere."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.page_allocator import PageAllocator

pytestmark = [pytest.mark.hardware,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (torch.cuda.is_available() is "
                                        "False)")]

SPECS = [KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16),
         KVSpec.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, page_size=8)]


class CudaRig:
    def __init__(self, spec: KVSpec, pages: int = 48, **config):
        self.spec = spec
        self.dpool = DeviceKVPool.empty(spec, pages, "cuda")
        self.alloc = PageAllocator(pages)
        cfg = {"model_id": "cuda", "host_pool_pages": 24, "l3_store": "memory",
               "prefetch_policy": "wait_complete"}
        cfg.update(config)
        self.cache = TieredKVCache.from_config(cfg, device_pool=self.dpool,
                                               allocate_device_pages=self.alloc.alloc,
                                               free_device_pages=self.alloc.free)
        self.ref: dict[bytes, torch.Tensor] = {}
        self.lock = threading.Lock()

    def page(self, p: int) -> torch.Tensor:
        s = self.spec
        return torch.cat([self.dpool.page(c, layer, p).reshape(-1).view(torch.uint8)
                          for layer in range(s.num_layers) for c in range(s.num_components)])

    def write(self, p: int, data: torch.Tensor) -> None:
        s, off = self.spec, 0
        for layer in range(s.num_layers):
            for c in range(s.num_components):
                flat = self.dpool.page(c, layer, p).view(-1).view(torch.uint8)
                flat.copy_(data[off:off + flat.numel()])
                off += flat.numel()

    def take(self, n):
        with self.lock:
            pages = self.alloc.alloc(n)
            if pages is None:
                self.cache.evict(n - self.alloc.free_count)
                pages = self.alloc.alloc(n)
            assert pages is not None
            return pages

    def request(self, tokens, layerwise=False):
        c = self.cache
        m = c.match(tokens)
        h = c.fetch(m, self.take(m.pages_to_load))
        if layerwise:                   # the caller's stream waits for each layer in turn
            for layer in range(self.spec.num_layers):
                h.wait_layer(layer)
        else:
            h.wait()
        got = [self.page(p) for p in m.l1_pages + h.device_pages]     # on the stream
        for key, g in zip(m.keys, got):
            assert torch.equal(g.cpu(), self.ref[key]), "restored page differs"
        n = len(m.keys) - m.l1_count - h.pages_loaded
        new = self.take(n)
        for key, p in zip(m.keys[len(m.keys) - n:], new):
            with self.lock:
                data = self.ref.get(key)
                if data is None:
                    data = torch.randint(0, 256, (self.spec.page_bytes,), dtype=torch.uint8)
                    self.ref[key] = data
            self.write(p, data.cuda())
        c.commit(tokens, m.l1_pages + h.device_pages + new, match=m)
        left = c.release(m)
        with self.lock:
            self.alloc.free(left)
        return m, h


@pytest.mark.parametrize("spec", SPECS, ids=["mha", "mla"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_every_tier_round_trips_on_cuda(spec, policy):
    r = CudaRig(spec, write_policy=policy)
    try:
        c = r.cache
        t = torch.randint(0, 30000, (6 * spec.page_size + 3,)).tolist()
        r.request(t)
        m, _ = r.request(t)
        assert m.l1_count == 6
        c.wait_idle()
        c.evict(100)
        m, h = r.request(t, layerwise=True)
        assert (m.l2_count, h.pages_loaded) == (6, 6)
        c.wait_idle()
        c.evict(100)
        c.evict(100, tier="l2")
        c.wait_idle()
        m, h = r.request(t, layerwise=True)
        assert (m.l3_count, h.pages_loaded) == (6, 6)
        c.check_invariants()
        assert c.host_pool.buffer.backing.endswith("pinned")
    finally:
        r.cache.close()


def test_concurrent_requests_on_cuda():
    spec = SPECS[0]
    r = CudaRig(spec, pages=96, host_pool_pages=32)
    errors = []
    shared = torch.randint(0, 30000, (2 * spec.page_size,)).tolist()

    def worker(w):
        try:
            for i in range(20):
                tail = torch.randint(0, 30000, (spec.page_size * (1 + (w + i) % 3),),
                                     generator=torch.Generator().manual_seed(w * 100 + i % 5))
                r.request(shared + tail.tolist(), layerwise=bool(i % 2))
                if i % 5 == w:
                    r.cache.evict(8)
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        assert r.cache.wait_idle(30)
        r.cache.check_invariants()
        for key, (dev, _) in r.cache.pages().items():
            if dev is not None:
                assert torch.equal(r.page(dev).cpu(), r.ref[key])
    finally:
        r.cache.close()


@pytest.mark.parametrize("spec", SPECS, ids=["mha", "mla"])
def test_a_second_cache_loads_shm_pages_in_place_on_cuda(spec):
    """Two caches on one shm arena (as two engine processes): the second loads the first's
    pages straight from the arena, registered with CUDA, into its device pages, bitwise
    (mha: 32 KiB pages, a slot each; mla: 27 KiB pages, through L2)."""
    import os
    name = f"kvtier-test-cuda-inplace-{os.getpid()}-{os.urandom(3).hex()}"
    l3 = {"l3_store": "shm", "l3_config": {"name": name, "capacity_pages": 64,
                                           "remove_when_unused": True}}
    a, b = CudaRig(spec, **l3), CudaRig(spec, **l3)
    try:
        t = torch.randint(0, 30000, (6 * spec.page_size + 3,)).tolist()
        a.request(t)
        assert a.cache.wait_idle(30)
        b.ref = a.ref                             # b checks against a's bytes
        m, h = b.request(t, layerwise=True)       # asserts every page bitwise
        assert (m.l3_count, h.pages_loaded) == (6, 6)
        in_place = b.cache.metrics()["l3_in_place_pages"]
        if spec.page_bytes % 4096 == 0:
            assert b.cache.in_place_why_not == "" and in_place == 6
        else:
            assert "not exactly a page" in b.cache.in_place_why_not and in_place == 0
        b.cache.check_invariants()
    finally:
        b.cache.close()
        a.cache.close()
