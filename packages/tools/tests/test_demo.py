"""`kvtier demo` end to end with the tiny model: the setups (the three tier setups, L1+L2+L3
loading every hit, and the measured ideal), the correctness check, the outputs, and a
corrupted restore caught by the check."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvtier.cli import main  # noqa: E402
from kvtier_tools.demo.model import CheckFailedError  # noqa: E402
from kvtier_tools.demo.output import tables, write_outputs  # noqa: E402
from kvtier_tools.demo.run import IDEAL, LOAD_ALL, SETUPS, DemoConfig, run_demo  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402

# 2 clients x 2 rounds of 166..245-token prompts in 16-token pages (25 distinct pages of
# round 0 to remember). L1 holds the longest request and little more, so it thrashes between
# the two clients; L2 holds more than L1 but not everything; L3 holds all.
SMALL = dict(model_size="tiny", page_size=16, clients=2, rounds=2, first_tokens=192,
             turn_tokens=32, answer_tokens=16, l1_pages=17, l2_pages=20, threads=1,
             progress=False, plot=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    cfg = DemoConfig.from_dict(SMALL | {"check": "all", "plot": True,
                                        "out": str(tmp_path_factory.mktemp("out"))})
    rep = run_demo(cfg, log=lambda *a: None)
    write_outputs(rep, cfg.out)
    return rep


def test_every_prefill_matched_the_full_recompute(report):
    for run in report.runs:
        assert run.checks == len(run.results) == 4
        assert all(r.check is not None and r.check.passed and r.check.same_token
                   for r in run.results)
        # every restored page was checked against its digest at commit
        assert sum(r.restored_checked for r in run.results) == \
            sum((r.l2_tokens + r.l3_tokens) // 16 for r in run.results)
    assert any(r.restored_checked for run in report.runs for r in run.results)
    # the new setups are checked like the others: the load-all one restores pages (each
    # against its digest), the ideal reuses L1 pages (each prefill against a recompute)
    runs = {run.name: run for run in report.runs}
    assert sum(r.restored_checked for r in runs[LOAD_ALL].results) > 0
    assert any(r.l1_tokens for r in runs[IDEAL].results) and runs[IDEAL].checks == 4


def test_bitwise_mode_prefills_page_by_page_and_compares_every_bit():
    cfg = DemoConfig.from_dict(SMALL | {"check": "all", "check_mode": "bitwise",
                                        "setups": ("L1 only", "L1+L2+L3")})
    rep = run_demo(cfg, log=lambda *a: None)
    for run in rep.runs:
        assert all(r.check is not None and r.check.exact and r.check.tolerance == 0
                   for r in run.results)


def test_hits_land_in_the_tiers_each_setup_has(report):
    s = {row["setup"]: row for row in report.summaries()}
    assert list(s) == list(SETUPS) == ["L1 only", "L1+L2", "L1+L2+L3", LOAD_ALL, IDEAL]
    assert s["L1 only"]["l2_hit_pct"] == 0 == s["L1 only"]["l3_hit_pct"]
    assert s["L1+L2"]["l2_hit_pct"] > 0 and s["L1+L2"]["l3_hit_pct"] == 0
    assert s["L1+L2+L3"]["l3_hit_pct"] > 0
    assert s["L1+L2+L3"]["hit_rate_pct"] > s["L1+L2"]["hit_rate_pct"] \
        > s["L1 only"]["hit_rate_pct"]
    assert s["L1+L2+L3"]["hit_gain_pts"] == pytest.approx(
        s["L1+L2+L3"]["hit_rate_pct"] - s["L1 only"]["hit_rate_pct"])
    for row in s.values():        # every prompt token is either reused, loaded or computed
        assert row["computed_tokens"] + row["loaded_tokens"] + row["reused_l1_tokens"] \
            == row["prompt_tokens"]
    # round 0 is all misses everywhere; every hit is in round 1
    for run in report.runs:
        assert all(r.hit_tokens == 0 for r in run.results if r.round == 0)
        assert all(r.ttft_s > 0 and r.prefill_s > 0 for r in run.results)
    assert s["L1+L2+L3"]["bytes_l3_read"] > 0 and s["L1+L2+L3"]["bytes_l3_written"] > 0
    assert s["L1+L2"]["bytes_h2d"] > 0 and s["L1+L2"]["bytes_l3_read"] == 0


def test_the_ideal_keeps_every_page_in_l1(report):
    """The ideal's device pool holds the workload: nothing evicted, nothing below L1, and
    every hit any setup had is an L1 hit there."""
    s = {row["setup"]: row for row in report.summaries()}
    ideal = s[IDEAL]
    assert s["L1 only"]["l1_evictions"] > 0           # the counter counts (L1 thrashes)
    assert ideal["l1_evictions"] == 0
    assert ideal["l1_pages"] >= report.distinct_pages
    assert ideal["l2_hit_pct"] == 0 == ideal["l3_hit_pct"] and ideal["loaded_tokens"] == 0
    assert ideal["bytes_h2d"] == ideal["bytes_d2h"] == ideal["bytes_l3_read"] == 0
    assert ideal["l2_pages"] is None
    for row in s.values():
        assert ideal["hit_rate_pct"] >= row["hit_rate_pct"]
    assert ideal["l1_hit_pct"] == pytest.approx(ideal["hit_rate_pct"])
    assert report.ideal() == {"setup": IDEAL, "ttft_mean_ms": ideal["ttft_mean_ms"],
                              "speedup": ideal["ttft_speedup"],
                              "hit_rate_pct": ideal["hit_rate_pct"],
                              "l1_pages": ideal["l1_pages"], "l1_evictions": 0}


def test_pct_of_ideal_is_measured_not_modelled(report, monkeypatch):
    """"% of ideal" is a setup's measured mean speedup over the measured ideal's: unmoved by
    the model, moved by the ideal's measured TTFTs."""
    import dataclasses

    from kvtier_tools.demo import run as demo_run
    rows = {row["setup"]: row for row in report.summaries()}
    for row in rows.values():
        assert row["of_ideal_pct"] == pytest.approx(
            100 * row["ttft_speedup"] / rows[IDEAL]["ttft_speedup"])
        assert row["of_ideal_pct"] == pytest.approx(
            100 * rows[IDEAL]["ttft_mean_ms"] / row["ttft_mean_ms"])
    assert rows[IDEAL]["of_ideal_pct"] == pytest.approx(100)
    # a model 1000x off changes the modelled columns only
    monkeypatch.setattr(demo_run, "modelled_speedup", lambda *a, **k: 1000.0)
    wild = {row["setup"]: row for row in report.summaries()}
    for name, row in wild.items():
        assert row["modelled_speedup"] == 1000.0
        assert row["of_ideal_pct"] == pytest.approx(rows[name]["of_ideal_pct"])
    # the ideal twice as slow, measured: every setup is twice as close to it
    ideal_run = next(r for r in report.runs if r.name == IDEAL)
    monkeypatch.setattr(ideal_run, "results", [dataclasses.replace(r, ttft_s=2 * r.ttft_s)
                                               for r in ideal_run.results])
    slower = {row["setup"]: row for row in report.summaries()}
    for name in ("L1 only", "L1+L2", "L1+L2+L3", LOAD_ALL):
        assert slower[name]["of_ideal_pct"] == pytest.approx(2 * rows[name]["of_ideal_pct"])


def test_the_split_is_judged_against_load_all_and_load_none(report):
    s = {row["setup"]: row for row in report.summaries()}
    sp = report.split()
    assert sp["load_all_ttft_mean_ms"] == s[LOAD_ALL]["ttft_mean_ms"]
    assert sp["load_none_ttft_mean_ms"] == s["L1+L2"]["ttft_mean_ms"]
    best = min(s[LOAD_ALL]["ttft_mean_ms"], s["L1+L2"]["ttft_mean_ms"])
    assert sp["ratio"] == pytest.approx(s["L1+L2+L3"]["ttft_mean_ms"] / best)
    assert sp["flagged"] == (sp["ratio"] > 1.05)
    # the load-all setup has the same tiers, the cost model off, and its own L3 directory
    runs = {run.name: run for run in report.runs}
    assert s[LOAD_ALL]["skipped_tokens"] == 0 and s[LOAD_ALL]["l3_hit_pct"] > 0
    assert (s[LOAD_ALL]["l1_pages"], s[LOAD_ALL]["l2_pages"]) == \
        (s["L1+L2+L3"]["l1_pages"], s["L1+L2+L3"]["l2_pages"])
    assert runs[LOAD_ALL].store_stats["root"] != runs["L1+L2+L3"].store_stats["root"]


@pytest.mark.parametrize("ours, flagged", [(106.0, True), (104.0, False), (90.0, False)])
def test_the_split_is_flagged_more_than_5pct_above_the_better_alternative(ours, flagged):
    from kvtier_tools.demo.run import DemoReport
    rep = DemoReport(DemoConfig(), None, {}, [], 0)
    rows = [{"setup": "L1+L2", "ttft_mean_ms": 200.0}, {"setup": LOAD_ALL, "ttft_mean_ms": 100.0},
            {"setup": "L1+L2+L3", "ttft_mean_ms": ours}]
    rep.summaries = lambda: rows
    sp = rep.split()
    assert sp["best_alternative"] == LOAD_ALL and sp["ratio"] == pytest.approx(ours / 100)
    assert sp["flagged"] is flagged
    rows[0]["ttft_mean_ms"] = 50.0                       # loading none is the better now
    assert rep.split()["best_alternative"] == "L1+L2"
    none_ran = DemoReport(DemoConfig(), None, {"page_size": 16, "page_bytes": 1}, [], 0)
    assert none_ran.split() is None and none_ran.ideal() is None


def test_outputs_table_json_and_plot(report):
    text = tables(report)
    assert "| L1+L2+L3" in text and "TTFT mean ms" in text and "mean speedup" in text
    assert "% of ideal" in text and f"| {IDEAL}" in text and f"| {LOAD_ALL}" in text
    assert "Measured ideal, every page kept in L1 (" in text
    assert "Cost-aware split (L1+L2+L3)" in text
    # the model is a diagnostic, named as such, never "ideal"
    assert "modelled split speedup" in text and "ideal speedup" not in text
    data = json.loads(open(report.files["json"]).read())
    assert [r["setup"] for r in data["summary"]] == list(SETUPS)
    assert all("of_ideal_pct" in r and "modelled_speedup" in r and "ideal_speedup" not in r
               for r in data["summary"])
    assert data["ideal"]["setup"] == IDEAL and data["ideal"]["l1_evictions"] == 0
    assert data["split"]["best_alternative"] in (LOAD_ALL, "L1+L2")
    assert len(data["per_round"]["L1+L2+L3"]["hit_rate_pct"]) == 2
    assert len(data["per_round"][IDEAL]["hit_rate_pct"]) == 2
    with open(report.files["plot"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_corrupted_restore_is_caught():
    cfg = DemoConfig.from_dict(SMALL | {"setups": ("L1+L2",), "check": "sample",
                                        "check_rate": 0.0})
    with pytest.raises(CheckFailedError, match="match no digest") as ei:
        run_demo(cfg, corrupt_restore=True, log=lambda *a: None)
    assert "L1+L2: request" in str(ei.value) and "1 restored KV page(s)" in str(ei.value)
    # and in the bitwise mode the full comparison would see it too
    cfg = DemoConfig.from_dict(SMALL | {"setups": ("L1+L2",), "check": "all",
                                        "check_mode": "bitwise"})
    with pytest.raises(CheckFailedError, match="match no digest"):
        run_demo(cfg, corrupt_restore=True, log=lambda *a: None)


def test_cli_exits_non_zero_on_a_failed_check(tmp_path, capsys):
    rc = main(["demo", "--model-size", "tiny", "--page-size", "16", "--clients", "2",
               "--rounds", "2", "--first-tokens", "192", "--turn-tokens", "32",
               "--answer-tokens", "16",
               "--l1-pages", "17", "--l2-pages", "20", "--setups", "L1+L2", "--no-progress",
               "--no-plot", "--corrupt-restore", "--out", str(tmp_path)])
    assert rc == 2
    assert "CheckFailedError" in capsys.readouterr().err


def test_bad_config_is_a_typed_error():
    with pytest.raises(ConfigError, match="setups"):
        DemoConfig.from_dict({"setups": ("L1+L3",)})
    with pytest.raises(ConfigError, match="trace"):
        DemoConfig.from_dict({"workload": "trace"})
    with pytest.raises(ConfigError, match="check_mode"):
        DemoConfig.from_dict({"check_mode": "approx"})
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ConfigError, match="recompute_tokens_per_s"):
            DemoConfig.from_dict(SMALL | {"recompute_tokens_per_s": bad})
    with pytest.raises(ConfigError, match="l1-pages 3 cannot hold"):
        run_demo(DemoConfig.from_dict(SMALL | {"l1_pages": 3}), log=lambda *a: None)


def test_trace_replay_end_to_end(tmp_path):
    """Requests sharing leading hash_ids reuse each other's pages through the tiers."""
    lines = []
    for i in range(6):       # three "sessions" of two requests; the second extends the first
        base = [100 * (i % 3) + b for b in range(4)]
        ids = base if i < 3 else base + [100 * (i % 3) + 50]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(ids) - 100,
                                 "output_length": 1, "hash_ids": ids}))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = DemoConfig.from_dict(SMALL | {"workload": "trace", "trace": str(path),
                                        "trace_block_tokens": 64, "rounds": 2,
                                        "l1_pages": 22, "l2_pages": 30, "check": "all",
                                        "setups": ("L1 only", "L1+L2+L3")})
    rep = run_demo(cfg, log=lambda *a: None)
    s = {row["setup"]: row for row in rep.summaries()}
    assert s["L1+L2+L3"]["hit_rate_pct"] > s["L1 only"]["hit_rate_pct"]
    assert s["L1+L2+L3"]["l2_hit_pct"] + s["L1+L2+L3"]["l3_hit_pct"] > 0
    assert all(run.checks == 6 for run in rep.runs)


def test_long_context_workload_end_to_end():
    cfg = DemoConfig.from_dict(SMALL | {"workload": "long", "long_min_tokens": 300,
                                        "long_max_tokens": 400, "clients": 2, "rounds": 2,
                                        "l1_pages": 30, "l2_pages": 60, "check": "all"})
    rep = run_demo(cfg, log=lambda *a: None)
    assert rep.workload.name == "long" and len(rep.workload) == 4
    s = {row["setup"]: row for row in rep.summaries()}
    assert s["L1+L2"]["loaded_tokens"] > 0 and s["L1+L2+L3"]["loaded_tokens"] > 0
    assert all(r.check.passed for run in rep.runs for r in run.results if r.check)
    assert s["L1+L2"]["modelled_speedup"] > 1 and s["L1 only"]["modelled_speedup"] == \
        pytest.approx(1.0)
    assert s[IDEAL]["hit_rate_pct"] >= s["L1+L2+L3"]["hit_rate_pct"]
    assert s[IDEAL]["l1_evictions"] == 0 and s[IDEAL]["loaded_tokens"] == 0
    assert "recompute tok/s" in tables(rep)


def test_cost_model_skips_loads_slower_than_recompute():
    """Told the engine recomputes a token in a femtosecond, the controller loads nothing from
    L2/L3: every hit page is recomputed, counted as skipped, and still correct."""
    cfg = DemoConfig.from_dict(SMALL | {"check": "all", "recompute_tokens_per_s": 1e15,
                                        "rounds": 4, "l1_pages": 24, "l2_pages": 30,
                                        "setups": ("L1 only", "L1+L2+L3", LOAD_ALL)})
    rep = run_demo(cfg, log=lambda *a: None)
    rows = {row["setup"]: row for row in rep.summaries()}
    s = rows["L1+L2+L3"]
    # the load-all setup, the cost model off, loads what the cost-aware one skips
    assert rows[LOAD_ALL]["skipped_tokens"] == 0
    assert rows[LOAD_ALL]["loaded_tokens"] > s["loaded_tokens"]
    # the first load measures the L2 -> L1 rate; from then on nothing is worth loading
    assert s["skipped_tokens"] > 0 and s["skipped_pages_l2"] + s["skipped_pages_l3"] > 0
    assert s["skipped_tokens"] == 16 * (s["skipped_pages_l2"] + s["skipped_pages_l3"])
    assert all(r.check.passed for run in rep.runs for r in run.results if r.check)


def test_modelled_split_on_hand_made_numbers():
    from kvtier_tools.demo.engine import RequestResult
    from kvtier_tools.demo.run import modelled_speedup, modelled_ttft, slower_share
    kw = dict(page_size=64, page_bytes=1 << 20, recompute_tps=64_000.0)
    # 10 pages in L2 at 1 GB/s (1.05 ms a page) vs 1 ms to recompute one, 1 token to compute:
    # load k, recompute 10-k: max(1.048576 k, (10 - k) + 1/64) ms -> best at k=5:
    # max(5.24, 5.016) = 5.243 ms (k=4: max(4.19, 6.016) = 6.016)
    t = modelled_ttft(tokens=641, l1_tokens=0, l2_tokens=640, l3_tokens=0, h2d_bps=1e9,
                      l3_bps=None, **kw)
    assert t == pytest.approx(5 * (1 << 20) / 1e9)
    # an L3 page costs its read and its load: at 10 MB/s L3 is never used
    t3 = modelled_ttft(tokens=641, l1_tokens=0, l2_tokens=0, l3_tokens=640, h2d_bps=1e9,
                       l3_bps=10e6, **kw)
    assert t3 == pytest.approx(641 / 64_000)
    # an L3 read does not overlap the prefill of its own request: 10 pages at 2 GB/s
    # (0.524 ms each, faster than the 1 ms recompute) before 6,401 tokens computed anyway
    t3 = modelled_ttft(tokens=7041, l1_tokens=0, l2_tokens=0, l3_tokens=640, h2d_bps=1e12,
                       l3_bps=2e9, **kw)
    assert t3 == pytest.approx(10 * (1 << 20) / 2e9 + 6401 / 64_000, rel=1e-3)
    # loaded in place, L3 pages cost what L2 pages do (no read before the prefill), even
    # where no L3 read rate was measured
    t3 = modelled_ttft(tokens=641, l1_tokens=0, l2_tokens=0, l3_tokens=640, h2d_bps=1e9,
                       l3_bps=None, in_place=True, **kw)
    assert t3 == pytest.approx(5 * (1 << 20) / 1e9)
    # L1 hits are free; no rate, no use of the tier
    assert modelled_ttft(tokens=641, l1_tokens=640, l2_tokens=0, l3_tokens=0, h2d_bps=None,
                         l3_bps=None, **kw) == pytest.approx(1 / 64_000)

    def res(i, ttft, l1=0, l2=0):
        return RequestResult(i, 0, 641, l1, 0, 0, 641 - l1, ttft, 0, 0, ttft, 0,
                             l2_hit_tokens=l2)
    base = [res(0, 0.0100), res(1, 0.0100)]
    ours = [res(0, 0.0053, l2=640), res(1, 0.0106)]
    # base: 2 x 641 / 64k s; ideal: 5.243 ms + 641/64k s
    sp = modelled_speedup(ours, base, h2d_bps=1e9, l3_bps=None, **kw)
    assert sp == pytest.approx(2 * 641 / 64_000 / (5 * (1 << 20) / 1e9 + 641 / 64_000))
    assert slower_share(ours, base) == 0.5          # request 1 is 6% slower
    assert slower_share(ours, base, loading_only=True) == 0.0   # neither loaded anything
    assert slower_share(ours, base, same_work=True) == 0.5
    more = [res(0, 0.0200, l1=64), res(1, 0.0100)]  # computed less: not the same work
    assert slower_share(more, base, same_work=True) == 0.0


def test_prefill_cost_fit_on_hand_made_numbers():
    from kvtier_tools.demo.engine import RequestResult
    from kvtier_tools.demo.run import fit_prefill_cost, modelled_ttft
    rate, attn, over = 10_000.0, 2e-9, 0.03

    def res(n, c, overhead=over, a=attn):
        t = overhead + c / rate + a * (n * n - (n - c) ** 2) / 2
        return RequestResult(0, 0, n, n - c, 0, 0, c, t, 0, 0, t, 0)
    sizes = [(1000, 1000), (4000, 200), (3000, 3000), (500, 100), (2500, 700)]
    got = fit_prefill_cost([res(n, c) for n, c in sizes])
    assert got == pytest.approx((rate, attn, over), rel=1e-6)
    # no fixed cost, no attention: tokens / seconds, the other terms 0
    flat = fit_prefill_cost([res(n, c, 0.0, 0.0) for n, c in sizes])
    assert flat[0] == pytest.approx(rate) and flat[1:] == pytest.approx((0, 0), abs=1e-12)
    # the fixed cost is paid in every split
    assert modelled_ttft(tokens=641, l1_tokens=640, l2_tokens=0, l3_tokens=0, page_size=64,
                         page_bytes=1, recompute_tps=64_000.0, h2d_bps=None, l3_bps=None,
                         overhead_s=0.03) == pytest.approx(0.03 + 1 / 64_000)


def test_without_the_cost_model_load_all_is_l1_l2_l3_and_not_run_twice():
    cfg = DemoConfig.from_dict(SMALL | {"cost_aware": False, "check": "none",
                                        "setups": ("L1+L2+L3", LOAD_ALL)})
    rep = run_demo(cfg, log=lambda *a: None)
    assert [r.name for r in rep.runs] == ["L1+L2+L3"] and rep.split() is None


def test_a_second_process_on_one_shm_arena_hits_its_first_turns(tmp_path):
    """Two demo runs (as two processes would) on one shm arena and one digests file: the
    second finds the first's pages from its first round on, and checks them against the
    digests the first recorded."""
    import glob
    import os
    name = f"kvtier-test-demo-{os.getpid()}-{os.urandom(3).hex()}"
    digests = str(tmp_path / "digests.json")
    base = SMALL | {"setups": ("L1+L2+L3",), "l3_store": "shm", "digests": digests,
                    "l3_config": {"name": name, "capacity_pages": 256}}
    try:
        first = run_demo(DemoConfig.from_dict(base), log=lambda *a: None)
        assert os.path.getsize(digests) > 2
        second = run_demo(DemoConfig.from_dict(base), log=lambda *a: None)
    finally:
        for f in glob.glob(f"/dev/shm/{name}-*.arena"):
            os.unlink(f)
    round0 = lambda rep: sum(r.l3_tokens for r in rep.runs[0].results if r.round == 0)  # noqa
    assert round0(first) == 0 and round0(second) > 0
    assert all(r.restored_bad == 0 for r in second.runs[0].results)


def test_digests_of_another_process_vouch_for_its_version_of_a_page(tmp_path):
    """A page the first process computed and the second recomputed with other rounding: the
    second's own digest alone refuses the first's bytes; with the shared file they pass."""
    import torch
    from kvtier import KVSpec
    from kvtier.device_pool import DeviceKVPool
    from kvtier_tools.demo.digest import PageDigests, load_known, save_known
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4,
                      dtype="float32")
    pool = DeviceKVPool.empty(spec, 3)
    for comp in pool.layers:
        for t in comp:
            t.copy_(torch.randn(t.shape))
    key, path = b"k" * 16, str(tmp_path / "d.json")
    one = PageDigests(pool)
    one.record([key], [0])                       # process 1's version: page 0
    save_known(path, one._known)
    for comp in pool.layers:                     # process 2's version differs in one value
        comp[0][4 * 1] += 1e-3
    two = PageDigests(pool)
    two.record([key], [1])
    assert two.mismatches([key], [0]) == [0]     # its own digest refuses page 0's bytes
    shared = PageDigests(pool, known=load_known(path))
    shared.record([key], [1])
    assert shared.mismatches([key], [0]) == [] and shared.mismatches([key], [1]) == []
    save_known(path, shared._known)
    assert len(load_known(path)[key]) == 2


@pytest.mark.parametrize("what", ["fifo", "not-json", "a-list", "nested", "no-directory"])
def test_a_bad_digests_file_is_a_one_line_error_before_the_model(tmp_path, capsys, what):
    import os
    path = tmp_path / "d.json"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "not-json":
        path.write_text("{not json")
    elif what == "a-list":
        path.write_text("[1, 2]")
    elif what == "nested":
        path.write_text('{"00": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        path = tmp_path / "missing" / "d.json"
    with pytest.raises(SystemExit) as ei:
        main(["demo", "--model-size", "tiny", "--digests", str(path), "--no-progress",
              "--out", str(tmp_path / "out")])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "--digests" in err[-1]
    assert not (tmp_path / "out").exists()
