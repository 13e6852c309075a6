"""`CacheExecutor`: the data-path half of the cache, for the process that owns the KV buffers.

It runs `Plan` s made by a `CachePlanner` (in this process or another): host <-> device copies
through a `TransferEngine`, L3 reads and writes through an `L3Store` on a worker pool with
deadlines (`kvtier.cache.l3io`), loads straight from a store's shared memory where the store
allows it (`kvtier.cache.inplace`; ``in_place_why_not`` says why not), and hands back a
`PlanResult` per plan (one bool per operation). It keeps no index and makes no decision:
host page ids come from the planner, whose `PageIdPool` mirrors this executor's `HostKVPool`.

Usage (vLLM's worker-side connector)::

    ex = CacheExecutor.from_config(config, device_pool=device_pool)   # or the parts
    ex.submit(plan)                  # starts it; raises a typed error on a malformed plan
    ex.wait_layer(plan.plan_id, i)   # optional: layer i of the plan's loads is in place
    for result in ex.poll():         # finished plans since the last poll (plain data)
        send_to_scheduler(result)
    ex.close()

Failures are results, not exceptions: a transfer that fails, a store call that raises,
misses or passes its deadline marks its operations False. A call past its deadline may still
touch its host pages when it finally returns: the result lists them in ``held_host_pages``
(the planner keeps them out of use) and a second result for the same plan, with only
``released_host_pages``, comes from `poll` once the call has returned. Thread-safe.

A plan runs at most once: its id is refused by this executor ever after, even once its result
was polled (a replay would load whatever the host pages hold by then). A plan whose host
pages alias outside the two chains of `kvtier.cache.plans` is refused before it starts.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

from ..device_pool import DeviceKVPool
from ..errors import InvalidArgumentError, PageIndexError, TransferError
from ..host_pool import HostKVPool
from ..interfaces import L3Store, TransferEngine, TransferHandle
from ..metrics import Metrics
from .config import CacheConfig
from .cost import CostModel, TimedStore, load_seconds
from .inplace import InPlace, wait_staged
from .keying import make_keyer
from .lifecycle import set_switch_interval
from .parts import Parts, build_parts
from .l3io import L3IO, first_miss
from .plans import Plan, PlanResult
from .runs import PlanHandle, PlanIds, Run, StoreTask, close_one
from .stream import Stream, StreamTask, handles_for, stream_groups, takes_through, wait_started
from .transfers import Completer

log = logging.getLogger("kvtier.cache")

__all__ = ["CacheExecutor"]


class CacheExecutor:
    """Runs plans on the host pool, the transfer engine and the L3 store (module doc)."""

    #: How many submitted plan ids are remembered one by one (`PlanIds`).
    PLAN_IDS_REMEMBERED = 1 << 16

    def __init__(self, *, host_pool: HostKVPool, engine: TransferEngine,
                 store: L3Store | None = None, l3_io_threads: int = 2,
                 l3_batch_pages: int = 64, l3_error_limit: int = 8,
                 l3_call_timeout_s: float = 30.0, owned: tuple[Any, ...] = (),
                 cost: CostModel | None = None, in_place: InPlace | None = None,
                 in_place_why_not: str = "", l3_max_queued_pages: int | None = None,
                 metrics: Metrics | None = None, l3_name: str = "kvtier-executor-l3",
                 on_failure: Callable[[str, str, BaseException | None], None] | None = None,
                 l3_stream_layers: bool = False, l3_stream_spans: bool = True):
        self.host_pool = host_pool
        #: The store's memory seen as a host pool, for plans' ``l3_loads`` (None: those fail,
        #: and ``in_place_why_not`` says why).
        self.in_place = in_place
        self.in_place_why_not = in_place_why_not if in_place is None else ""
        #: The rates this data path achieves (its loads, its store's reads), for a planner
        #: elsewhere (`rates`); recompute observations go in it too.
        self.cost = cost if cost is not None else CostModel()
        self.engine = engine
        self.store = store
        #: The layer groups a plan's L3 reads stream in, each loaded as it lands
        #: (`kvtier.cache.stream`); () where loads wait for whole reads, and
        #: ``stream_why_not`` says why.
        self.read_groups: tuple[tuple[int, int], ...] = ()
        self.stream_why_not = "off (l3_stream_layers)"
        if l3_stream_layers:
            self.read_groups, self.stream_why_not = stream_groups(
                store, engine, host_pool.spec.num_layers)
        #: Whether those groups are read in doubling spans (`kvtier.cache.stream.read_spans`):
        #: asked, and the store's ``batch_get_layers`` takes ``through``.
        self.stream_spans = l3_stream_spans and takes_through(store)
        self.batch_pages = l3_batch_pages
        #: L3 writes beyond this many queued pages are dropped (counted in
        #: ``l3_writes_dropped``): a store slower than the saves never grows a backlog.
        self.max_queued_write_pages = l3_max_queued_pages
        self.metrics_registry = metrics if metrics is not None else Metrics()
        #: ``on_failure(tier, message, cause)``: a tier failed (``"l3"``: `L3IO` marked the
        #: store failed; ``"transfer"``: the completion thread died).
        self._on_failure = on_failure
        self._owned = list(owned)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._runs: dict[int, Run] = {}
        self._done: dict[Any, PlanResult] = {}
        self._held: dict[int, list[int]] = {}     # plan id -> host pages still held
        self._submitted = PlanIds(self.PLAN_IDS_REMEMBERED)
        self._serial = 0
        self._closed = False
        self._closing = False
        self._completer = Completer(self._completer_died)
        self.l3: L3IO | None = None
        if store is not None:
            timed = TimedStore(store, self.cost, host_pool.spec.page_bytes,
                               groups=self.read_groups, num_layers=host_pool.spec.num_layers)
            self.l3 = L3IO(timed, threads=l3_io_threads, error_limit=l3_error_limit,
                           call_timeout_s=l3_call_timeout_s, metrics=self.metrics_registry,
                           on_failure=self._l3_failed, name=l3_name)
        m = self.metrics_registry
        m.gauge("plans_running", lambda: len(self._runs))
        m.gauge("l3_state", lambda: self.l3_state)

    @classmethod
    def from_config(cls, config: CacheConfig | Mapping[str, Any], *,
                    device_pool: DeviceKVPool, num_host_pages: int | None = None,
                    engine_identity: Mapping[str, Any] | None = None) -> "CacheExecutor":
        """Create the host pool, engine and store ``config`` names (closed with it); the
        store in the key namespace of ``config``, the pool's layout and ``engine_identity``
        (`kvtier.cache.keying`), as its planner's."""
        cfg = CacheConfig.from_dict(config)
        keyer = make_keyer(cfg, device_pool.spec, device_layout=device_pool.page_order,
                           engine=engine_identity)
        parts = build_parts(cfg, device_pool, keyer, num_host_pages=num_host_pages)
        return cls.over_parts(cfg, parts, cost=CostModel.from_config(cfg))

    @classmethod
    def over_parts(cls, cfg: CacheConfig, parts: Parts, **kwargs: Any) -> "CacheExecutor":
        """The executor of ``cfg`` over ``parts`` (`build_parts`, closed with it); ``kwargs``:
        the constructor's other arguments. `from_config` and `TieredKVCache` build theirs
        here. Sets the interpreter's switch interval where ``cfg`` gives one."""
        set_switch_interval(cfg.switch_interval_s)
        return cls(host_pool=parts.host_pool, engine=parts.engine, store=parts.store,
                   l3_io_threads=cfg.l3_io_threads, l3_batch_pages=cfg.l3_batch_pages,
                   l3_error_limit=cfg.l3_error_limit, l3_call_timeout_s=cfg.l3_call_timeout_s,
                   owned=tuple(parts.owned), in_place=parts.in_place,
                   in_place_why_not=parts.in_place_why_not,
                   l3_max_queued_pages=cfg.l3_max_queued_pages,
                   l3_stream_layers=cfg.l3_stream_layers,
                   l3_stream_spans=cfg.l3_stream_spans, **kwargs)

    @property
    def l3_state(self) -> str:
        return self.l3.state if self.l3 is not None else "none"

    # ----- plans ------------------------------------------------------------------------------
    def submit(self, plan: Plan, *, on_done: Callable[[PlanResult], None] | None = None,
               on_read: Callable[[int, int, list[bool] | None], None] | None = None,
               stop: Callable[[], bool] | None = None, two_part: bool = False,
               whole_reads: bool = False) -> PlanHandle:
        """Start ``plan``; a malformed plan, or one whose id was submitted before (running,
        finished or polled long ago), raises before anything starts.

        ``on_done(result)``: called with the plan's result (and with a later release of held
        host pages) instead of queueing it for `poll`, on the thread that finished it.
        ``on_read(first, count, got)``: called as each batch of the plan's L3 reads comes
        back (reads ``first`` to ``first + count``; ``got`` None if the call failed), before
        the loads that wait on them start -- in a streamed plan (`kvtier.cache.stream`: its
        reads feed loads, and ``read_groups`` is set) once, for every page read, after the
        loads have started. ``stop()``: checked before each L3 call of the
        plan; True ends its store work there (the rest fail, untried).

        ``two_part``: a save whose L3 writes outlast its backups is reported in two results,
        as `PlanResult` describes (``writes_pending``): the first as soon as everything but
        the writes is done (its backed-up pages can serve hits; `wait_backups` waits for
        it), the second with the writes. A plan whose writes do not outlast the rest is
        reported in one result.

        ``whole_reads``: the plan's L3 reads feeding loads are read whole even where this
        executor streams them, each batch's loads starting as it lands."""
        self._validate(plan)
        run = Run(plan, on_done, on_read, stop, two_part)
        if self.read_groups and run.late_loads and not whole_reads:
            run.stream = Stream(run, self.read_groups, self.stream_spans)
        handle = PlanHandle(self, run)
        run.handle = handle
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the executor is closed", argument="executor")
            if plan.plan_id in self._submitted:
                raise InvalidArgumentError(f"plan {plan.plan_id} was already submitted to this "
                                           f"executor: a plan id runs once", argument="plan",
                                           value=plan.plan_id)
            self._submitted.add(plan.plan_id)
            self._runs[plan.plan_id] = run
            run.parts = 1                         # this call's own part, ended below
        try:
            if plan.backups:
                self._start_backups(run)
            if plan.l3_reads:
                self._start_store(run, list(range(len(plan.l3_reads))), is_read=True)
            if run.stream is not None:
                run.load_group_started()         # its L3 loads start group by group
            if run.now_loads:
                self._start_loads(run, run.now_loads)
            if plan.l3_loads:
                self._start_in_place(run)
            run.load_group_started()
            if run.now_writes:
                self._start_store(run, run.now_writes, is_read=False)
        finally:
            self._part_done(run, "submit")
        return handle

    def poll(self) -> list[PlanResult]:
        """Results of the plans finished since the last poll, in finishing order (and the
        release of held host pages, see the module doc)."""
        with self._lock:
            out = list(self._done.values())
            self._done.clear()
        return out

    def wait(self, plan_id: int, timeout: float | None = None) -> bool:
        """Wait until ``plan_id`` has finished (its result then comes from `poll`)."""
        with self._cv:
            return self._cv.wait_for(lambda: plan_id not in self._runs, timeout)

    def wait_backups(self, plan_id: int, timeout: float | None = None) -> bool:
        """Wait until everything of ``plan_id`` but its L3 writes is done: the first result
        of a ``two_part`` plan is made (or the plan has finished)."""
        with self._cv:
            return self._cv.wait_for(
                lambda: plan_id not in self._runs or self._runs[plan_id].interim, timeout)

    def wait_layer(self, plan_id: int, layer: int | None, timeout: float | None = None
                   ) -> BaseException | None:
        """Make the caller wait until layer ``layer`` (None: every layer) of the plan's loads
        is in the device pages: its stream on an accelerator (the engines' ``wait_layer`` /
        ``wait``; the thread goes on queueing work), its thread on the CPU. Returns the
        first error an engine raised (the plan's result reports it too)."""
        with self._lock:
            run = self._runs.get(plan_id)
        if run is None:
            return None
        run.loads_started.wait(timeout)
        handles = list(run.handles)
        first: BaseException | None = None
        if run.stream is not None:
            wait_started(run.stream, layer, timeout)
            handles += handles_for(run.stream, layer)
            short = run.stream.missing() if layer is None else 0
            if short:
                first = TransferError(f"plan {plan_id}: {short} of its pages were not read "
                                      "whole from L3 (their streamed loads are incomplete)")
        for h in handles:
            try:
                if layer is None:
                    h.wait()
                else:
                    h.wait_layer(layer)
            except Exception as exc:
                first = first or exc
        return first

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._runs, timeout)

    def metrics(self) -> dict[str, Any]:
        return self.metrics_registry.snapshot()

    def rates(self) -> dict[str, float | None]:
        """What this data path measured (`CostModel.rates`): L2 -> L1 loads (the engine's busy
        time of its copies where it gives one, else start to landed), L3 reads per store call
        (one still running counts while it runs), and the recompute rate from what the engine
        reported."""
        return self.cost.rates()

    def close(self, timeout: float = 30.0, *, cancel_writes: bool = False,
              flush: Callable[[], None] | None = None) -> None:
        """Finish running plans, stop the threads and close what `from_config` created, all
        within ``timeout`` (idempotent). Transfers in flight land first (their bookings may
        queue L3 writes); then queued L3 writes are cancelled (``cancel_writes``) or
        ``flush()`` may submit last ones; queued L3 reads are cancelled (they would only fill
        L2). Plans still running at the end are reported failed; a host pool that a store
        call stuck past its deadline may still write into is left open, and an owned object
        whose close does not return in time is left behind (logged)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True       # plans the bookings below submit still run
        deadline = time.monotonic() + timeout
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        self._completer.wait_idle(left())
        io = self.l3
        if io is not None:
            for task in io.queue.drain() if cancel_writes else []:
                task.abort(cancelled=True)
            if flush is not None and not cancel_writes and io.usable():
                flush()
            for task in io.queue.drain(reads_only=True):
                task.abort(cancelled=True)
        with self._lock:
            self._closed = True
        if not self.wait_idle(left()):
            log.error("kvtier executor: close timed out with plans in flight")
        if io is not None:
            io.stop(left())
        self._completer.stop(left())
        with self._cv:                  # stuck past the timeout: reported failed
            stuck_runs = list(self._runs.values())
            self._runs.clear()
            for run in stuck_runs:
                run.reported = True
                if run.on_done is None:
                    self._done[run.plan.plan_id] = run.failed()
            self._cv.notify_all()
        for run in stuck_runs:
            if run.on_done is not None:
                self._deliver(run.on_done, run.failed())
        stuck = io is not None and io.stuck_calls() > 0
        for obj in reversed(self._owned):
            if stuck and obj is self.host_pool:
                log.error("kvtier executor: an L3 call is stuck; the host pool is left open")
                continue
            closer = threading.Thread(target=close_one, args=(obj,), daemon=True,
                                      name="kvtier-close")
            closer.start()
            closer.join(left())
            if closer.is_alive():
                log.error("kvtier executor: closing %s did not return in time",
                          type(obj).__name__)

    def __enter__(self) -> "CacheExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- parts ------------------------------------------------------------------------------
    def _start_backups(self, run: Run) -> None:
        p = run.plan
        with self._lock:
            run.parts += 1
        try:
            h = self.engine.backup([d for d, _ in p.backups], [hp for _, hp in p.backups])
        except Exception as exc:
            log.warning("kvtier executor: backup failed to start: %s", exc)
            self._backups_done(run, exc)
            return
        self._completer.submit(h, lambda err: self._backups_done(run, err))

    def _backups_done(self, run: Run, err: BaseException | None) -> None:
        try:
            if err is None:
                run.backups = [True] * len(run.backups)
                self.metrics_registry.add("backup_pages", len(run.backups))
            else:
                self.metrics_registry.add("transfer_errors")
            if run.late_writes:
                ok_hp = {hp for (_, hp), ok in zip(run.plan.backups, run.backups) if ok}
                idx = [i for i in run.late_writes if run.plan.l3_writes[i][0] in ok_hp]
                if idx:
                    self._start_store(run, idx, is_read=False)
        finally:
            self._part_done(run, "backups")

    def _start_store(self, run: Run, idx: list[int], *, is_read: bool) -> None:
        with self._lock:
            run.parts += 1
            run.write_parts += not is_read
        task: StoreTask | StreamTask = StreamTask(self, run) \
            if is_read and run.stream is not None else StoreTask(self, run, idx, is_read=is_read)
        limit = self.max_queued_write_pages
        if self.l3 is None or not self.l3.usable() or (
                not is_read and limit is not None
                and self.l3.queue.queued_write_pages + len(idx) > limit):
            task.abort(cancelled=False)
            return
        self.l3.submit(task)

    def _start_loads(self, run: Run, idx: list[int]) -> None:
        p = run.plan
        with self._lock:
            run.parts += 1
        t0 = time.perf_counter()
        try:
            h = self.engine.load([p.loads[i][0] for i in idx], [p.loads[i][1] for i in idx])
        except Exception as exc:
            log.warning("kvtier executor: load failed to start: %s", exc)
            self._loads_done(run, idx, exc)
            return
        run.handles.append(h)      # loads_started is set once every load has its handle
        self._completer.submit(h, lambda err: self._loads_done(run, idx, err, h, t0))

    def _start_late_loads(self, run: Run, *, final: bool = False) -> None:
        """Start the loads of the plan's leading run of L3 reads that came back, where not
        started yet: each batch's loads start as it lands, beside the next batch's read, so
        a load waits for little more than its last batch (a streamed plan's reads run as a
        `StreamTask`, which starts its loads group by group instead). A read after a miss
        feeds no load: the device pages past a prefix stay the engine's, and nothing may
        still be writing into them. ``final``: the reads are over; none start after this."""
        with run.late_lock:
            if run.late_closed:
                return
            lead = first_miss(run.reads, len(run.reads))
            idx = [run.load_of_read[j] for j in range(run.late_started, lead)
                   if j in run.load_of_read]
            run.late_started = max(run.late_started, lead)
            run.late_closed = final
            if idx:
                self._start_loads(run, idx)

    def _loads_done(self, run: Run, idx: list[int], err: BaseException | None,
                    handle: TransferHandle | None = None, t0: float = 0.0) -> None:
        try:
            if err is None:
                for i in idx:
                    run.loads[i] = True
                self.metrics_registry.add("loaded_pages", len(idx))
                if handle is not None:
                    self.cost.observe_load(len(idx) * self.host_pool.spec.page_bytes,
                                           load_seconds(handle, t0))
            else:
                self.metrics_registry.add("transfer_errors")
        finally:
            self._part_done(run, "loads")

    def _start_in_place(self, run: Run) -> None:
        """Load the plan's ``l3_loads`` from the slots of the leading run the store holds,
        pinned (no writer of any process changes them) until the load has landed."""
        p = run.plan
        m = self.metrics_registry
        with self._lock:
            run.parts += 1
        direct = self.in_place
        if direct is None or self.l3 is None or not self.l3.usable():
            m.add("l3_in_place_refused_pages", len(p.l3_loads))
            self._part_done(run, "in_place")
            return
        keys = [k for k, _ in p.l3_loads]
        self._pin_and_load(run, keys, stage=p.stage)

    def _pin_and_load(self, run: Run, keys: list[bytes], stage: bool) -> None:
        """Pin the leading run of ``keys`` the arena holds and load it. ``stage``: where the
        run is short and the store stages (`L3Store.stage`), let go, have it staged and
        come back here from a thread of its own once that is done (bounded by the store's
        timeout): the caller's thread never waits for it."""
        p, m, direct = run.plan, self.metrics_registry, self.in_place
        assert direct is not None
        try:
            slots = direct.reads.pin(keys)
        except Exception as exc:
            log.warning("kvtier executor: pinning %d L3 pages failed: %s", len(keys), exc)
            m.add("l3_read_failed_call_pages", len(keys))
            self._part_done(run, "in_place")
            return
        if stage and len(slots) < len(keys) and self.l3 is not None:
            ticket = None
            try:
                ticket = self.l3.store.stage(keys[len(slots):])
            except Exception as exc:        # a broken store: what is in the arena loads
                log.warning("kvtier executor: staging %d L3 pages failed: %s",
                            len(keys) - len(slots), exc)
                m.add("l3_stage_errors")
            if ticket is not None:
                direct.reads.unpin(slots)
                run.defer_load_group()          # wait_layer waits for the load's handle
                threading.Thread(target=self._when_staged, args=(run, keys, ticket),
                                 daemon=True, name="kvtier-stage-wait").start()
                return
        m.add("l3_read_missed_pages", len(keys) - len(slots))   # gone since the lookup
        if run.handle is not None:
            run.handle.in_place_pages = len(slots)
        if not slots:
            self._part_done(run, "in_place")
            return
        t0 = time.perf_counter()
        try:
            h = direct.engine.load(slots, [d for _, d in p.l3_loads[:len(slots)]])
        except Exception as exc:
            log.warning("kvtier executor: in-place load failed to start: %s", exc)
            self._in_place_done(run, slots, exc)
            return
        run.handles.append(h)
        self._completer.submit(h, lambda err: self._in_place_done(run, slots, err, h, t0))

    def _when_staged(self, run: Run, keys: list[bytes], ticket: Any) -> None:
        try:
            t0 = time.perf_counter()
            wait_staged(ticket, self.metrics_registry)
            self.metrics_registry.observe("l3_stage_wait", time.perf_counter() - t0)
            self._pin_and_load(run, keys, stage=False)
        finally:
            run.load_group_started()       # its handle (if any) is in run.handles now
            ticket.cancel()                # pinned by the load: the store's hold can go

    def _in_place_done(self, run: Run, slots: list[int], err: BaseException | None,
                       handle: TransferHandle | None = None, t0: float = 0.0) -> None:
        try:
            self.in_place.reads.unpin(slots)    # type: ignore[union-attr]
            if err is None:
                run.in_place[:len(slots)] = [True] * len(slots)
                nbytes = len(slots) * self.host_pool.spec.page_bytes
                self.metrics_registry.add_many({"l3_in_place_pages": len(slots),
                                                "loaded_pages": len(slots)})
                if handle is not None:
                    self.cost.observe_load(nbytes, load_seconds(handle, t0))
            else:
                self.metrics_registry.add("transfer_errors")
        finally:
            self._part_done(run, "in_place")

    def _part_done(self, run: Run, part: str) -> None:
        if part == "reads" and run.late_loads and run.stream is None:
            self._start_late_loads(run, final=True)
            run.load_group_started()
        interim = None
        with self._cv:
            run.parts -= 1
            run.write_parts -= part == "writes"
            if run.parts and run.two_part and not run.interim and not run.reported \
                    and run.parts == run.write_parts:
                run.interim = True           # only the writes run: the rest is reported
                interim = run.interim_result()
                if run.on_done is None:
                    self._done[(run.plan.plan_id, "interim")] = interim
                self._cv.notify_all()
        if interim is not None:
            if run.on_done is not None:
                self._deliver(run.on_done, interim)
            run.interim_out.set()
        with self._cv:
            if run.parts or run.reported:     # reported: a close gave up on it already
                return
            run.reported = True
            result = run.result()
            if run.held:
                self._held[run.plan.plan_id] = list(run.held)
        if run.on_done is not None:
            if run.interim:
                run.interim_out.wait()          # the first result goes first
            self._deliver(run.on_done, result)
        if run.handle is not None:
            run.handle.result = result          # done() once booked
        with self._cv:
            del self._runs[run.plan.plan_id]
            if run.on_done is None:
                self._done[run.plan.plan_id] = result
            self._cv.notify_all()

    @staticmethod
    def _deliver(on_done: Callable[[PlanResult], None], result: PlanResult) -> None:
        try:
            on_done(result)
        except Exception:
            log.exception("kvtier executor: booking the result of plan %d failed",
                          result.plan_id)

    def _release_held(self, run: Run, pages: list[int]) -> None:
        """A call past its deadline came back: the host pages it held are free again."""
        pid = run.plan.plan_id
        with self._cv:
            for p in pages:
                run.held.remove(p)
            if not run.reported:        # the result will not hold them
                return
            held = self._held.get(pid, [])
            for p in pages:
                held.remove(p)
            if not held:
                self._held.pop(pid, None)
            released = PlanResult(pid, released_host_pages=tuple(pages))
            if run.on_done is None:
                self._serial += 1
                self._done[(pid, "released", self._serial)] = released
            self._cv.notify_all()
        if run.on_done is not None:
            self._deliver(run.on_done, released)

    def _completer_died(self, exc: BaseException) -> None:
        message = f"completion thread died: {type(exc).__name__}: {exc}"
        self.metrics_registry.add("transfer_failures")
        log.error("kvtier executor: transfer tier failed: %s", message, exc_info=exc)
        if self._on_failure is not None:
            self._on_failure("transfer", message, exc)

    def _l3_failed(self, message: str, cause: BaseException | None) -> None:
        if self._on_failure is not None:
            self._on_failure("l3", message, cause)

    def _validate(self, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise InvalidArgumentError(f"submit needs a Plan, got {type(plan).__name__}",
                                       argument="plan")
        plan.check_shape()
        nh, nd = self.host_pool.num_pages, self.engine.device_pool.num_pages
        if (plan.l3_reads or plan.l3_writes) and self.store is None:
            raise InvalidArgumentError("the plan has L3 operations but this executor has no "
                                       "L3 store", argument="plan", value=plan.plan_id)

        def pages(vals: list[Any], limit: int, what: str) -> None:
            for v in vals:
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < limit:
                    raise PageIndexError(f"plan {plan.plan_id}: {what} {v!r} out of range "
                                         f"[0, {limit})", index=v, limit=limit)
            if len(set(vals)) != len(vals):
                raise PageIndexError(f"plan {plan.plan_id}: {what}s repeat")

        if plan.l3_loads and self.store is None:
            raise InvalidArgumentError("the plan loads L3 pages in place but this executor "
                                       "has no L3 store", argument="plan", value=plan.plan_id)
        pages([hp for _, hp in plan.l3_reads], nh, "L3 read host page")
        pages([hp for hp, _ in plan.loads], nh, "load host page")
        pages(list(plan.load_pages), nd, "load device page")
        pages([d for d, _ in plan.backups], nd, "backup device page")
        pages([hp for _, hp in plan.backups], nh, "backup host page")
        pages([hp for hp, _ in plan.l3_writes], nh, "L3 write host page")
        if set(plan.load_pages) & set(d for d, _ in plan.backups):
            raise PageIndexError(f"plan {plan.plan_id}: a device page is both loaded and "
                                 "backed up")
        # Host pages: an L3 read -> load and a backup -> L3 write are ordered (plans module
        # doc); any other page two operations share would race a fill.
        read_hp = {hp for _, hp in plan.l3_reads}
        backup_hp = {hp for _, hp in plan.backups}
        for a, b, what in ((read_hp, {hp for hp, _ in plan.l3_writes},
                            "filled by an L3 read and the source of an L3 write"),
                           (backup_hp, {hp for hp, _ in plan.loads},
                            "filled by a backup and the source of a load"),
                           (read_hp, backup_hp, "filled by both an L3 read and a backup")):
            both = sorted(a & b)
            if both:
                raise PageIndexError(f"plan {plan.plan_id}: host page(s) {both} {what} in "
                                     f"one plan (it would race the fill)", index=both[0],
                                     limit=nh)

