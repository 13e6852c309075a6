"""What a 1 MiB page's write costs on tmpfs without the store around it: THREADS threads
write PAGES pages of PAGE_MIB MiB (from memory as large as the data) in runs of RUN pages
(one run a task, runs dealt to FILES sparse files round-robin), one mode at a time:
raw (one pwritev a run), crcN (the store's hot path: N checksum calls a page, each piece
checksummed just before it is queued, a pwritev once 8 MiB is pending), crc1 (one checksum
call a page). Fresh files each repetition. python3 write_paths.py DIR PAGE_MIB THREADS PAGES
RUN FILES"""
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from isal import isal_zlib

root, mib, threads, n, run, files = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
page = int(mib * (1 << 20))
data = bytearray(os.urandom(1 << 20)) * (n * page >> 20)
mv = memoryview(data)
crc = isal_zlib.crc32
PIECE = 8 << 20


def task(fds, r, calls):
    fd = fds[r % len(fds)]
    first = r * run
    off = (first // len(fds)) * page
    views = [mv[(first + j) * page:(first + j + 1) * page] for j in range(run)
             if first + j < n]
    pend, pb, at = [], 0, off
    for v in views:
        if calls:
            step = len(v) // calls
            value = 0
            for o in range(0, len(v), step):
                value = crc(v[o:o + step], value)
        pend.append(v)
        pb += len(v)
        if pb >= PIECE:
            os.pwritev(fd, pend, at)
            at, pend, pb = at + pb, [], 0
    if pend:
        os.pwritev(fd, pend, at)


for mode, calls in (("raw", 0), ("crc8", 8), ("crc1", 1), ("raw", 0), ("crc8", 8),
                    ("crc1", 1)):
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    fds = [os.open(f"{root}/f{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(files)]
    for fd in fds:
        os.ftruncate(fd, (n // files + run + 1) * page)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(task, [fds] * -(-n // run), range(-(-n // run)), [calls] * -(-n // run)))
    dt = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    print(f"{mode:5s} {mib:g} MiB x {n}, {threads} threads, runs of {run}, {files} files: "
          f"{n * page / dt / 1e9:.2f} GB/s ({dt / n * 1e6:.0f} us/page)", flush=True)
shutil.rmtree(root, ignore_errors=True)
