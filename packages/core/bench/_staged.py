"""What the staged-path bench scripts beside this file share: their command line, the pinned
host allocator they time against, a median timer and the staged CPU copies alone."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from kvtier import registry
from kvtier.errors import KVTierError

CASES = "mla-p16,mla-p64,mha-32k,mha-128k"


def parse(doc: str, repeat: int) -> argparse.Namespace:
    """``--mib``, ``--cases``, ``--repeat`` and ``--json``, described by ``doc``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--cases", default=CASES)
    p.add_argument("--repeat", type=int, default=repeat)
    p.add_argument("--json")
    return p.parse_args()


def pinned_allocator() -> Any:
    """``cuda-host-register`` where kvtier-nvidia-tma runs, else ``torch-pinned``."""
    try:
        return registry.create_host_allocator("cuda-host-register")
    except KVTierError:
        return registry.create_host_allocator("torch-pinned")


def median_s(fn: Callable[[], Any], repeat: int, warm: int = 1) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after ``warm`` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def host_copies(eng: Any, h: Any, gather: bool) -> None:
    """Every batch of a staged transfer of host pages ``h`` (a NumPy array) gathered into (or
    scattered from) the engine's first staging slot, with nothing else running."""
    L, g = eng.spec.num_layers, eng._group_size(len(h))
    slot = eng._slots[0]
    for a in range(0, L, g):
        k = min(g, L - a)
        for s, e in eng._batches(len(h), k):
            eng._host_rows(eng._plan(slot, e - s, a, k), h[s:e], gather)
