"""Hostile inputs to the tools: a FIFO as the config file or the trace, hostile trace lines,
huge pools and config values given to ``kvtier simulate``, ``bench`` and ``demo``.

Every case ends in one typed error naming the file, the line or the field (``kvtier``: one
line, exit status 2), before anything is allocated; nothing waits forever. A case that could
hang runs in a thread or a subprocess with a time limit and fails instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.testing import hostile
from kvtier.errors import ConfigError, KVTierError
from kvtier_tools.trace import TraceError, TraceFormatError, read_trace

DEEP = 5000                 # past the interpreter's recursion limit
BIG = "1" * 5000            # past the interpreter's int digit limit (4300)


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    """`kvtier --config` sets $KVTIER_CONFIG; no test leaves it behind or sees another's."""
    monkeypatch.setenv("KVTIER_CONFIG", "")        # recorded, so restored (or removed) after
    monkeypatch.delenv("KVTIER_CONFIG")


# --------------------------------------------------------------------------------------------
# 1. a FIFO as the config file
# --------------------------------------------------------------------------------------------
def test_cli_fifo_config_is_one_line_exit_2(tmp_path):
    fifo = hostile.fifo(tmp_path)
    p = hostile.run_kvtier("simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", "1",
                env={"KVTIER_CONFIG": str(fifo)})
    assert p.returncode == 2 and str(fifo) in hostile.one_line(p.stderr)


# --------------------------------------------------------------------------------------------
# 2. a FIFO as the trace
# --------------------------------------------------------------------------------------------
def test_fifo_trace_is_refused_not_waited_on(tmp_path):
    from kvtier_tools.simulate import load_trace
    fifo = hostile.fifo(tmp_path)
    for fn in (lambda: read_trace(fifo), lambda: load_trace(str(fifo))):
        err = hostile.bounded(fn, fifo)
        assert isinstance(err, TraceError) and not isinstance(err, TraceFormatError), err
        assert str(fifo) in str(err) and "FIFO" in str(err) and err.source == str(fifo)


def test_cli_fifo_trace_is_one_line_exit_2(tmp_path):
    fifo = hostile.fifo(tmp_path)
    p = hostile.run_kvtier("simulate", "--trace", str(fifo), "--l1-pages", "8", "--l2-pages", "8")
    assert p.returncode == 2
    line = hostile.one_line(p.stderr)
    assert "TraceError" in line and str(fifo) in line and "FIFO" in line


# --------------------------------------------------------------------------------------------
# 11. simulate --limit < 1
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", ["0", "-1"])
def test_simulate_limit_below_one_is_refused(limit, capsys):
    assert main(["simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", limit]) == 2
    captured = capsys.readouterr()
    assert "limit" in hostile.one_line(captured.err) and "ConfigError" in captured.err
    assert "requests" not in captured.out          # refused before any replay


def test_simulate_function_refuses_limit_below_one():
    from kvtier_tools.simulate import sample_trace, simulate
    for limit in (0, -3, True):
        with pytest.raises(ConfigError, match="limit"):
            simulate(sample_trace(5), l1_pages=8, l2_pages=8, limit=limit,
                     show_progress=False)


# --------------------------------------------------------------------------------------------
# 12. huge sizes in configs
# --------------------------------------------------------------------------------------------
def test_simulate_with_a_pool_no_machine_holds_is_one_line_exit_2(capsys):
    for flag in ("--l2-pages", "--l1-pages"):
        argv = ["simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", "1"]
        argv[argv.index(flag) + 1] = str(2**63 - 1)
        assert main(argv) == 2
        line = hostile.one_line(capsys.readouterr().err)
        assert "ConfigError" in line and flag[2:].replace("-", "_") in line


def test_cli_huge_host_pool_pages_in_the_config_file_is_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "kvtier.toml"
    p.write_text(f"[cache]\nhost_pool_pages = {2**63 - 1}\n")
    for argv in (["bench", "control", "--tokens", "128"],
                 ["simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", "1"]):
        assert main(["--config", str(p), *argv]) == 2
        assert "host_pool_pages" in hostile.one_line(capsys.readouterr().err)


# --------------------------------------------------------------------------------------------
# 13. hostile traces and --l3-config in kvtier simulate
# --------------------------------------------------------------------------------------------
GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'


@pytest.mark.parametrize("line, field", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, %d]}'
     % 2**63, "hash_ids"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, %d]}'
     % 2**64, "hash_ids"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, %s]}'
     % BIG, None),
    ('{"timestamp": 0, "input_length": 600, "output_length": %d, "hash_ids": [1, 2]}'
     % 2**63, "output_length"),
    ('{"timestamp": %d, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'
     % 10**400, "timestamp"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], "x": '
     + "[" * DEEP + "]" * DEEP + "}", None),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], "x": '
     + "[" * 40 + "]" * 40 + "}", None),
], ids=["hash-2**63", "hash-2**64", "5000-digits", "output-2**63", "timestamp-10**400",
        "deep-5000", "deep-40"])
def test_hostile_trace_line_is_a_format_error_naming_line_and_field(tmp_path, capsys, line,
                                                                    field):
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p)
    assert ei.value.line == 2 and ei.value.field == field and ei.value.source == str(p)
    assert f"{p}:2:" in str(ei.value) and len(str(ei.value)) < 400
    assert main(["simulate", "--trace", str(p), "--l1-pages", "8", "--l2-pages", "8"]) == 2
    err = hostile.one_line(capsys.readouterr().err)
    assert "TraceFormatError" in err and f"{p}:2:" in err


def test_hash_id_past_what_simulate_maps_to_tokens_names_the_line(tmp_path, capsys):
    from kvtier_tools.simulate import load_trace
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + "\n" + GOOD.replace("[1, 2]", f"[1, {2**23}]") + "\n")
    with pytest.raises(TraceFormatError) as ei:
        load_trace(p)
    assert ei.value.line == 2 and ei.value.field == "hash_ids"
    assert main(["simulate", "--trace", str(p), "--l1-pages", "8", "--l2-pages", "8"]) == 2
    assert f"{p}:2:" in hostile.one_line(capsys.readouterr().err)


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, '{"a": ' * 40 + "1" + "}" * 40,
                                  '{"capacity_bytes": ' + BIG + "}", "[1]"])
def test_simulate_hostile_l3_config_is_one_line_exit_2(text, capsys):
    assert main(["simulate", "--l1-pages", "8", "--l2-pages", "8", "--l3", "memory",
                 "--limit", "1", "--l3-config", text]) == 2
    line = hostile.one_line(capsys.readouterr().err)
    assert "ConfigError" in line and "--l3-config" in line and len(line) < 600


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, '{"capacity_bytes": ' + BIG + "}",
                                  "{"], ids=["deep", "huge-int", "not-json"])
def test_demo_hostile_l3_config_is_a_usage_error(text):
    """``kvtier demo --l3-config`` is read as every config value is: a usage error naming the
    flag, before anything is built."""
    import argparse

    from kvtier_tools.demo.command import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit) as ei:
        p.parse_args(["--l3-config", text])
    assert ei.value.code == 2


# --------------------------------------------------------------------------------------------
# 7. the config file applies to the caches simulate and bench build
# --------------------------------------------------------------------------------------------
def _toml(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "kvtier.toml"
    p.write_text("[cache]\n" + body)
    return p


def test_simulate_applies_the_config_file_under_its_flags(tmp_path, capsys):
    p = _toml(tmp_path, 'write_policy = "write_back"\nl3_io_threads = 1\n'
                        'prefetch_policy = "timeout"\nl3_store = "memory"\n')
    argv = ["--config", str(p), "simulate", "--l1-pages", "16", "--l2-pages", "16",
            "--sample-requests", "20", "--json"]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)["tiers"]["settings"]
    assert s["write_policy"] == "write_back" and s["prefetch_policy"] == "timeout"
    assert s["l3"] == "memory"
    assert s["cache_config"]["l3_io_threads"] == 1
    assert main(argv + ["--write-policy", "write_through", "--l3", "file",
                        "--l3-config", json.dumps({"root": str(tmp_path / "l3")})]) == 0
    s = json.loads(capsys.readouterr().out)["tiers"]["settings"]
    assert s["write_policy"] == "write_through" and s["prefetch_policy"] == "timeout"
    assert s["l3"] == "file"


@pytest.mark.parametrize("body, field", [
    ('write_policy = "bogus"\n', "write_policy"), ("host_pool_pagez = 3\n", "host_pool_pagez"),
    ("l3_call_timeout_s = 0\n", "l3_call_timeout_s"), ('l3_store = 5\n', "l3_store"),
    ("host_pool_bytes = -1\n", "host_pool_bytes"),
])
def test_simulate_refuses_bad_config_file_values(tmp_path, capsys, body, field):
    p = _toml(tmp_path, body)
    assert main(["--config", str(p), "simulate", "--l1-pages", "8", "--l2-pages", "8",
                 "--sample-requests", "5"]) == 2
    captured = capsys.readouterr()
    assert field in hostile.one_line(captured.err) and "requests" not in captured.out


def test_bench_control_builds_its_caches_from_the_config_file(tmp_path, capsys):
    from kvtier_tools.bench.control import _Rig, rig_config
    cfg = rig_config(8, write_policy="write_back", l3=None,
                     extra={"l3_io_threads": 1, "write_policy": "write_through",
                            "host_pool_bytes": 1 << 30, "key_hash": "blake2b"})
    assert cfg["l3_io_threads"] == 1 and cfg["write_policy"] == "write_back"
    assert "host_pool_bytes" not in cfg and cfg["key_hash"] == "blake2b"
    rig = _Rig(64, 8, 8, write_policy="write_through", l3="memory",
               extra={"l3_io_threads": 1, "l3_batch_pages": 3})
    try:
        assert rig.cache.config.l3_io_threads == 1 and rig.cache.config.l3_batch_pages == 3
    finally:
        rig.close()
    p = _toml(tmp_path, 'key_hash = "md5"\n')
    assert main(["--config", str(p), "bench", "control", "--tokens", "128"]) == 2
    assert "key_hash" in hostile.one_line(capsys.readouterr().err)


def test_bench_store_takes_batch_and_callers_from_the_config_file(tmp_path, monkeypatch,
                                                                   capsys):
    from kvtier_tools.bench.store import _controller_defaults
    p = _toml(tmp_path, "l3_batch_pages = 5\nl3_io_threads = 3\nkey_hash = \"blake2b\"\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(p))
    args = argparse.Namespace(batch=None, callers=7)
    _controller_defaults(args)
    assert (args.batch, args.callers) == (5, 7)               # the flag wins
    assert "key_hash" in capsys.readouterr().err
    bad = _toml(tmp_path, "l3_batch_pages = 0\n")
    assert main(["--config", str(bad), "bench", "store", "--dir", str(tmp_path / "d"),
                 "--total", "1M", "--page-sizes", "256K"]) == 2
    assert "l3_batch_pages" in hostile.one_line(capsys.readouterr().err)
    assert not (tmp_path / "d").exists()                      # refused before the run


def test_bench_vllm_lays_the_config_file_under_each_run(tmp_path):
    pytest.importorskip("kvtier.integrations.vllm")
    from kvtier_tools.bench.vllm import _kvtier_config
    ktc = _kvtier_config({"host_pool_pages": 24},
                         {"l3_io_threads": 1, "host_pool_pages": 9, "l3_store": "file",
                          "tp_size": 2, "cost_aware_fetch": False})
    assert ktc["kv_connector_extra_config"] == {"l3_io_threads": 1, "host_pool_pages": 24,
                                                "cost_aware_fetch": False}


@pytest.mark.parametrize("argv", [
    ["bench", "keys", "--tokens", "256", "--page-sizes", "64", "--hashes", "sha256",
     "--repeat", "1"],
])
def test_bench_commands_without_a_cache_say_the_file_does_not_apply(tmp_path, capsys, argv):
    p = _toml(tmp_path, 'model_id = "m"\n')
    assert main(["--config", str(p), *argv]) == 0
    err = capsys.readouterr().err
    assert "builds no cache" in err and str(p) in err


def test_every_bench_command_says_whether_it_builds_a_cache():
    import importlib
    for name, builds in (("keys", False), ("transfer", False), ("mooncake_store", False),
                         ("prefill", False), ("control", True), ("store", True),
                         ("vllm", True)):
        try:
            mod = importlib.import_module(f"kvtier_tools.bench.{name}")
        except ImportError as exc:              # a benchmark's optional dependency
            pytest.skip(f"kvtier_tools.bench.{name}: {exc}")
        assert getattr(mod, "BUILDS_CACHE", True) is builds, name


def test_errors_are_typed():
    assert issubclass(TraceError, KVTierError) and issubclass(ConfigError, KVTierError)
