"""L3 I/O: the worker pool that runs store calls, and the L3 tier's health state machine.

`L3IO` owns a queue of tasks (reads before writes), ``threads`` daemon workers and the
tier's health. With two workers or more, writes run on all but one of them, so a read never
waits in the queue for a write call to end (a request's backup of a few 8 MiB pages to a
1.6 GB/s disk takes tens of milliseconds).

A task is any object with ``is_read``, ``num_pages``, ``run(io)`` and ``abort(cancelled)``;
inside ``run`` it makes each store call through `L3IO.call`, which
counts errors and latencies and returns None for a failed call.

Deadlines: a call that has not returned after ``call_timeout_s`` is a counted failure
(``l3_timeouts``; it adds to the error streak) and its worker is replaced, so a store that
blocks forever costs misses, never a hang. The stuck thread keeps its task's host pages (a
late ``batch_get`` may still write into them) until the call returns, and its result is then
thrown away. ``batch_exists`` runs on a thread of its own under the same deadline.

Health (``state``): ``"none"`` (no store), ``"ok"``, ``"degraded: ..."`` (calls stuck past
their deadline, or reads that returned none of their pages; still used), ``"failed: ..."``
(``error_limit`` failed calls in a row, ``error_limit`` reads in a row that returned none of
the pages the store said it had, ``error_limit`` calls stuck at once -- each holds a thread --
or a dead worker). Failed is reported once through ``on_failure`` and stays until `restart`;
every queued task is aborted then. Each change of state is logged once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..interfaces import L3Store
from ..metrics import Metrics

log = logging.getLogger("kvtier.cache")

__all__ = ["L3IO", "TaskQueue", "worse_state", "store_batches", "first_miss"]

_RANK = {"ok": 0, "none": 0, "degraded": 1, "failed": 2}


def worse_state(a: str | None, b: str | None) -> str | None:
    """The worse of two `L3IO.state` strings (None: not known)."""
    if a is None or b is None:
        return a if b is None else b
    return a if _RANK.get(a.split(":")[0], 0) >= _RANK.get(b.split(":")[0], 0) else b


def first_miss(got: Sequence[bool] | None, n: int) -> int:
    """The one definition of a read's miss: the first page that did not come back (the store
    said no, or the call raised, was refused or passed its deadline: ``got`` None). A prefix
    cannot use any page after it. Returns its index (``n``: none missed)."""
    if got is None:
        return 0
    for i, ok in enumerate(got):
        if not ok:
            return i
    return n


def store_batches(io: "L3IO", op: str, keys: Sequence[bytes], pages: Sequence[int],
                  batch: int, *, task: Any = None,
                  calling: Callable[[Sequence[int]], None] | None = None,
                  stop: Callable[[], bool] = lambda: False
                  ) -> Iterator[tuple[int, int, list[bool] | None]]:
    """The one loop every L3 read and write runs: ``op`` (``batch_get`` / ``batch_set``) of
    ``keys`` and ``pages`` in batches of ``batch``, each call under the deadline (`L3IO.call`).
    Yields ``(start, count, got)`` per batch: one bool per page (True: done), or None when the
    call failed. Stops before a batch once the tier is not usable or ``stop()`` says so, and
    after one whose call ``stop()`` then refuses (a caller gave up on it). Reads stop at their
    first miss (`first_miss`) and book the tier's read health. ``calling(pages)`` is told the
    host pages of the call in progress (``[]`` once it returned): the pages a call past its
    deadline may still touch."""
    fn = io.store.batch_get if op == "batch_get" else io.store.batch_set
    for s in range(0, len(keys), batch):
        if not io.usable() or stop():
            return
        kb, pb = list(keys[s:s + batch]), list(pages[s:s + batch])
        n = len(kb)
        if calling is not None:
            calling(pb)
        ok = io.call(op, fn, kb, pb, task=task,
                     check=lambda r, n=n: isinstance(r, list) and len(r) == n)
        if calling is not None:
            calling([])
        if stop():
            return
        got = None if ok is None else [v is True for v in ok]
        if op == "batch_get":
            if got is not None:
                good = sum(got)
                io.read_outcome(good, n - good)
            yield s, n, got
            if first_miss(got, n) < n:
                return
        else:
            yield s, n, got


class TaskQueue:
    """Reads before writes, and at most ``max_writers`` writes running at once (None: no
    bound); counts queued pages; can be drained."""

    def __init__(self, max_writers: int | None = None) -> None:
        self.cv = threading.Condition()
        self.reads: deque = deque()
        self.writes: deque = deque()
        self.inflight = 0
        self.queued_write_pages = 0
        self.reading: dict[int, int] = {}     # id() of the reads running: their pages
        self.stopping = False
        self.max_writers = max_writers
        self.writing: set[int] = set()        # id() of the writes running

    def _can_write(self) -> bool:
        return bool(self.writes) and (self.max_writers is None
                                      or len(self.writing) < self.max_writers)

    def put(self, task: Any) -> None:
        with self.cv:
            if task.is_read:
                self.reads.append(task)
            else:
                self.writes.append(task)
                self.queued_write_pages += task.num_pages
            self.cv.notify()

    def get(self) -> Any:
        with self.cv:
            while not self.reads and not self._can_write() and not self.stopping:
                self.cv.wait()
            if self.stopping:
                return None
            if self.reads:
                task = self.reads.popleft()
                self.reading[id(task)] = task.num_pages
            else:
                task = self.writes.popleft()
                self.queued_write_pages -= task.num_pages
                self.writing.add(id(task))
            self.inflight += 1
            return task

    def task_done(self, task: Any = None) -> None:
        with self.cv:
            self.inflight -= 1
            self.reading.pop(id(task), None)
            self.writing.discard(id(task))
            self.cv.notify_all()

    def release(self, task: Any) -> None:
        """A task whose call is stuck past its deadline no longer holds a writer's place nor
        counts in the read backlog (its worker is replaced)."""
        with self.cv:
            self.reading.pop(id(task), None)
            if id(task) in self.writing:
                self.writing.discard(id(task))
                self.cv.notify_all()

    def drain(self, reads_only: bool = False) -> list[Any]:
        with self.cv:
            tasks = list(self.reads)
            self.reads.clear()
            if not reads_only:
                tasks += list(self.writes)
                self.writes.clear()
                self.queued_write_pages = 0
            self.cv.notify_all()
            return tasks

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()

    def depths(self) -> tuple[int, int]:
        with self.cv:
            return (sum(t.num_pages for t in self.reads), self.queued_write_pages)

    def read_backlog(self) -> int:
        """Pages of the reads queued or running: what a read started now lands behind."""
        with self.cv:
            return sum(t.num_pages for t in self.reads) + sum(self.reading.values())


class _ExistsJob:
    __slots__ = ("keys", "result", "done")

    def __init__(self, keys: list[bytes]):
        self.keys = keys
        self.result: int | None = None
        self.done = threading.Lock()      # held until the exists thread has the result
        self.done.acquire()


@dataclass(slots=True, eq=False)
class _Call:
    op: str
    deadline: float
    task: Any
    thread: threading.Thread
    timed_out: bool = False


class L3IO:
    """Worker pool and health of one L3 store (see the module doc)."""

    def __init__(self, store: L3Store, *, threads: int, error_limit: int,
                 call_timeout_s: float, metrics: Metrics,
                 on_failure: Callable[[str, BaseException | None], None] | None = None,
                 name: str = "kvtier-l3-io"):
        self.store = store
        self.threads = threads
        self.error_limit = error_limit
        self.call_timeout_s = call_timeout_s
        self.metrics = metrics
        self._on_failure = on_failure
        self._name = name
        self.queue = TaskQueue(max_writers=threads - 1 if threads >= 2 else None)
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._replaced: set[threading.Thread] = set()   # stuck past a deadline
        self._calls: dict[int, _Call] = {}              # thread ident -> call in progress
        self._watch_cv = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None
        #: The deadline the watchdog sleeps until (None: until told). A call whose deadline
        #: is not earlier does not wake it: every call's thread would otherwise take the
        #: interpreter lock once more per store call, beside the engine's.
        self._watch_until: float | None = None
        self._watch_wakes = 0
        self._streak = 0
        self._read_streak = 0            # reads in a row that returned none of their pages
        self._logged_state = "ok"
        self._failed: str | None = None
        self._stopped = False
        self._exists_thread: threading.Thread | None = None
        self._exists_q: queue.SimpleQueue = queue.SimpleQueue()
        self._serial = 0
        self._exists_serial = 0
        self.start_workers()

    # ----- health -----------------------------------------------------------------------------
    @property
    def state(self) -> str:
        with self._lock:
            if self._failed is not None:
                return f"failed: {self._failed}"
            stuck = sum(1 for c in self._calls.values() if c.timed_out)
            reads = self._read_streak
        why = []
        if stuck:
            why.append(f"{stuck} store call(s) stuck past the {self.call_timeout_s:g}s "
                       "deadline")
        if reads:
            why.append(f"{reads} read(s) in a row returned none of their pages")
        return "degraded: " + "; ".join(why) if why else "ok"

    def read_outcome(self, read: int, failed: int) -> None:
        """Book one ``batch_get`` of pages the store said it had: ``read`` pages came back,
        ``failed`` did not. A read that returned none of them adds to a streak (degraded);
        ``error_limit`` in a row fail the tier; any page read ends the streak."""
        if failed and not read:
            with self._lock:
                self._read_streak += 1
                broken = self._read_streak >= self.error_limit
            if broken:
                self.fail(f"store {self.store.name!r}: {self.error_limit} reads in a row "
                          "returned none of the pages it said it had", None)
        elif read and self._read_streak:
            with self._lock:
                self._read_streak = 0
        self.log_state()

    def log_state(self) -> None:
        """One log line per change of `state` (``failed`` logs in `fail`)."""
        state = self.state
        kind = state.split(":")[0]
        with self._lock:
            was, self._logged_state = self._logged_state, kind
        if kind == was or kind == "failed":
            return
        (log.info if kind == "ok" else log.warning)(
            "kvtier cache: L3 store %r is %s", self.store.name, state)

    def usable(self) -> bool:
        return self._failed is None and not self._stopped

    def check_workers(self) -> None:
        """Mark the tier failed if a worker died (not one replaced after a deadline)."""
        if self._failed is not None or self._stopped:
            return
        with self._lock:               # start_workers lists a thread before starting it
            dead = [t for t in self._workers if not t.is_alive() and t not in self._replaced]
        if dead:
            self.fail(f"L3 I/O thread {dead[0].name} is dead", None)

    def fail(self, message: str, cause: BaseException | None) -> None:
        with self._lock:
            if self._failed is not None:
                return
            self._failed = message
            self._logged_state = "failed"
        self.metrics.add("l3_failures")
        log.error("kvtier cache: l3 tier failed: %s", message, exc_info=cause)
        if self._on_failure is not None:
            self._on_failure(message, cause)
        for task in self.queue.drain():
            task.abort(cancelled=False)

    def error(self, op: str, exc: BaseException) -> None:
        self.metrics.add("store_errors")
        log.warning("kvtier cache: L3 store %r %s failed: %s: %s", self.store.name, op,
                    type(exc).__name__, exc)
        with self._lock:
            self._streak += 1
            broken = self._streak >= self.error_limit
        if broken:
            self.fail(f"store {self.store.name!r} failed {self.error_limit} calls in a row; "
                      f"last: {op}: {type(exc).__name__}: {exc}", exc)

    def ok(self) -> None:
        if self._streak:
            with self._lock:
                self._streak = 0

    def restart(self) -> None:
        """After a failure: reset the error streak and the state, start missing workers."""
        with self._lock:
            self._streak = 0
            self._read_streak = 0
            self._failed = None
        self.start_workers()
        self.log_state()

    # ----- workers ----------------------------------------------------------------------------
    def start_workers(self) -> None:
        with self._lock:
            self._workers = [t for t in self._workers
                             if t.is_alive() and t not in self._replaced]
            while len(self._workers) < self.threads:
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"{self._name}-{self._serial}")
                self._serial += 1
                self._workers.append(t)
                t.start()

    @property
    def workers(self) -> list[threading.Thread]:
        """The worker threads (not those replaced after a deadline)."""
        with self._lock:
            return list(self._workers)

    def submit(self, task: Any) -> None:
        self.queue.put(task)

    def _work(self) -> None:
        me = threading.current_thread()
        try:
            while me not in self._replaced:
                task = self.queue.get()
                if task is None:
                    return
                try:
                    task.run(self)
                finally:
                    self.queue.task_done(task)
        except BaseException as exc:
            self.fail(f"L3 I/O thread {me.name} died: {type(exc).__name__}: {exc}", exc)
        finally:
            with self._lock:
                if me in self._replaced:        # its stuck call came back: leave quietly
                    self._replaced.discard(me)
                    if me in self._workers:
                        self._workers.remove(me)

    # ----- calls ------------------------------------------------------------------------------
    def call(self, op: str, fn: Callable[..., Any], *args: Any,
             check: Callable[[Any], bool] = lambda r: True, task: Any = None) -> Any:
        """One store call under the deadline: its result, or None if it raised, returned
        something ``check`` refuses, or came back after its deadline (all counted)."""
        me = threading.current_thread()
        c = _Call(op, time.monotonic() + self.call_timeout_s, task, me)
        with self._lock:
            self._calls[me.ident or 0] = c
            self._ensure_watchdog()
            if self._watch_until is None or c.deadline < self._watch_until:
                self._watch_cv.notify()
        t0 = time.perf_counter()
        try:
            result = fn(*args)
            err: BaseException | None = None
        except Exception as exc:
            result, err = None, exc
        finally:
            with self._lock:
                self._calls.pop(me.ident or 0, None)
        if c.timed_out:
            self.metrics.add("l3_late_returns")
            return None
        if err is not None:
            self.error(op, err)
            return None
        if not check(result):
            self.error(op, ValueError(f"returned {result!r}"))
            return None
        self.ok()
        self.metrics.observe(f"l3_{op.removeprefix('batch_')}", time.perf_counter() - t0)
        return result

    def exists(self, keys: Sequence[bytes]) -> int:
        """``batch_exists`` under the deadline, on its own thread; 0 on any failure."""
        job = _ExistsJob(list(keys))
        with self._lock:
            t = self._exists_thread
            if t is None or not t.is_alive() or t in self._replaced:
                self._exists_q = queue.SimpleQueue()
                self._exists_serial += 1
                t = threading.Thread(target=self._exists_loop, args=(self._exists_q,),
                                     daemon=True,
                                     name=f"{self._name}-exists-{self._exists_serial}")
                self._exists_thread = t
                t.start()
            q = self._exists_q
        q.put(job)
        # The call's own deadline fires first; the margin covers the watchdog's wake-up.
        job.done.acquire(timeout=self.call_timeout_s + 1.0)
        return job.result if job.result is not None else 0

    def _exists_loop(self, q: "queue.SimpleQueue[_ExistsJob | None]") -> None:
        me = threading.current_thread()
        try:
            while me not in self._replaced:
                job = q.get()
                if job is None:
                    return
                n = len(job.keys)
                job.result = self.call(
                    "batch_exists", self.store.batch_exists, job.keys,
                    check=lambda r, n=n: not isinstance(r, bool) and isinstance(r, int)
                    and 0 <= r <= n)
                job.done.release()
        finally:
            with self._lock:
                self._replaced.discard(me)

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"{self._name}-watchdog")
            self._watchdog.start()

    def _watch(self) -> None:
        with self._lock:
            while not self._stopped:
                now = time.monotonic()
                late = [c for c in self._calls.values() if not c.timed_out and c.deadline <= now]
                for c in late:
                    c.timed_out = True
                    self._replaced.add(c.thread)
                pending = [c.deadline for c in self._calls.values() if not c.timed_out]
                if late:
                    self._lock.release()
                    try:
                        self._timed_out(late)
                    finally:
                        self._lock.acquire()
                    continue
                self._watch_until = min(pending) if pending else None
                self._watch_cv.wait(None if not pending else max(0.0, min(pending) - now))
                self._watch_wakes += 1

    def _timed_out(self, calls: list[_Call]) -> None:
        for c in calls:
            self.metrics.add("l3_timeouts")
            log.error("kvtier cache: L3 store %r %s did not return within %gs; counted as "
                      "failed, its worker replaced", self.store.name, c.op, self.call_timeout_s)
            if c.task is not None:
                self.queue.release(c.task)
                if hasattr(c.task, "deadline_passed"):
                    c.task.deadline_passed()
            self.error(c.op, TimeoutError(f"no return within {self.call_timeout_s:g}s"))
        stuck = self.stuck_calls()
        if stuck >= self.error_limit:          # each one holds a thread: bound them
            self.fail(f"{stuck} store calls stuck past the {self.call_timeout_s:g}s deadline",
                      None)
        if not self._stopped and self._failed is None:
            self.start_workers()

    # ----- draining ---------------------------------------------------------------------------
    def wait_idle(self, timeout: float | None, *, writes_only: bool = False) -> bool:
        """Wait until no task is queued or running (a stuck call counts as done)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        q = self.queue

        def idle() -> bool:
            busy = q.inflight - self.stuck_calls()
            return not q.writes and busy <= 0 and (writes_only or not q.reads)
        with q.cv:
            while not idle():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                # a deadline passing does not notify the queue: re-check now and then
                q.cv.wait(0.05 if left is None else min(left, 0.05))
        return True

    def depths(self) -> tuple[int, int]:
        return self.queue.depths()

    def read_backlog(self) -> int:
        return self.queue.read_backlog()

    def stuck_calls(self) -> int:
        """Store calls past their deadline that have not returned yet."""
        with self._lock:
            return sum(1 for t in self._replaced if t.is_alive())

    def stop(self, timeout: float) -> None:
        """Stop the workers (queued tasks should be drained first); waits up to ``timeout``
        for those not stuck in a store call."""
        deadline = time.monotonic() + timeout
        self.queue.stop()
        with self._lock:
            self._stopped = True
            self._watch_cv.notify_all()
            workers = [t for t in self._workers if t not in self._replaced]
        self._exists_q.put(None)
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        for task in self.queue.drain():
            task.abort(cancelled=True)
