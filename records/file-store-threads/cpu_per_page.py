"""CPU time per page of the `file` store's batch_get on tmpfs where the copy is negligible
(8 KiB pages, batches of 13): the store's own per-page work. Usage: python cpu_per_page.py"""
import os
import shutil
import tempfile
import time

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import FileStore
from kvtier.spec import KVSpec

spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=1024, page_size=2, dtype="bfloat16")
n = 13 * 64
for threads in (1, 8):
    pool = HostKVPool(spec, 2 * n, allocator=MmapAllocator())
    pool.raw.random_(0, 256)
    keys = [os.urandom(32) for _ in range(n)]
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="pp-")
    store = FileStore({"root": root, "io_threads": threads}, spec=spec)
    store.attach(pool)
    for i in range(0, n, 13):
        assert all(store.batch_set(keys[i:i + 13], list(range(i, i + 13))))
    best = 1e9
    for _ in range(5):
        c0 = time.process_time()
        for i in range(0, n, 13):
            assert all(store.batch_get(keys[i:i + 13], list(range(n + i, n + i + 13))))
        best = min(best, time.process_time() - c0)
    print(f"io_threads {threads}: {best / n * 1e6:.1f} us CPU per page (best of 5)")
    store.close()
    pool.close()
    shutil.rmtree(root)
