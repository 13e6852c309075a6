"""The `file` store's batch_set (and batch_get) of pages of one size into a directory, timed
per repetition, at a chosen interpreter switch interval: what `kvtier bench store` times,
without its raw modes, to profile. python3 store_writes.py DIR PAGE_MIB THREADS PAGES
SWITCH_MS (0: CPython's 5 ms)."""
import os
import shutil
import sys
import time

import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import FileStore
from kvtier.spec import KVSpec

root, mib, threads, n, switch_ms = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), float(sys.argv[5])
if switch_ms > 0:
    sys.setswitchinterval(switch_ms / 1e3)
# the 8B shape (128 KiB a token): a page of ``mib`` MiB
spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128,
              page_size=int(mib * (1 << 20)) // 131072, dtype=torch.bfloat16)
pool = HostKVPool(spec, 2 * n, allocator=MmapAllocator())
pool.raw[: n * spec.page_bytes].copy_(
    torch.randint(0, 256, (n * spec.page_bytes,), dtype=torch.uint8))
keys = [os.urandom(32) for _ in range(n)]
for _rep in range(3):
    shutil.rmtree(root, ignore_errors=True)
    st = FileStore({"root": root, "io_threads": threads}, spec=spec)
    st.attach(pool)
    t0 = time.perf_counter()
    for i in range(0, n, 64):
        assert all(st.batch_set(keys[i:i + 64], list(range(i, min(n, i + 64)))))
    ts = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, n, 64):
        assert all(st.batch_get(keys[i:i + 64], list(range(n + i, n + min(n, i + 64)))))
    tg = time.perf_counter() - t0
    b = n * spec.page_bytes
    assert torch.equal(pool.raw[:b], pool.raw[b:2 * b])
    print(f"{mib:g} MiB x {n}, {threads} threads, switch {switch_ms or 5:g} ms: set "
          f"{b / ts / 1e9:.2f} GB/s ({ts / n * 1e6:.0f} us/page), get {b / tg / 1e9:.2f} GB/s",
          flush=True)
    st.close()
shutil.rmtree(root, ignore_errors=True)
