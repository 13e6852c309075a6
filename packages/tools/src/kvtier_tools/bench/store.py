"""File store throughput against the same disk's raw sequential throughput, in one run.

For each page size the run alternates (``--repeat`` times, medians reported):

* raw write: 8 MiB pieces written sequentially, then ``fsync``: by one thread into one file,
  and by N threads into one file (pieces dealt round-robin) and into a file each, for N =
  ``--threads`` and N = ``--threads`` x ``--callers`` (as many I/O calls in flight as the
  store may have); the best of these is the ceiling. Each call moves its own part of a buffer
  as large as the data, as the store's calls move their own host pages; a raw mode that
  reuses one 8 MiB buffer for every call ("1 hot": a cache-resident buffer, which no store
  of real size has) is shown but not counted (on a virtual disk it has run 5-20% faster
  than the same calls spread over the data, and in other runs no faster);
* store ``batch_set`` of the same number of bytes as pages, then ``syncfs`` (both are timed
  until the data is on the disk), called as the controller calls it: ``--batch`` pages per
  call (``CacheConfig.l3_batch_pages``) from ``--callers`` threads at once
  (``CacheConfig.l3_io_threads``);
* raw read: the file read back the same ways (after ``POSIX_FADV_DONTNEED`` when cached);
* store ``batch_get`` of every page, called the same way (after ``POSIX_FADV_DONTNEED`` on
  every object when cached).

By default both sides use ``O_DIRECT`` (no page cache at all; the store's own default where
the filesystem allows); ``--cache fadvise`` measures the page-cache path instead. Every
page read back is compared bitwise with what was written (not timed). The single-thread cost
of the payload checksum is measured in the same run, since the store computes it on both paths.
``--json`` keeps every figure (and the machine it ran on), ``--plot`` draws store and raw GB/s
against page size (``--replot`` redraws from a JSON file).

No cache is built: of a config file's ``[cache]`` table (``kvtier --config FILE``) only
``l3_batch_pages`` and ``l3_io_threads`` apply, as the defaults of ``--batch`` and
``--callers``; the run says which of its other settings it leaves unused.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import platform
import ctypes.util
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvtier.cache.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.host_allocators.mmap import MmapAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.file import _CHECKSUMS, DIRECT_ALIGN, TRAILER_BYTES, FileStore, checksum_impl
from kvtier.l3_stores.file._files import medium
from kvtier.l3_stores.file.store import auto_io_threads
from kvtier.report import parse_size, progress, table
from kvtier.spec import KVSpec

CHUNK = 8 << 20
_BATCH, _CALLERS = (CacheConfig.__dataclass_fields__[f].default
                    for f in ("l3_batch_pages", "l3_io_threads"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None,
                   help="directory on the disk to measure (default: a new temporary directory)")
    p.add_argument("--page-sizes", default="256K,1M,4M,8M", help="comma-separated page sizes")
    p.add_argument("--total", default="1G", help="bytes moved per measurement (default 1G)")
    p.add_argument("--batch", type=int, default=None,
                   help="pages per batch_set/batch_get call (default: the controller's "
                        f"l3_batch_pages: the config file's, else {_BATCH})")
    p.add_argument("--callers", type=int, default=None,
                   help="threads calling the store at once (default: the controller's "
                        f"l3_io_threads: the config file's, else {_CALLERS})")
    p.add_argument("--threads", type=int, default=None,
                   help="file store io_threads (default: the store's for the directory: one "
                        "per CPU in memory, 4 to 16; 4 on a disk)")
    p.add_argument("--io-depth", type=int, default=0,
                   help="file store io_depth: read/write calls in flight in the store "
                        "(0: one per I/O thread)")
    p.add_argument("--io-call", default="8M",
                   help="file store io_call_bytes (least bytes per I/O call)")
    p.add_argument("--group-bytes", default=None,
                   help="file store group_bytes: least bytes of a layer group, one checksum "
                        "call per group and page written (default: the store's, 1M; 0: "
                        "min(8, layers) groups whatever the page size)")
    p.add_argument("--raw-pieces", default="",
                   help="comma-separated call sizes of extra single-stream raw modes (the "
                        "ceiling is the best of every mode; a mode at the store's call size "
                        "shows what the disk gives calls of that size)")
    p.add_argument("--cache", choices=["direct", "fadvise"], default="direct",
                   help="page cache treatment for both sides: bypass it with O_DIRECT (the "
                        "store's default where it can), or use it and drop it with fadvise")
    p.add_argument("--checksum", choices=["crc32", "adler32"], default="crc32")
    p.add_argument("--format", choices=["segments", "objects"], default="segments",
                   help="file store format (default segments)")
    p.add_argument("--repeat", type=int, default=3, help="alternating repetitions (median)")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--plot", help="save a PNG of GB/s vs page size here")
    p.add_argument("--replot", help="read results from this JSON instead of running")
    p.add_argument("--store", choices=["file", "shm"], default="file",
                   help="file: the file store against the disk (the default); shm: the shm "
                        "store against memcpy between the same host pool and a tmpfs mapping")


# --------------------------------------------------------------------------------------------
def _syncfs(path: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _medium_of(directory: str) -> str:
    """What ``directory`` lives on, as the file store sees it ("memory", "disk", ...)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return medium(fd)
    finally:
        os.close(fd)


def _pause(where: str) -> None:
    """The same untimed pause between every write phase and the read after it (the disk
    behind a VM may still be flushing what was just written). None on a filesystem in memory
    (tmpfs, ramfs), which has nothing to flush."""
    if _medium_of(where) != "memory":
        _syncfs(where)
        time.sleep(1.0)


def _drop(path: str) -> None:
    """Write back and drop one file's cached pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drop_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _drop(os.path.join(dirpath, f))


def _plan(total: int, streams: int, files: bool, piece: int = CHUNK
          ) -> list[list[tuple[int, int, int, int]]]:
    """Per stream, its (file index, offset in that file, length, offset in the data) pieces:
    one file with the pieces dealt round-robin to the streams, or one file per stream written
    from its start."""
    plan: list[list[tuple[int, int, int, int]]] = [[] for _ in range(streams)]
    ends = [0] * streams
    for i, off in enumerate(range(0, total, piece)):
        n, s = min(piece, total - off), i % streams
        if files:
            plan[s].append((s, ends[s], n, off))
            ends[s] += n
        else:
            plan[s].append((0, off, n, off))
    return plan


def _parallel(fn, streams: int) -> None:
    if streams == 1:
        fn(0)
        return
    with ThreadPoolExecutor(streams) as ex:
        list(ex.map(fn, range(streams)))


def _op(fn, keys: list[bytes], pages: list[int], c: slice) -> list[bool]:
    return fn(keys[c], pages[c])


def _calls(fn, calls: list[slice], callers: int) -> list[bool]:
    """Every call's results in order, made by ``callers`` threads at once."""
    if callers <= 1:
        return [v for c in calls for v in fn(c)]
    with ThreadPoolExecutor(callers) as ex:
        return [v for r in ex.map(fn, calls) for v in r]


def _raw_paths(path: str, streams: int, files: bool) -> list[str]:
    return [f"{path}.{s}" for s in range(streams)] if files else [path]


def _tail(page: int) -> int:
    """Bytes after a page in its segments-format slot: the trailer, padded to the alignment."""
    return -(-(page + TRAILER_BYTES) // DIRECT_ALIGN) * DIRECT_ALIGN - page


@functools.lru_cache(maxsize=None)
def _tail_buf(nbytes: int) -> mmap.mmap:
    """One page-aligned (O_DIRECT-fit) tail buffer per size, shared by every call."""
    return mmap.mmap(-1, nbytes)


def _slot_plan(total: int, streams: int, files: bool, piece: int, slot_page: int
               ) -> tuple[int, list[list[tuple[int, int, int, int]]]]:
    """``total`` payload bytes laid out as the segments format lays them out when
    ``slot_page`` is set (each page followed by its trailer's tail), in calls of as many whole
    slots as fit ``piece``; the file's bytes and the plan."""
    if not slot_page:
        return total, _plan(total, streams, files, piece)
    slot = slot_page + _tail(slot_page)
    size = total // slot_page * slot
    return size, _plan(size, streams, files, max(1, piece // slot) * slot)


def _iov(view: memoryview, n: int, slot_page: int) -> list[memoryview]:
    """The iovecs of one ``n``-byte call: one buffer, or (slots) each page's bytes then its
    tail, as the store's ``preadv``/``pwritev`` calls pass them."""
    if not slot_page:
        return [view[:n]]
    out: list[memoryview] = []
    tail = memoryview(_tail_buf(_tail(slot_page)))
    for j in range(n // (slot_page + len(tail))):
        out += [view[j * slot_page:(j + 1) * slot_page], tail]
    return out


def _source(data: mmap.mmap, s: int, src: int, piece: int, slot_page: int, hot: bool
            ) -> memoryview:
    """Where one call's payload lives in memory: at its own place in ``data`` (a buffer as
    large as the data, as the store's pages are), or with ``hot``, in stream ``s``'s one
    ``piece``-sized region reused by every call (a destination that stays in the CPU's
    caches, which no store of real size has)."""
    if hot:
        src = s * piece
    elif slot_page:
        src = src // (slot_page + _tail(slot_page)) * slot_page
    return memoryview(data)[src:]


def raw_write(path: str, total: int, data: mmap.mmap, direct: bool,
              streams: int = 1, files: bool = False, piece: int = CHUNK,
              slot_page: int = 0, hot: bool = False) -> float:
    """GB/s of writing ``total`` bytes of ``data`` sequentially in ``piece``-byte calls by
    ``streams`` threads (into one file, or one file each), fsync included; with ``slot_page``,
    in the segments format's slot layout (payload bytes counted); with ``hot``, every call of
    a stream from the same ``piece`` bytes."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    _, plan = _slot_plan(total, streams, files, piece, slot_page)
    t0 = time.perf_counter()
    fds = [os.open(p, flags, 0o600) for p in _raw_paths(path, streams, files)]
    try:
        def stream(s: int) -> None:
            for f, off, n, src in plan[s]:
                view = _source(data, s, src, piece, slot_page, hot)
                done = 0
                if slot_page:
                    done = os.pwritev(fds[f], _iov(view, n, slot_page), off)
                while done < n:
                    done += os.pwrite(fds[f], view[done:n], off + done)
        _parallel(stream, streams)
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def raw_read(path: str, total: int, data: mmap.mmap, direct: bool,
             streams: int = 1, files: bool = False, piece: int = CHUNK,
             slot_page: int = 0, hot: bool = False) -> float:
    """GB/s of reading back what ``raw_write`` wrote (cache dropped or bypassed) into
    ``data``, each call to its own place (or with ``hot``, to its stream's one region)."""
    paths = _raw_paths(path, streams, files)
    if not direct:
        for p in paths:
            _drop(p)
    _, plan = _slot_plan(total, streams, files, piece, slot_page)
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in paths]
    try:
        def stream(s: int) -> None:
            for f, off, n, src in plan[s]:
                view = _source(data, s, src, piece, slot_page, hot)
                if os.preadv(fds[f], _iov(view, n, slot_page), off) != n:
                    raise OSError(f"{paths[f]}: short read at {off}")
        _parallel(stream, streams)
    finally:
        for fd in fds:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def _remove_raw(path: str, streams: int, files: bool) -> None:
    for p in _raw_paths(path, streams, files):
        os.unlink(p)
    _pause(os.path.dirname(path))


def _spec_for(page_bytes: int) -> KVSpec:
    """A 32-layer bf16 MHA geometry (8 KV heads x 128) with pages of ``page_bytes``."""
    row = 8 * 128 * 2
    per_token = 32 * 2 * row
    if page_bytes % per_token == 0:
        return KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128,
                          page_size=page_bytes // per_token)
    return KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=page_bytes // 4, page_size=1,
                      dtype="bfloat16")


def checksum_gbps(kind: str) -> tuple[float, str]:
    """Single-thread GB/s of the checksum implementation the store uses, and its provider."""
    fn, provider = checksum_impl(_CHECKSUMS[kind][0])
    data = memoryview(os.urandom(1 << 20) * 16)
    t0 = time.perf_counter()
    for _ in range(8):
        fn(data)
    return 8 * len(data) / (time.perf_counter() - t0) / 1e9, provider


def _env(base: str) -> dict[str, Any]:
    """Where the run happened: CPU, kernel, filesystem and device of the directory."""
    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc)
                           .strftime("%Y-%m-%d %H:%M UTC"), "kernel": platform.release(),
                           "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                               if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        best = ("", "", "")
        real = os.path.realpath(base)
        with open("/proc/self/mounts") as f:
            for ln in f:
                dev, mnt, fstype = ln.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and \
                        len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
        env["device"], env["mount"], env["fs"] = best
    except OSError:
        pass
    return env


def _label(ps: int) -> str:
    return f"{ps / (1 << 20):g} MiB" if ps >= 1 << 20 else f"{ps >> 10} KiB"


def report(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in data["results"]:
        rows.append([_label(r["page_bytes"]),
                     " / ".join(f"{v:.3f}" for v in r["raw_write"].values()),
                     f"{r['set']:.3f}", f"{r['set_ratio']:.0%}",
                     " / ".join(f"{v:.3f}" for v in r["raw_read"].values()),
                     f"{r['get']:.3f}", f"{r['get_ratio']:.0%}"])
    return rows


def _raw_modes(data: dict[str, Any]) -> list[str]:
    """Every raw mode of a record (the oldest records name them only in their results)."""
    return data.get("raw_modes") or list(data["results"][0]["raw_write"])


def _vs_median(result: dict[str, Any], op: str, modes: list[str]) -> float:
    """One page size's store figure (``op``: set or get) against the median of the raw
    ``modes``: how much of a gap to the best raw figure is the disk's own spread."""
    raw = result["raw_write" if op == "set" else "raw_read"]
    return result[op] / statistics.median(raw[m] for m in modes)


def _ceiling_modes(data: dict[str, Any]) -> list[str]:
    """The raw modes the ceiling is the best of (every mode, in records made before the hot
    mode existed)."""
    return data.get("ceiling_modes", _raw_modes(data))


def plot(data: dict[str, Any], path: str) -> None:
    """Store and raw-ceiling GB/s vs page size, writes and reads side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = sorted(data["results"], key=lambda r: r["page_bytes"])
    xs = [r["page_bytes"] for r in res]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (op, raw, title) in zip(axes, (("set", "raw_write", "batch_set vs raw write"),
                                           ("get", "raw_read", "batch_get vs raw read"))):
        modes = _ceiling_modes(data)
        ceil = [max(r[raw][m] for m in modes) for r in res]
        ax.plot(xs, ceil, "k--", marker="s", ms=4, lw=1, label="raw ceiling (best of "
                + " / ".join(modes) + ")")
        if "1 hot" in res[0][raw]:
            ax.plot(xs, [r[raw]["1 hot"] for r in res], color="gray", marker="x", ms=4,
                    lw=0.8, label="raw, one reused 8 MiB buffer (not a ceiling)")
        ax.plot(xs, [0.9 * c for c in ceil], color="gray", ls=":", lw=1, label="90% of raw")
        ax.plot(xs, [r[op] for r in res], marker="o", ms=5, lw=1.5, label=f"file {op}")
        for x, r in zip(xs, res):
            ax.annotate(f"{r[op + '_ratio']:.0%}", (x, r[op]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [_label(x) for x in xs])
        ax.set_xlabel("page bytes")
        ax.set_ylabel("GB/s (1e9 bytes/s)")
        ax.set_ylim(0, max(max(ceil), max(r[op] for r in res)) * 1.15)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="lower right")
    env = data.get("env", {})
    fig.suptitle(f"kvtier file store vs the same disk ({data.get('cache', '')}), "
                 f"{env.get('device', '')} {env.get('fs', '')}, {env.get('cpu', '')}, "
                 f"{env.get('date', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _print(data: dict[str, Any], failures: int) -> None:
    how = " / ".join(_raw_modes(data))
    calls = "" if data.get("io_call_bytes") is None else \
        f", calls of {data['io_call_bytes'] >> 10} KiB" + (
            " or more" if not data.get("io_depth") else f", io_depth={data['io_depth']}")
    groups = "" if data.get("group_bytes") is None else \
        f", group_bytes={data['group_bytes']}"
    print(f"file store ({data.get('format', 'objects')} format) vs raw sequential I/O in "
          f"{data['dir']} ({data['cache']}; "
          f"{data['total'] / 2**30:g} GiB per measurement, median of {data['repeat']}; "
          f"io_threads={data['threads']}, batch={data['batch']}, "
          f"callers={data.get('callers', 1)}{calls}{groups}; GB/s = 1e9 bytes/s)")
    print(table(["page", f"raw write ({how})", "batch_set", "set/raw", f"raw read ({how})",
                 "batch_get", "get/raw"], report(data)))
    ck = data["checksum"]
    modes = _ceiling_modes(data)
    spread = [f"{_label(r['page_bytes'])} {_vs_median(r, 'set', modes):.0%} / "
              f"{_vs_median(r, 'get', modes):.0%}" for r in data["results"]]
    print("against the median of the same raw modes (set / get): " + ", ".join(spread))
    hot = [m for m in _raw_modes(data) if m not in modes]
    print("ratios are against the best raw figure"
          + (f" except {' / '.join(hot)} (one reused buffer, cache-resident: no store's "
             "pages are)" if hot else "") + "; "
          f"checksum {ck['kind']} via {ck['provider']}: {ck['gbps']:.2f} GB/s on one thread")


def _controller_defaults(args: argparse.Namespace) -> None:
    """``--batch`` and ``--callers`` not given: the config file's l3_batch_pages and
    l3_io_threads (``kvtier --config FILE``), else the controller's defaults. The file's
    values are checked; the settings it has that do not apply here are named on stderr."""
    import sys
    file = CacheConfig.file_settings()
    if file:
        CacheConfig.from_dict({"model_id": "bench-store", **file})
        unused = sorted(set(file) - {"l3_batch_pages", "l3_io_threads"})
        if unused:
            print(f"kvtier bench store: note: it builds no cache; of the config file only "
                  f"l3_batch_pages and l3_io_threads apply, not {', '.join(unused)}",
                  file=sys.stderr)
    if args.batch is None:
        args.batch = file.get("l3_batch_pages", _BATCH)
    if args.callers is None:
        args.callers = file.get("l3_io_threads", _CALLERS)


def run(args: argparse.Namespace) -> int:
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not data.get("results") or \
                not all("raw_write" in r for r in data["results"]):
            raise ConfigError(f"--replot: {args.replot} is not a `kvtier bench store --json` "
                              "record (no results with raw figures)", key="replot",
                              value=args.replot)
        _print(data, 0)
        if args.plot:
            plot(data, args.plot)
        return 0
    _controller_defaults(args)
    for flag, low in (("batch", 1), ("callers", 1), ("threads", 1), ("repeat", 1),
                      ("io_depth", 0)):
        if getattr(args, flag) is not None and getattr(args, flag) < low:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= {low}, got "
                              f"{getattr(args, flag)}", key=flag, value=getattr(args, flag))
    sizes = [parse_size(s, "--page-sizes") for s in args.page_sizes.split(",") if s.strip()]
    total = parse_size(args.total, "--total")
    if args.store == "shm":
        return run_shm(args, sizes, total)
    io_call = parse_size(args.io_call, "--io-call")
    group = {} if args.group_bytes is None else {
        "group_bytes": 0 if str(args.group_bytes).strip() == "0"
        else parse_size(args.group_bytes, "--group-bytes")}
    pieces = list(dict.fromkeys(parse_size(x, "--raw-pieces")
                                for x in args.raw_pieces.split(",") if x.strip()))
    for piece in pieces:
        if piece < 4096 or piece % 4096:
            raise ConfigError(f"--raw-pieces: {piece} is not a positive multiple of 4096",
                              key="raw_pieces", value=piece)
    direct = args.cache == "direct"
    own_dir = args.dir is None
    base = tempfile.mkdtemp(prefix="kvtier-bench-store-") if own_dir else args.dir
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=base)
    if args.threads is None:              # the store's own default for this directory
        args.threads = auto_io_threads(_medium_of(work))
    # raw ceilings: one stream; N streams over one file; N streams, a file each. Every mode
    # moves the data from/to memory as large as the data, as the store does; "1 hot" reuses
    # one 8 MiB buffer (cache-resident) and is shown, not counted in the ceiling.
    modes = [("1", 1, False, CHUNK, False, False)]
    for k in sorted({args.threads, args.threads * args.callers} - {1}):
        modes += [(f"{k}", k, False, CHUNK, False, False),
                  (f"{k} files", k, True, CHUNK, False, False)]
    for piece in pieces:
        modes.append((f"1 @{_label(piece)}", 1, False, piece, False, False))
    if args.format == "segments":
        # the disk's answer to the store's own iovec pattern (its calls, without the store)
        modes.append((f"1 slots @{_label(io_call)}", 1, False, io_call, True, False))
    modes.append(("1 hot", 1, False, CHUNK, False, True))
    need = max(total, max(m[1] * m[3] for m in modes))
    data_buf = mmap.mmap(-1, need)               # page-aligned: fit for O_DIRECT
    torch.frombuffer(data_buf, dtype=torch.uint8).random_(
        0, 256, generator=torch.Generator().manual_seed(need))
    failures = 0
    steps = [(ps, r) for ps in sizes for r in range(args.repeat)]
    results: dict[int, dict[str, list[float]]] = {ps: {} for ps in sizes}
    bar = progress(steps, desc=f"store vs raw ({args.cache})")
    pools: dict[int, tuple[KVSpec, HostKVPool, list[bytes]]] = {}
    try:
        for ps, _rep in bar:
            if ps not in pools:
                for old in list(pools):
                    pools.pop(old)[1].close()
                spec = _spec_for(ps)
                n = max(1, total // spec.page_bytes)
                pool = HostKVPool(spec, 2 * n, allocator=MmapAllocator())
                g = torch.Generator().manual_seed(ps)
                pool.raw[: n * spec.page_bytes].copy_(
                    torch.randint(0, 256, (n * spec.page_bytes,), dtype=torch.uint8,
                                  generator=g))
                pools[ps] = (spec, pool, [os.urandom(32) for _ in range(n)])
            spec, pool, keys = pools[ps]
            n = len(keys)
            moved = n * spec.page_bytes
            r = results[ps]
            raw_path = os.path.join(work, "raw.bin")
            for label, k, files, piece, slots, hot in modes:
                sp = spec.page_bytes if slots else 0
                r.setdefault(f"raw_w{label}", []).append(
                    raw_write(raw_path, moved, data_buf, direct, k, files, piece, sp, hot))
                _pause(work)
                r.setdefault(f"raw_r{label}", []).append(
                    raw_read(raw_path, moved, data_buf, direct, k, files, piece, sp, hot))
                _remove_raw(raw_path, k, files)

            root = os.path.join(work, "store")
            store = FileStore({"root": root, "io_threads": args.threads,
                               "io_depth": args.io_depth, "io_call_bytes": io_call,
                               "o_direct": "on" if direct else "off",
                               "checksum": args.checksum, "format": args.format, **group},
                              spec=spec)
            store.attach(pool)
            src, dst = list(range(n)), list(range(n, 2 * n))
            calls = [slice(i, i + args.batch) for i in range(0, n, args.batch)]
            t0 = time.perf_counter()
            ok = _calls(functools.partial(_op, store.batch_set, keys, src), calls,
                        args.callers)
            _syncfs(root)
            r.setdefault("set", []).append(moved / (time.perf_counter() - t0) / 1e9)
            if not direct:
                _drop_tree(store.dir)
            pool.raw[n * spec.page_bytes:].fill_(0xA5)
            _pause(work)
            t0 = time.perf_counter()
            got = _calls(functools.partial(_op, store.batch_get, keys, dst), calls,
                         args.callers)
            r.setdefault("get", []).append(moved / (time.perf_counter() - t0) / 1e9)
            same = torch.equal(pool.raw[: moved], pool.raw[moved: 2 * moved])
            if not (all(ok) and all(got) and same):
                failures += 1
            r["o_direct"] = [float(bool(store.stats()["o_direct"]))]
            store.clear()
            store.close()
            shutil.rmtree(root, ignore_errors=True)
            _pause(work)
    finally:
        for _, pool, _ in pools.values():
            pool.close()
        shutil.rmtree(work if not own_dir else base, ignore_errors=True)
    labels = [m[0] for m in modes]
    ceiling = [m[0] for m in modes if not m[5]]
    speed, provider = checksum_gbps(args.checksum)
    data = {
        "dir": base, "cache": args.cache, "format": args.format, "total": total,
        "repeat": args.repeat,
        "threads": args.threads, "batch": args.batch, "callers": args.callers,
        "io_depth": args.io_depth, "io_call_bytes": io_call,
        "group_bytes": group.get("group_bytes", FileStore.Config.group_bytes),
        "raw_modes": labels, "ceiling_modes": ceiling,
        "checksum": {"kind": args.checksum, "provider": provider, "gbps": speed},
        "env": _env(base), "failures": failures, "results": []}
    for ps in sizes:
        med = {k: statistics.median(v) for k, v in results[ps].items()}
        raw_w = max(med[f"raw_w{k}"] for k in ceiling)      # the ceiling: best raw figure
        raw_r = max(med[f"raw_r{k}"] for k in ceiling)
        data["results"].append({
            "page_bytes": ps, "set": med["set"], "get": med["get"],
            "raw_write": {k: med[f"raw_w{k}"] for k in labels},
            "raw_read": {k: med[f"raw_r{k}"] for k in labels},
            "set_ratio": med["set"] / raw_w, "get_ratio": med["get"] / raw_r,
            "o_direct": bool(med.get("o_direct", 0)),
            "samples": {k: v for k, v in results[ps].items() if k != "o_direct"}})
        res = data["results"][-1]
        for op in ("set", "get"):
            res[f"{op}_ratio_median_mode"] = _vs_median(res, op, ceiling)
    _print(data, failures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.plot:
        plot(data, args.plot)
    if failures:
        print(f"ERROR: {failures} runs read back wrong or incomplete data")
        return 1
    print("every page read back bitwise identical")
    return 0


def _shm_one(args: argparse.Namespace, root: str, ps: int, total: int) -> dict[str, Any]:
    """One page size of ``--store shm``: medians (GB/s) and whether every page read back."""
    from kvtier.l3_stores.shm import ShmStore
    spec = _spec_for(ps)
    n, pb = max(1, total // spec.page_bytes), spec.page_bytes
    pool = HostKVPool(spec, 2 * n, allocator=MmapAllocator())
    store = ShmStore({"root": root, "name": f"kvtier-bench-{os.getpid()}",
                      "capacity_pages": -(-n // 16) * 16, "remove_when_unused": True},
                     spec=spec)
    raw_path = os.path.join(root, f".kvtier-bench-raw-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    r: dict[str, list[float]] = {}
    good = True
    try:
        os.unlink(raw_path)
        os.posix_fallocate(fd, 0, n * pb)
        raw = mmap.mmap(fd, n * pb, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        anchor: Any = ctypes.c_char.from_buffer(raw)
        raw_base, base = ctypes.addressof(anchor), pool.raw.data_ptr()
        store.attach(pool)
        pool.raw[: n * pb].copy_(torch.randint(0, 256, (n * pb,), dtype=torch.uint8,
                                               generator=torch.Generator().manual_seed(ps)))
        keys: list[bytes] = []
        room = [0] * store.arena.geo.sets
        while len(keys) < n:
            k = os.urandom(32)
            s = store.arena.digest(k).set
            if room[s] < store.arena.geo.ways:
                room[s] += 1
                keys.append(k)
        calls = [slice(i, min(i + args.batch, n)) for i in range(0, n, args.batch)]

        def copy(to_raw: bool, c: slice) -> list[bool]:
            for i in range(c.start, c.stop):
                a, b = raw_base + i * pb, base + (i if to_raw else n + i) * pb
                ctypes.memmove(a, b, pb) if to_raw else ctypes.memmove(b, a, pb)
            return [True] * (c.stop - c.start)

        def one_copy(to_raw: bool) -> list[bool]:
            b = base + (0 if to_raw else n * pb)
            ctypes.memmove(raw_base, b, n * pb) if to_raw else ctypes.memmove(b, raw_base, n * pb)
            return [True]

        def timed(label: str, fn: Any, *a: Any) -> list[bool]:
            t0 = time.perf_counter()
            out = _calls(functools.partial(fn, *a), calls, args.callers) if a else fn()
            r.setdefault(label, []).append(n * pb / (time.perf_counter() - t0) / 1e9)
            return out
        for _ in range(args.repeat):
            timed("memcpy_w_calls", copy, True)
            timed("memcpy_w_one", functools.partial(one_copy, True))
            ok = timed("set", _op, store.batch_set, keys, list(range(n)))
            timed("memcpy_r_calls", copy, False)
            timed("memcpy_r_one", functools.partial(one_copy, False))
            pool.raw[n * pb:].fill_(0xA5)
            got = timed("get", _op, store.batch_get, keys, list(range(n, 2 * n)))
            good = good and all(ok) and all(got) and \
                torch.equal(pool.raw[: n * pb], pool.raw[n * pb: 2 * n * pb])
        stats = store.stats()
        anchor = None
        raw.close()
    finally:
        os.close(fd)
        store.close()
        pool.close()
    med = {k: statistics.median(v) for k, v in r.items()}
    ceil_w, ceil_r = (max(med[f"memcpy_{d}_calls"], med[f"memcpy_{d}_one"]) for d in "wr")
    return {"page_bytes": ps, "pages": n, **med, "set_ratio": med["set"] / ceil_w,
            "get_ratio": med["get"] / ceil_r, "samples": r, "good": good,
            "backing": stats["backing"], "checksum": stats["checksum"]}


def run_shm(args: argparse.Namespace, sizes: list[int], total: int) -> int:
    """``--store shm``: the shm store's batch_set and batch_get against the same run's memcpy
    ceiling: the same pages copied between the same host pool and a populated mapping of a
    tmpfs file (in ``--dir``, default /dev/shm) with ``ctypes.memmove``, in the same calls
    from the same threads, and as one large copy; the ceiling is the faster. Keys are chosen
    so that every page has a slot (the run measures copies, not conflict misses)."""
    from kvtier.l3_stores.shm import DEFAULT_ROOT
    root = args.dir or DEFAULT_ROOT
    results = [_shm_one(args, root, ps, total)
               for ps in progress(sizes, desc="shm store vs memcpy")]
    failures = sum(1 for x in results if not x["good"])
    data = {"store": "shm", "dir": root, "total": total, "repeat": args.repeat,
            "batch": args.batch, "callers": args.callers, "env": _env(root),
            "failures": failures, "results": results}
    print(f"shm store vs memcpy ({results[0]['backing'] if results else ''}; "
          f"checksum {results[0]['checksum'] if results else ''}; {total / 2**30:g} GiB per "
          f"measurement, median of {args.repeat}; batch={args.batch}, callers={args.callers}; "
          "memcpy: the same calls / one copy; GB/s = 1e9 bytes/s)")
    print(table(["page", "memcpy write (calls / one)", "batch_set", "set/memcpy",
                 "memcpy read (calls / one)", "batch_get", "get/memcpy"],
                [[_label(x["page_bytes"]),
                  f"{x['memcpy_w_calls']:.2f} / {x['memcpy_w_one']:.2f}", f"{x['set']:.2f}",
                  f"{x['set_ratio']:.0%}",
                  f"{x['memcpy_r_calls']:.2f} / {x['memcpy_r_one']:.2f}", f"{x['get']:.2f}",
                  f"{x['get_ratio']:.0%}"] for x in results]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if failures:
        print(f"ERROR: {failures} page sizes read back wrong or incomplete data")
        return 1
    print("every page read back bitwise identical")
    return 0
