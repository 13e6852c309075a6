"""L1 <-> L2 transfer bookkeeping: waiting for copies on the host, the completion thread,
and how the controller books its backups (L1 -> L2) and fetches (L2 -> L1).

`host_wait` blocks until a `TransferHandle`'s copies have really landed (``synchronize()`` when
the handle has it, else ``wait()`` then polling ``done()``). `Completer` is one daemon thread
that waits for submitted handles in order and then runs their callbacks; the controller books
a finished backup or fetch there (`finish_backup`, `finish_fetch`), and `CacheExecutor`
finishes plans there. A page being copied is pinned (``backup_pending`` / the fetch's pins)
until its copy is booked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from ..errors import TransferError
from ..interfaces import TransferHandle
from .index import Node
from .plans import Plan, PlanResult, hit_counts

if TYPE_CHECKING:
    from .controller import TieredKVCache
    from .runs import PlanHandle
    from .handles import FetchHandle

log = logging.getLogger("kvtier.cache")

__all__ = ["host_wait", "landed", "Completer", "schedule_backup", "submit_backup", "undo_backup",
           "finish_backup", "finish_fetch"]


def host_wait(handle: TransferHandle) -> None:
    """Block the calling thread until ``handle``'s copies have really landed."""
    sync = getattr(handle, "synchronize", None)
    if sync is not None:
        sync()
        return
    handle.wait()
    delay = 20e-6
    while not handle.done():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


def landed(handle: TransferHandle) -> BaseException | None:
    """Wait (`host_wait`) for ``handle``'s copies; the error they ended with, if any."""
    try:
        host_wait(handle)
    except Exception as exc:
        return exc
    return None


class Completer:
    """One thread that waits for transfers to land and then runs their callbacks, in order."""

    def __init__(self, on_death: Callable[[BaseException], None]):
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._busy = 0
        self._on_death = on_death
        self.thread = threading.Thread(target=self._run, name="kvtier-cache-completer",
                                       daemon=True)
        self.thread.start()

    def submit(self, handle: TransferHandle, callback: Callable[[BaseException | None], None]
               ) -> None:
        if not self.thread.is_alive():        # dead (and reported): finish inline
            self._finish(handle, callback)
            return
        with self._cv:
            self._q.append((handle, callback))
            self._cv.notify()

    @staticmethod
    def _finish(handle: TransferHandle, callback: Callable) -> None:
        callback(landed(handle))

    def _run(self) -> None:
        item = None
        called = False                         # the current item's callback has run
        try:
            while True:
                with self._cv:
                    while not self._q and not self._stop:
                        self._cv.wait()
                    if not self._q:
                        return
                    item = self._q.popleft()
                    self._busy += 1
                called = False
                try:
                    err = landed(item[0])
                    called = True
                    item[1](err)
                finally:
                    with self._cv:
                        self._busy -= 1
                        self._cv.notify_all()
                item = None
        except BaseException as exc:
            self._on_death(exc)
            if item is not None and not called:   # its copy is not known to have landed
                try:
                    item[1](exc)
                except BaseException:  # pragma: no cover - already reported as dead
                    pass
            with self._cv:                     # finish what is queued, then exit
                items = list(self._q)
                self._q.clear()
            for it in items:
                try:
                    self._finish(*it)
                except BaseException:  # pragma: no cover - already reported as dead
                    pass

    def wait_idle(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: (not self._q and not self._busy)
                                     or not self.thread.is_alive(), timeout)

    def depth(self) -> int:
        with self._cv:
            return len(self._q) + self._busy

    def stop(self, timeout: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.thread.join(timeout)


# --------------------------------------------------------------------------------------------
# The controller's bookkeeping (lock held where said)
# --------------------------------------------------------------------------------------------
def schedule_backup(c: "TieredKVCache", nodes: list[Node]) -> None:
    """Copy those of ``nodes`` in L1, not in L2 and not on their way there to new host pages
    in the background (lock held)."""
    cand = [nd for nd in nodes if nd.device_page is not None and nd.host_page is None
            and not nd.backup_pending]
    if not cand:
        return
    pages = c._alloc_host(len(cand))
    if len(pages) < len(cand):
        c.metrics_registry.add("backup_skipped_pages", len(cand) - len(pages))
        cand = cand[:len(pages)]
        if not cand:
            return
    submit_backup(c, cand, pages, l3=c.write_policy.l3_on_backup)


def submit_backup(c: "TieredKVCache", nodes: list[Node], pages: list[int], *, l3: bool
                  ) -> "PlanHandle":
    """Pin ``nodes`` and start their copy into ``pages`` (lock held); booked by
    `finish_backup` when it lands."""
    pin_backup(c, nodes)
    plan = Plan(c._new_plan_id(), backups=tuple(
        (nd.device_page, hp) for nd, hp in zip(nodes, pages)))  # type: ignore[misc]
    t0 = time.perf_counter()

    def booked(res: PlanResult) -> None:
        err = None if all(res.backups) else TransferError("L1 -> L2 backup failed")
        finish_backup(c, nodes, pages, err, t0, l3=l3)
    try:
        return c._ex.submit(plan, on_done=booked)
    except BaseException:
        undo_backup(c, nodes, pages)
        raise


def pin_backup(c: "TieredKVCache", nodes: list[Node], pin: bool = True) -> None:
    """Pin ``nodes`` for their L1 -> L2 copy, or (``pin`` False) unpin them (lock held)."""
    step = 1 if pin else -1
    for nd in nodes:
        nd.backup_pending = pin
        c._index.backups_inflight += step
        nd.l1_pins += step


def undo_backup(c: "TieredKVCache", nodes: list[Node], pages: list[int]) -> None:
    pin_backup(c, nodes, False)
    c.host_pool.free(pages)


def finish_backup(c: "TieredKVCache", nodes: list[Node], pages: list[int],
                  err: BaseException | None, t0: float, *, l3: bool) -> None:
    """Book an L1 -> L2 copy: register the host pages (or free them if it failed) and, with
    ``l3``, queue their L3 write."""
    if err is not None:
        log.warning("kvtier cache: L1 -> L2 backup failed: %s", err)
    writes: list[Node] = []
    unused: list[int] = []
    idx = c._index
    with c._lock:
        pin_backup(c, nodes, False)
        for nd, p in zip(nodes, pages):
            if err is not None or nd.host_page is not None:
                unused.append(p)
                continue
            idx.l2_add(nd, p)
            if l3 and not nd.in_l3:
                writes.append(nd)
        if unused:
            c.host_pool.free(unused)
        done = len(nodes) - len(unused)
        if done:
            idx.touch_l2_up(nodes)
        if writes and c.store is not None:    # counted as dropped while L3 is off
            for nd in writes:
                nd.l2_pins += 1
            c._enqueue_write(writes, evict_after=False)
    if err is None:
        c.metrics_registry.add("bytes_d2h", len(nodes) * c.spec.page_bytes)
        c.metrics_registry.observe("backup_l2", time.perf_counter() - t0)


def finish_fetch(c: "TieredKVCache", fh: "FetchHandle", err: BaseException | None) -> None:
    """Book an L2 -> L1 load: register the loaded device pages in L1, pinned for the match."""
    idx = c._index
    with c._lock:
        if not fh.mark_finished(err):
            return
        m = fh.match
        for d in fh.device_pages:
            c._loading.pop(d, None)
        for nd in fh.nodes:            # the load no longer reads the host pages
            nd.l2_pins -= 1
        if err is not None:
            log.warning("kvtier cache: L2 -> L1 load failed: %s", err)
            return
        fresh: list[Node] = []
        loaded = list(zip(fh.nodes, fh.device_pages))
        if fh.in_place_pages:
            # pages loaded in place: in the index from now on (L1, and L3 where they came
            # from), under the node before them
            start = m.l1_count + m.l2_count
            keys = m.keys[start:start + len(fh.device_pages) - len(fh.nodes)]
            pkey = m.keys[start - 1] if start else None
            parent = idx.get(pkey) if pkey is not None else None
            if pkey is not None and parent is None:
                for d in fh.device_pages[len(fh.nodes):]:
                    fh.reject(d)           # the prefix went: these would be orphans
            else:
                for key, d in zip(keys, fh.device_pages[len(fh.nodes):]):
                    nd = idx.node(key, parent)
                    nd.in_l3 = True
                    loaded.append((nd, d))
                    parent = nd
        for nd, d in loaded:
            if nd.device_page is None:
                parent = nd.parent
                if parent is not None and parent.device_page is None:
                    fh.reject(d)           # cannot happen while the prefix is pinned
                    idx.maybe_drop(nd)     # a node made for an in-place page: no tier
                    continue
                idx.l1_add(nd, d)
                fresh.append(nd)
            elif nd.device_page != d:
                fh.reject(d)               # someone else loaded it meanwhile
                continue
            if not m.released and not m.holds(d):
                m.hold_l1(nd, d)
            m.take(d)
        touch = idx.l1_lru.touch
        for nd in reversed(fresh):
            touch(nd.key, nd)
        for nd in reversed(m.l1_nodes):
            if nd.device_page is not None:
                touch(nd.key, nd)
    n2, n3 = fh.from_l2, len(fh.device_pages) - fh.from_l2
    ps = c.spec.page_size
    c.metrics_registry.add_many(hit_counts(n2, n3, ps))
    c.metrics_registry.observe("load_l1", time.perf_counter() - fh.started_at)
