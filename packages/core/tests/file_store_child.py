"""A separate process using the file store, driven by test_file_store.py (not a test module).

Every page written is ``page_content(key_index, generation)``: random bytes from a seed, with
the generation and key index in its first 16 bytes, so any reader can tell a complete page of
some generation from anything else.

    python file_store_child.py ROOT MODE [ARGS...]

modes: ``loop`` (write generations forever), ``stall`` (write one generation, then stop half
way through the next object's write and sleep), ``rlimit`` (write under RLIMIT_FSIZE smaller
than one object), ``writer GEN0 STEP SECONDS`` and ``reader SECONDS`` (share a directory),
``capacity CAPACITY SECONDS WRITER WRITERS`` (write and check reads under a shared capacity).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import _files as files_mod
from kvtier.l3_stores.file import FileStore
from kvtier.spec import KVSpec

FORMAT_ENV = "KVTIER_TEST_FILE_FORMAT"      # the store format of the children (file_formats)
SPEC = KVSpec.mha(num_layers=4, num_kv_heads=4, head_dim=128, page_size=64, dtype="bfloat16")
NUM_KEYS = 6


def keys() -> list[bytes]:
    return [bytes([i]) * 32 for i in range(1, NUM_KEYS + 1)]


def page_content(key_index: int, gen: int, nbytes: int = SPEC.page_bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(key_index * 1_000_003 + gen)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    t[:16] = torch.tensor(list(gen.to_bytes(8, "little") + key_index.to_bytes(8, "little")),
                          dtype=torch.uint8)
    return t


def check_page(page: torch.Tensor, key_index: int) -> int | None:
    """The generation a page holds, or None if it is not a complete page of ``key_index``."""
    head = bytes(page[:16].tolist())
    gen, idx = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
    if idx != key_index or not torch.equal(page, page_content(key_index, gen, page.numel())):
        return None
    return gen


def open_store(root: str, **config) -> tuple[FileStore, HostKVPool]:
    pool = HostKVPool(SPEC, 2 * NUM_KEYS, allocator=MmapAllocator())   # aligned: O_DIRECT (auto)
    store = FileStore({"root": root, "io_threads": 2,
                       "format": os.environ.get(FORMAT_ENV, "segments"), **config}, spec=SPEC)
    store.attach(pool)
    return store, pool


def write_gen(store: FileStore, pool: HostKVPool, gen: int) -> list[bool]:
    for i in range(NUM_KEYS):
        pool.page_bytes_view(i).copy_(page_content(i, gen))
    return store.batch_set(keys(), list(range(NUM_KEYS)))


# ----- the parent's side -------------------------------------------------------------------
def read_all(root: str, **config) -> tuple[int, list[int]]:
    """Hits and generations read back by a fresh store; every hit must be a whole page."""
    store, pool = open_store(root, **config)
    try:
        got = store.batch_get(keys(), list(range(NUM_KEYS)))
        gens = []
        for i, ok in enumerate(got):
            if ok:
                gen = check_page(pool.page_bytes_view(i), i)
                assert gen is not None, f"key {i}: wrong bytes after a killed writer"
                gens.append(gen)
        return sum(got), gens
    finally:
        store.close()
        pool.close()


def wait_for(proc, word: str, timeout: float = 60) -> None:
    """Read a child's stdout until it prints ``word`` (an error if it exits or stays silent)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if word in line:
            return
        if proc.poll() is not None:
            raise AssertionError(f"child exited: {proc.stderr.read()}")
    raise AssertionError(f"child never said {word!r}")


def main(argv: list[str]) -> None:
    root, mode = argv[0], argv[1]
    if mode == "loop":
        store, pool = open_store(root, fsync=True)
        pages = {g: [page_content(i, g) for i in range(NUM_KEYS)] for g in range(4)}
        gen = 0
        while True:        # time goes into writing, so a kill most likely lands inside one
            for i in range(NUM_KEYS):
                pool.page_bytes_view(i).copy_(pages[gen % 4][i])
            store.batch_set(keys(), list(range(NUM_KEYS)))
            if gen == 0:
                print("ready", flush=True)
            gen += 1
    elif mode == "stall":
        store, pool = open_store(root, io_threads=1)
        assert all(write_gen(store, pool, 0))
        real = files_mod._pwrite_all

        def half_then_stall(fd, bufs, offset=0):
            first = bufs[0]
            real(fd, [first[: len(first) // 2]], offset)
            os.fsync(fd)
            print("stalled", flush=True)
            time.sleep(3600)

        files_mod._pwrite_all = half_then_stall
        write_gen(store, pool, 1)
    elif mode == "rlimit":
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # get EFBIG instead of dying
        store, pool = open_store(root)
        limit = store.object_bytes // 2
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        ok = write_gen(store, pool, 7)
        tmp = [f for _, _, fs in os.walk(store.dir) for f in fs if f.endswith(".tmp")]
        print(json.dumps({"ok": ok, "stats": store.stats(), "tmp": tmp}), flush=True)
    elif mode == "writer":
        gen0, step, seconds = int(argv[2]), int(argv[3]), float(argv[4])
        store, pool = open_store(root)
        gen, end, n = gen0, time.monotonic() + seconds, 0
        while time.monotonic() < end:
            n += sum(write_gen(store, pool, gen))
            gen += step
        print(json.dumps({"written": n, "errors": store.stats()["errors"]}), flush=True)
    elif mode == "reader":
        seconds = float(argv[2])
        store, pool = open_store(root)
        end = time.monotonic() + seconds
        hits = wrong = 0
        gens: set[int] = set()
        while time.monotonic() < end:
            got = store.batch_get(keys(), list(range(NUM_KEYS, 2 * NUM_KEYS)))
            for i, ok in enumerate(got):
                if ok:
                    hits += 1
                    gen = check_page(pool.page_bytes_view(NUM_KEYS + i), i)
                    if gen is None:
                        wrong += 1
                    else:
                        gens.add(gen)
        print(json.dumps({"hits": hits, "wrong": wrong, "generations": len(gens),
                          "stats": store.stats()}), flush=True)
    elif mode == "capacity":
        capacity_writer(root, int(argv[2]), float(argv[3]), int(argv[4]), int(argv[5]))
    else:
        raise SystemExit(f"unknown mode {mode}")


CAP_KEYS = 40        # keys per writer in ``capacity`` mode


def cap_key(writer: int, i: int) -> bytes:
    return f"cap-{writer}-{i}".encode()


def capacity_writer(root: str, capacity: int, seconds: float, writer: int, writers: int) -> None:
    """Write batches of this writer's keys (new generations) and read random keys of every
    writer, checking each hit bitwise, for ``seconds``; print what happened as JSON."""
    import random
    store, pool = open_store(root, capacity_bytes=capacity)
    rng = random.Random(writer)
    print("ready", flush=True)
    gen = written = hits = wrong = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        idx = rng.sample(range(CAP_KEYS), 4)
        for j, i in enumerate(idx):
            pool.page_bytes_view(j).copy_(page_content(writer * 1000 + i, gen))
        written += sum(store.batch_set([cap_key(writer, i) for i in idx], list(range(4))))
        gen += 1
        want = rng.sample([(w, i) for w in range(writers) for i in range(CAP_KEYS)], 4)
        got = store.batch_get([cap_key(w, i) for w, i in want], list(range(4, 8)))
        for j, ok in enumerate(got):
            if ok:
                hits += 1
                w, i = want[j]
                if check_page(pool.page_bytes_view(4 + j), w * 1000 + i) is None:
                    wrong += 1
    stats = store.stats()
    store.close()
    print(json.dumps({"written": written, "hits": hits, "wrong": wrong,
                      "errors": stats["errors"], "evictions": stats["evictions"]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
