"""A writer process for test_store_read_groups.py (not a test module): rewrites keys of a
`file` store with new generations while the test reads them layer group by layer group.

Every page written is ``page_content(key_index, gen)``: random bytes from a seed (never
zero), each layer starting with the generation and the key index, so a reader can tell which
generation any layer range it got belongs to, and check it bitwise.

    python store_groups_child.py ROOT FORMAT SECONDS [GROUP_BYTES]

GROUP_BYTES (default 0: 8 groups) sets the writer's split in layer groups.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import FileStore
from kvtier.spec import KVSpec

#: 13 layers (8 uneven groups), odd page size and rows.
SPEC = KVSpec.mha(num_layers=13, num_kv_heads=3, head_dim=40, page_size=7, dtype="bfloat16")
NUM_KEYS = 5
PER_LAYER = SPEC.page_bytes // SPEC.num_layers
CAPACITY = 4 << 20


def keys() -> list[bytes]:
    return [b"groups-child-key-%d" % i for i in range(NUM_KEYS)]


def page_content(key_index: int, gen: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(key_index * 1_000_003 + gen)
    t = torch.randint(1, 256, (SPEC.page_bytes,), dtype=torch.uint8, generator=g)
    head = torch.tensor(list(gen.to_bytes(8, "little") + key_index.to_bytes(8, "little")),
                        dtype=torch.uint8)
    for layer in range(SPEC.num_layers):
        t[layer * PER_LAYER:layer * PER_LAYER + 16] = head
    return t


def generation_at(data: torch.Tensor, offset: int) -> tuple[int, int]:
    """(generation, key index) a layer starting at ``offset`` of ``data`` says it is of."""
    head = bytes(data[offset:offset + 16].tolist())
    return int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")


def open_store(root: str, fmt: str, layout: str = "page_first", group_bytes: int = 0
               ) -> tuple[FileStore, HostKVPool]:
    pool = HostKVPool(SPEC, 2 * NUM_KEYS, layout=layout, allocator=MmapAllocator())
    store = FileStore({"root": root, "format": fmt, "io_threads": 2,
                       "capacity_bytes": CAPACITY, "remove_corrupted": False,
                       "group_bytes": group_bytes}, spec=SPEC)
    store.attach(pool)
    return store, pool


def write_gen(store: FileStore, pool: HostKVPool, gen: int) -> int:
    for i in range(NUM_KEYS):
        data = page_content(i, gen)
        off = 0
        for seg in pool.page_segments(i):
            seg.copy_(data[off:off + seg.numel()])
            off += seg.numel()
    return sum(store.batch_set(keys(), list(range(NUM_KEYS))))


def main(argv: list[str]) -> None:
    root, fmt, seconds = argv[0], argv[1], float(argv[2])
    store, pool = open_store(root, fmt, group_bytes=int(argv[3]) if len(argv) > 3 else 0)
    written = write_gen(store, pool, 0)
    print("ready", flush=True)
    gen = 1
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        written += write_gen(store, pool, gen)
        gen += 1
        # mostly back to back; now and then a pause in which the reader gets whole pages
        time.sleep(0.05 if gen % 8 == 0 else 0.002)
    print(json.dumps({"generations": gen, "written": written,
                      "errors": store.stats()["errors"]}), flush=True)
    store.close()
    pool.close()


if __name__ == "__main__":
    main(sys.argv[1:])
