"""`kvtier.cache.l3io`: with two workers or more a read never waits in the queue behind
writes, and a write stuck past its deadline gives its writer's place back."""

from __future__ import annotations

import threading
import time

from kvtier.cache.l3io import L3IO, TaskQueue
from kvtier.l3_stores.memory import MemoryStore
from kvtier.metrics import Metrics
from kvtier import KVSpec

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float16")


class Task:
    def __init__(self, is_read: bool, gate: threading.Event | None = None, call=None):
        self.is_read, self.num_pages = is_read, 1
        self.gate, self.call_fn = gate, call
        self.started, self.done = threading.Event(), threading.Event()

    def run(self, io):
        self.started.set()
        if self.call_fn is not None:
            io.call("batch_set", self.call_fn, task=self)
        elif self.gate is not None:
            self.gate.wait(10)
        self.done.set()

    def abort(self, cancelled):
        self.done.set()


def _io(threads: int, timeout_s: float = 30.0) -> L3IO:
    io = L3IO(MemoryStore(spec=SPEC), threads=threads, error_limit=100,
              call_timeout_s=timeout_s, metrics=Metrics())
    io.start_workers()
    return io


def test_a_read_runs_while_every_write_it_came_after_is_blocked():
    io = _io(3)
    gate = threading.Event()
    writes = [Task(False, gate) for _ in range(4)]
    for w in writes:
        io.submit(w)
    assert writes[0].started.wait(5) and writes[1].started.wait(5)
    time.sleep(0.1)
    assert not writes[2].started.is_set()       # two writers of three workers, no more
    read = Task(True)
    io.submit(read)
    assert read.done.wait(5)                    # the third worker: reads only
    assert not writes[2].started.is_set()
    gate.set()
    assert all(w.done.wait(5) for w in writes)
    assert io.wait_idle(5)
    io.stop(5)


def test_one_worker_runs_reads_and_writes_alike():
    q = TaskQueue(None)
    for _ in range(3):
        q.put(Task(False))
    got = [q.get() for _ in range(3)]           # no bound: all three at once
    assert all(not t.is_read for t in got)
    io = _io(1)
    w = Task(False)
    io.submit(w)
    assert w.done.wait(5)
    io.stop(5)


def test_a_write_stuck_past_its_deadline_gives_its_writer_place_back():
    io = _io(2, timeout_s=0.2)
    hang = threading.Event()
    stuck = Task(False, call=lambda: hang.wait(10))
    io.submit(stuck)
    assert stuck.started.wait(5)
    nxt = Task(False)
    io.submit(nxt)
    assert nxt.done.wait(5)                     # after the deadline, not after the hang
    assert not hang.is_set()
    hang.set()
    assert stuck.done.wait(5)
    io.stop(5)


def test_the_watchdog_wakes_for_deadlines_not_for_every_call():
    """A store call whose deadline is not earlier than the one the watchdog sleeps until
    does not wake it (a wake-up per call is one more thread taking the interpreter lock
    beside the engine's)."""
    io = _io(1)
    for _ in range(200):
        assert io.call("batch_exists", lambda: 0) == 0
    assert io._watch_wakes <= 3
    io.stop(5)


def test_overlapping_stuck_calls_each_time_out_at_their_own_deadline():
    io = _io(3, timeout_s=0.3)
    hang = threading.Event()
    t0 = time.monotonic()
    threads = []
    for _ in range(2):
        t = threading.Thread(target=io.call, args=("batch_set", lambda: hang.wait(10)))
        t.start()
        threads.append(t)
        time.sleep(0.15)
    seen = []
    while time.monotonic() - t0 < 5 and len(seen) < 2:
        n = io.metrics.get("l3_timeouts")
        if n > len(seen):
            seen.append(time.monotonic() - t0)
        time.sleep(0.01)
    hang.set()
    for t in threads:
        t.join(5)
    io.stop(5)
    assert len(seen) == 2
    assert 0.25 < seen[0] < 0.9 and 0.4 < seen[1] < 1.2     # 0.3 s and 0.45 s, not later
