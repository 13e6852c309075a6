"""Does a store reading on I/O threads slow a prefill whose kernels are launched from Python,
and is the interpreter lock the way? (one process; DEVICE cuda, else cpu for a smoke run)

A launch-bound loop stands for the prefill: LAYERS x small matmuls and elementwise ops on the
device, synchronised at the end. It is timed alone, then while readers run beside it:
- the `file` store on tmpfs, `batch_get` of 13 x 8 MiB pages in a loop from one caller with
  8 I/O threads, with the shipped piece size and with other piece sizes (``io_call_bytes``);
- the same store read by 8 processes (each its own store and interpreter lock);
- 8 threads copying 8 MiB host buffers with torch (one call per 8 MiB, lock released).
Each row: the loop's median ms (and vs alone), the readers' GB/s meanwhile.

Usage: python launch_probe.py DIR OUT.json
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

DEV = os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
LAYERS, OPS = 32, 12
PAGE = 8 << 20
PAGES = int(os.environ.get("PAGES", "64"))
BATCH = 13


def launch_loop(iters: int) -> list[float]:
    x = torch.randn(64, 1024, device=DEV)
    w = torch.randn(1024, 1024, device=DEV) / 32
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        h = x
        for _ in range(LAYERS):
            for _ in range(OPS // 3):
                h = torch.nn.functional.silu(h @ w)
                h = h * 0.5 + x
        if DEV == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def make_store(base, hot):
    from kvtier.host_allocators.mmap import MmapAllocator
    from kvtier.host_pool import HostKVPool
    from kvtier.l3_stores.file import FileStore
    from kvtier_tools.bench.store import _spec_for
    spec = _spec_for(PAGE)
    pool = HostKVPool(spec, 2 * PAGES, allocator=MmapAllocator())
    pool.raw[: PAGES * PAGE].random_(0, 256)
    keys = [os.urandom(32) for _ in range(PAGES)]
    root = tempfile.mkdtemp(dir=base, prefix="lp-")
    store = FileStore({"root": root, "io_threads": 8,
                       **({"io_call_bytes": hot} if hot > 0 else {})}, spec=spec)
    store.attach(pool)
    if hot < 0:
        store._seg.hot = False
    assert all(store.batch_set(keys, list(range(PAGES))))
    return store, pool, keys, root


def read_loop(store, keys, stop, moved):
    i = 0
    while not stop.is_set():
        ks = [keys[(i + j) % PAGES] for j in range(BATCH)]
        got = store.batch_get(ks, [PAGES + j for j in range(BATCH)])
        assert all(got)
        moved[0] += BATCH * PAGE
        i += BATCH


def proc_reader(base, hot, ready, go, stop, q):
    store, pool, keys, root = make_store(base, hot)
    moved = [0]
    ready.wait()
    go.wait()
    t0 = time.perf_counter()
    read_loop(store, keys, stop, moved)
    q.put(moved[0] / (time.perf_counter() - t0))
    store.close()
    shutil.rmtree(root, ignore_errors=True)


def beside(threads, moved, stop, iters):
    """The launch loop timed while ``threads`` run (they add bytes to ``moved[0]`` until
    ``stop``): (loop times, their GB/s meanwhile)."""
    for t in threads:
        t.start()
    time.sleep(0.2)
    m0, t0 = moved[0], time.perf_counter()
    loop = launch_loop(iters)
    gbps = (moved[0] - m0) / (time.perf_counter() - t0) / 1e9
    stop.set()
    for t in threads:
        t.join()
    return loop, gbps


def row(name, loop, alone, gbps):
    med = statistics.median(loop)
    r = {"readers": name, "loop_ms": round(med, 3), "vs_alone": round(med / alone, 3),
         "read_gbps": round(gbps, 2)}
    print(json.dumps(r), flush=True)
    return r


def main():
    base, out = sys.argv[1], sys.argv[2]
    os.makedirs(base, exist_ok=True)
    iters = int(os.environ.get("ITERS", "200"))
    launch_loop(20)
    rows = []
    alone = statistics.median(launch_loop(iters))
    rows.append(row("none", [alone], alone, 0.0))
    for hot in [int(h) for h in os.environ.get("HOTS", "524288,2097152,0,-1").split(",") if h]:
        store, pool, keys, root = make_store(base, hot)
        stop, moved = threading.Event(), [0]
        loop, gbps = beside([threading.Thread(target=read_loop, args=(store, keys, stop, moved))],
                            moved, stop, iters)
        name = {0: "store threads, shipped pieces (io_call_bytes)",
                -1: "store threads, no pieces (hot path off)"}.get(
            hot, f"store threads, {hot >> 10} KiB pieces")
        rows.append(row(name, loop, alone, gbps))
        store.close()
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
        rows.append(row("none (again)", launch_loop(iters), alone, 0.0))
    # the same reads in 8 processes
    ctx = mp.get_context("spawn")
    n = int(os.environ.get("NPROC", "8"))
    ready, go = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    stop, q = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=proc_reader, args=(base, 524288, ready, go, stop, q))
          for _ in range(n)]
    for p in ps:
        p.start()
    ready.wait()
    go.wait()
    time.sleep(0.2)
    loop = launch_loop(iters)
    stop.set()
    gbps = sum(q.get(timeout=120) for _ in ps) / 1e9       # each process's rate, summed
    for p in ps:
        p.join()
    rows.append(row(f"{n} processes (1 store each, 1 caller, 8 I/O threads)", loop, alone, gbps))
    # torch copies on 8 threads: memory traffic without per-call Python
    src = torch.empty(8, PAGE, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty_like(src)
    tstop, moved = threading.Event(), [0]

    def copier(i):
        while not tstop.is_set():
            dst[i].copy_(src[i])
            moved[0] += PAGE
    loop, gbps = beside([threading.Thread(target=copier, args=(i,)) for i in range(8)],
                        moved, tstop, iters)
    rows.append(row("8 threads of torch copies", loop, alone, gbps))
    with open(out, "w") as f:
        json.dump({"device": DEV, "alone_ms": alone, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
