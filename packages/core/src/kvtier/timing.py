"""GPU timing: the one timer kvtier's benchmarks and the engines' calibrations measure with.

`timed_ms` times a callable by the GPU's clock (CUDA events around all it queued) and by the
calling thread's (what queuing it costs), optionally behind GPU work queued first
(`gpu_busy`), as a median or the best of several runs. It lives in the library, not beside a
benchmark, so an engine's calibration and the benchmark that judges it time the same way
without an engine importing a benchmark module. ``torch`` is passed in: importing this module
imports nothing.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["gpu_busy", "median_ms", "timed_ms"]


def median_ms(torch, fn, repeat: int, warmup: int = 1, behind_ms: float = 0.0) -> float:
    return timed_ms(torch, fn, repeat, warmup, behind_ms)[0]


_CYCLES_PER_MS: list[float] = []


def gpu_busy(torch, ms: float) -> None:
    """Queue ``ms`` of GPU work (a spin kernel, no memory traffic) on the current stream."""
    if not _CYCLES_PER_MS:          # the spin kernel counts clock cycles: measure them once
        probe = 2_000_000
        torch.cuda._sleep(probe // 10)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(probe / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(max(1, int(ms * _CYCLES_PER_MS[0])))


def timed_ms(torch, fn, repeat: int, warmup: int = 1, behind_ms: float = 0.0,
             best: bool = False) -> tuple[float, float]:
    """Medians over ``repeat`` runs after ``warmup`` (with ``best``: the shortest of each):
    the GPU's time from before ``fn`` is called (with ``behind_ms``: from the end of that much
    GPU work queued before it) to after all it queued (CUDA events), and the calling thread's
    time in ``fn`` (queueing its work, and any wait that blocks the thread)."""
    times, calls = [], []
    for i in range(warmup + repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if behind_ms > 0:
            gpu_busy(torch, behind_ms)
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
            calls.append(1e3 * (t1 - t0))
        elif start.elapsed_time(end) > 500 and repeat > 1:
            repeat = 1          # very slow configurations: one timed run is enough
    pick = min if best else statistics.median
    return pick(times), pick(calls)
