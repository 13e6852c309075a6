"""Host row copies split over threads of kvtier's own, each copying on one CPU core.

torch runs a CPU index op (``index_select``, ``index_copy_``) on OpenMP threads of the thread
that calls it. Called from a thread other than the one torch set up (an engine's worker), that
is a second OpenMP team beside the first, and a gather ran at 2.2-5.3 GB/s where the same call
on the main thread ran at 17 (128 KiB rows, the 2-core CI box). Here the rows of one copy are
split into contiguous shares, one per thread, and each thread turns OpenMP off for itself
(``omp_set_num_threads(1)`` is a per-thread setting) so every share is one plain loop of
memcpys on one core.

Where the OpenMP runtime torch loaded cannot be found (not Linux, a torch built without
OpenMP), :func:`host_threads` reports why and the caller copies on its own thread instead.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
from typing import Callable

import torch

_OMP_LIBS = ("libgomp", "libiomp", "libomp")


def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime already loaded into this process (the one
    torch uses), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if ".so" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if os.path.basename(p).startswith(_OMP_LIBS)):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | getattr(os, "RTLD_LAZY", 1))
        except OSError:
            continue
        fn = getattr(lib, "omp_set_num_threads", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], None
            return fn
    return None


_SET = _omp_set_num_threads()


def single_core() -> bool:
    """Make torch's CPU ops run on the calling thread alone; True where that took effect.

    torch sets the OpenMP thread count of each thread once, on that thread's first CPU op
    (``torch.get_num_threads()`` triggers it), so this runs after it and then checks."""
    if _SET is None:
        return False
    torch.get_num_threads()
    _SET(1)
    return torch.get_num_threads() == 1


class HostThreads:
    """``n`` daemon threads (the caller runs one share itself, so ``n - 1`` are started), each
    on one core for torch's CPU ops. :meth:`run` splits rows ``[0, rows)`` into contiguous
    shares of at least ``min_rows`` and waits for all of them."""

    def __init__(self, n: int, name: str = "kvtier-host-copy"):
        self.n = n
        self._jobs: list[queue.SimpleQueue] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        ready: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n - 1):
            q: queue.SimpleQueue = queue.SimpleQueue()
            self._jobs.append(q)
            threading.Thread(target=self._serve, args=(q, ready), name=f"{name}-{i}",
                             daemon=True).start()
        self.single_core = all(ready.get() for _ in range(n - 1))

    def _serve(self, jobs: queue.SimpleQueue, ready: queue.SimpleQueue) -> None:
        ready.put(single_core())
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, lo, hi = job
            try:
                fn(lo, hi)
                self._done.put(None)
            except BaseException as exc:     # handed to run()'s caller
                self._done.put(exc)

    def run(self, fn: Callable[[int, int], None], rows: int, min_rows: int = 1) -> None:
        """``fn(lo, hi)`` over contiguous shares of ``[0, rows)``; the caller's thread runs the
        last share. Raises the first failure once every share has finished."""
        k = max(1, min(self.n, rows // max(1, min_rows)))
        if k == 1 or self._closed:
            fn(0, rows)
            return
        cuts = [rows * i // k for i in range(k + 1)]
        for i in range(k - 1):
            self._jobs[i].put((fn, cuts[i], cuts[i + 1]))
        error: BaseException | None = None
        try:
            fn(cuts[k - 1], rows)
        except BaseException as exc:
            error = exc
        for _ in range(k - 1):
            got = self._done.get()
            if got is not None and error is None:
                error = got
        if error is not None:
            raise error

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for q in self._jobs:
                q.put(None)


def host_threads(requested: int) -> tuple[HostThreads | None, str]:
    """The thread set for ``requested`` threads (0: one per CPU core the process may use, at
    most 8), or None with the reason when copies stay on the caller's thread with torch's
    own CPU threads."""
    n = requested or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else (os.cpu_count() or 1))
    if n <= 1:
        return None, "1 host thread"
    if _SET is None:
        return None, "no OpenMP runtime found to give each thread one core"
    pool = HostThreads(n)
    if not pool.single_core:
        pool.close()
        return None, "torch kept its CPU threads in a copy thread"
    return pool, f"{n} host threads"
