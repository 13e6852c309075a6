"""The controller's L3 work: plans run by its `CacheExecutor`, booked into its index.

`ReadTask` reads a match's L3 run into freshly allocated host pages and registers each page
in L2 as its batch lands (pinned for the match while the match still wants it); a fetch waits
on it within the prefetch policy's budget. `WriteTask` writes pinned L2 pages to L3
(write-through backups, write-backs before eviction, the flush at close) and unpins them,
freeing evicted ones children first.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Sequence

from ..errors import InvalidArgumentError
from . import eviction
from .eviction import after_l3_write
from .index import Node
from .l3io import first_miss
from .plans import Plan, PlanResult

if TYPE_CHECKING:
    from .controller import TieredKVCache
    from .handles import Match

__all__ = ["ReadTask", "WriteTask", "start_read", "stream_task", "wait_read", "enqueue_write"]


class ReadTask:
    """L3 -> L2 read of a match's L3 run (its first ``len(host_pages)`` pages) into freshly
    allocated host pages."""

    def __init__(self, cache: "TieredKVCache", match: "Match", host_pages: list[int]):
        start = match.l1_count + match.l2_count
        self.cache = cache
        self.match = match
        self.keys = match.keys[start:start + len(host_pages)]
        self.host_pages = host_pages
        self.parent_key = match.keys[start - 1] if start else None
        self.landed: list[Node] = []     # nodes registered in L2 and pinned for the match
        self.used = 0                    # host pages consumed (registered or freed)
        self.cancelled = False           # the match no longer wants more pages
        self.finished = False
        self.cv = threading.Condition()
        self.n_landed = 0
        self.t0 = time.perf_counter()

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def settled(self) -> bool:
        """Nothing more will land that a waiter should wait for (a store call past its
        deadline ends the plan at once)."""
        return self.finished

    @property
    def complete(self) -> bool:
        """Every page landed, or nothing more will (read it under ``cv``)."""
        return self.settled or self.n_landed >= self.num_pages

    def batch(self, first: int, count: int, got: list[bool] | None) -> None:
        """A batch of the plan's reads came back (`CacheExecutor.submit`'s ``on_read``)."""
        lead = first_miss(got, count)
        self._land(first, lead)
        if lead < count:
            # the store said it had it: not offered again until rewritten (a lookup stops
            # there, so the pages after it need no mark)
            self.cache.forget_l3([self.keys[first + lead]])
            self.cache.metrics_registry.add("l3_read_miss_pages",
                                            self.num_pages - first - lead)

    def _land(self, start: int, count: int) -> None:
        """Register pages read from L3 in L2 (pinned for the match while it wants them)."""
        if count <= 0:
            return
        c = self.cache
        idx = c._index
        dup: list[int] = []
        with c._lock:
            pkey = self.parent_key if start == 0 else self.keys[start - 1]
            parent = idx.get(pkey) if pkey is not None else None
            ok = pkey is None or parent is not None
            pin = not self.cancelled and not self.match.released
            landed = 0
            for j in range(start, start + count):
                hp = self.host_pages[j]
                self.used = j + 1
                if not ok:
                    dup.append(hp)                # prefix gone: the page would be orphaned
                    continue
                node = idx.node(self.keys[j], parent)
                if node.host_page is None:
                    idx.l2_add(node, hp)
                else:
                    dup.append(hp)
                node.in_l3 = True
                if pin:
                    self.match.hold_l2(node)
                    self.landed.append(node)
                    landed += 1
                parent = node
            if ok:
                idx.touch_l2_up(self.landed[-landed:] if landed else [])
            if dup:
                c.host_pool.free(dup)
        c.metrics_registry.add_many({"l3_loaded_pages": count,
                                     "bytes_l3_read": count * c.spec.page_bytes})
        with self.cv:
            self.n_landed += landed
            self.cv.notify_all()

    def done(self, result: PlanResult) -> None:
        """The plan finished (or released host pages a late store call held): free the host
        pages nothing landed in, but those a call past its deadline may still write into."""
        c = self.cache
        with c._lock:
            rest = let_go(result, self.host_pages[self.used:])
            if result.released_host_pages:
                c.host_pool.free(rest)
                return
            self.used = len(self.host_pages)
            if rest:
                c.host_pool.free(rest)
        with self.cv:
            self.finished = True
            self.cv.notify_all()


def let_go(result: PlanResult, pages: Sequence[int]) -> list[int]:
    """The host pages a read plan's ``result`` lets go of: those a late store call released
    (a release result), else ``pages`` but those a call past its deadline may still write
    into."""
    if result.released_host_pages:
        return list(result.released_host_pages)
    held = set(result.held_host_pages)
    return [p for p in pages if p not in held]


class WriteTask:
    """L2 -> L3 write of registered L2 pages (pinned while queued). With ``evict_after`` the
    pages are freed afterwards, children before parents; ``write[i]`` False marks a clean
    page that only waits for its children's write-back before it is freed."""

    def __init__(self, cache: "TieredKVCache", nodes: list[Node], evict_after: bool,
                 write: list[bool] | None = None):
        self.cache = cache
        self.nodes = nodes
        self.host_pages = [n.host_page for n in nodes]
        self.evict_after = evict_after
        self.write = write if write is not None else [True] * len(nodes)
        self._late: PlanResult | None = None   # booked once a late store call returns

    def plan(self) -> Plan:
        return Plan(self.cache._new_plan_id(), l3_writes=tuple(
            (hp, nd.key) for hp, nd, w in zip(self.host_pages, self.nodes, self.write)
            if w))                                                # type: ignore[misc]

    def booked(self, result: PlanResult) -> None:
        """Book the plan's result (`CacheExecutor.submit`'s ``on_done``). A store call past
        its deadline may still read its host pages: they stay pinned (not freed, not
        evicted) and the booking waits for the release that comes when the call returns."""
        if result.released_host_pages:
            late, self._late = self._late, None
            if late is None:
                return
            result = late
        elif result.held_host_pages:
            self._late = result
            return
        it = iter(result.l3_writes)
        self.done([next(it, False) if w else None for w in self.write])

    def done(self, ok: list[bool | None]) -> None:
        """Unpin the pages; free evicted ones. ``ok[i]`` None: not written."""
        c = self.cache
        written = sum(1 for v in ok if v)
        if written:
            c.unreadable.discard(nd.key for nd, v in zip(self.nodes, ok) if v)
        with c._lock:
            freed = after_l3_write(c._index, self.nodes, ok, evict_after=self.evict_after)
            if freed:
                c.host_pool.free(freed)
        c.metrics_registry.add_many({
            "l3_written_pages": written, "bytes_l3_written": written * c.spec.page_bytes,
            "l2_evictions": len(freed), "l2_writebacks": written if self.evict_after else 0})
        if written:
            probe_read(c, [nd.key for nd, v in zip(self.nodes, ok) if v])


def probe_read(c: "TieredKVCache", keys: list[bytes]) -> None:
    """Once, while the L3 read rate is not measured: read back up to `CostModel.L3_PROBE_PAGES`
    of the pages just written into free host pages (never evicting for it), so the rate is
    known before the first L3 hit and the split need not cap that read
    (`CostModel.first_read_cap`). The pages are freed when the read is done."""
    if not c.cost.enabled or c.cost.l3_bytes_per_s is not None or not c._l3_usable():
        return
    with c._lock:
        if c._l3_probed or c._closing:
            return
        pages = c.host_pool.alloc(min(len(keys), c.cost.L3_PROBE_PAGES,
                                      c.host_pool.free_count))
        if not pages:
            return
        c._l3_probed = True

    def done(res: PlanResult) -> None:
        with c._lock:
            c.host_pool.free(let_go(res, pages))
        c.metrics_registry.add("l3_probe_read_pages", sum(1 for v in res.l3_reads if v))

    plan = Plan(c._new_plan_id(), l3_reads=tuple(zip(keys, pages)))
    try:
        c._ex.submit(plan, on_done=done)
    except InvalidArgumentError:           # closing
        with c._lock:
            c.host_pool.free(pages)


def _new_task(c: "TieredKVCache", match: "Match", want: int, *, wait_room: bool
              ) -> ReadTask | None:
    """A `ReadTask` for the match's first ``want`` L3 pages, attached to it, into new host
    pages: fewer where L2 has no room (counted; none: the task is finished), room L2 is
    writing back to L3 waited for with ``wait_room``. None where another read started or
    the match was released meanwhile."""
    with c._lock:
        pages = eviction.alloc_host(c, want)
        wait = wait_room and len(pages) < want and eviction.writes_back(c)
    if wait:
        eviction.wait_writebacks(c)
    with c._lock:
        if wait:
            pages += eviction.alloc_host(c, want - len(pages))
        if match.read is not None or match.released:      # raced with another prefetch
            c.host_pool.free(pages)
            return None
        if len(pages) < want:
            c.metrics_registry.add("prefetch_no_space_pages", want - len(pages))
        task = ReadTask(c, match, pages)
        match.attach_read(task)
        task.finished = not pages
        return task


def start_read(c: "TieredKVCache", match: "Match", limit: int | None = None) -> None:
    """Start reading the match's L3 run (its first ``limit`` pages) into new host pages
    (idempotent). Room that L2 is writing back to L3 (write_back) is waited for, not
    skipped."""
    with c._lock:
        if match.read is not None or match.l3_count == 0 or not c._l3_usable():
            return
        want = match.l3_count if limit is None else min(limit, match.l3_count)
        if want <= 0:
            return
    task = _new_task(c, match, want, wait_room=True)
    if task is None or task.finished:
        return
    plan = Plan(c._new_plan_id(), l3_reads=tuple(zip(task.keys, task.host_pages)))
    try:
        c._ex.submit(plan, on_read=task.batch, on_done=task.done,
                     stop=lambda: task.cancelled)
    except InvalidArgumentError:           # closing
        task.done(plan.failed())


def stream_task(c: "TieredKVCache", match: "Match", want: int, *, wait_room: bool = False
                ) -> ReadTask | None:
    """Host pages for a fetch that reads the match's first ``want`` L3 pages in its own plan
    (streamed, `kvtier.cache.stream`, or each batch loaded as it lands); fewer where L2 has
    no room, None if it has none. ``wait_room``: room L2 is writing back to L3 is waited for,
    as `start_read` does. The fetch's plan result is booked through the task
    (`TieredKVCache._stream_booked`)."""
    task = _new_task(c, match, want, wait_room=wait_room)
    return task if task is not None and task.host_pages else None


def wait_read(c: "TieredKVCache", match: "Match", want: int) -> None:
    """Wait for ``want`` pages of the match's read, within the prefetch policy's budget
    (counted from the read's start); a store call past its deadline ends the wait."""
    task = match.read
    if task is None:
        return
    want = min(want, task.num_pages)
    budget = c.prefetch_policy.wait_budget_s(want * c.spec.page_size)
    remaining = budget - (time.perf_counter() - task.t0)
    pred = lambda: task.settled or task.n_landed >= want  # noqa: E731
    with task.cv:
        if pred() or remaining <= 0:
            return
        task.cv.wait_for(pred, None if math.isinf(remaining) else remaining)


def enqueue_write(c: "TieredKVCache", nodes: list[Node], *, evict_after: bool,
                  write: list[bool] | None = None) -> None:
    """Write pinned L2 pages to L3 (lock held); the data path drops (and counts) them when
    L3 is off or its write queue is full."""
    task = WriteTask(c, nodes, evict_after, write)
    plan = task.plan()
    if not plan.l3_writes:
        task.done([None] * len(nodes))
        return
    try:
        c._ex.submit(plan, on_done=task.booked)
    except InvalidArgumentError:           # closing
        c.metrics_registry.add("l3_writes_dropped", len(plan.l3_writes))
        task.done([None] * len(nodes))
