"""A complete engine integration of kvtier, small enough to read in one sitting.

The "engine" here owns a paged KV pool on the CPU and a toy prefill whose KV bytes depend on
the whole prefix (as a transformer's do). It serves requests through kvtier's controller:

    match -> fetch (L2/L3 -> L1, layer by layer) -> prefill the rest -> commit -> release

then restarts with an empty L1 and L2 over the same file L3 and serves the prompt again, to
show a restart served from disk. Every restored page is compared bit for bit with a recompute.
Run it with ``python examples/integrate.py``; docs/integrate.md walks through it.
"""

from __future__ import annotations

import hashlib
import tempfile
import urllib.request

import torch

from kvtier import DeviceKVPool, KVSpec
from kvtier.cache import TieredKVCache
from kvtier.prometheus import Source, serve
from kvtier.page_allocator import PageAllocator

SPEC = KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=16, page_size=16, dtype="float32")
DEVICE_PAGES = 64


class ToyEngine:
    """The engine side: its own KV pool, its page allocator, its prefill."""

    def __init__(self, spec: KVSpec):
        self.spec = spec
        # The engine's L1 buffers: per layer a K and a V [slots, heads, dim] tensor.
        self.pool = DeviceKVPool.empty(spec, DEVICE_PAGES)
        self.alloc = PageAllocator(DEVICE_PAGES)

    def compute_page(self, tokens: list[int], page: int) -> list[torch.Tensor]:
        """KV of full page ``page`` of ``tokens``: a function of the whole prefix."""
        ps = self.spec.page_size
        seed = hashlib.sha256(repr(tokens[:(page + 1) * ps]).encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
        shape = (ps, *self.spec.row_shape)
        return [torch.randn(shape, generator=g) for _ in range(2 * self.spec.num_layers)]

    def write_page(self, dev_page: int, kv: list[torch.Tensor]) -> None:
        for layer in range(self.spec.num_layers):
            self.pool.page(0, layer, dev_page).copy_(kv[2 * layer])
            self.pool.page(1, layer, dev_page).copy_(kv[2 * layer + 1])

    def same_page(self, dev_page: int, kv: list[torch.Tensor]) -> bool:
        return all(torch.equal(self.pool.page(c, layer, dev_page), kv[2 * layer + c])
                   for layer in range(self.spec.num_layers) for c in (0, 1))

    def take(self, cache: TieredKVCache, n: int) -> list[int]:
        """n free device pages; ask the cache to give back unpinned L1 pages if short."""
        pages = self.alloc.alloc(n)
        if pages is None:
            cache.evict(n - self.alloc.free_count)
            pages = self.alloc.alloc(n)
        if pages is None:
            raise RuntimeError("out of device pages")
        return pages

    def serve(self, cache: TieredKVCache, tokens: list[int]) -> dict[str, int]:
        """One request's prefill through the cache; returns where its pages came from."""
        n_full = len(tokens) // self.spec.page_size
        m = cache.match(tokens)                       # pins its L1 and L2 hits
        try:
            dev = self.take(cache, m.pages_to_load)
            h = cache.fetch(m, dev)                   # L3 -> L2 -> L1, layer by layer
            for layer in range(self.spec.num_layers):
                h.wait_layer(layer)                   # layer i's attention may start here
            h.wait()
            self.alloc.free(h.unused_pages)           # given, not loaded: still ours
            cached = m.l1_pages + h.device_pages
            for i, d in enumerate(cached):            # (a real engine would not check)
                assert self.same_page(d, self.compute_page(tokens, i)), f"page {i} differs"
            new = self.take(cache, n_full - len(cached))
            for i, d in enumerate(new, start=len(cached)):
                self.write_page(d, self.compute_page(tokens, i))     # the prefill
            cache.commit(tokens, cached + new, match=m)
            return {"l1": m.l1_count, "loaded": h.pages_loaded,
                    "computed": len(new), "pages": n_full}
        finally:
            self.alloc.free(cache.release(m))         # pages the cache did not take


def config(root: str) -> dict:
    return {"model_id": "toy-model", "host_pool_pages": 32, "l3_store": "file",
            "l3_config": {"root": root}, "write_policy": "write_through",
            "prefetch_policy": "wait_complete"}


def main() -> None:
    system = list(range(1000, 1000 + 5 * 16))        # a shared 80-token system prompt
    with tempfile.TemporaryDirectory() as root:
        engine = ToyEngine(SPEC)
        with TieredKVCache.from_config(config(root), device_pool=engine.pool,
                                       allocate_device_pages=engine.alloc.alloc,
                                       free_device_pages=engine.alloc.free) as cache, \
                serve(Source(cache.metrics_registry, {"engine": "toy"})) as exporter:
            print("first:", engine.serve(cache, system + [1, 2, 3] * 10))
            print("again:", engine.serve(cache, system + [4, 5, 6] * 10))
            cache.wait_idle(30)                       # the backups land (in the background)
            cache.evict(DEVICE_PAGES)                 # L1 gone: the next hit is from L2
            print("from L2:", engine.serve(cache, system + [7, 8] * 20))
            cache.wait_idle(30)                       # backups and L3 writes are background
            scrape = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
            hits = [ln for ln in scrape.splitlines() if ln.startswith("kvtier_hit_pages_total")]
            print("metrics:", "; ".join(hits))
        # A restart: a new engine and cache (empty L1 and L2) over the same L3 directory.
        engine = ToyEngine(SPEC)
        with TieredKVCache.from_config(config(root), device_pool=engine.pool,
                                       allocate_device_pages=engine.alloc.alloc,
                                       free_device_pages=engine.alloc.free) as cache:
            got = engine.serve(cache, system + [9] * 16)
            print("after restart (from L3):", got)
            assert got["loaded"] == 5, got
    print("ok: every restored page equals its recompute")


if __name__ == "__main__":
    main()
