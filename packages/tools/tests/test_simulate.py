"""Trace replay: tokens from block ids, exact hit counts on handmade traces, the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier_tools.trace import EmptyTraceWarning, TraceError, TraceFormatError
from kvtier_tools.simulate import (BLOCK_TOKENS, PageAllocator, TraceRequest, block_tokens,
                             load_trace, simulate)

#: The public Mooncake trace kept in ``shared/data`` beside the repository (or KVTIER_TRACE).
TRACE = os.environ.get("KVTIER_TRACE", str(
    Path(__file__).resolve().parents[3].parent / "shared" / "data"
    / "mooncake_synthetic_trace.jsonl"))


def test_block_tokens_are_deterministic_and_distinct():
    a = block_tokens([3, 7], 1000)
    assert a.dtype == np.uint32 and a.size == 1000
    assert np.array_equal(a[:BLOCK_TOKENS], np.arange(3 * 512, 4 * 512))
    assert np.array_equal(a, block_tokens([3, 7], 1000))
    assert not np.array_equal(block_tokens([7], 512), block_tokens([3], 512))
    with pytest.raises(InvalidArgumentError):
        block_tokens([1], 513)
    with pytest.raises(InvalidArgumentError):
        block_tokens([2**23], 10)


def write_trace(path, reqs):
    with open(path, "w") as f:
        for ids, n in reqs:
            f.write(json.dumps({"timestamp": 0, "input_length": n, "output_length": 1,
                                "hash_ids": ids}) + "\n")
    return str(path)


def test_load_trace_names_the_bad_line(tmp_path):
    p = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    p.write_text(good + '\n\n{"input_length": 5}\n')
    with pytest.raises(TraceFormatError) as ei:
        load_trace(p)
    assert ":3:" in str(ei.value) and ei.value.line == 3 and ei.value.source == str(p)
    p.write_text(good.replace("10", "9999") + "\n")
    with pytest.raises(TraceFormatError):
        load_trace(p)
    assert len(load_trace(write_trace(tmp_path / "u.jsonl", [([1], 5)] * 4), limit=2)) == 2


def test_exact_hits_when_everything_fits(tmp_path):
    # page 256: each block is 2 pages. r2 shares r1's first block, r3 repeats r1 exactly.
    reqs = [([0, 1], 1024), ([0, 2], 1000), ([0, 1], 1024)]
    res = simulate([TraceRequest(0, n, 1, tuple(ids)) for ids, n in reqs], l1_pages=64,
                   l2_pages=64, page_size=256, show_progress=False)
    assert res.prompt_tokens == 3048
    assert res.l1_hit_tokens == 512 + 1024 and res.l2_hit_tokens == res.l3_hit_tokens == 0
    assert res.ideal_hit_tokens == res.hit_tokens
    assert res.computed_tokens == 3048 - 1536 and res.skipped == 0
    assert res.hit_rate == pytest.approx(1536 / 3048)


def test_small_l1_hits_l2_and_l3_and_matches_the_unbounded_cache():
    reqs = [TraceRequest(0, 1024, 1, (i, i + 100)) for i in range(6)]
    reqs += [TraceRequest(0, 1024, 1, (i, i + 100)) for i in reversed(range(6))]
    # 4 pages a request. L1 holds the last two requests, the (inclusive) L2 the last four,
    # L3 all six: replayed newest first, the second round hits L1, then L2, then L3.
    res = simulate(reqs, l1_pages=8, l2_pages=16, l3="memory", l3_pages=64, page_size=256,
                   show_progress=False)
    assert (res.l1_hit_tokens, res.l2_hit_tokens, res.l3_hit_tokens) == (2048, 2048, 2048)
    assert res.hit_tokens == res.ideal_hit_tokens == 6 * 1024
    base = simulate(reqs, l1_pages=8, l2_pages=1, page_size=256, count_only_l1=True,
                    show_progress=False)
    assert base.hit_tokens == 2048            # L1 alone: only the two newest requests
    assert base.ideal_hit_tokens == res.ideal_hit_tokens


def test_requests_larger_than_l1_are_skipped_not_crashed():
    res = simulate([TraceRequest(0, 4096, 1, tuple(range(8)))], l1_pages=4, l2_pages=4,
                   page_size=256, show_progress=False)
    assert res.skipped == 1 and res.computed_tokens == 4096


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError):
        simulate([], l1_pages=0, l2_pages=4)
    with pytest.raises(ConfigError):
        simulate([], l1_pages=4, l2_pages=4, l3="memory", l3_pages=4, page_size=-1)


def test_page_allocator():
    a = PageAllocator(4)
    p = a.alloc(3)
    assert sorted(p) == [0, 1, 2] and a.alloc(2) is None and a.free_count == 1
    a.free(p[:1])
    with pytest.raises(InvalidArgumentError):
        a.free(p[:1])                          # double free
    with pytest.raises(InvalidArgumentError):
        a.free([p[1], p[1]])


def test_cli_table_and_json(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", [([0, 1], 1024), ([0, 1], 1024), ([2], 300)])
    assert main(["simulate", "--trace", path, "--l1-pages", "16", "--l2-pages", "16",
                 "--l3", "memory", "--l3-pages", "32", "--page-size", "128",
                 "--baseline"]) == 0
    out = capsys.readouterr().out
    assert "L1 hit %" in out and "L1 only" in out and "percentage points" in out
    assert main(["simulate", "--trace", path, "--l1-pages", "16", "--l2-pages", "16",
                 "--page-size", "128", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tiers"]["l1_hit_tokens"] == 1024 and d["tiers"]["requests"] == 3
    assert main(["simulate", "--trace", path, "--l1-pages", "16", "--l2-pages", "16",
                 "--l3-pages", "8"]) == 2          # --l3-pages without --l3
    assert "ConfigError" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(TRACE), reason="Mooncake trace not present")
def test_replays_the_start_of_the_mooncake_trace(capsys):
    assert main(["simulate", "--trace", TRACE, "--l1-pages", "1024", "--l2-pages", "2048",
                 "--l3", "memory", "--l3-pages", "8192", "--page-size", "512",
                 "--limit", "150", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["tiers"]
    assert d["requests"] == 150 and 0 < d["hit_rate"] <= d["ideal_hit_rate"] + 1e-9


@pytest.mark.parametrize("content, words", [
    (b'[1, 2]\n', "expected a JSON object, got list"),
    (b'"just a string"\n', "expected a JSON object, got str"),
    (b'\xff\xfe{}\n', "not UTF-8"),
    (b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": "01"}\n',
     "hash_ids must be a non-empty list"),
    (b'{"timestamp": 0, "input_length": 6', "not valid JSON"),
])
def test_bad_trace_is_one_line_exit_2_naming_file_and_line(tmp_path, capsys, content, words):
    p = tmp_path / "bad.jsonl"
    good = b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [4]}\n'
    p.write_bytes(good + content)
    assert main(["simulate", "--trace", str(p), "--l1-pages", "8", "--l2-pages", "8"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{p}:2:" in err and words in err and "TraceFormatError" in err


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_missing_trace_or_directory_is_one_line_exit_2(tmp_path, capsys, what):
    path = tmp_path / "nope.jsonl" if what == "missing" else tmp_path
    assert main(["simulate", "--trace", str(path), "--l1-pages", "8", "--l2-pages", "8"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "TraceError" in err and str(path) in err


def test_empty_trace_warns(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.warns(EmptyTraceWarning, match="holds no request"):
        res = simulate(str(p), l1_pages=4, l2_pages=4, show_progress=False)
    assert res.requests == 0 and res.hit_rate == 0.0
    assert issubclass(TraceFormatError, TraceError)


@pytest.mark.parametrize("store", ["file", "memory"])
def test_l3_pages_hold_exactly_that_many_pages(tmp_path, store):
    """--l3 STORE --l3-pages N keeps N pages: the file store's trailer (and padding) is
    counted in the capacity, not against it. 12 distinct pages go through a one-page L1 and
    L2 (write_through: each reaches L3); then the last N are all L3 hits and the one before
    them is not."""
    n, page = 5, 64
    reqs = [([i], page) for i in range(12)]
    config = json.dumps({"root": str(tmp_path / "l3")}) if store == "file" else None
    path = write_trace(tmp_path / "t.jsonl", reqs + [([i], page) for i in range(12 - n, 12)])
    res = simulate(path, l1_pages=1, l2_pages=1, l3=store, l3_pages=n, page_size=page,
                   l3_config=json.loads(config) if config else None, show_progress=False)
    assert res.l3_hit_tokens == n * page, res.as_dict()
    path = write_trace(tmp_path / "u.jsonl", reqs + [([12 - n - 1], page)])
    res = simulate(path, l1_pages=1, l2_pages=1, l3=store, l3_pages=n, page_size=page,
                   l3_config=json.loads(config) if config else None, show_progress=False)
    assert res.l3_hit_tokens == 0, res.as_dict()


def test_page_allocator_lives_in_its_own_module():
    import kvtier.page_allocator
    import kvtier_tools.simulate
    assert kvtier_tools.simulate.PageAllocator is kvtier.page_allocator.PageAllocator


def test_runs_without_a_trace_on_a_generated_workload_with_json_and_png(tmp_path, capsys):
    import json as _json

    from kvtier_tools.simulate import sample_trace
    a, b = sample_trace(200, seed=3), sample_trace(200, seed=3)
    assert a == b and len(a) == 200 and sample_trace(200, seed=4) != a
    assert any(set(x.hash_ids) & set(y.hash_ids) for x, y in zip(a, a[1:]))   # shared prefixes
    png = tmp_path / "sim.png"
    assert main(["simulate", "--l1-pages", "64", "--l2-pages", "256", "--l3", "memory",
                 "--sample-requests", "150", "--baseline", "--json", "--plot",
                 str(png)]) == 0
    out = _json.loads(capsys.readouterr().out)
    assert out["tiers"]["requests"] == 150
    assert out["tiers"]["l2_hit_tokens"] + out["tiers"]["l3_hit_tokens"] > 0
    assert out["L1 only"]["l2_hit_tokens"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--l1-pages", "64", "--l2-pages", "8",
                 "--sample-requests", "0"]) == 2
