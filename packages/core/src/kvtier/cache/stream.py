"""Streamed L3 reads: a plan's L3 pages land layer group by layer group, and each group's
loads into the device start as soon as it has landed.

Where the store reads layer ranges (`L3Store.read_groups`) and the transfer engine loads them
(`Capabilities.layer_ranges`), a `CacheExecutor` reads the L3 pages of a plan whose loads they
feed group-major: layers of group 0 of every page, then group 1, and so on, each range checked
by the store on its own checksum. Once group ``g`` is back for the leading pages still good,
their loads of that group's layers start, and ``wait_layer(i)`` on the plan waits for the
group of layer ``i`` only: the prefill's first layers run while later ones are still read.

The groups are read in spans (`read_spans`): the first group alone, then each span as many
groups as were read before it (of 8 groups: 1, 1, 2, 4), each span one ranged read of each
page and one load, so the prefill's first layers wait for one group while the reads and loads
number a few per page instead of one per group (with ``spans=False``, or a store whose
``batch_get_layers`` takes no ``through``: one span per group).

A page is read only once every group of it came back. The first group is read as a whole
read is (batches in order until one with a miss); later groups read the pages still good.
Only the leading run of good pages is loaded. A page whose later group missed has had its
earlier groups loaded: its load is reported failed, never booked, and the engine recomputes
it, as it does any failed load (`PlanHandle.wait` raises). How many leading pages a plan can
load from L3 is known once the first group is back (`Stream.first_group`). A store call past its
deadline ends the read at once; the groups not started then start no load, so no waiter
hangs on them.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from ..interfaces import L3Store, TransferEngine, TransferHandle
from .cost import group_bytes, load_seconds
from .l3io import L3IO, first_miss
from .runs import StoreTask

if TYPE_CHECKING:
    from .executor import CacheExecutor
    from .runs import Run

log = logging.getLogger("kvtier.cache")

__all__ = ["stream_groups", "read_spans", "takes_through", "Stream", "StreamTask"]

Groups = tuple[tuple[int, int], ...]


def takes_through(store: L3Store | None) -> bool:
    """Whether ``store.batch_get_layers`` takes ``through`` (reads a span of groups as one
    range): declared by its signature; a store written before spans reads one group a call."""
    fn = getattr(store, "batch_get_layers", None)
    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "through" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def read_spans(n: int, doubling: bool = True) -> list[tuple[int, int]]:
    """The spans ``(first, last)`` (inclusive) that ``n`` groups are read in: doubling, the
    first group alone and then each span as many groups as came before it; else one span per
    group."""
    if not doubling:
        return [(g, g) for g in range(n)]
    spans, at = [], 0
    while at < n:
        last = min(n, at + max(1, at)) - 1
        spans.append((at, last))
        at = last + 1
    return spans


def stream_groups(store: L3Store | None, engine: TransferEngine, num_layers: int
                  ) -> tuple[Groups, str]:
    """The layer groups L3 reads stream in, and why not ("" when they do): the store's
    `read_groups` where the engine loads layer ranges, the groups cover every layer in order
    and there are at least two of them."""
    if store is None:
        return (), "no L3 store"
    if not type(engine).capabilities().layer_ranges:
        return (), f"the {engine.name!r} transfer engine loads whole pages only"
    try:
        groups = tuple((int(lo), int(hi)) for lo, hi in store.read_groups())
    except Exception as exc:
        return (), f"the store's read_groups() failed: {type(exc).__name__}: {exc}"
    if not groups:
        return (), f"the {store.name!r} store reads whole pages only"
    at = 0
    for lo, hi in groups:
        if lo != at or hi <= lo:
            return (), f"the store's read groups {groups} do not cover the layers in order"
        at = hi
    if at != num_layers:
        return (), f"the store's read groups {groups} do not cover {num_layers} layers"
    if len(groups) < 2:
        return (), "the store reads one group (whole pages)"
    return groups, ""


class Stream:
    """A streamed plan's state on its `Run`: each group's loads and whether they started."""

    def __init__(self, run: "Run", groups: Groups, spans: bool = True):
        self.groups = groups
        #: The spans the groups are read and loaded in (`read_spans`).
        self.spans = read_spans(len(groups), spans)
        p = run.plan
        read_of = {hp: j for j, (_, hp) in enumerate(p.l3_reads)}
        #: The read feeding each of the plan's loads from L3 (`Run.late_loads`).
        self.read_of = {i: read_of[p.loads[i][0]] for i in run.late_loads}
        self.started = [threading.Event() for _ in groups]
        #: Leading reads each group's loads covered once started (0: a group never read).
        self.good_at = [0] * len(groups)
        self.handles: list[list[TransferHandle]] = [[] for _ in groups]
        self.loaded = {i: 0 for i in run.late_loads}   # groups of each load that landed
        self.lock = threading.Lock()

    def span_layers(self, span: tuple[int, int]) -> tuple[int, int]:
        """The layers ``(lo, hi)`` of groups ``span[0]`` through ``span[1]``."""
        return self.groups[span[0]][0], self.groups[span[1]][1]

    def group_of(self, layer: int) -> int:
        for g, (lo, hi) in enumerate(self.groups):
            if lo <= layer < hi:
                return g
        return len(self.groups) - 1         # out of range: the engines' handles raise

    def start_rest(self) -> None:
        """No more groups will start loads: their waiters go on."""
        for ev in self.started:
            ev.set()

    def missing(self) -> int:
        """Loads of the plan that started (their first group landed) and missed a later
        group: incomplete in their device pages (meaningful once every group has started).
        Loads whose first group never landed never started: failed, not incomplete."""
        least, first = min(self.good_at), self.good_at[0]
        return sum(1 for j in self.read_of.values() if least <= j < first)

    def first_group(self, timeout: float | None = None) -> int:
        """Wait for the first group's loads to start; how many leading L3 pages they load
        (the most the plan can load from L3: a later group can only cut it shorter)."""
        self.started[0].wait(timeout)
        return self.good_at[0]


class StreamTask(StoreTask):
    """A streamed plan's L3 reads, group-major, in batches of the executor's
    ``batch_pages``; its calls run under the deadline as `StoreTask` 's do (a call past it
    ends the reads, its host pages held until it returns), and then no more groups start."""

    def __init__(self, ex: "CacheExecutor", run: "Run"):
        super().__init__(ex, run, list(range(len(run.plan.l3_reads))), is_read=True)

    def run(self, io: L3IO) -> None:
        run, ex = self.run_, self.ex
        st: Stream = run.stream               # type: ignore[assignment]
        keys = [k for k, _ in run.plan.l3_reads]
        pages = [hp for _, hp in run.plan.l3_reads]
        n = len(keys)
        m = ex.metrics_registry
        fn = io.store.batch_get_layers
        batch = ex.batch_pages
        alive = [False] * n      # pages every group so far came back for
        tried = 0
        complete = False
        failed_calls = 0
        try:
            for g, h in st.spans:
                # the first span as a whole read: batches in order until one with a miss;
                # later spans: the pages still alive among those
                cand = list(range(n)) if g == 0 else [j for j in range(tried) if alive[j]]
                cut = False
                for s in range(0, len(cand), batch):
                    if not io.usable() or self._stop():
                        cut = True
                        break
                    js = cand[s:s + batch]
                    kb, pb = [keys[j] for j in js], [pages[j] for j in js]
                    self._calling(pb)
                    args = (kb, pb, g) if g == h else (kb, pb, g, h)
                    ok = io.call("batch_get_layers", fn, *args, task=self,
                                 check=lambda r, c=len(kb): isinstance(r, list) and len(r) == c)
                    self._calling([])
                    if self._stop():
                        cut = True
                        break
                    got = None if ok is None else [v is True for v in ok]
                    if got is None:
                        failed_calls += len(kb)
                    else:
                        io.read_outcome(sum(got), len(kb) - sum(got))
                    for j, v in zip(js, got or [False] * len(js)):
                        alive[j] = v
                    if g == 0:
                        tried = js[-1] + 1
                        run.reads_tried = tried
                        if first_miss(got, len(js)) < len(js):
                            break
                if cut:
                    break
                good = first_miss(alive, n)       # the leading run: only it is loaded
                start_group(ex, run, (g, h), good)
                if not any(alive):
                    break
            else:
                complete = True
            done = [alive[j] and complete for j in range(tried)]
            for j, v in enumerate(done):
                run.reads[j] = v
            m.add_many({"l3_read_failed_call_pages": min(failed_calls, tried),
                        "l3_read_missed_pages": max(0, tried - sum(done) - failed_calls),
                        "l3_read_skipped_pages": 0 if self._gave_up else n - tried,
                        "l3_streamed_pages": sum(done)})
            if run.on_read is not None and tried and not self._gave_up:
                run.on_read(0, tried, done)
        finally:
            st.start_rest()
            self._end()

    def deadline_passed(self) -> None:
        self.run_.stream.start_rest()         # type: ignore[union-attr]
        super().deadline_passed()

    def abort(self, cancelled: bool) -> None:
        self.run_.stream.start_rest()         # type: ignore[union-attr]
        super().abort(cancelled)


def start_group(ex: "CacheExecutor", run: "Run", span: tuple[int, int], good: int) -> None:
    """Groups ``span[0]`` through ``span[1]`` of a streamed plan's L3 reads came back for
    its leading ``good`` pages: start those pages' loads of the span's layers (on the reading
    thread)."""
    st = run.stream
    assert st is not None
    g, h = span
    for k in range(g, h + 1):
        st.good_at[k] = good
    idx = [i for i, j in st.read_of.items() if j < good]
    if not idx:
        for k in range(g, h + 1):
            st.started[k].set()
        return
    p = run.plan
    with ex._lock:
        run.parts += 1
    t0 = time.perf_counter()
    try:
        hd = ex.engine.load([p.loads[i][0] for i in idx], [p.loads[i][1] for i in idx],
                            layers=st.span_layers(span))
    except Exception as exc:
        log.warning("kvtier executor: a streamed load failed to start: %s", exc)
        for k in range(g, h + 1):
            st.started[k].set()
        group_loaded(ex, run, span, idx, exc)
        return
    for k in range(g, h + 1):
        st.handles[k].append(hd)
        st.started[k].set()
    ex._completer.submit(hd, lambda err: group_loaded(ex, run, span, idx, err, hd, t0))


def group_loaded(ex: "CacheExecutor", run: "Run", span: tuple[int, int], idx: list[int],
                 err: BaseException | None, handle: TransferHandle | None = None,
                 t0: float = 0.0) -> None:
    """A span's loads landed: a load is done once every group of it has."""
    st = run.stream
    assert st is not None
    g, h = span
    try:
        if err is None:
            whole = []
            with st.lock:
                for i in idx:
                    st.loaded[i] += h - g + 1
                    if st.loaded[i] == len(st.groups):
                        whole.append(i)
            for i in whole:
                run.loads[i] = True
            ex.metrics_registry.add("loaded_pages", len(whole))
            if handle is not None:
                spec = ex.host_pool.spec
                ex.cost.observe_load(
                    group_bytes(spec.page_bytes, spec.num_layers, st.span_layers(span),
                                len(idx)),
                    load_seconds(handle, t0))
        else:
            ex.metrics_registry.add("transfer_errors")
    finally:
        ex._part_done(run, "loads")


def handles_for(st: Stream, layer: int | None) -> Sequence[Any]:
    if layer is None:
        return [h for hs in st.handles for h in hs]
    return list(st.handles[st.group_of(layer)])


def wait_started(st: Stream, layer: int | None, timeout: float | None) -> None:
    if layer is None:
        end = None if timeout is None else time.monotonic() + timeout
        for ev in st.started:
            ev.wait(None if end is None else max(0.0, end - time.monotonic()))
    else:
        st.started[st.group_of(layer)].wait(timeout)
