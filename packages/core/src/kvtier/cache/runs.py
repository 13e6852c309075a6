"""A plan in flight on a `CacheExecutor`: its run state (`Run`), its L3 store work
(`StoreTask`, one batch loop under the deadline), the handle a submit returns
(`PlanHandle`) and the ids an executor has accepted (`PlanIds`)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..errors import TransferError
from ..interfaces import TransferHandle
from .l3io import L3IO, store_batches
from .plans import Plan, PlanResult

if TYPE_CHECKING:
    from .executor import CacheExecutor

log = logging.getLogger("kvtier.cache")

__all__ = ["Run", "StoreTask", "PlanHandle", "PlanIds", "close_one"]


def close_one(obj: Any) -> None:
    try:
        obj.close()
    except Exception as exc:
        log.warning("kvtier executor: closing %s failed: %s", type(obj).__name__, exc)


class PlanIds:
    """The plan ids an executor has accepted; each is refused ever after.

    Memory stays bounded: past ``limit`` ids, the older half (in submission order) is
    forgotten into a floor per group, a group being the sign and the bits above the low 32
    (one `CachePlanner` instance's ids). Every id of a
    group below its floor in magnitude is refused. So an id is refused without having run only
    if a larger one of its group was accepted ``limit // 2`` submissions earlier: planners count
    up, and a plan is submitted soon after it is made, so that is a plan of long ago."""

    def __init__(self, limit: int):
        self.limit = max(2, limit)
        self._ids: dict[int, None] = {}           # insertion-ordered: oldest first
        self._floors: dict[tuple[bool, int], int] = {}

    @staticmethod
    def _group(pid: int) -> tuple[tuple[bool, int], int]:
        mag = abs(pid)
        return (pid < 0, mag >> 32), mag

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, pid: int) -> bool:
        if pid in self._ids:
            return True
        group, mag = self._group(pid)
        return mag < self._floors.get(group, 0)

    def add(self, pid: int) -> None:
        self._ids[pid] = None
        if len(self._ids) > self.limit:
            for old in list(itertools.islice(self._ids, len(self._ids) - self.limit // 2)):
                del self._ids[old]
                group, mag = self._group(old)
                self._floors[group] = max(self._floors.get(group, 0), mag + 1)


class Run:
    """One plan in flight: results so far and the parts still running."""

    def __init__(self, plan: Plan, on_done: Callable[[PlanResult], None] | None = None,
                 on_read: Callable[[int, int, list[bool] | None], None] | None = None,
                 stop: Callable[[], bool] | None = None, two_part: bool = False):
        self.plan = plan
        self.on_done = on_done
        #: Report the plan in two results when its L3 writes outlast the rest (`submit`).
        self.two_part = two_part
        self.interim = False                # the first of those two results is made
        self.interim_out = threading.Event()  # ... and delivered: the second waits for it
        self.write_parts = 0                # parts of it that are L3 writes, running
        self.on_read = on_read
        self.stop = stop
        self.reported = False               # its result is made (held pages in it)
        self.handle: "PlanHandle | None" = None
        self.reads = [False] * len(plan.l3_reads)
        self.loads = [False] * len(plan.loads)
        self.backups = [False] * len(plan.backups)
        self.writes = [False] * len(plan.l3_writes)
        self.in_place = [False] * len(plan.l3_loads)
        self.reads_tried = 0                # leading L3 reads the store was asked for
        self.parts = 0
        self.held: list[int] = []           # host pages a call past its deadline may touch
        self.handles: list[TransferHandle] = []
        self.loads_started = threading.Event()
        read_hp = {hp for _, hp in plan.l3_reads}
        backup_hp = {hp for _, hp in plan.backups}
        self.late_loads = [i for i, (hp, _) in enumerate(plan.loads) if hp in read_hp]
        self.now_loads = [i for i, (hp, _) in enumerate(plan.loads) if hp not in read_hp]
        #: Outside a stream, the loads L3 reads feed start batch by batch as the reads land
        #: (`CacheExecutor._start_late_loads`): the load fed by each read, how many leading
        #: reads have their loads started, and whether the reads are over (none start then).
        read_at = {hp: j for j, (_, hp) in enumerate(plan.l3_reads)}
        self.load_of_read = {read_at[plan.loads[i][0]]: i for i in self.late_loads}
        self.late_started = 0
        self.late_closed = False
        self.late_lock = threading.Lock()
        #: Groups of loads still to start (the ones from L2 at once, the ones L3 reads feed
        #: after them): `wait_layer` waits until every load has its handle.
        self._to_start = 1 + bool(self.late_loads)
        #: Its L3 reads streamed layer group by layer group (`kvtier.cache.stream`).
        self.stream: Any = None
        self._start_lock = threading.Lock()
        self.late_writes = [i for i, (hp, _) in enumerate(plan.l3_writes) if hp in backup_hp]
        self.now_writes = [i for i, (hp, _) in enumerate(plan.l3_writes)
                           if hp not in backup_hp]

    def defer_load_group(self) -> None:
        """One more group of loads will have its handle later (its `load_group_started`
        comes then): in-place loads waiting for their pages to be staged."""
        with self._start_lock:
            self._to_start += 1

    def load_group_started(self) -> None:
        """One group of the plan's loads has its handle (or will have none)."""
        with self._start_lock:
            self._to_start -= 1
            if self._to_start == 0:
                self.loads_started.set()

    def interim_result(self) -> PlanResult:
        """Everything but the L3 writes, which still run (``writes_pending``; host pages a
        call holds go with the writes' result)."""
        return dataclasses.replace(self._whole(), l3_writes=(), held_host_pages=(),
                                   writes_pending=True)

    def failed(self) -> PlanResult:
        """The result of a plan that will not finish (after a first result: its writes)."""
        if self.interim:
            return PlanResult(self.plan.plan_id, l3_writes=(False,) * len(self.plan.l3_writes))
        return self.plan.failed()

    def result(self) -> PlanResult:
        if self.interim:                    # the rest was reported: the writes only
            return PlanResult(self.plan.plan_id, l3_writes=tuple(self.writes),
                              held_host_pages=tuple(self.held))
        return self._whole()

    def _whole(self) -> PlanResult:
        return PlanResult(self.plan.plan_id, tuple(self.reads), tuple(self.loads),
                          tuple(self.backups), tuple(self.writes),
                          held_host_pages=tuple(self.held), l3_loads=tuple(self.in_place),
                          l3_reads_tried=self.reads_tried if self.plan.l3_reads else None)


class StoreTask:
    """L3 reads or writes of one plan, in batches of ``batch`` pages. A call past its
    deadline ends the task's part of the plan at once, with the host pages that call may
    still touch reported as held; they are released (a second result) when it returns."""

    def __init__(self, ex: "CacheExecutor", run: Run, idx: list[int], *, is_read: bool):
        self.ex = ex
        self.run_ = run
        self.idx = idx
        self.is_read = is_read
        self.num_pages = len(idx)
        self._lock = threading.Lock()
        self._current: list[int] = []     # host pages of the call in progress
        self._gave_up = False
        self._held: list[int] = []
        self._part = "reads" if is_read else "writes"

    def run(self, io: L3IO) -> None:
        p = self.run_.plan
        out = self.run_.reads if self.is_read else self.run_.writes
        if self.is_read:
            keys = [p.l3_reads[i][0] for i in self.idx]
            pages = [p.l3_reads[i][1] for i in self.idx]
        else:
            keys = [p.l3_writes[i][1] for i in self.idx]
            pages = [p.l3_writes[i][0] for i in self.idx]
        m = self.ex.metrics_registry
        tried = 0
        try:
            for start, count, got in store_batches(
                    io, "batch_get" if self.is_read else "batch_set", keys, pages,
                    self.ex.batch_pages, task=self, calling=self._calling, stop=self._stop):
                tried = start + count
                if self.is_read:
                    self.run_.reads_tried = tried
                if got is None:         # raised, refused or past its deadline (io counts why)
                    m.add("l3_read_failed_call_pages" if self.is_read
                          else "l3_write_failed_pages", count)
                else:
                    for i, ok in zip(self.idx[start:start + count], got):
                        out[i] = ok
                    # (a read's misses: the store's stats say why -- corrupted, errors, ...)
                    m.add("l3_read_missed_pages" if self.is_read else "l3_write_failed_pages",
                          count - sum(got))
                if self.is_read and self.run_.on_read is not None:
                    self.run_.on_read(self.idx[start], count, got)
                if self.is_read and self.run_.late_loads:
                    self.ex._start_late_loads(self.run_)     # this batch's loads start now
            if self.is_read and not self._gave_up and tried < len(keys):
                m.add("l3_read_skipped_pages", len(keys) - tried)   # after a miss, or L3 off
        finally:
            self._end()

    def _stop(self) -> bool:
        """End the store work here? (A call passed its deadline, or the plan's ``stop``.)"""
        return self._gave_up or (self.run_.stop is not None and self.run_.stop())

    def _end(self) -> None:
        """The task's part of the plan is done (or, past a deadline, its held pages free)."""
        if self._gave_up:
            self.ex._release_held(self.run_, self._held)
        else:
            self.ex._part_done(self.run_, self._part)

    def _calling(self, pages: Any) -> None:
        with self._lock:
            self._current = list(pages)

    def deadline_passed(self) -> None:
        with self._lock:
            if self._gave_up:
                return
            self._gave_up = True
            self._held = list(self._current)
        with self.ex._cv:
            self.run_.held.extend(self._held)
        self.ex._part_done(self.run_, self._part)

    def abort(self, cancelled: bool) -> None:
        if not self.is_read:
            self.ex.metrics_registry.add("l3_writes_cancelled" if cancelled
                                         else "l3_writes_dropped", self.num_pages)
        self.ex._part_done(self.run_, self._part)


class PlanHandle(TransferHandle):
    """A submitted plan as a transfer handle, with the engines' semantics: ``wait_layer(i)``
    and ``wait`` make the caller's stream wait for layer i / every layer of its loads (the
    calling thread goes on queueing work), ``synchronize`` blocks the calling thread until
    the plan has finished and its ``on_done`` has returned, ``done`` says whether it has.
    ``in_place_pages``: how many of its ``l3_loads`` load (the leading run the store held
    when it was submitted); ``result`` once finished and booked."""

    def __init__(self, ex: "CacheExecutor", run: Run):
        self._ex = ex
        self.plan_id = run.plan.plan_id
        self.in_place_pages = 0
        #: Its L3 reads' streaming state (`kvtier.cache.stream.Stream`), or None.
        self.stream = run.stream
        self.result: PlanResult | None = None
        self._run = run

    def read_lead(self, timeout: float | None = None) -> int:
        """Wait until the plan's L3 reads are over and every load they feed has started
        (outside a stream); how many leading reads came back, each feeding its load."""
        self._run.loads_started.wait(timeout)
        return self._run.late_started

    def wait_layer(self, layer: int) -> None:
        self._ex.wait_layer(self.plan_id, layer)

    def wait(self) -> None:
        err = self._ex.wait_layer(self.plan_id, None)
        if err is not None:
            raise err if isinstance(err, TransferError) else TransferError(
                f"plan {self.plan_id}: a load failed: {err}")

    def synchronize(self) -> None:
        self._ex.wait(self.plan_id)

    def done(self) -> bool:
        return self.result is not None
