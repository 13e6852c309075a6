"""Mooncake-format trace parsing and replay for the demo."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtier_tools.demo.trace import (TraceFormatError, parse_line, read_trace, scaled_length,
                               trace_workload)
from kvtier_tools.demo.workload import WorkloadError
from kvtier.errors import InputError, KVTierError
from kvtier_tools.trace import EmptyTraceWarning, TraceError


def _rec(ts, n_in, ids, n_out=4):
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": ids})


@pytest.fixture
def trace_file(tmp_path):
    lines = [
        _rec(0, 1024, [0, 1]),                  # two full blocks
        _rec(10, 1300, [0, 1, 2]),              # shares blocks 0, 1; partial last block
        "",                                     # blank lines are skipped
        _rec(25.5, 100, [9]),                   # one partial block
        _rec(40, 1536, [0, 5, 2]),              # shares block 0 only
    ]
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_valid_lines_parse(trace_file):
    recs = read_trace(trace_file)
    assert [r.line for r in recs] == [1, 2, 4, 5]
    assert recs[1].input_length == 1300 and recs[1].hash_ids == (0, 1, 2)
    assert recs[2].timestamp == 25.5 and recs[2].output_length == 4
    assert [r.line for r in read_trace(trace_file, max_requests=2)] == [1, 2]
    assert [r.line for r in read_trace(trace_file, max_requests=2, skip=1)] == [2, 4]
    with pytest.raises(TraceError, match="holds no request"):
        read_trace(trace_file, skip=4)
    wl = trace_workload(trace_file, start=2, max_requests=5, rounds=1)
    assert [r.arrival_ms for r in wl.requests] == [25.5, 40] and "requests 2..3" in \
        wl.description


def test_scaled_lengths_keep_the_partial_last_block():
    assert scaled_length(1024, 16) == 32
    assert scaled_length(1300, 16) == 32 + 9        # 276 of 512 tokens -> ceil(8.6) = 9
    assert scaled_length(100, 16) == 4              # ceil(3.1)
    assert scaled_length(1, 16) == 1                # never rounds a block away
    assert scaled_length(1300, 512) == 1300


def test_replay_shares_prefixes_exactly_as_the_hash_ids(trace_file):
    wl = trace_workload(trace_file, block_tokens=16, rounds=2, vocab_size=1000, seed=3)
    a, b, c, d = (r.tokens for r in wl.requests)
    assert [len(t) for t in (a, b, c, d)] == [32, 41, 4, 48]
    assert np.array_equal(b[:32], a)                # blocks 0, 1 shared
    assert np.array_equal(d[:16], a[:16])           # block 0 shared
    assert not np.array_equal(d[16:32], a[16:32])   # block 5 != block 1
    assert np.array_equal(d[32:41], b[32:41])       # block 2 again: same tokens anywhere
    assert [r.round for r in wl.requests] == [0, 0, 1, 1]
    assert [r.arrival_ms for r in wl.requests] == [0, 10, 25.5, 40]
    again = trace_workload(trace_file, block_tokens=16, rounds=2, vocab_size=1000, seed=3)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(wl.requests, again.requests))
    other = trace_workload(trace_file, block_tokens=16, rounds=2, vocab_size=1000, seed=4)
    assert not np.array_equal(other.requests[0].tokens, a)


@pytest.mark.parametrize("bad, field, words", [
    ('{"timestamp": 0, "input_length": 10', None, "not valid JSON"),
    ('[1, 2, 3]', None, "expected a JSON object"),
    (_rec(-1, 10, [0]), "timestamp", "timestamp"),
    (json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": [0]}), "input_length",
     "missing field 'input_length'"),
    (_rec(0, 0, [0]), "input_length", "input_length must be an int >= 1"),
    (_rec(0, 10, [0], n_out=-2), "output_length", "output_length"),
    (_rec(0, 10, [0], n_out=True), "output_length", "output_length"),
    (_rec(0, 10, []), "hash_ids", "non-empty list"),
    (_rec(0, 10, [0, "x"]), "hash_ids", "hash_ids[1]"),
    (_rec(0, 10, [-3]), "hash_ids", "hash_ids[0]"),
    (_rec(0, 1024, [0]), "hash_ids", "needs 2 hash_ids"),
    (_rec(0, 100, [0, 1]), "hash_ids", "needs 1 hash_ids"),
])
def test_malformed_line_is_a_typed_error_naming_the_line(tmp_path, bad, field, words):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([_rec(0, 512, [0]), _rec(1, 512, [0]), bad, _rec(2, 512, [1])]))
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p)
    err = ei.value
    assert isinstance(err, KVTierError) and isinstance(err, InputError)
    assert err.line == 3 and err.source == str(p) and err.field == field
    assert f"{p}:3:" in str(err) and words in str(err)


def test_parse_line_alone_and_utf8_errors(tmp_path):
    with pytest.raises(TraceFormatError, match=r"<trace>:7: .*hash_ids"):
        parse_line(_rec(0, 10, "abc"), line=7)
    p = tmp_path / "bin.jsonl"
    p.write_bytes(_rec(0, 512, [0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p)
    assert ei.value.line == 2


def test_missing_or_empty_trace_and_bad_scale(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceError, match="holds no request"):
        read_trace(empty)
    with pytest.warns(EmptyTraceWarning, match="holds no request"):
        assert read_trace(empty, allow_empty=True) == []
    ok = tmp_path / "ok.jsonl"
    ok.write_text(_rec(0, 512, [0]))
    for kwargs in ({"block_tokens": 0}, {"block_tokens": 513}, {"max_requests": 0},
                   {"rounds": 0}, {"start": -1}):
        with pytest.raises(WorkloadError):
            trace_workload(ok, **kwargs)
    assert trace_workload(ok, rounds=5).num_rounds == 1
