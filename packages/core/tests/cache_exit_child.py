"""A process that uses a cache with an L3 store and background copies, then exits WITHOUT
calling close(), driven by test_cache_reliability.py (not a test module).

    python cache_exit_child.py ROOT [blocking]

It leaves L1 -> L2 copies, L3 writes and an L3 prefetch in flight at exit. With ``blocking``
the store's batch_get never returns (a wedged store) and the process must still exit.
"""

from __future__ import annotations

import sys
import threading

import torch

from kvtier import KVSpec
from kvtier.cache import TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.l3_stores.file import FileStore
from kvtier.page_allocator import PageAllocator

SPEC = KVSpec.mha(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16, dtype="bfloat16")


class Wedged(FileStore):
    """batch_get blocks forever (as on a FIFO at an object's path)."""

    def batch_get(self, keys, host_pages):
        threading.Event().wait()
        return super().batch_get(keys, host_pages)


def main() -> None:
    root, blocking = sys.argv[1], "blocking" in sys.argv[2:]
    store_cls = Wedged if blocking else FileStore
    store = store_cls({"root": root}, spec=SPEC)
    dpool = DeviceKVPool.empty(SPEC, 64)
    g = torch.Generator().manual_seed(1)
    for comp in dpool.layers:
        for t in comp:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    alloc = PageAllocator(64)
    cache = TieredKVCache.from_config(
        {"model_id": "exit", "host_pool_pages": 32, "write_policy": "write_through",
         "prefetch_policy": "best_effort", "l3_io_threads": 2, "l3_call_timeout_s": 1.0,
         "close_timeout_s": 3.0},
        device_pool=dpool, allocate_device_pages=alloc.alloc, free_device_pages=alloc.free,
        store=store)
    for r in range(12):
        tokens = list(range(r * 1000, r * 1000 + 16 * 6))
        m = cache.match(tokens)
        h = cache.fetch(m)
        need = len(m.keys) - m.l1_count - h.pages_loaded
        new = alloc.alloc(need)
        if new is None:
            cache.evict(need)
            new = alloc.alloc(need) or []
        if len(new) == need:
            cache.commit(tokens, m.l1_pages + h.device_pages + new, match=m)
        alloc.free(cache.release(m))
    cache.evict(40)
    cache.evict(32, tier="l2")
    m = cache.match(list(range(0, 16 * 6)))       # L3 hits: start a read, leave it running
    cache.prefetch(m)
    print("exiting", flush=True)
    # no close(), no release(m): the interpreter exits with threads busy


if __name__ == "__main__":
    main()
