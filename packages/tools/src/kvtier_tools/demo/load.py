"""The demo under load: requests arrive by an arrival process, wait in a FIFO queue and are
served by the engine one at a time; TTFT counts the wait.

Arrival processes: open loop, Poisson at a rate given as a fraction of the L1-only capacity
the serial replay measured (its requests per second of busy time), or in requests per second;
closed loop, N users each sending its conversations' turns one after another, a turn a think
time after the previous one's first token.

Time is simulated where that is exact and real where the cache needs it. The queue is a
discrete-event simulation: a request is dispatched at ``max(its arrival, the engine free)``,
its first token comes its measured TTFT later and the engine is free again after its commit,
both measured by really serving it (`DemoEngine.serve`). Idle gaps cost no wall time, and the
machine's noise does not pile up in the queue. The L3 reads are real: a request's match and
prefetch (`TieredKVCache.prefetch`) are made when it arrives -- while the engine serves the
request in front, a thread admits each arrival at its instant, real time since the service
began standing for simulated time -- and at dispatch the part of the read that has not landed
is the request's L3 wait, counted in its TTFT; a read that landed costs nothing. L2 -> L1
loads run layer by layer at dispatch, as in the serial replay. With ``preload`` the request
next in the queue (queued, or arriving during the prefill ahead with nothing queued) has its
hits loaded while the request ahead prefills, once its L3 run has landed
(`DemoEngine.preload`), and is served on the match made for that load.
The setups run one after the other (not interleaved: another setup's request would give the
reads in flight free time).

The demo's model prefills one sequence per forward (its attention runs on one request's
paged prefix), so prefills of different lengths are not batched: the engine serves the queue
one request at a time, in arrival order. A load whose work exceeds the time it arrives in
(``utilisation = rate x mean service >= 1``) has a queue that grows without bound: it is
reported as overloaded, with no mean taken over it.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvtier.errors import ConfigError
from .engine import RequestResult
from .workload import Request, Workload

#: The default sweep of ``--loads``: fractions of the L1-only capacity.
DEFAULT_LOADS = (0.5, 0.8, 0.95)


def check_positive(name: str, value: Any, *, integer: bool = False,
                   zero: bool = False) -> None:
    """A rate, a load fraction or a concurrency: a finite number > 0 (``zero``: >= 0)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
    if ok and integer:
        ok = float(value) == int(value)
    if ok:
        v = float(value)
        ok = math.isfinite(v) and (v >= 0 if zero else v > 0)
    if not ok:
        what = "an int" if integer else "a finite number"
        raise ConfigError(f"{name} must be {what} {'>= 0' if zero else '> 0'}, got {value!r}",
                          key=name, value=value)


@dataclass(frozen=True)
class Level:
    """One load level: ``kind`` "open" (Poisson; ``load`` a fraction of the L1-only capacity
    or None, ``rate`` requests/s) or "closed" (``users`` concurrent, ``think_s``)."""

    kind: str
    rate: float | None = None
    load: float | None = None
    users: int | None = None
    think_s: float = 0.0

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"closed {self.users}"
        if self.load is not None:
            return f"{100 * self.load:g}%"
        return f"{self.rate:g} req/s"


@dataclass
class Served:
    """One request's passage through the queue (simulated seconds)."""

    arrival: float
    dispatch: float
    first_token: float
    done: float
    result: RequestResult
    prefetched: bool            # its L3 read started at arrival

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrival

    @property
    def wait_s(self) -> float:
        return self.dispatch - self.arrival


@dataclass
class LoadRun:
    """One setup at one load level."""

    setup: str
    level: Level
    served: list[Served]
    checks: int = 0
    max_queue: int = 0
    released_for_room: int = 0      # queued matches released to make room in L1
    #: The transfer engine's own ``stats()`` at the end of the run, where it has them (the
    #: router's paths and in-use checks): recorded, not tabled.
    engine_stats: dict[str, Any] = field(default_factory=dict)
    #: why a queued request was not preloaded (`DemoEngine.preload_skips`), and how often
    preload_skips: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        s = self.served
        res = [x.result for x in s]
        ttft = np.array([x.ttft_s for x in s]) * 1e3
        tokens = sum(r.tokens for r in res)
        span = max(x.first_token for x in s) - min(x.arrival for x in s) if s else 0.0
        service = float(np.mean([x.done - x.dispatch for x in s])) if s else 0.0
        if self.level.kind == "open":
            util = (self.level.rate or 0.0) * service
        else:
            util = sum(x.done - x.dispatch for x in s) / span if span > 0 else 0.0
        return {
            "setup": self.setup, "level": self.level.label, "kind": self.level.kind,
            "load": self.level.load, "rate_per_s": self.level.rate, "users": self.level.users,
            "think_ms": 1e3 * self.level.think_s, "requests": len(s), "prompt_tokens": tokens,
            "utilisation": util, "overloaded": self.level.kind == "open" and util >= 1.0,
            **_ttft_and_hits(ttft, res, tokens),
            "wait_mean_ms": mean_ms(s, "wait_s"),
            "service_mean_ms": 1e3 * service, "max_queue": self.max_queue,
            "requests_per_s": len(s) / span if span > 0 else 0.0,
            "tokens_per_s": tokens / span if span > 0 else 0.0,
            "l3_wait_mean_ms": mean_ms(res, "l3_wait_s"),
            "preloaded_pct": 100.0 * sum(r.preloaded for r in res) / len(res) if res else 0.0,
            **_service_parts(res),
            "computed_tokens": sum(r.computed_tokens for r in res),
            "restored_pages_checked": sum(r.restored_checked for r in res),
            "checks_passed": self.checks, "released_for_room": self.released_for_room,
            "preload_skips": dict(self.preload_skips),
        }


def open_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` Poisson arrival instants at ``rate`` per second, the first at 0."""
    gaps = np.random.default_rng([int(seed), 0x6C64]).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def closed_users(workload: Workload, users: int) -> list[list[Request]]:
    """The workload's conversations dealt to ``users`` users (conversation c to user
    c mod users), each user's turns in replay order; requests without a conversation
    (``client`` -1) are dealt one by one."""
    out: list[list[Request]] = [[] for _ in range(users)]
    for r in workload.requests:
        out[(r.client if r.client >= 0 else r.index) % users].append(r)
    return [u for u in out if u]


@dataclass(order=True)
class _Entry:
    arrival: float
    seq: int
    request: Request = field(compare=False)
    user: int = field(compare=False, default=-1)
    match: Any = field(compare=False, default=None)
    admitted: bool = field(compare=False, default=False)
    preload_tried: bool = field(compare=False, default=False)


def serve_queue(engine: Any, workload: Workload, level: Level,
                check: Callable[[int, int], bool] | bool = False, *, seed: int = 0,
                name: str = "", arrivals: list[float] | None = None,
                on_result: Callable[[Request, RequestResult], None] | None = None,
                real_time_admission: bool = True, preload: bool = False) -> LoadRun:
    """Serve ``workload`` on ``engine`` (a `DemoEngine`) under ``level``'s arrivals, FIFO,
    one request at a time (see the module docstring). ``arrivals``: open loop, the arrival
    instants (seconds) instead of Poisson ones at ``level.rate``. ``preload``: load the next
    queued request's hits while the request ahead prefills (False: all at dispatch)."""
    pending: list[_Entry] = []
    seq = 0
    users: list[list[Request]] = []
    if level.kind == "open":
        if arrivals is None:
            assert level.rate is not None
            arrivals = open_arrivals(len(workload), level.rate, seed)
        for t, r in zip(arrivals, workload.requests):
            pending.append(_Entry(t, seq, r))
            seq += 1
    else:
        assert level.users is not None
        users = closed_users(workload, level.users)
        rng = np.random.default_rng([int(seed), 0x636C])
        for u, reqs in enumerate(users):
            t = float(rng.exponential(level.think_s)) if level.think_s > 0 else 0.0
            pending.append(_Entry(t, seq, reqs.pop(0), u))
            seq += 1
    heapq.heapify(pending)
    queue: deque[_Entry] = deque()
    lock = threading.Lock()
    run = LoadRun(name, level, [])

    # the queue-aware split: an arrival's expected wait for its turn, from the requests ahead
    # of it and the mean service time measured so far (an L3 read that lands within it
    # costs the request nothing, so the split reads those pages)
    busy = {"until": 0.0, "service": 0.0, "served": 0}

    def expected_wait(e: _Entry) -> float:
        with lock:
            ahead = sum(1 for q in queue if q is not e)
            mean = busy["service"] / busy["served"] if busy["served"] else 0.0
            return max(0.0, busy["until"] - e.arrival) + ahead * mean

    # the keys of the request being served, once its prefill is launched (None before):
    # from then on, the request next in the queue has its hits loaded under that prefill
    launched: dict[str, list[bytes] | None] = {"keys": None}

    def admit(e: _Entry) -> None:
        e.match = engine.arrive(e.request, expected_wait_s=expected_wait(e))
        with lock:
            e.admitted = True
            keys = launched["keys"] if preload and queue and queue[0] is e else None
        if keys is not None:           # it arrived during a prefill, with nothing ahead
            load_ahead(e, keys)

    def make_room() -> bool:
        # L1 is short: drop the pins (and the reads) of the requests queued last
        with lock:
            held = [e for e in queue if e.match is not None]
        if not held:
            return False
        e = held[-1]
        m, e.match = e.match, None
        engine.drop(m)
        run.released_for_room += 1
        return True

    def load_ahead(e: _Entry, keys: list[bytes]) -> None:
        # while the request ahead prefills: load this one's hits into L1 (once: from the
        # serving thread at the launch, or from the arrivals' thread at its arrival)
        with lock:
            if e.preload_tried:
                return
            e.preload_tried = True
        got = engine.preload(e.match, e.request, after=keys)
        with lock:
            e.match = got

    def launch(keys: list[bytes]) -> None:
        with lock:
            launched["keys"] = keys
            e = queue[0] if queue and queue[0].admitted else None
        if e is not None:
            load_ahead(e, keys)

    engine.make_room = make_room
    t_free = 0.0
    try:
        while pending or queue:
            if not queue:
                e = heapq.heappop(pending)
                admit(e)
                queue.append(e)
            head = queue[0]
            start = max(t_free, head.arrival)
            while pending and pending[0].arrival <= start:
                e = heapq.heappop(pending)
                admit(e)
                queue.append(e)
            queue.popleft()
            with lock:
                busy["until"] = start + (busy["service"] / busy["served"]
                                         if busy["served"] else 0.0)
            run.max_queue = max(run.max_queue, len(queue) + 1)
            # the next request (queued now, or arriving while this one prefills) has its hits
            # loaded while this one prefills (on an accelerator: its loads run under it)
            stop = threading.Event()
            admitter = None
            if real_time_admission and pending:
                admitter = threading.Thread(target=_admit_while_serving,
                                            args=(pending, queue, lock, admit, start, stop),
                                            daemon=True, name="kvtier-demo-arrivals")
                admitter.start()
            try:
                res = engine.serve(head.request, check, queued=head.match,
                                   ahead=launch if preload else None)
            finally:
                stop.set()
                if admitter is not None:
                    admitter.join()
                launched["keys"] = None
            if on_result is not None:
                on_result(head.request, res)
            if res.check is not None and res.check.passed:
                run.checks += 1
            first = start + res.ttft_s
            t_free = first + res.commit_s
            with lock:
                busy["service"] += t_free - start
                busy["served"] += 1
                busy["until"] = t_free
            run.served.append(Served(head.arrival, start, first, t_free, res,
                                     res.l3_prefetched_tokens > 0
                                     or (head.match is not None and not res.preloaded)))
            if level.kind == "closed" and users[head.user]:
                heapq.heappush(pending, _Entry(first + level.think_s, seq,
                                               users[head.user].pop(0), head.user))
                seq += 1
    finally:
        engine.make_room = None
        for e in queue:
            engine.drop(e.match)
        run.preload_skips = dict(getattr(engine, "preload_skips", {}))
    return run


def _admit_while_serving(pending: list[_Entry], queue: deque, lock: threading.Lock,
                         admit: Callable[[_Entry], None], start: float,
                         stop: threading.Event) -> None:
    """While the engine serves the request dispatched at simulated ``start``, admit each
    pending arrival when the real time since then reaches its simulated offset."""
    t0 = time.perf_counter()
    while not stop.is_set():
        with lock:
            e = pending[0] if pending else None
        if e is None:
            return
        delay = e.arrival - start - (time.perf_counter() - t0)
        if delay > 0 and stop.wait(delay):
            return
        with lock:
            if not pending or pending[0] is not e:
                return
            heapq.heappop(pending)
            queue.append(e)
        admit(e)


def levels(loads: tuple[float, ...], rates: tuple[float, ...], concurrency: tuple[int, ...],
           think_ms: float, capacity: float | None) -> list[Level]:
    """The load levels asked for, in order: load fractions (of ``capacity``, requests/s),
    absolute rates, then closed-loop concurrencies."""
    out = []
    for f in loads:
        if capacity is None:
            raise ConfigError("--loads needs the L1-only capacity: keep 'L1 only' in --setups "
                              "or give --rate", key="loads", value=loads)
        out.append(Level("open", rate=f * capacity, load=f))
    out += [Level("open", rate=r) for r in rates]
    out += [Level("closed", users=n, think_s=think_ms / 1e3) for n in concurrency]
    return out


def _ttft_and_hits(ttft_ms: Any, results: list[Any], tokens: int) -> dict[str, float]:
    """TTFT mean and percentiles (ms) and hit rates per tier (% of prompt tokens), as both
    the load table's rows and its serial row report them."""
    def pct(x: int) -> float:
        return 100.0 * x / tokens if tokens else 0.0

    def q(p: float) -> float:
        return float(np.percentile(ttft_ms, p)) if len(ttft_ms) else 0.0
    return {"ttft_mean_ms": float(ttft_ms.mean()) if len(ttft_ms) else 0.0,
            "ttft_p50_ms": q(50), "ttft_p90_ms": q(90), "ttft_p99_ms": q(99),
            "hit_rate_pct": pct(sum(r.hit_tokens for r in results)),
            "l1_hit_pct": pct(sum(r.l1_tokens for r in results)),
            "l2_hit_pct": pct(sum(r.l2_tokens for r in results)),
            "l3_hit_pct": pct(sum(r.l3_tokens for r in results)),
            "l3_prefetched_pct": pct(sum(r.l3_prefetched_tokens for r in results))}


def mean_ms(items: Any, attr: str) -> float:
    """The mean of ``attr`` (seconds) over ``items``, in ms; 0 for none."""
    return 1e3 * float(np.mean([getattr(x, attr) for x in items])) if len(items) else 0.0


def _service_parts(results: list[Any]) -> dict[str, float]:
    """Where a request's service went, mean ms per part: match, what the prefill waited for
    (its loads, and at dispatch the L3 read still in flight), the prefill itself and the
    commit -- the same parts under load and in the serial replay, so a part that grows under
    load shows which."""
    return {f"{part}_mean_ms": mean_ms(results, f"{part}_s")
            for part in ("match", "load", "prefill", "commit")}


def serial_summary(name: str, results: list[RequestResult], busy_s: float) -> dict[str, Any]:
    """The serial replay as the zero-load point of the load table: every request alone."""
    ttft = np.array([r.ttft_s for r in results]) * 1e3
    tokens = sum(r.tokens for r in results)
    return {
        "setup": name, "level": "serial", "kind": "serial", "load": 0.0, "utilisation": 0.0,
        "overloaded": False, "requests": len(results), "prompt_tokens": tokens,
        **_ttft_and_hits(ttft, results, tokens),
        "wait_mean_ms": 0.0, "max_queue": 1,
        "requests_per_s": len(results) / busy_s if busy_s > 0 else 0.0,
        "tokens_per_s": tokens / busy_s if busy_s > 0 else 0.0,
        "l3_wait_mean_ms": 0.0, **_service_parts(results),
    }


def with_speedups(rows: list[dict[str, Any]], ideal: str) -> list[dict[str, Any]]:
    """Add ratios within one load level: mean and p99 TTFT of L1 only over each setup's, and
    the setup's mean as a % of the measured ideal's speed. An overloaded row gets none (its
    mean only says how long this finite run happened to be)."""
    base = next((r for r in rows if r["setup"] == "L1 only"), None)
    best = next((r for r in rows if r["setup"] == ideal), None)
    for r in rows:
        r["ttft_speedup"] = r["p99_speedup"] = r["of_ideal_pct"] = None
        if r["overloaded"]:
            continue
        if base is not None and not base["overloaded"] and r["ttft_mean_ms"] > 0:
            r["ttft_speedup"] = base["ttft_mean_ms"] / r["ttft_mean_ms"]
            r["p99_speedup"] = base["ttft_p99_ms"] / r["ttft_p99_ms"] \
                if r["ttft_p99_ms"] > 0 else math.inf
        if best is not None and not best["overloaded"] and r["ttft_mean_ms"] > 0:
            r["of_ideal_pct"] = 100.0 * best["ttft_mean_ms"] / r["ttft_mean_ms"]
    return rows


@dataclass
class LoadSweep:
    """Every load level's runs, and the serial replay as the zero-load point."""

    capacity_per_s: float | None          # L1 only saturated: 1 / its mean service time
    levels: list[Level]
    serial: list[dict[str, Any]]
    runs: list[LoadRun]
    #: The saturated L1-only run the capacity was measured on (None: no load fractions).
    calibration: LoadRun | None = None

    def table(self, ideal: str) -> list[dict[str, Any]]:
        """One row per setup and level (the serial replay first), with speedups within
        each level."""
        out = with_speedups([dict(r) for r in self.serial], ideal)
        for lv in self.levels:
            out += with_speedups([r.summary() for r in self.runs if r.level is lv], ideal)
        return out
