"""Metrics: counters and histograms are thread-safe; percentiles are within a bucket."""

from __future__ import annotations

import random
import threading

import pytest

from kvtier.metrics import LatencyHistogram, Metrics


def test_percentiles_within_one_bucket():
    rng = random.Random(0)
    xs = [rng.lognormvariate(-7, 1.5) for _ in range(5000)]
    h = LatencyHistogram()
    for x in xs:
        h.record(x)
    xs.sort()
    for q in (50, 90, 99):
        exact = xs[int(q / 100 * len(xs)) - 1]
        assert h.percentile(q) == pytest.approx(exact, rel=0.13)
    s = h.summary()
    assert s["count"] == 5000 and s["min"] == xs[0] and s["max"] == xs[-1]
    assert s["mean"] == pytest.approx(sum(xs) / len(xs))
    h.record(-1.0)                        # nonsense is ignored
    h.record(float("nan"))
    assert h.count == 5000
    assert LatencyHistogram().summary()["p99"] == 0.0
    one = LatencyHistogram()
    one.record(1e-9)
    one.record(1e5)                       # outside the buckets: clamped to observed values
    assert one.percentile(0) == 1e-9 and one.percentile(100) == 1e5


def test_counters_and_histograms_are_thread_safe():
    m = Metrics()

    def work():
        for i in range(2000):
            m.add("n")
            m.add_many({"a": 1, "b": 2})
            m.observe("lat", 1e-5 * (i % 7 + 1))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = m.snapshot()
    assert s["n"] == 8000 and s["a"] == 8000 and s["b"] == 16000
    assert s["latency"]["lat"]["count"] == 8000
    assert m.get("n") == 8000 and m.get("missing") == 0
    assert m.latency("lat")["count"] == 8000 and m.latency("none")["count"] == 0


def test_gauges_are_read_at_snapshot_and_never_break_it():
    m = Metrics()
    box = {"v": 1}
    m.gauge("depth", lambda: box["v"])
    m.gauge("broken", lambda: 1 / 0)
    assert m.snapshot()["depth"] == 1
    box["v"] = 5
    s = m.snapshot()
    assert s["depth"] == 5 and s["broken"].startswith("error: ZeroDivisionError")
    with m.timer("t"):
        pass
    assert m.snapshot()["latency"]["t"]["count"] == 1
