"""The `file` store's batch_set (and batch_get) of pages of one size into a directory, timed
per repetition, at a chosen interpreter switch interval: what `kvtier bench store` times,
without its raw modes, to profile. python3 store_writes.py DIR PAGE_MIB THREADS PAGES
SWITCH_MS (0: CPython's 5 ms) [STORE_CONFIG_JSON] [VARIANT]; VARIANT ``nocrc`` replaces the
payload checksum by nothing, ``onegroup`` checksums each page in one call (one layer group),
``held`` calls ISA-L's CRC-32 holding the interpreter lock: what the checksum calls cost, not
store settings."""
import os
import shutil
import json
import sys
import time

import torch

from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import FileStore
from kvtier.spec import KVSpec

root, mib, threads, n, switch_ms = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), float(sys.argv[5])
extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
variant = sys.argv[7] if len(sys.argv) > 7 else ""
if variant == "nocrc":
    from kvtier.l3_stores.file import segment_reads
    segment_reads.SegmentReads._crc = lambda self: ((lambda b, v=0: v), 0)
elif variant == "held":          # ISA-L's CRC-32 called holding the interpreter lock
    import ctypes
    from isal import isal_zlib
    from kvtier.l3_stores.file import segment_reads
    _f = ctypes.PyDLL(isal_zlib.__file__).crc32_gzip_refl
    _f.restype, _f.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]

    def _held(b, value=0):
        return _f(value, ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b)), len(b))
    segment_reads.SegmentReads._crc = lambda self: (_held, 0)
elif variant == "onegroup":
    from kvtier.l3_stores.file import store as _store_mod
    _store_mod.group_ends = lambda layers, nbytes: [nbytes]
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
    st = FileStore({"root": root, "io_threads": threads, **extra}, spec=spec)
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
    print(f"{mib:g} MiB x {n}, {threads} threads, switch {switch_ms or 5:g} ms {extra or ''} "
          f"{variant}: set "
          f"{b / ts / 1e9:.2f} GB/s ({ts / n * 1e6:.0f} us/page), get {b / tg / 1e9:.2f} GB/s",
          flush=True)
    st.close()
shutil.rmtree(root, ignore_errors=True)
