"""Hostile input files and values: a FIFO, deep nesting, huge integers, huge strings (the
tools' traces and flags: kvtier-tools' test_inputs_hostile.py).

Every case ends in one typed error naming the file, the line or the field (``kvtier``: one
line, exit status 2), before anything is allocated; nothing waits forever. A case that could
hang runs in a thread or a subprocess with a time limit and fails instead.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvtier.cache import CacheConfig
from kvtier.cli import main
from kvtier.testing import hostile
from kvtier.config import read_config_file
from kvtier.errors import ConfigError, KVTierError

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
def test_fifo_config_file_is_refused_not_waited_on(tmp_path):
    fifo = hostile.fifo(tmp_path)
    for fn in (lambda: read_config_file(fifo, "cache"),
               lambda: CacheConfig.load({"model_id": "m"}, path=str(fifo), environ={}),
               lambda: CacheConfig.load({"model_id": "m"}, environ={"KVTIER_CONFIG": str(fifo)}),
               lambda: CacheConfig.from_file(str(fifo))):
        err = hostile.bounded(fn, fifo)
        assert isinstance(err, ConfigError), err
        assert str(fifo) in str(err) and "FIFO" in str(err) and "\n" not in str(err)
        assert err.key == "config"


def test_character_device_config_file_is_refused(tmp_path):
    if not os.path.exists(os.devnull) or os.name != "posix":
        pytest.skip("no /dev/null here")
    with pytest.raises(ConfigError, match="character device"):
        read_config_file(os.devnull, "cache")


def test_cli_fifo_config_is_one_line_exit_2(tmp_path):
    fifo = hostile.fifo(tmp_path)
    p = hostile.run_kvtier("--config", str(fifo), "backends", "--kind", "l3_store")
    assert p.returncode == 2
    line = hostile.one_line(p.stderr)
    assert "ConfigError" in line and str(fifo) in line and "FIFO" in line


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
    line = hostile.one_line(capsys.readouterr().err)
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


def test_errors_are_typed():
    assert issubclass(ConfigError, KVTierError)
