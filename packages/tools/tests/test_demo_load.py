"""`kvtier demo` under load: the queue (TTFT counts the wait), L3 prefetch from the arrival
(a read that lands before dispatch costs nothing), overload reported as such, bad rates as
one-line errors before any model is built, and the per-load table in results.json."""

from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest

import kvtier_tools.demo.run as demo_run
from kvtier.cli import main
from kvtier_tools.demo.engine import RequestResult
from kvtier_tools.demo.load import Level, LoadSweep, serial_summary, serve_queue
from kvtier_tools.demo.run import IDEAL, DemoConfig
from kvtier_tools.demo.workload import Request, Workload, multiturn
from kvtier.errors import ConfigError

SMALL = dict(model_size="tiny", page_size=16, clients=2, rounds=2, first_tokens=192,
             turn_tokens=32, answer_tokens=16, l1_pages=17, l2_pages=20, threads=1,
             progress=False, plot=False)


class FixedEngine:
    """An engine whose every request takes ``ttft_s`` to its first token, then
    ``commit_s``; no cache, nothing prefetched."""

    def __init__(self, ttft_s: float, commit_s: float = 0.0):
        self.ttft_s, self.commit_s = ttft_s, commit_s
        self.make_room = None
        self.served: list[int] = []
        self.waits: dict[int, float] = {}      # the expected wait each arrival was given

    def arrive(self, request, expected_wait_s=0.0):
        self.waits[request.index] = expected_wait_s
        return None

    def drop(self, queued):
        assert queued is None

    def serve(self, request, check=False, *, queued=None, ahead=None):
        self.served.append(request.index)
        return RequestResult(index=request.index, round=request.round,
                             tokens=request.num_tokens, l1_tokens=0, l2_tokens=0, l3_tokens=0,
                             computed_tokens=request.num_tokens, ttft_s=self.ttft_s,
                             match_s=0.0, load_s=0.0, prefill_s=self.ttft_s,
                             commit_s=self.commit_s)


class PreloadingEngine(FixedEngine):
    """A FixedEngine whose prefill launches at once and takes ``ttft_s`` of real time; it
    records which requests were preloaded, from which thread, and what `serve` got."""

    def __init__(self, ttft_s: float):
        super().__init__(ttft_s)
        self.preloads: list[tuple[int, str]] = []
        self.queued: dict[int, object] = {}

    def arrive(self, request, expected_wait_s=0.0):
        return ("arrived", request.index)

    def preload(self, queued, request, *, after=None):
        assert after == [b"keys of the request ahead"]
        self.preloads.append((request.index, threading.current_thread().name))
        return ("preloaded", request.index)

    def drop(self, queued):
        pass

    def serve(self, request, check=False, *, queued=None, ahead=None):
        self.queued[request.index] = queued
        if ahead is not None:
            ahead([b"keys of the request ahead"])
        time.sleep(self.ttft_s)
        return super().serve(request, check, queued=queued)


@pytest.mark.parametrize("arrivals,thread", [([0.0, 0.0], "MainThread"),
                                             ([0.0, 0.05], "kvtier-demo-arrivals")])
def test_the_next_request_is_preloaded_once_whether_queued_or_arriving_mid_prefill(
        arrivals, thread):
    """Queued at the dispatch of the request ahead: preloaded when that prefill launches;
    arriving while it runs (nothing else queued): preloaded at its arrival. Once, and
    served on what the preload returned."""
    eng = PreloadingEngine(ttft_s=0.2)
    serve_queue(eng, _workload(2), Level("open", rate=100.0), arrivals=arrivals,
                preload=True)
    assert eng.preloads == [(1, thread)]
    assert eng.queued == {0: ("arrived", 0), 1: ("preloaded", 1)}
    eng = PreloadingEngine(ttft_s=0.05)
    serve_queue(eng, _workload(2), Level("open", rate=100.0), arrivals=arrivals)
    assert eng.preloads == [] and eng.queued[1] == ("arrived", 1)


def _workload(n: int, clients: int = 1) -> Workload:
    reqs = tuple(Request(i, i % clients, i // clients, np.arange(10)) for i in range(n))
    return Workload("w", reqs, max(1, n // clients))


def test_a_request_arriving_while_the_engine_is_busy_waits_the_remaining_service():
    eng = FixedEngine(ttft_s=0.010, commit_s=0.002)
    run = serve_queue(eng, _workload(3), Level("open", rate=100.0), arrivals=[0.0, 0.004, 0.5],
                      real_time_admission=False)
    a, b, c = run.served
    assert a.wait_s == 0 and a.ttft_s == pytest.approx(0.010)
    # b arrives 4 ms into a's 12 ms of service: it waits the remaining 8 ms
    assert b.dispatch == pytest.approx(0.012) and b.wait_s == pytest.approx(0.008)
    assert b.ttft_s == pytest.approx(0.008 + 0.010)
    assert c.wait_s == 0 and c.ttft_s == pytest.approx(0.010)      # the engine was idle
    assert eng.served == [0, 1, 2] and run.max_queue == 1     # b waited alone


def test_each_arrival_is_told_its_expected_wait_for_the_split():
    """The queue-aware split: an arrival's prefetch is told how long it is expected to wait
    (the rest of the service in progress plus the mean service of each request ahead)."""
    eng = FixedEngine(ttft_s=0.010, commit_s=0.002)
    serve_queue(eng, _workload(4), Level("open", rate=100.0),
                arrivals=[0.0, 0.5, 0.503, 0.504], real_time_admission=False)
    assert eng.waits[0] == 0.0                    # the engine is idle
    assert eng.waits[1] == 0.0                    # idle again by then
    # request 2 arrives 3 ms into request 1's 12 ms (the mean so far): 9 ms to go; request 3
    # arrives a millisecond later with request 2 ahead of it: 8 ms + 12 ms
    assert eng.waits[2] == pytest.approx(0.009)
    assert eng.waits[3] == pytest.approx(0.008 + 0.012)


def test_closed_loop_users_send_turns_one_after_another():
    eng = FixedEngine(ttft_s=0.010)
    run = serve_queue(eng, _workload(4, clients=2), Level("closed", users=2, think_s=0.005),
                      real_time_admission=False)
    by_index = {s.result.index: s for s in run.served}
    for first, second in ((0, 2), (1, 3)):     # client c's turns: c, c + 2
        assert by_index[second].arrival == pytest.approx(by_index[first].first_token + 0.005)
    assert not run.summary()["overloaded"]


def test_overload_is_detected_and_reported_without_a_mean():
    from kvtier_tools.demo.output import load_table
    eng = FixedEngine(ttft_s=0.010)
    lv, ok = Level("open", rate=200.0, load=2.0), Level("open", rate=20.0, load=0.2)
    over = serve_queue(eng, _workload(20), lv, seed=1, name="L1 only",
                       real_time_admission=False)
    fine = serve_queue(eng, _workload(20), ok, seed=1, name="L1 only",
                       real_time_admission=False)
    s = over.summary()
    assert s["overloaded"] and s["utilisation"] == pytest.approx(2.0)
    assert not fine.summary()["overloaded"] and fine.summary()["utilisation"] < 1
    sweep = LoadSweep(100.0, [ok, lv], [serial_summary("L1 only", [], 1.0)], [fine, over])
    rows = sweep.table(IDEAL)
    bad = [r for r in rows if r["level"] == lv.label]
    assert bad and all(r["ttft_speedup"] is None for r in bad)

    class Report:
        load = sweep
    text = load_table(Report())                 # type: ignore[arg-type]
    line = next(x for x in text.splitlines() if x.startswith(f"| {lv.label} "))
    assert "overloaded" in line


def _tiered_engine(tmp_path, cache=None, **cfg):
    """The tiny model served through L1+L2+L3 (a file L3 under ``tmp_path``); ``cache``:
    cache config over the demo's."""
    pytest.importorskip("transformers")
    from kvtier_tools.demo.engine import DemoEngine
    from kvtier_tools.demo.model import DemoModel
    from kvtier_tools.demo.run import cache_config
    model = DemoModel("tiny", page_size=16, seed=0)
    cc = cache_config(DemoConfig.from_dict({**SMALL, **cfg}), "L1+L2+L3", model, 20,
                      str(tmp_path))
    return model, DemoEngine(model, {**cc, **(cache or {})}, l1_pages=40)


def test_prefetch_starts_at_arrival_and_a_landed_read_costs_nothing(tmp_path):
    model, eng = _tiered_engine(tmp_path)
    try:
        eng.warm_up(model.vocab_size)
        w = multiturn(1, 2, first_tokens=128, turn_tokens=32, answer_tokens=16, seed=0,
                      vocab_size=model.vocab_size)
        first, second = w.requests
        eng.serve(first)
        eng.cache.wait_idle(timeout=60)
        # only L3 holds the first turn now
        eng.cache.evict(1000, "l1")
        eng.cache.evict(1000, "l2")
        m = eng.arrive(second)                     # queued: its read starts now
        assert m is not None and m.l3_count > 0 and m.read is not None
        deadline = time.monotonic() + 30
        while not m.read.settled and time.monotonic() < deadline:
            time.sleep(0.005)
        res = eng.serve(second, True, queued=m)    # dispatched after the read landed
        assert res.l3_wait_s == 0.0
        assert res.l3_tokens > 0 and res.l3_prefetched_tokens == res.l3_tokens
        assert res.l2_tokens == 0
        assert res.restored_bad == 0 and res.restored_checked * 16 == res.l3_tokens
        assert res.check is not None and res.check.passed
    finally:
        eng.close()


@pytest.mark.parametrize("flag,value", [("--loads", "0"), ("--loads", "-0.5"),
                                        ("--loads", "nan"), ("--load", "inf"),
                                        ("--rate", "0"), ("--rate", "inf"),
                                        ("--concurrency", "0"), ("--concurrency", "-2"),
                                        ("--loads", "0.5,nan"), ("--think-ms", "nan"),
                                        ("--switch-interval-ms", "-1"),
                                        ("--switch-interval-ms", "nan"),
                                        ("--switch-interval-ms", "2000")])
def test_a_bad_rate_load_or_concurrency_is_a_one_line_error(flag, value, capsys, monkeypatch,
                                                            tmp_path):
    built = []
    monkeypatch.setattr(demo_run, "DemoModel", lambda *a, **k: built.append(a))
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--model-size", "tiny", "--out", str(tmp_path), flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err and built == []


@pytest.mark.parametrize("data", [{"loads": (0.0,)}, {"loads": (math.nan,)},
                                  {"rates": (math.inf,)}, {"concurrency": (0,)},
                                  {"concurrency": (1.5,)}, {"think_ms": -1.0},
                                  {"switch_interval_ms": -0.1},
                                  {"switch_interval_ms": math.inf},
                                  {"loads": (0.5,), "setups": ("L1+L2",)}])
def test_bad_load_config_is_a_typed_error(data):
    with pytest.raises(ConfigError):
        DemoConfig.from_dict(data)


def test_results_json_carries_the_per_load_table(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from kvtier.transfer_engines.torch_engine import TorchTransferEngine
    # the CPU's engine keeps no stats of its own: give it some, as the router's are recorded
    # (a number per engine built: each run has an engine of its own)
    built = iter(range(1_000_000))
    monkeypatch.setattr(TorchTransferEngine, "stats", lambda self: {
        "route": {"h2d": "here"},
        "engine": self.__dict__.setdefault("_test_no", next(built))}, raising=False)
    from kvtier_tools.demo.output import tables, write_outputs
    from kvtier_tools.demo.run import run_demo
    cfg = DemoConfig.from_dict(SMALL | {"check": "all", "plot": True, "out": str(tmp_path),
                                        "loads": (0.5, 0.9), "concurrency": (2,),
                                        "setups": ("L1 only", "L1+L2+L3", IDEAL)})
    rep = run_demo(cfg, log=lambda *a: None)
    files = write_outputs(rep, cfg.out)
    data = json.loads(open(files["json"]).read())["load"]
    assert data["capacity_per_s"] > 0
    # the capacity is L1 only saturated (every conversation at once), not the serial replay
    cap = data["capacity_run"]
    assert cap["setup"] == "L1 only" and cap["kind"] == "closed"
    assert cap["users"] == len(rep.workload) and cap["requests"] == len(rep.workload)
    assert data["capacity_per_s"] == pytest.approx(1e3 / cap["service_mean_ms"])
    assert [lv["label"] for lv in data["levels"]] == ["50%", "90%", "closed 2"]
    levels = [r["level"] for r in data["table"]]
    assert levels == ["serial"] * 3 + ["50%"] * 3 + ["90%"] * 3 + ["closed 2"] * 3
    for r in data["table"]:
        for k in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                  "requests_per_s", "tokens_per_s", "l1_hit_pct", "l2_hit_pct", "l3_hit_pct",
                  "ttft_speedup", "p99_speedup", "of_ideal_pct", "overloaded", "utilisation"):
            assert k in r
        assert r["requests"] == len(rep.workload)
        # where the service went: its parts are measured, none negative, within the service
        parts = [r[k] for k in ("match_mean_ms", "load_mean_ms", "prefill_mean_ms",
                                "commit_mean_ms")]
        assert min(parts) >= 0 and parts[2] > 0
        if r["level"] != "serial":
            assert sum(parts) <= r["service_mean_ms"] * 1.001
    # the tiers' hits under load are those of the serial replay (same order, FIFO)
    under = [r for r in data["table"] if r["setup"] == "L1+L2+L3" and r["level"] == "50%"]
    assert under[0]["hit_rate_pct"] > 0
    assert "Under load" in tables(rep) and "Where a request's service went" in tables(rep)
    assert files["load_plot"].endswith("load.png")
    # each load run's transfer engine's own stats, one entry per run (each run's own engine)
    runs = [(r["setup"], r["level"]) for r in data["table"] if r["level"] != "serial"]
    assert [(e["setup"], e["level"]) for e in data["engine_stats"]] == runs
    assert all(e["route"] == {"h2d": "here"} for e in data["engine_stats"])
    assert len({e["engine"] for e in data["engine_stats"]}) == len(runs)
    # every restored page under load matched its digest (a mismatch fails the run)
    assert sum(r.result.restored_checked for run in rep.load.runs for r in run.served) > 0


def test_each_load_level_gets_a_shm_arena_of_its_own(tmp_path):
    """A user-named shm arena is the serial replay's; every load level starts on an empty
    arena of its own (not warmed by the replay), and each is removed at the end."""
    pytest.importorskip("transformers")
    import glob
    import os
    from kvtier_tools.demo.run import run_demo
    name = f"kvtier-test-lv-{os.getpid()}-{os.urandom(3).hex()}"
    cfg = DemoConfig.from_dict(SMALL | {"loads": (0.5,), "setups": ("L1 only", "L1+L2+L3"),
                                        "l3_store": "shm",
                                        "l3_config": {"name": name, "capacity_pages": 256}})
    try:
        rep = run_demo(cfg, log=lambda *a: None)
        left = sorted(os.path.basename(f) for f in glob.glob(f"/dev/shm/{name}*"))
    finally:
        for f in glob.glob(f"/dev/shm/{name}*"):
            os.unlink(f)
    assert len(left) == 1 and "-load" not in left[0]           # the serial replay's, kept
    serial = next(r for r in rep.runs if r.name == "L1+L2+L3")
    assert sum(r.l3_tokens for r in serial.results if r.round == 0) == 0
    for run in rep.load.runs:
        if run.setup == "L1+L2+L3":
            assert sum(s.result.l3_tokens for s in run.served if s.result.round == 0) == 0
            assert sum(s.result.l3_tokens for s in run.served) > 0


def test_a_serial_request_streams_its_l3_pages_and_a_failed_stream_is_recomputed(tmp_path):
    """Served one at a time, a request's L3 pages are read by its fetch, layer group by layer
    group (no prefetch first); a group that misses after the prefill began fails the fetch,
    and the request is computed again on its L1 hit alone, right."""
    # (loads every hit, any box; the tiny model's pages are split in layer groups however
    # small they are: the file store's default wants 1 MiB a group)
    model, eng = _tiered_engine(tmp_path, cost_aware=False, l3_config={"group_bytes": 0},
                                cache={"l3_stream_layers": True, "l3_stream_min_read_s": 0})
    try:
        assert eng.cache.streams_l3, eng.cache.stream_why_not
        eng.warm_up(model.vocab_size)
        w = multiturn(2, 2, first_tokens=128, turn_tokens=32, answer_tokens=16, seed=0,
                      vocab_size=model.vocab_size)
        by_round = sorted(w.requests, key=lambda r: (r.round, r.index))
        for r in by_round[:2]:
            eng.serve(r)
        eng.cache.wait_idle(timeout=60)
        eng.cache.evict(1000, "l1")
        eng.cache.evict(1000, "l2")
        res = eng.serve(by_round[2], True)
        assert res.l3_tokens > 0 and not res.load_failed
        assert eng.cache.metrics()["l3_streamed_pages"] * 16 == res.l3_tokens
        assert res.restored_bad == 0 and res.check is not None and res.check.passed
        eng.cache.wait_idle(timeout=60)
        eng.cache.evict(1000, "l1")
        eng.cache.evict(1000, "l2")
        store = eng.cache.store
        real = store.batch_get_layers
        store.batch_get_layers = lambda keys, pages, group: (
            real(keys, pages, group) if group == 0 else [False] * len(keys))
        res = eng.serve(by_round[3], True)
        assert res.load_failed and res.l3_tokens == 0 and res.l2_tokens == 0
        assert res.computed_tokens == res.tokens - res.l1_tokens
        assert res.check is not None and res.check.passed
    finally:
        eng.close()


def _two_turns(model):
    w = multiturn(1, 2, first_tokens=128, turn_tokens=32, answer_tokens=16, seed=0,
                  vocab_size=model.vocab_size)
    return w.requests


def _second_turn_behind_l1(tmp_path):
    """An engine that served a conversation's first turn, now out of L1 (in L2 and L3),
    and the second turn."""
    model, eng = _tiered_engine(tmp_path)
    eng.warm_up(model.vocab_size)
    first, second = _two_turns(model)
    eng.serve(first)
    eng.cache.wait_idle(timeout=60)
    eng.cache.evict(1000, "l1")
    return eng, second


@pytest.mark.parametrize("where", ["l2", "l3"])
def test_a_preloaded_request_is_served_on_the_hits_loaded_ahead_bit_for_bit(tmp_path, where):
    """`DemoEngine.preload` loads a queued request's hits (L2, or the L3 run its arrival read
    landed) while another prefills; `serve` then uses that match and load as they are: no
    second match, every restored page its committed digest, the logits a full recompute's."""
    eng, second = _second_turn_behind_l1(tmp_path)
    try:
        if where == "l3":
            eng.cache.evict(1000, "l2")
        m = eng.arrive(second)
        if where == "l3":
            assert m is not None and m.read is not None
            deadline = time.monotonic() + 30
            while not m.read.settled and time.monotonic() < deadline:
                time.sleep(0.005)
        else:
            assert m is None                        # nothing to read: no match is kept
        free = len(eng._free)
        p = eng.preload(m, second)
        assert type(p).__name__ == "Preloaded" and len(eng._free) < free
        res = eng.serve(second, True, queued=p)
        assert res.preloaded and res.l1_tokens == 0
        got = res.l2_tokens if where == "l2" else res.l3_tokens
        assert got > 0 and res.hit_tokens == got
        assert res.l3_prefetched_tokens == (got if where == "l3" else 0)
        assert res.restored_bad == 0 and res.restored_checked * 16 == got
        assert res.check is not None and res.check.passed
    finally:
        eng.close()


def test_no_preload_where_the_request_ahead_extends_the_hit_or_l1_is_full(tmp_path):
    """Nothing is loaded ahead where the request in front will commit the page after the
    hit (dispatch matches afresh and gets it), nor where L1 has no free or evictable page;
    either way nothing stays pinned and the request is served in full at dispatch."""
    model, eng = _tiered_engine(tmp_path)
    try:
        eng.warm_up(model.vocab_size)
        first, second = _two_turns(model)
        # the request ahead is the first turn, not yet committed: it extends second's hit
        keys = eng.cache.keys(np.asarray(first.tokens))
        assert eng.preload(None, second, after=keys) is None
        assert eng.preload_skips == {"the request ahead extends its hit": 1}
        eng.serve(first)
        eng.cache.wait_idle(timeout=60)
        eng.cache.evict(1000, "l1")
        held = eng._take(len(eng._free))            # L1 full of pages the engine holds
        assert eng.preload(None, second) is None
        assert eng.preload_skips["no free or evictable L1 page"] == 1
        eng._give(held)
        res = eng.serve(second, True)
        assert not res.preloaded and res.l2_tokens > 0 and res.check.passed
        eng.cache.wait_idle(timeout=60)
        eng.cache.evict(1000, "l1")                # nothing pinned: every page comes back
        assert len(eng._free) == eng.pool.num_pages
    finally:
        eng.close()


def test_a_dropped_preload_gives_its_pages_back(tmp_path):
    eng, second = _second_turn_behind_l1(tmp_path)
    try:
        p = eng.preload(None, second)
        assert type(p).__name__ == "Preloaded"
        eng.drop(p)
        eng.cache.wait_idle(timeout=60)
        eng.cache.evict(1000, "l1")
        assert len(eng._free) == eng.pool.num_pages
    finally:
        eng.close()


@pytest.mark.parametrize("l2_pages", [200, 20])
def test_a_queue_preloads_the_next_request_and_every_restore_checks(tmp_path, l2_pages):
    """Every request queued at once: while one prefills, the next one's hits load (200 L2
    pages: from L2; 20: most prefixes are in L3 only, written after the arrivals' matches,
    and their reads start at the preload); the digests and a recompute of every request say
    the KV served is the committed KV (the cost-aware split is off: the tiny model on a CPU
    recomputes faster than it loads)."""
    model, eng = _tiered_engine(tmp_path, cache={"host_pool_pages": l2_pages},
                                cost_aware=False)
    try:
        eng.warm_up(model.vocab_size)
        w = multiturn(6, 3, first_tokens=96, turn_tokens=32, answer_tokens=16, seed=1,
                      vocab_size=model.vocab_size)
        bad = []
        run = serve_queue(eng, w, Level("open", rate=1000.0), True, preload=True,
                          arrivals=[0.0] * len(w), real_time_admission=False,
                          on_result=lambda q, r: bad.append(r.restored_bad))
        res = [s.result for s in run.served]
        assert len(res) == len(w) and sum(bad) == 0
        assert all(r.check is not None and r.check.passed for r in res)
        assert run.summary()["preloaded_pct"] > 0
        if l2_pages == 200:
            assert sum(r.restored_checked for r in res if r.preloaded) > 0
        else:
            assert sum(r.l3_tokens for r in res) > 0
        assert sum(r.restored_checked for r in res) * 16 == sum(r.l2_tokens + r.l3_tokens
                                                                 for r in res)
        off = serve_queue(eng, w, Level("open", rate=1000.0), False, arrivals=[0.0] * len(w),
                          real_time_admission=False)
        assert not any(s.result.preloaded for s in off.served)
    finally:
        eng.close()


def test_every_setup_serves_at_the_switch_interval_and_the_caller_gets_its_own_back(
        tmp_path, monkeypatch):
    """``switch_interval_ms``: every setup's cache (the ideal's and L1 only's too, so the
    ratios compare like with like) runs at it, under load as served one at a time; the
    interval the caller had is back after the run. 0 leaves it."""
    pytest.importorskip("transformers")
    import sys

    from kvtier_tools.demo.run import run_demo
    seen: list[float] = []
    real = demo_run.DemoEngine

    class Engine(real):     # type: ignore[misc,valid-type]
        def serve(self, *a, **k):
            seen.append(sys.getswitchinterval())
            return super().serve(*a, **k)

    monkeypatch.setattr(demo_run, "DemoEngine", Engine)
    before = sys.getswitchinterval()      # (conftest hands it back after the test)
    logged: list[str] = []

    def log(*a: object) -> None:
        logged.append(" ".join(map(str, a)))
    for ms in (0.25, 0.0):
        seen.clear()
        logged.clear()
        cfg = DemoConfig.from_dict(SMALL | {"check": "none", "out": str(tmp_path),
                                            "rates": (50.0,), "switch_interval_ms": ms})
        run_demo(cfg, log=log)
        assert len(seen) > 3 * 4 and abs(sys.getswitchinterval() - before) < 2e-6
        want = 0.00025 if ms else before
        assert all(abs(s - want) < 2e-6 for s in seen), (want, seen)
        assert f"thread switch interval {1e3 * want:g} ms;" in logged[0]
        keyed = demo_run.cache_config(cfg, "L1+L2+L3", demo_run.DemoModel(
            "tiny", page_size=16), 20, None)
        assert keyed.get("switch_interval_s") == (0.00025 if ms else None)
    # a config file's [cache] table wins over the flag, in the caches and in the header
    (tmp_path / "kvtier.toml").write_text("[cache]\nswitch_interval_s = 0.0003\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(tmp_path / "kvtier.toml"))
    seen.clear()
    logged.clear()
    run_demo(cfg, log=log)
    assert seen and all(abs(s - 0.0003) < 2e-6 for s in seen), seen
    assert "thread switch interval 0.3 ms;" in logged[0]
