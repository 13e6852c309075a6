"""A separate process using the shm store, driven by test_shm_store.py (not a test module).

Every page written is ``page_content(key_index, generation)``: random bytes from a seed, with
the generation and key index in its first 16 bytes, so any reader can tell a complete page of
some generation from anything else.

    python shm_store_child.py CONFIG_JSON MODE [ARGS...]

modes: ``write GEN [FIRST COUNT]`` (write keys once), ``read`` (read every key once),
``loop-write SECONDS`` (write generation after generation), ``loop-read SECONDS`` (read and
check over and over), ``race KEY ID SECONDS`` (write one key with this process's own
generations and read it back), ``stall-write GEN`` / ``stall-read`` (stop half way through
copying a page, say ``stalled`` and sleep: the parent kills it there). Each prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores import shm_arena
from kvtier.l3_stores.shm import ShmStore
from kvtier.spec import KVSpec

#: 56 KiB + odd: not a multiple of 4 KiB (a slot is rounded up, a page is not).
SPEC = KVSpec.mha(num_layers=3, num_kv_heads=3, head_dim=40, page_size=41, dtype="bfloat16")
NUM_KEYS = 6
POOL_PAGES = 64


def key(i: int) -> bytes:
    return b"shm-child-key-" + i.to_bytes(8, "little") + b"." * 10


def keys(first: int = 0, count: int = NUM_KEYS) -> list[bytes]:
    return [key(i) for i in range(first, first + count)]


def page_content(key_index: int, gen: int, nbytes: int = SPEC.page_bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(key_index * 1_000_003 + gen)
    t = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=g)
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


def open_store(config: dict) -> tuple[ShmStore, HostKVPool]:
    pool = HostKVPool(SPEC, POOL_PAGES, allocator=MmapAllocator())
    store = ShmStore(config, spec=SPEC)
    store.attach(pool)
    return store, pool


def write(store: ShmStore, pool: HostKVPool, gen: int, first: int = 0,
          count: int = NUM_KEYS) -> list[bool]:
    for j in range(count):
        pool.page_bytes_view(j).copy_(page_content(first + j, gen))
    return store.batch_set(keys(first, count), list(range(count)))


def read(store: ShmStore, pool: HostKVPool, first: int = 0,
         count: int = NUM_KEYS) -> tuple[list[bool], list[int | None]]:
    """Hits, and for each hit the generation it holds (None: wrong bytes)."""
    dst = list(range(POOL_PAGES - count, POOL_PAGES))
    for p in dst:
        pool.page_bytes_view(p).fill_(0xA5)
    got = store.batch_get(keys(first, count), dst)
    gens = [check_page(pool.page_bytes_view(p), first + j) if ok else -1
            for j, (p, ok) in enumerate(zip(dst, got))]
    return got, gens


def _stall_half_way() -> None:
    """From now on, a copy moves half its bytes, then the process says so and sleeps."""
    real = shm_arena._memmove

    def stalling(dst: int, src: int, n: int) -> int:
        real(dst, src, n // 2)
        print("stalled", flush=True)
        time.sleep(3600)
        return dst
    shm_arena._memmove = stalling


def main() -> None:
    config, mode, args = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
    store, pool = open_store(config)
    out: dict = {"mode": mode}
    if mode == "write":
        gen = int(args[0])
        first, count = (int(args[1]), int(args[2])) if len(args) > 2 else (0, NUM_KEYS)
        out["ok"] = write(store, pool, gen, first, count)
    elif mode == "read":
        out["hits"], out["gens"] = read(store, pool)
    elif mode == "loop-write":
        end, gen = time.monotonic() + float(args[0]), 1
        print("started", flush=True)
        while time.monotonic() < end:
            write(store, pool, gen)
            gen += 1
        out["gens"] = gen
    elif mode == "loop-read":
        end, hits, bad = time.monotonic() + float(args[0]), 0, 0
        print("started", flush=True)
        while time.monotonic() < end:
            got, gens = read(store, pool)
            hits += sum(got)
            bad += sum(1 for ok, g in zip(got, gens) if ok and g is None)
        out.update(hits=hits, bad=bad)
    elif mode == "race":
        k, ident, seconds = int(args[0]), int(args[1]), float(args[2])
        end, n, hits, bad, gen = time.monotonic() + seconds, 0, 0, 0, ident << 32
        while time.monotonic() < end:
            gen += 1
            pool.page_bytes_view(0).copy_(page_content(k, gen))
            n += sum(store.batch_set([key(k)], [0]))
            got, gens = read(store, pool, k, 1)
            hits += got[0]
            bad += bool(got[0] and gens[0] is None)
        out.update(written=n, hits=hits, bad=bad)
    elif mode == "stall-write":
        for j in range(NUM_KEYS):
            pool.page_bytes_view(j).copy_(page_content(j, int(args[0])))
        _stall_half_way()
        store.batch_set(keys(), list(range(NUM_KEYS)))
    elif mode == "stall-read":
        _stall_half_way()
        store.batch_get(keys(), list(range(NUM_KEYS)))
    else:
        raise SystemExit(f"unknown mode {mode}")
    out["stats"] = {k: v for k, v in store.stats().items() if isinstance(v, (int, str))}
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
