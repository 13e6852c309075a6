"""The `file` store's streamed reads alone: N pages of the 8B shape (8 MiB, 32 layers, 8
layer groups) on /dev/shm, read back whole (`batch_get`), one call per group in order, 8
group calls at once, group 0 alone, and in doubling spans (groups 0, 1, 2-3, 4-7), median of
7 of each; then the same beside a thread launching GPU work from Python (a prefill's
pattern; on a machine without CUDA, a thread spinning in Python). The interpreter's switch
interval is the demo's (0.1 ms). Environment: N (pages, 28), T (I/O threads, 8).
Used by records/demo-stream/call-6.sh."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import FileStore
from kvtier.spec import KVSpec

sys.setswitchinterval(1e-4)
SPEC = KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64)
N = int(os.environ.get("N", 28))
THREADS = int(os.environ.get("T", 8))


def main() -> None:
    pool = HostKVPool(SPEC, 2 * N, allocator=MmapAllocator())
    pb = SPEC.page_bytes
    pool.raw[: N * pb].copy_(torch.randint(0, 255, (N * pb,), dtype=torch.uint8))
    root = f"/dev/shm/kvgb{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    st = FileStore({"root": root, "io_threads": THREADS}, spec=SPEC)
    st.attach(pool)
    keys = [b"k%d" % i for i in range(N)]
    assert all(st.batch_set(keys, list(range(N))))
    dst = list(range(N, 2 * N))
    groups = len(st.read_groups())
    pool_ex = ThreadPoolExecutor(groups)
    stop = threading.Event()

    def busy() -> None:
        if torch.cuda.is_available():
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            while not stop.is_set():
                for _ in range(50):
                    b = (a @ a).relu() + 1
                del b
                torch.cuda.synchronize()
            return
        x = 0
        while not stop.is_set():
            for _ in range(200):
                x += 1
            time.sleep(0)

    def per_group() -> None:
        for g in range(groups):
            st.batch_get_layers(keys, dst, g)

    def at_once() -> None:
        for f in [pool_ex.submit(st.batch_get_layers, keys, dst, g) for g in range(groups)]:
            f.result()

    def spans() -> None:
        for g, h in ((0, 0), (1, 1), (2, 3), (4, 7)):
            st.batch_get_layers(keys, dst, g, through=h)

    cases = {"whole": lambda: st.batch_get(keys, dst), "one call per group": per_group,
             "8 group calls at once": at_once,
             "group 0 alone": lambda: st.batch_get_layers(keys, dst, 0),
             "doubling spans": spans}
    for beside in (False, True):
        stop.clear()
        th = threading.Thread(target=busy, daemon=True) if beside else None
        if th is not None:
            th.start()
        for name, fn in cases.items():
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(ts)
            moved = N * pb // groups if name == "group 0 alone" else N * pb
            print(f"{N} pages, {'beside GPU work' if beside else 'alone':15s} {name:22s} "
                  f"{ms:7.2f} ms  {moved / ms / 1e6:6.2f} GB/s", flush=True)
        stop.set()
        if th is not None:
            th.join()
    st.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
