"""What serialises the `file` store's threads on a many-core host's tmpfs?

Runs, in one process and the same minutes:
- the raw ceiling: N threads over N files, 8 MiB preadv/pwritev (the bench's raw modes);
- the store in one process: page size x piece size (the store's ``io_call_bytes``) x I/O threads,
  with the process's CPU use (CPU seconds per wall second);
- the store in P processes at once (GIL-free aggregation): P stores, each its own directory.
If P processes reach the raw ceiling where one process with as many threads does not, the
threads are serialised by the interpreter lock, not by the medium or the store's locks.

Usage: python probe.py DIR OUT.json [GRID_JSON]
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

TOTAL = int(os.environ.get("TOTAL_MIB", "1024")) << 20


def _store_run(base, ps, hot, threads, callers, batch, total, barrier=None, out=None):
    import torch
    from kvtier.host_allocators.mmap import MmapAllocator
    from kvtier.host_pool import HostKVPool
    from kvtier.l3_stores.file import FileStore
    from kvtier_tools.bench.store import _spec_for
    spec = _spec_for(ps)
    n = total // spec.page_bytes
    pool = HostKVPool(spec, 2 * n, allocator=MmapAllocator())
    pool.raw[: n * spec.page_bytes].random_(0, 256, generator=torch.Generator().manual_seed(ps))
    pool.raw[n * spec.page_bytes:].fill_(0xA5)
    keys = [os.urandom(32) for _ in range(n)]
    root = tempfile.mkdtemp(dir=base, prefix="st-")
    store = FileStore({"root": root, "io_threads": threads,
                       **({"io_call_bytes": hot} if hot > 0 else {})}, spec=spec)
    store.attach(pool)
    if hot < 0:
        store._seg.hot = False          # whole-call reads/writes, checksum over each page
    calls = [slice(i, min(n, i + batch)) for i in range(0, n, batch)]
    res = {}
    with ThreadPoolExecutor(callers) as ex:
        for name, fn, off in (("set", store.batch_set, 0), ("get", store.batch_get, n)):
            if barrier is not None:
                barrier.wait()
            t0 = time.time()
            c0 = time.process_time()
            got = list(ex.map(lambda c, fn=fn, off=off:
                              fn(keys[c], [off + i for i in range(c.start, c.stop)]), calls))
            t1 = time.time()
            res[name] = (t0, t1, time.process_time() - c0, all(all(g) for g in got))
    ok = torch.equal(pool.raw[: n * spec.page_bytes], pool.raw[n * spec.page_bytes:])
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    pool.close()
    res["ok"] = ok
    if out is not None:
        out.put(res)
    return res


def store_threads(base, ps, hot, threads, callers, batch):
    r = _store_run(base, ps, hot, threads, callers, batch, TOTAL)
    row = {"kind": "store", "procs": 1, "page_mib": ps >> 20, "hot_kib": max(-1, hot >> 10),
           "threads": threads, "callers": callers, "batch": batch, "ok": r["ok"]}
    for op in ("set", "get"):
        t0, t1, cpu, ok = r[op]
        row[op] = round(TOTAL / (t1 - t0) / 1e9, 2)
        row[op + "_cpus"] = round(cpu / (t1 - t0), 2)
        row["ok"] = row["ok"] and ok
    return row


def store_procs(base, ps, hot, procs, threads, callers, batch):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    q = ctx.Queue()
    each = TOTAL // procs
    ps_ = [ctx.Process(target=_store_run,
                       args=(base, ps, hot, threads, callers, batch, each, barrier, q))
           for _ in range(procs)]
    for p in ps_:
        p.start()
    rs = [q.get(timeout=300) for _ in ps_]
    for p in ps_:
        p.join()
    row = {"kind": "store", "procs": procs, "page_mib": ps >> 20, "hot_kib": max(-1, hot >> 10),
           "threads": threads, "callers": callers, "batch": batch,
           "ok": all(r["ok"] for r in rs)}
    for op in ("set", "get"):
        t0 = min(r[op][0] for r in rs)
        t1 = max(r[op][1] for r in rs)
        row[op] = round(each * procs / (t1 - t0) / 1e9, 2)
        row[op + "_cpus"] = round(sum(r[op][2] for r in rs) / (t1 - t0), 2)
        row["ok"] = row["ok"] and all(r[op][3] for r in rs)
    return row


def raw(base, streams):
    import mmap
    import torch
    from kvtier_tools.bench.store import CHUNK, raw_read, raw_write, _remove_raw
    need = max(TOTAL, streams * CHUNK)
    data = mmap.mmap(-1, need)
    torch.frombuffer(data, dtype=torch.uint8).random_(0, 256)
    path = os.path.join(tempfile.mkdtemp(dir=base, prefix="raw-"), "raw.bin")
    w = raw_write(path, TOTAL, data, False, streams, True, CHUNK, 0, False)
    r = raw_read(path, TOTAL, data, False, streams, True, CHUNK, 0, False)
    _remove_raw(path, streams, True)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return {"kind": "raw", "streams": streams, "files": streams, "set": round(w, 2),
            "get": round(r, 2)}


DEFAULT = [
    ["raw", 8], ["raw", 16],
    # page MiB, piece KiB (0: the shipped one, -1: no pieces), threads, callers, batch
    ["t", 8, 512, 8, 2, 13], ["t", 8, 2048, 8, 2, 13], ["t", 8, 8192, 8, 2, 13],
    ["t", 8, -1, 8, 2, 13],
    ["t", 1, 512, 8, 2, 64], ["t", 1, 1024, 8, 2, 64], ["t", 1, -1, 8, 2, 64],
    ["t", 8, 512, 16, 4, 13], ["t", 8, 8192, 16, 4, 13],
    ["p", 8, 512, 4, 2, 1, 13], ["p", 8, 512, 8, 1, 1, 13], ["p", 1, 512, 8, 1, 1, 64],
    ["t", 8, 512, 1, 1, 13], ["t", 8, 8192, 1, 1, 13],
    ["raw", 8], ["raw", 16],
]


def main():
    base, out = sys.argv[1], sys.argv[2]
    grid = json.loads(sys.argv[3]) if len(sys.argv) > 3 else DEFAULT
    os.makedirs(base, exist_ok=True)
    rows = []
    for g in grid:
        if g[0] == "raw":
            row = raw(base, g[1])
        elif g[0] == "t":
            row = store_threads(base, g[1] << 20, g[2] << 10, *g[3:])
        else:
            row = store_procs(base, g[1] << 20, g[2] << 10, *g[3:])
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
