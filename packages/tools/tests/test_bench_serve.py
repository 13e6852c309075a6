"""`kvtier bench serve` without vLLM: its arguments, the figures of a level and the parts
that read vLLM's logs and /metrics (the runs themselves are in tests_vllm)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvtier_tools.bench import serve


@pytest.mark.parametrize("flags, says", [
    (["--concurrency", "0"], "concurrency must be ints >= 1"),
    (["--concurrency", "2,-1"], "concurrency must be ints >= 1"),
    (["--rate", "nan"], "rates must be finite numbers > 0"),
    (["--rate", "0"], "rates must be finite numbers > 0"),
    (["--rate", "inf"], "rates must be finite numbers > 0"),
    (["--setups", "vllm,sglang"], "unknown setup(s) ['sglang']"),
    (["--repeat", "0"], "must be an int >= 1"),
    (["--warmup", "-1"], "must be an int >= 0"),
    (["--warmup", "one"], "must be an int >= 0"),
    (["--shm-gib", "0"], "must be a finite number of GiB > 0"),
    (["--shm-gib", "nan"], "must be a finite number of GiB > 0"),
    (["--offload-gib", "0"], "must be a finite number of GiB > 0"),
    (["--offload-gib", "inf"], "must be a finite number of GiB > 0"),
    (["--think-ms", "nan"], "must be a finite number >= 0"),
    (["--think-ms", "inf"], "must be a finite number >= 0"),
    (["--think-ms", "-1"], "must be a finite number >= 0"),
    (["--conversations", "0"], "must be an int >= 1"),
    (["--conversations", "-2"], "must be an int >= 1"),
    (["--conversations", "1.5"], "must be an int >= 1"),
    (["--turns", "0"], "must be an int >= 1"),
    (["--turns", "two"], "must be an int >= 1"),
    (["--system-tokens", "-1"], "must be an int >= 0"),
    (["--user-tokens", "0"], "must be an int >= 1"),
    (["--max-tokens", "0"], "must be an int >= 1"),
    (["--layers", "0"], "must be an int >= 1"),
    (["--hidden", "0"], "must be a multiple of 64 >= 64"),
    (["--hidden", "96"], "must be a multiple of 64 >= 64"),
    (["--block-size", "0"], "must be an int >= 1"),
    (["--device-blocks", "0"], "must be an int >= 1"),
    (["--host-pages", "0"], "must be an int >= 1"),
    (["--l3-host-pages", "-1"], "must be an int >= 1"),
    (["--max-model-len", "0"], "must be an int >= 1"),
    (["--memory-utilization", "0"], "must be a finite number > 0 and <= 1"),
    (["--memory-utilization", "1.5"], "must be a finite number > 0 and <= 1"),
    (["--memory-utilization", "nan"], "must be a finite number > 0 and <= 1"),
    (["--start-timeout", "0"], "must be a finite number > 0"),
    (["--request-timeout", "nan"], "must be a finite number > 0"),
    (["--request-timeout", "-5"], "must be a finite number > 0"),
])
def test_bad_flags_are_one_line_errors(flags, says, tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvtier_tools.bench.serve", *flags,
                        "--out", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert says in err[-1] and flags[0] in err[-1], p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "work").exists()          # no model made, no server started


def test_zero_is_legal_where_it_means_none():
    """No think time, no shared system prompt, no warm-up: each a run that makes sense."""
    import argparse
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    a = p.parse_args(["--think-ms", "0", "--system-tokens", "0", "--warmup", "0",
                      "--hidden", "64", "--memory-utilization", "1"])
    assert (a.think_ms, a.system_tokens, a.warmup, a.hidden, a.memory_utilization) == \
        (0.0, 0, 0, 64, 1.0)


def test_the_shm_setup_gets_an_arena_of_its_own(tmp_path):
    import argparse
    import json
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    argv = serve._setup_args("vllm+kvtier-shm", "m", str(tmp_path / "work"),
                             p.parse_args(["--shm-gib", "0.5"]), None, str(tmp_path))
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert cfg["l3_store"] == "shm" and cfg["l3_config"]["capacity_bytes"] == 1 << 29
    assert cfg["l3_config"]["root"] == str(tmp_path)


def test_each_shm_server_starts_on_an_empty_arena_removed_after(tmp_path, monkeypatch):
    """Rounds must not feed each other: every start of the shm setup gets a new directory
    for its arena, removed once the server has stopped, started or not."""
    import argparse
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    monkeypatch.setattr(serve, "SHM_DIR", str(shm_dir))
    roots = []

    def fake(name, model, work, tag, rnd, levels, workloads, args, file, shm_root):
        roots.append(shm_root)
        if shm_root:
            assert os.path.isdir(shm_root) and os.listdir(shm_root) == []
            (shm_dir / os.path.basename(shm_root) / "x.arena").write_bytes(b"")
        return {"error": "not started"}
    monkeypatch.setattr(serve, "_serve_in", fake)
    args = argparse.Namespace()
    for rnd in (0, 1):
        assert serve._serve("vllm+kvtier-shm", "m", str(tmp_path), rnd, [], [], args,
                            None) == {"error": "not started"}
    assert len(set(roots)) == 2 and all(r.startswith(str(shm_dir)) for r in roots)
    assert os.listdir(shm_dir) == []
    serve._serve("vllm+kvtier-l3", "m", str(tmp_path), 0, [], [], args, None)
    assert roots[-1] == ""                       # other setups get none


def test_each_round_starts_with_another_setup(tmp_path, monkeypatch):
    """The first server of a run pays the machine's warm-up: rounds rotate which setup goes
    first (a setup that did not start is tried once); rows keep the setups' order."""
    import argparse
    order = []
    rng = random.Random(3)

    def fake(name, model, work, rnd, levels, workloads, args, file):
        order.append((rnd, name))
        if name == "vllm+offload":
            return {"error": "not started"}
        reqs = [{"conv": c, "turn": 0, "prompt_len": 100, "cached": 0, "output": [c],
                 "ttft_s": rng.uniform(0.05, 0.2)} for c in range(4)]
        return {"start_s": 1.0, "levels": [
            {"kind": kind, "value": value, "requests": reqs, "counters": {}, "samples": [],
             "wall_s": 1.0, "conversations_per_s": value} for kind, value in levels]}
    monkeypatch.setattr(serve, "_serve", fake)
    monkeypatch.setattr(serve, "make_llama", lambda path, **kw: path)
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--setups", "vllm+null-connector,vllm+kvtier-l2,vllm+offload",
                         "--repeat", "3", "--out", str(tmp_path)])
    out = serve.bench(args)
    null, l2, off = args.setups
    assert order == [(0, null), (0, l2), (0, off), (1, l2), (1, null), (2, null), (2, l2)]
    n = len(serve._levels(args))
    for rows in out["rounds"]:               # the setups' order, whichever served first
        assert [r["setup"] for r in rows] == [null] * n + [l2] * n + [off], rows


def test_a_pool_smaller_than_one_request_is_refused_before_anything_starts(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvtier_tools.bench.serve",
                        "--device-blocks", "8", "--block-size", "32", "--max-model-len",
                        "2048", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "cannot hold one request" in p.stderr
    assert not any(tmp_path.iterdir())             # no model made, no server started


def test_metrics_are_summed_over_their_labels():
    text = "\n".join([
        "# HELP vllm:num_requests_running x",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_kv_fetch_by_stage{engine="0",stage="waiting_to_start"} 2.0',
        'vllm:num_requests_kv_fetch_by_stage{engine="0",stage="completed_waiting"} 1.0',
        "vllm:prefix_cache_hits_total 640.0",
        "python_gc_objects_collected_total 7.0",
        "vllm:broken{a=\"b\"} not-a-number"])
    got = serve._scrape(text)
    assert got == {"vllm:num_requests_running": 3.0,
                   "vllm:num_requests_kv_fetch_by_stage": 3.0,
                   "vllm:prefix_cache_hits_total": 640.0}


def test_a_failed_start_reports_the_cause_not_vllms_wrappers(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\n".join([
        "(APIServer pid=1) WARNING 12-05 01:46:53 [system_utils.py:255] Found ulimit of 20000 "
        "and failed to automatically increase with error current limit exceeds maximum limit.",
        "(EngineCore pid=2) ERROR 12-05 01:47:06 [core.py:1510] EngineCore failed to start.",
        "Traceback (most recent call last):",
        "ValueError: To serve at least one request with the model's max seq len (2048) ...",
        "RuntimeError: Engine core initialization failed. See root cause above.",
        ""]))
    assert serve._last_error(str(log)).startswith("ValueError: To serve at least one request")
    assert serve._last_error(str(tmp_path / "missing.log")) == ""


def _level(kind, value, ttfts, outputs, wall=2.0, convs_per_s=1.0, cached=0):
    reqs = [{"conv": i, "turn": 0, "prompt_len": 100, "ttft_s": t, "output": o,
             "cached": cached} for i, (t, o) in enumerate(zip(ttfts, outputs))]
    return {"kind": kind, "value": value, "requests": reqs, "wall_s": wall,
            "conversations_per_s": convs_per_s, "counters": {}, "samples": [
                {"fetch": 2.0, "running": 1.0, "waiting": 0.0},
                {"fetch": 0.0, "running": 1.0, "waiting": 0.0}]}


def test_a_level_row_against_vllm_alone_and_the_null_connector():
    base = _level("concurrency", 4, [0.2, 0.2, 0.2, 0.2], [[1], [2], [3], [4]])
    null = _level("concurrency", 4, [0.2] * 4, [[1], [2], [9], [4]])
    mine = _level("concurrency", 4, [0.1, 0.1, 0.1, 0.1], [[1], [2], [9], [5]])
    r = serve._row("vllm+kvtier-l2", mine, base, null)
    assert r["ttft_mean_ratio"] == pytest.approx(2.0) and r["ttft_mean_ms"] == pytest.approx(100)
    assert r["outputs_identical"] == 2 and r["outputs_identical_null_connector"] == 3
    assert r["kv_fetch_waiting_max"] == 2 and r["kv_fetch_samples_with_others_running"] == 1
    assert not r["overloaded"]
    slow = _level("rate", 4.0, [0.3] * 4, [[1]] * 4, convs_per_s=2.0)
    assert serve._row("vllm", slow, None)["overloaded"]          # finished at half the rate


def test_rounds_give_medians_any_overload_and_the_fewest_identical():
    def row(ttft, over, same):
        return {"setup": "vllm+kvtier-l2", "load": "rate 2", "ttft_mean_ms": ttft,
                "overloaded": over, "outputs_identical": same, "requests": 8}
    got = serve._median_rows([[row(10.0, False, 8)], [row(30.0, True, 7)],
                              [row(20.0, False, 8)],
                              ])
    assert len(got) == 1
    assert got[0]["ttft_mean_ms"] == 20.0 and got[0]["overloaded"] is True
    assert got[0]["outputs_identical"] == 7 and got[0]["rounds"] == 3
    err = serve._median_rows([[{"setup": "vllm+offload", "error": "no"}]] * 2)
    assert err == [{"setup": "vllm+offload", "error": "no"}]


def _rate_rows(over_mine=False, over_base=False):
    """Rows of one rate level: vLLM alone, the ideal and kvtier, either maybe overloaded."""
    def lv(ttft, over):
        return _level("rate", 4.0, [ttft] * 4, [[1]] * 4,
                      convs_per_s=1.5 if over else 4.0)
    base, mine = lv(0.4, over_base), lv(0.2, over_mine)
    ideal = lv(0.1, False)
    return [serve._row("vllm", base, base, None, ideal),
            serve._row("vllm+kvtier-l2", mine, base, None, ideal)]


def test_an_overloaded_level_gets_no_ratios_for_it_or_against_it():
    """A queue that grew has a mean that only says how long this finite run was: no ratio
    is taken for an overloaded row, nor for another row against it."""
    ratios = ("ttft_mean_ratio", "ttft_p99_ratio", "throughput_ratio", "of_ideal_pct")
    base, mine = _rate_rows()
    assert mine["ttft_mean_ratio"] == pytest.approx(2.0) and mine["of_ideal_pct"] == 50
    base, mine = _rate_rows(over_mine=True)
    assert mine["overloaded"] and all(mine[k] is None for k in ratios), mine
    assert mine["ttft_mean_ms"] == pytest.approx(200)            # measured, kept in JSON
    assert mine["conversations_per_s"] == 1.5
    assert base["ttft_mean_ratio"] == 1.0                        # vllm itself: not overloaded
    base, mine = _rate_rows(over_base=True)
    assert not mine["overloaded"] and base["overloaded"]
    assert all(mine[k] is None for k in ratios[:3]), mine        # vllm alone overloaded
    assert mine["of_ideal_pct"] == pytest.approx(50)             # the ideal was not
    # a round overloaded makes the median row overloaded, with no ratio
    good, bad = _rate_rows()[1], _rate_rows(over_mine=True)[1]
    got = serve._median_rows([[good], [bad], [good]])[0]
    assert got["overloaded"] and all(got[k] is None for k in ratios), got


def test_the_table_says_overloaded_instead_of_ttft_and_ratios():
    base, mine = _rate_rows(over_mine=True)
    lines = serve.table([base, mine]).splitlines()
    over = next(ln for ln in lines if "| vllm+kvtier-l2 |" in ln)
    assert "**overloaded**: 1.50 of 4 conversations/s" in over, over
    assert "200.0" not in over and "x)" not in over, over       # no TTFT, no ratio
    ok = next(ln for ln in lines if "| vllm |" in ln)
    assert "400.0 (1.00x)" in ok and "overloaded" not in ok, ok


def test_the_plot_draws_no_ttft_point_for_an_overloaded_level(tmp_path):
    rows = _rate_rows(over_mine=True)
    ok, over = serve._plot_points(rows, "vllm+kvtier-l2", "rate")
    assert ok == [] and over == [4.0]
    ok, over = serve._plot_points(rows, "vllm", "rate")
    assert ok == [(4.0, pytest.approx(400), pytest.approx(400))] and over == []
    pytest.importorskip("matplotlib")
    assert serve.plot(rows, str(tmp_path / "serve.png")) == str(tmp_path / "serve.png")
