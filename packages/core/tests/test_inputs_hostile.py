"""Hostile input files and values: a FIFO, deep nesting, huge integers, huge strings.

Every case ends in one typed error naming the file, the line or the field (``kvtier``: one
line, exit status 2), before anything is allocated; nothing waits forever. A case that could
hang runs in a thread or a subprocess with a time limit and fails instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from kvtier.cache import CacheConfig
from kvtier.cli import main
from kvtier.config import read_config_file
from kvtier.errors import ConfigError, KVTierError
from kvtier.trace import TraceError, TraceFormatError, read_trace

LIMIT_S = 10.0
DEEP = 5000                 # past the interpreter's recursion limit
BIG = "1" * 5000            # past the interpreter's int digit limit (4300)


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    """`kvtier --config` sets $KVTIER_CONFIG; no test leaves it behind or sees another's."""
    monkeypatch.setenv("KVTIER_CONFIG", "")        # recorded, so restored (or removed) after
    monkeypatch.delenv("KVTIER_CONFIG")


def _fifo(tmp_path: Path, name: str = "fifo") -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    p = tmp_path / name
    os.mkfifo(p)
    return p


def _bounded(fn: Callable[[], Any], fifo: Path) -> BaseException | None:
    """The exception ``fn()`` raises, run in a thread for at most LIMIT_S; if it is still
    blocked on ``fifo`` then, a writer opens the FIFO to set it free and the test fails."""
    out: dict[str, BaseException | None] = {"error": None}

    def target() -> None:
        try:
            fn()
        except BaseException as exc:        # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(LIMIT_S)
    if t.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        t.join(LIMIT_S)
        pytest.fail(f"still blocked on the FIFO {fifo} after {LIMIT_S} s")
    return out["error"]


_MAIN = "import sys; from kvtier.cli import main; sys.exit(main())"


def _kvtier(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``kvtier ARGV`` in a new process, killed (and the test failed) past the time limit."""
    full = {k: v for k, v in os.environ.items() if k != "KVTIER_CONFIG"}
    full.update(env or {})
    try:
        return subprocess.run([sys.executable, "-c", _MAIN, *argv], env=full,
                              capture_output=True, text=True, timeout=3 * LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier {' '.join(argv)} did not finish in {3 * LIMIT_S} s")


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------------------------
# 1. a FIFO as the config file
# --------------------------------------------------------------------------------------------
def test_fifo_config_file_is_refused_not_waited_on(tmp_path):
    fifo = _fifo(tmp_path)
    for fn in (lambda: read_config_file(fifo, "cache"),
               lambda: CacheConfig.load({"model_id": "m"}, path=str(fifo), environ={}),
               lambda: CacheConfig.load({"model_id": "m"}, environ={"KVTIER_CONFIG": str(fifo)}),
               lambda: CacheConfig.from_file(str(fifo))):
        err = _bounded(fn, fifo)
        assert isinstance(err, ConfigError), err
        assert str(fifo) in str(err) and "FIFO" in str(err) and "\n" not in str(err)
        assert err.key == "config"


def test_character_device_config_file_is_refused(tmp_path):
    if not os.path.exists(os.devnull) or os.name != "posix":
        pytest.skip("no /dev/null here")
    with pytest.raises(ConfigError, match="character device"):
        read_config_file(os.devnull, "cache")


def test_cli_fifo_config_is_one_line_exit_2(tmp_path):
    fifo = _fifo(tmp_path)
    p = _kvtier("--config", str(fifo), "backends", "--kind", "l3_store")
    assert p.returncode == 2
    line = _one_line(p.stderr)
    assert "ConfigError" in line and str(fifo) in line and "FIFO" in line
    p = _kvtier("simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", "1",
                env={"KVTIER_CONFIG": str(fifo)})
    assert p.returncode == 2 and str(fifo) in _one_line(p.stderr)


# --------------------------------------------------------------------------------------------
# 2. a FIFO as the trace
# --------------------------------------------------------------------------------------------
def test_fifo_trace_is_refused_not_waited_on(tmp_path):
    from kvtier.simulate import load_trace
    fifo = _fifo(tmp_path)
    for fn in (lambda: read_trace(fifo), lambda: load_trace(str(fifo))):
        err = _bounded(fn, fifo)
        assert isinstance(err, TraceError) and not isinstance(err, TraceFormatError), err
        assert str(fifo) in str(err) and "FIFO" in str(err) and err.source == str(fifo)


def test_cli_fifo_trace_is_one_line_exit_2(tmp_path):
    fifo = _fifo(tmp_path)
    p = _kvtier("simulate", "--trace", str(fifo), "--l1-pages", "8", "--l2-pages", "8")
    assert p.returncode == 2
    line = _one_line(p.stderr)
    assert "TraceError" in line and str(fifo) in line and "FIFO" in line


# --------------------------------------------------------------------------------------------
# 10. l3_call_timeout_s = 0
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 0.0, -1.0, float("inf"), float("nan"), 1e300])
def test_l3_call_timeout_must_be_positive_and_finite(value):
    with pytest.raises(ConfigError, match="l3_call_timeout_s") as ei:
        CacheConfig.from_dict({"model_id": "m", "l3_call_timeout_s": value})
    assert ei.value.key == "l3_call_timeout_s"
    with pytest.raises(ConfigError, match="l3_call_timeout_s"):
        CacheConfig.from_env(environ={"KVTIER_MODEL_ID": "m",
                                      "KVTIER_L3_CALL_TIMEOUT_S": str(value)})
    assert CacheConfig.from_dict({"model_id": "m", "l3_call_timeout_s": 0.01}
                                 ).l3_call_timeout_s == 0.01


# --------------------------------------------------------------------------------------------
# 11. simulate --limit < 1
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", ["0", "-1"])
def test_simulate_limit_below_one_is_refused(limit, capsys):
    assert main(["simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", limit]) == 2
    captured = capsys.readouterr()
    assert "limit" in _one_line(captured.err) and "ConfigError" in captured.err
    assert "requests" not in captured.out          # refused before any replay


def test_simulate_function_refuses_limit_below_one():
    from kvtier.simulate import sample_trace, simulate
    for limit in (0, -3, True):
        with pytest.raises(ConfigError, match="limit"):
            simulate(sample_trace(5), l1_pages=8, l2_pages=8, limit=limit,
                     show_progress=False)


# --------------------------------------------------------------------------------------------
# 12. deep nesting, huge ints, huge sizes in configs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, words", [
    ("[cache]\nmodel_id = \"m\"\nx = " + "[" * DEEP + "]" * DEEP + "\n", "nests more than"),
    ("[cache]\nmodel_id = \"m\"\nx = " + "{a = " * DEEP + "1" + "}" * DEEP + "\n",
     "nests more than"),
    ("[cache]\nmodel_id = \"m\"\n[cache.l3_config]\nroot = " + "[" * 40 + "]" * 40 + "\n",
     "nests more than 32"),
    ("[cache]\nmodel_id = \"m\"\nhost_pool_pages = " + BIG + "\n", "cannot be read"),
])
def test_hostile_toml_is_one_config_error_naming_the_file(tmp_path, body, words):
    p = tmp_path / "kvtier.toml"
    p.write_text(body)
    with pytest.raises(ConfigError) as ei:
        CacheConfig.load(path=str(p), environ={})
    msg = str(ei.value)
    assert str(p) in msg and words in msg and "\n" not in msg and len(msg) < 400


def test_cli_deep_toml_is_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "deep.toml"
    p.write_text("[cache]\nx = " + "[" * DEEP + "]" * DEEP + "\n")
    assert main(["--config", str(p), "backends", "--kind", "l3_store"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "ConfigError" in line and str(p) in line


@pytest.mark.parametrize("text, words", [
    ("[" * DEEP + "]" * DEEP, "nests more than"),
    ('{"a": ' * DEEP + "1" + "}" * DEEP, "nests more than"),
    ('{"a": ' * 40 + "1" + "}" * 40, "nests more than 32"),
    ('{"capacity_bytes": ' + BIG + "}", "l3_config must be a JSON object"),
])
def test_hostile_l3_config_json_is_one_config_error_naming_the_field(text, words):
    with pytest.raises(ConfigError) as ei:
        CacheConfig.from_env(environ={"KVTIER_MODEL_ID": "m", "KVTIER_L3_CONFIG": text})
    msg = str(ei.value)
    assert "l3_config" in msg and words in msg and "\n" not in msg and len(msg) < 600
    assert ei.value.key.startswith("l3_config")


def test_deep_dict_given_in_code_is_a_config_error():
    deep: dict[str, Any] = {}
    d = deep
    for _ in range(DEEP):
        d["a"] = {}
        d = d["a"]
    with pytest.raises(ConfigError, match="nests more than 32"):
        CacheConfig.from_dict({"model_id": "m", "l3_config": deep})


@pytest.mark.parametrize("field, value", [
    ("host_pool_pages", 2**63 - 1), ("host_pool_pages", 2**64), ("host_pool_pages", 10**4000),
    ("host_pool_bytes", 2**63 - 1), ("l3_max_queued_pages", 2**60),
    ("l3_io_threads", 10**6), ("l3_batch_pages", 2**63 - 1), ("tp_size", -(2**70)),
    ("close_timeout_s", 1e300), ("prefetch_timeout_cap_s", 1e300),
    ("host_pool_ratio", 1e300), ("host_pool_ratio", 10**400),
], ids=lambda v: v if isinstance(v, str) else f"{v!r:.12}")
def test_sizes_no_machine_holds_are_config_errors_naming_the_field(field, value):
    with pytest.raises(ConfigError) as ei:
        CacheConfig.from_dict({"model_id": "m", field: value})
    msg = str(ei.value)
    assert field in msg and "\n" not in msg and len(msg) < 400
    text = str(value) if not isinstance(value, int) or value < 10**4000 else BIG
    with pytest.raises(ConfigError, match=field):
        CacheConfig.from_env(environ={"KVTIER_MODEL_ID": "m", f"KVTIER_{field.upper()}": text})


def test_the_largest_sizes_allowed_still_build():
    from kvtier.cache.config import MAX_COUNT
    c = CacheConfig.from_dict({"model_id": "m", "host_pool_pages": MAX_COUNT,
                               "selective_threshold": 1 << 62, "l3_io_threads": 1024})
    assert c.host_pool_pages == MAX_COUNT and c.selective_threshold == 1 << 62


def test_host_pool_size_is_checked_in_bytes_before_allocating():
    c = CacheConfig.from_dict({"model_id": "m", "host_pool_pages": 2**40})
    with pytest.raises(ConfigError, match="host_pool_pages") as ei:
        c.host_pages_for(page_bytes=2**20, device_pages=8)
    assert ei.value.key == "host_pool_pages"
    c = CacheConfig.from_dict({"model_id": "m", "host_pool_ratio": 2.0**40})
    with pytest.raises(ConfigError, match="host_pool_ratio"):
        c.host_pages_for(page_bytes=2**20, device_pages=2**20)
    assert CacheConfig.from_dict({"model_id": "m", "host_pool_pages": 4}
                                 ).host_pages_for(2**20, 8) == 4


def test_simulate_with_a_pool_no_machine_holds_is_one_line_exit_2(capsys):
    for flag in ("--l2-pages", "--l1-pages"):
        argv = ["simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", "1"]
        argv[argv.index(flag) + 1] = str(2**63 - 1)
        assert main(argv) == 2
        line = _one_line(capsys.readouterr().err)
        assert "ConfigError" in line and flag[2:].replace("-", "_") in line


def test_cli_huge_host_pool_pages_in_the_config_file_is_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "kvtier.toml"
    p.write_text(f"[cache]\nhost_pool_pages = {2**63 - 1}\n")
    for argv in (["bench", "control", "--tokens", "128"],
                 ["simulate", "--l1-pages", "8", "--l2-pages", "8", "--limit", "1"]):
        assert main(["--config", str(p), *argv]) == 2
        assert "host_pool_pages" in _one_line(capsys.readouterr().err)


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
    err = _one_line(capsys.readouterr().err)
    assert "TraceFormatError" in err and f"{p}:2:" in err


def test_hash_id_past_what_simulate_maps_to_tokens_names_the_line(tmp_path, capsys):
    from kvtier.simulate import load_trace
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + "\n" + GOOD.replace("[1, 2]", f"[1, {2**23}]") + "\n")
    with pytest.raises(TraceFormatError) as ei:
        load_trace(p)
    assert ei.value.line == 2 and ei.value.field == "hash_ids"
    assert main(["simulate", "--trace", str(p), "--l1-pages", "8", "--l2-pages", "8"]) == 2
    assert f"{p}:2:" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, '{"a": ' * 40 + "1" + "}" * 40,
                                  '{"capacity_bytes": ' + BIG + "}", "[1]"])
def test_simulate_hostile_l3_config_is_one_line_exit_2(text, capsys):
    assert main(["simulate", "--l1-pages", "8", "--l2-pages", "8", "--l3", "memory",
                 "--limit", "1", "--l3-config", text]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "ConfigError" in line and "--l3-config" in line and len(line) < 600


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, '{"capacity_bytes": ' + BIG + "}",
                                  "{"], ids=["deep", "huge-int", "not-json"])
def test_demo_hostile_l3_config_is_a_usage_error(text):
    """``kvtier demo --l3-config`` is read as every config value is: a usage error naming the
    flag, before anything is built."""
    import argparse

    from kvtier.demo.command import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit) as ei:
        p.parse_args(["--l3-config", text])
    assert ei.value.code == 2


# --------------------------------------------------------------------------------------------
# 14. huge values are not echoed whole
# --------------------------------------------------------------------------------------------
HUGE = "x" * (1 << 20)


@pytest.mark.parametrize("data", [
    {"model_id": "m", "host_pool_pages": HUGE}, {"model_id": "m", "host_pool_ratio": HUGE},
    {"model_id": "m", "write_policy": HUGE}, {"model_id": "m", "cost_aware_fetch": HUGE},
    {"model_id": "m", "tp_rank": HUGE}, {"model_id": "m", HUGE: 1},
    {"model_id": "m", "l3_config": HUGE}, {"model_id": "m", "recompute_tokens_per_s": HUGE},
])
def test_config_errors_echo_at_most_a_short_cut_of_the_value(data):
    with pytest.raises(ConfigError) as ei:
        CacheConfig.from_dict(data)
    assert len(str(ei.value)) < 1000, len(str(ei.value))


def test_environment_values_are_cut_too():
    for var in ("KVTIER_HOST_POOL_PAGES", "KVTIER_L3_CONFIG", "KVTIER_WRITE_POLICY"):
        with pytest.raises(ConfigError) as ei:
            CacheConfig.from_env(environ={"KVTIER_MODEL_ID": "m", var: HUGE})
        msg = str(ei.value)
        assert len(msg) < 1000 and f"({len(repr(HUGE))} characters)" in msg
        assert ei.value.value == HUGE                   # the field keeps the whole value


def test_show_value_cuts_long_values_and_says_how_long():
    from kvtier.errors import show_value
    assert show_value(12) == "12" and show_value("ab") == "'ab'"
    cut = show_value("y" * 1000)
    assert cut.startswith("'yyy") and cut.endswith("... (1002 characters)") and len(cut) < 120
    assert "digits" in show_value(10**5000)


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
    assert field in _one_line(captured.err) and "requests" not in captured.out


def test_bench_control_builds_its_caches_from_the_config_file(tmp_path, capsys):
    from kvtier.bench.control import _Rig, rig_config
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
    assert "key_hash" in _one_line(capsys.readouterr().err)


def test_bench_store_takes_batch_and_callers_from_the_config_file(tmp_path, monkeypatch,
                                                                   capsys):
    from kvtier.bench.store import _controller_defaults
    p = _toml(tmp_path, "l3_batch_pages = 5\nl3_io_threads = 3\nkey_hash = \"blake2b\"\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(p))
    args = argparse.Namespace(batch=None, callers=7)
    _controller_defaults(args)
    assert (args.batch, args.callers) == (5, 7)               # the flag wins
    assert "key_hash" in capsys.readouterr().err
    bad = _toml(tmp_path, "l3_batch_pages = 0\n")
    assert main(["--config", str(bad), "bench", "store", "--dir", str(tmp_path / "d"),
                 "--total", "1M", "--page-sizes", "256K"]) == 2
    assert "l3_batch_pages" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "d").exists()                      # refused before the run


def test_bench_vllm_lays_the_config_file_under_each_run(tmp_path):
    pytest.importorskip("kvtier.integrations.vllm")
    from kvtier.bench.vllm import _kvtier_config
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
            mod = importlib.import_module(f"kvtier.bench.{name}")
        except ImportError as exc:              # a benchmark's optional dependency
            pytest.skip(f"kvtier.bench.{name}: {exc}")
        assert getattr(mod, "BUILDS_CACHE", True) is builds, name


def test_errors_are_typed():
    assert issubclass(TraceError, KVTierError) and issubclass(ConfigError, KVTierError)
