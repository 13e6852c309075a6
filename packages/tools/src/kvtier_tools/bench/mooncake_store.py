"""Mooncake store throughput over loopback, next to the loopback TCP ceiling and the file store.

The run starts its own ``mooncake_master`` (from the wheel, bound to 127.0.0.1) unless
``--master`` names one. With ``--segment remote`` (default) a second process contributes the
pool's only memory segment, so every page crosses TCP between processes, as between two
servers; with ``--segment local`` this process holds it. For each page size, alternating
``--repeat`` times (medians reported):

* the reference: with a remote segment, ``--streams`` TCP connections over 127.0.0.1
  between two processes, 8 MiB per ``sendall`` / ``recv_into`` (both directions), the path
  Mooncake's TCP transport takes; with a local one, a memcpy of the same bytes;
* ``batch_set`` then ``batch_get`` of the same pages through the ``mooncake`` store;
* ``batch_set`` (+ ``sync``) and ``batch_get`` (page cache dropped) through the ``file`` store
  in a temporary directory, for comparison.

Every page read back is compared bitwise with what was written (not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.report import parse_size, progress, table
from kvtier.spec import KVSpec

CHUNK = 8 << 20


#: No cache is built here (it builds mooncake and file stores from its own flags):
#: `kvtier --config FILE` says the file does not apply (`kvtier.cli`).
BUILDS_CACHE = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-sizes", default="256K,1M,4M,8M", help="comma-separated page sizes")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write every figure (medians per page size and op) as JSON")
    p.add_argument("--total", default="512M", help="bytes moved per measurement")
    p.add_argument("--batch", type=int, default=32, help="pages per batch_set/batch_get call")
    p.add_argument("--repeat", type=int, default=3, help="alternating repetitions (median)")
    p.add_argument("--segment", choices=["remote", "local"], default="remote",
                   help="who holds the pool's memory: another process (default) or this one")
    p.add_argument("--master", default=None,
                   help="host:port of a running mooncake_master (default: start one on "
                        "127.0.0.1)")
    p.add_argument("--streams", type=int, default=4,
                   help="parallel TCP streams of the loopback reference (default 4)")
    p.add_argument("--no-file", action="store_true", help="skip the file store comparison")


def _label(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _spec_for(page_bytes: int) -> KVSpec:
    """A 32-layer bf16 MHA geometry (8 KV heads x 128) whose pages are ``page_bytes``."""
    per_token = 32 * 2 * 8 * 128 * 2
    if page_bytes % per_token == 0:
        return KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128,
                          page_size=page_bytes // per_token)
    return KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=page_bytes // 4, page_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_master() -> tuple[subprocess.Popen, str]:
    import mooncake
    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    port, metrics = _free_port(), _free_port()
    proc = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
                             "--enable_http_metadata_server=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mooncake_master did not start")


_HOLD = """
import sys
from kvtier.l3_stores.mooncake import MooncakeStore
from kvtier.spec import KVSpec
s = MooncakeStore({"master_address": sys.argv[1], "global_segment_size": int(sys.argv[2]),
                   "namespace": "bench-holder"}, spec=KVSpec.mha(num_layers=1, num_kv_heads=1,
                   head_dim=8, page_size=1))
print("ready", flush=True)
sys.stdin.read()
"""

_SINK = """
import socket, sys, threading
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(64)
print(s.getsockname()[1], flush=True)

def serve(c):
    buf = bytearray(8 << 20); view = memoryview(buf)
    while True:
        head = c.recv(16)
        if not head:
            return
        op, n = head[:1], int(head[1:])
        if op == b"w":                    # receive n bytes, then ack
            got = 0
            while got < n:
                got += c.recv_into(view[:min(len(buf), n - got)])
            c.sendall(b"k")
        else:                             # send n bytes
            sent = 0
            while sent < n:
                m = min(len(buf), n - sent)
                c.sendall(view[:m])
                sent += m

while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


class _Loopback:
    """The reference: ``streams`` TCP connections between this process and another over
    127.0.0.1, moving 8 MiB per system call (threads; the GIL is released in the calls)."""

    def __init__(self, streams: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE,
                                     text=True)
        port = int(self.proc.stdout.readline())
        self.socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        self.buf = bytearray(os.urandom(1 << 20) * 8)

    def _one(self, sock: socket.socket, op: bytes, n: int) -> None:
        view = memoryview(bytearray(self.buf))
        sock.sendall(op + str(n).encode().rjust(15))
        done = 0
        while done < n:
            m = min(len(view), n - done)
            if op == b"w":
                sock.sendall(view[:m])
                done += m
            else:
                done += sock.recv_into(view[:m])
        if op == b"w":
            assert sock.recv(1) == b"k"

    def _run(self, op: bytes, total: int) -> float:
        share = total // len(self.socks)
        threads = [threading.Thread(target=self._one, args=(sk, op, share))
                   for sk in self.socks]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return share * len(self.socks) / (time.perf_counter() - t0) / 1e9

    def send(self, total: int) -> float:
        return self._run(b"w", total)

    def recv(self, total: int) -> float:
        return self._run(b"r", total)

    def close(self) -> None:
        for sk in self.socks:
            sk.close()
        self.proc.kill()
        self.proc.wait(10)


def _memcpy(src: torch.Tensor, dst: torch.Tensor) -> float:
    dst.copy_(src)                           # fault the pages in first
    t0 = time.perf_counter()
    dst.copy_(src)
    return src.numel() / (time.perf_counter() - t0) / 1e9


def _drop_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed_batches(fn, keys, pages, batch: int) -> tuple[float, list[bool]]:
    out: list[bool] = []
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        out += fn(keys[i:i + batch], pages[i:i + batch])
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> int:
    from kvtier.l3_stores.mooncake import MooncakeStore, close_idle_clients
    av = MooncakeStore.probe()
    if not av.ok:
        print(f"mooncake unavailable: {av.reason} ({av.hint})")
        return 2
    sizes = [parse_size(s, "--page-sizes") for s in args.page_sizes.split(",") if s.strip()]
    total = parse_size(args.total, "--total")
    master_proc, address = (None, args.master) if args.master else _start_master()
    holder = None
    segment = max(2 * total, 64 << 20)
    if args.segment == "remote":
        holder = subprocess.Popen([sys.executable, "-c", _HOLD, address, str(segment)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        while holder.stdout.readline().strip() != "ready":
            if holder.poll() is not None:
                raise RuntimeError("the segment holder process failed to start")
    ceiling = _Loopback(args.streams) if args.segment == "remote" else None
    work = tempfile.mkdtemp(prefix="kvtier-bench-mooncake-")
    results: dict[int, dict[str, list[float]]] = {ps: {} for ps in sizes}
    failures = 0
    try:
        for ps in sizes:
            spec = _spec_for(ps)
            n = max(1, total // spec.page_bytes)
            moved = n * spec.page_bytes
            pool = HostKVPool(spec, 2 * n, allocator=TorchPinnedAllocator())
            pool.raw[:moved].copy_(torch.randint(0, 256, (moved,), dtype=torch.uint8,
                                                 generator=torch.Generator().manual_seed(ps)))
            keys = [os.urandom(32) for _ in range(n)]
            src, dst = list(range(n)), list(range(n, 2 * n))
            store = MooncakeStore({"master_address": address, "namespace": "bench",
                                   "global_segment_size":
                                       0 if args.segment == "remote" else segment,
                                   "local_buffer_size": 16 << 20, "timeout_s": 60.0},
                                  spec=spec)
            store.attach(pool)
            r = results[ps]
            for _ in progress(range(args.repeat), desc=f"{_label(ps)} pages"):
                if args.segment == "remote":
                    r.setdefault("ref_w", []).append(ceiling.send(moved))
                    r.setdefault("ref_r", []).append(ceiling.recv(moved))
                else:
                    gbps = _memcpy(pool.raw[:moved], pool.raw[moved:2 * moved])
                    r.setdefault("ref_w", []).append(gbps)
                    r.setdefault("ref_r", []).append(gbps)
                store.clear()
                dt, ok = _timed_batches(store.batch_set, keys, src, args.batch)
                r.setdefault("mc_set", []).append(moved / dt / 1e9)
                pool.raw[moved:].fill_(0xA5)
                dt, got = _timed_batches(store.batch_get, keys, dst, args.batch)
                r.setdefault("mc_get", []).append(moved / dt / 1e9)
                if not (all(ok) and all(got) and torch.equal(pool.raw[:moved],
                                                             pool.raw[moved:])):
                    failures += 1
                if not args.no_file:
                    failures += _file_round(spec, pool, keys, src, dst, moved, work, args, r)
            store.clear()
            store.close()
            pool.close()
    finally:
        if ceiling is not None:
            ceiling.close()
        if holder is not None:
            holder.stdin.close()
            holder.wait(30)
        close_idle_clients(address)
        if master_proc is not None:
            master_proc.terminate()
            master_proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for ps in sizes:
        med = {k: statistics.median(v) for k, v in results[ps].items()}
        row = [_label(ps), f"{med['ref_w']:.2f}", f"{med['mc_set']:.2f}",
               f"{med['mc_set'] / med['ref_w']:.0%}", f"{med['ref_r']:.2f}",
               f"{med['mc_get']:.2f}", f"{med['mc_get'] / med['ref_r']:.0%}"]
        if not args.no_file:
            row += [f"{med['file_set']:.2f}", f"{med['file_get']:.2f}"]
        rows.append(row)
    ref = "TCP" if args.segment == "remote" else "memcpy"
    header = ["page", f"{ref} send" if ref == "TCP" else ref, "mooncake set", f"set/{ref}",
              f"{ref} recv" if ref == "TCP" else ref, "mooncake get", f"get/{ref}"]
    if not args.no_file:
        header += ["file set", "file get"]
    print(f"mooncake store over 127.0.0.1 ({args.segment} segment, master {address}; "
          f"{total / 2**20:g} MiB per measurement, batch={args.batch}, median of "
          f"{args.repeat}; GB/s = 1e9 bytes/s). Reference, measured in the same run: "
          + (f"TCP = {args.streams} loopback streams between two processes, 8 MiB per call"
             if ref == "TCP" else "memcpy = one torch copy_ of the same bytes in this process")
          + "; file = the file "
          f"store in {tempfile.gettempdir()} (set includes sync, get after dropping the page "
          "cache)")
    print(table(header, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"segment": args.segment, "reference": ref, "batch": args.batch,
                       "total_bytes": total, "repeat": args.repeat, "failures": failures,
                       "gbps": {str(ps): {k: statistics.median(v)
                                          for k, v in results[ps].items()} for ps in sizes}},
                      f, indent=2)
    if failures:
        print(f"ERROR: {failures} runs read back wrong or incomplete data")
        return 1
    print("every page read back bitwise identical")
    return 0


def _file_round(spec, pool, keys, src, dst, moved, work, args, r) -> int:
    from kvtier.l3_stores.file import FileStore
    root = os.path.join(work, "file")
    store = FileStore({"root": root}, spec=spec)
    try:
        store.attach(pool)
        t0 = time.perf_counter()
        _, ok = _timed_batches(store.batch_set, keys, src, args.batch)
        os.sync()
        r.setdefault("file_set", []).append(moved / (time.perf_counter() - t0) / 1e9)
        _drop_cache(root)
        pool.raw[moved:].fill_(0x5A)
        dt, got = _timed_batches(store.batch_get, keys, dst, args.batch)
        r.setdefault("file_get", []).append(moved / dt / 1e9)
        bad = not (all(ok) and all(got) and torch.equal(pool.raw[:moved], pool.raw[moved:]))
        store.clear()
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return int(bad)
