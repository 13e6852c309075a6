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
])
def test_bad_flags_are_one_line_errors(flags, says):
    p = subprocess.run([sys.executable, "-m", "kvtier_tools.bench.serve", *flags],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert says in err[-1], p.stderr
    assert "Traceback" not in p.stderr


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
