"""Thread-safe counters, gauges and latency histograms for the controller and benchmarks.

Counters only go up; gauges are callables read at snapshot time (queue depths, pool use);
latencies go into log-spaced histograms (20 buckets per decade, 1 us .. 1000 s) that give
percentiles to within one bucket (about 12 %) plus the exact count, mean, min and max.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

_LO = 1e-6
_PER_DECADE = 20
_DECADES = 9


class LatencyHistogram:
    """Log-spaced histogram of durations in seconds. Not locked: `Metrics` locks around it."""

    __slots__ = ("bounds", "counts", "count", "total", "min", "max")

    def __init__(self) -> None:
        n = _PER_DECADE * _DECADES
        self.bounds = [_LO * 10 ** (i / _PER_DECADE) for i in range(n + 1)]
        self.counts = [0] * (n + 2)       # [< lo] + n buckets + [>= hi]
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = 0.0

    def record(self, seconds: float) -> None:
        if seconds < 0 or seconds != seconds:
            return
        self.counts[bisect.bisect_right(self.bounds, seconds)] += 1
        self.count += 1
        self.total += seconds
        if seconds < self.min:
            self.min = seconds
        if seconds > self.max:
            self.max = seconds

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100): the geometric middle of the bucket it falls in,
        clamped to the observed min and max."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q / 100.0 * self.count))
        seen, i = 0, 0
        for i, c in enumerate(self.counts):  # noqa: B007 - i is the bucket found
            seen += c
            if seen >= rank:
                break
        if i == 0:
            est = self.min
        elif i >= len(self.bounds):
            est = self.max
        else:
            est = math.sqrt(self.bounds[i - 1] * self.bounds[i])
        return min(max(est, self.min), self.max)

    def summary(self) -> dict[str, float]:
        if not self.count:
            return {"count": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "min": 0.0,
                    "max": 0.0}
        return {"count": self.count, "mean": self.total / self.count,
                "p50": self.percentile(50), "p90": self.percentile(90),
                "p99": self.percentile(99), "min": self.min, "max": self.max}


class Metrics:
    """Named counters, latency histograms and gauges behind one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        self._hists: dict[str, LatencyHistogram] = {}
        self._gauges: dict[str, Callable[[], Any]] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def add_many(self, counts: dict[str, int]) -> None:
        with self._lock:
            c = self._counters
            for name, n in counts.items():
                c[name] = c.get(name, 0) + n

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            h = self._hists.get(name)
            if h is None:
                h = self._hists[name] = LatencyHistogram()
            h.record(seconds)

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - t0)

    def gauge(self, name: str, read: Callable[[], Any]) -> None:
        """Register a value read at snapshot time."""
        with self._lock:
            self._gauges[name] = read

    def get(self, name: str) -> int:
        with self._lock:
            return self._counters.get(name, 0)

    def latency(self, name: str) -> dict[str, float]:
        with self._lock:
            h = self._hists.get(name)
            return h.summary() if h is not None else LatencyHistogram().summary()

    def export(self) -> tuple[dict[str, int], dict[str, Any], dict[str, tuple]]:
        """(counters, gauge values read now, histograms as ``name -> (bounds, counts, total,
        count)``) with ``counts[0]`` below ``bounds[0]`` and ``counts[i]`` in
        ``[bounds[i-1], bounds[i])``: what exporters need (`kvtier.prometheus`)."""
        with self._lock:
            counters = dict(self._counters)
            hists = {name: (h.bounds, list(h.counts), h.total, h.count)
                     for name, h in self._hists.items()}
            gauges = dict(self._gauges)
        values: dict[str, Any] = {}
        for name, read in gauges.items():
            try:
                values[name] = read()
            except Exception as exc:  # a gauge must never break a metrics read
                values[name] = f"error: {type(exc).__name__}"
        return counters, values, hists

    def snapshot(self) -> dict[str, Any]:
        """``{counter: n, ..., gauge: value, ..., "latency": {name: summary}}``."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            lat = {name: h.summary() for name, h in self._hists.items()}
            gauges = dict(self._gauges)
        for name, read in gauges.items():     # outside our lock: gauges take their own
            try:
                out[name] = read()
            except Exception as exc:  # a gauge must never break a metrics read
                out[name] = f"error: {type(exc).__name__}: {exc}"
        out["latency"] = lat
        return out
