"""`kvtier demo` end to end with the tiny model: the three setups, the correctness check, the
outputs, and a corrupted restore caught by the check."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvtier.cli import main  # noqa: E402
from kvtier.demo.model import CheckFailedError  # noqa: E402
from kvtier.demo.run import DemoConfig, run_demo, tables, write_outputs  # noqa: E402
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
        assert all(r.check is not None and r.check.exact for r in run.results)


def test_hits_land_in_the_tiers_each_setup_has(report):
    s = {row["setup"]: row for row in report.summaries()}
    assert list(s) == ["L1 only", "L1+L2", "L1+L2+L3"]
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


def test_outputs_table_json_and_plot(report):
    text = tables(report)
    assert "| L1+L2+L3" in text and "TTFT mean ms" in text and "mean speedup" in text
    data = json.loads(open(report.files["json"]).read())
    assert [r["setup"] for r in data["summary"]] == ["L1 only", "L1+L2", "L1+L2+L3"]
    assert len(data["per_round"]["L1+L2+L3"]["hit_rate_pct"]) == 2
    with open(report.files["plot"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_corrupted_restore_is_caught():
    cfg = DemoConfig.from_dict(SMALL | {"setups": ("L1+L2",), "check": "sample",
                                        "check_rate": 0.0})
    with pytest.raises(CheckFailedError, match="does not match a full recompute") as ei:
        run_demo(cfg, corrupt_restore=True, log=lambda *a: None)
    assert "L1+L2: request" in str(ei.value) and "KV page(s) differ" in str(ei.value)


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
