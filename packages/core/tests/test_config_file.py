"""Configuration from a TOML file and the environment: typed errors in plain words, unknown
KVTIER_* variables refused with a did-you-mean, and the generated field reference."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from kvtier.config import build_config, config_from_env, read_config_file
from kvtier.config_reference import reference_markdown
from kvtier.errors import ConfigError


@dataclass(frozen=True)
class Conf:
    name: str
    #: How many threads.
    threads: int = 2
    pages: int | None = None
    mode: Literal["a", "b"] = "a"
    #: Extra settings
    #: over two lines.
    extra: dict[str, Any] = field(default_factory=dict)


def test_toml_file_and_section(tmp_path) -> None:
    p = tmp_path / "kvtier.toml"
    p.write_text('[cache]\nname = "m"\nthreads = 4\n[cache.extra]\nroot = "/x"\n')
    data = read_config_file(p, "cache")
    c = build_config(Conf, data, section="cache")
    assert c == Conf("m", 4, None, "a", {"root": "/x"})
    assert read_config_file(p)["cache"]["threads"] == 4


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"),
    ("dir", "is a directory"),
    (b"name = \n", "not valid TOML"),
    (b"\xff\xfe = 1\n", "not valid TOML"),
    (b'other = 1\n', r"has no \[cache\] table"),
    (b'cache = 3\n', "must be a table"),
])
def test_bad_config_files_are_config_errors_naming_the_file(tmp_path, content, match) -> None:
    p = tmp_path / "c.toml"
    if content == "dir":
        p.mkdir()
    elif content is not None:
        p.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as ei:
        read_config_file(p, "cache")
    assert str(p) in str(ei.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_config_file(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("a = 1\n")
    p.chmod(0)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_config_file(p)


def test_errors_in_plain_words() -> None:
    with pytest.raises(ConfigError) as ei:
        build_config(Conf, {"name": "m", "pages": "32"}, section="cache")
    assert str(ei.value) == "cache.pages must be an int or None, got the string '32'"
    with pytest.raises(ConfigError) as ei:
        build_config(Conf, {"threads": 1}, section="cache")
    assert "cache.name is required" in str(ei.value) and "TypeError" not in str(ei.value)
    assert ei.value.key == "cache.name"


def test_unknown_environment_variables_are_refused_with_a_did_you_mean() -> None:
    env = {"KV_NAME": "m", "KV_THREADS": "3", "OTHER": "x"}
    assert config_from_env(Conf, "KV_", env).threads == 3
    with pytest.raises(ConfigError, match="KV_THRADS is not a Conf setting; did you mean "
                                          "KV_THREADS"):
        config_from_env(Conf, "KV_", {**env, "KV_THRADS": "3"})
    with pytest.raises(ConfigError, match="known: "):
        config_from_env(Conf, "KV_", {**env, "KV_ZZZZZZZZZZ": "1"})
    assert config_from_env(Conf, "KV_", {**env, "KV_ZZZ": "1"}, strict=False).name == "m"


def test_reserved_kvtier_variables_pass() -> None:
    env = {"KVTIER_NAME": "m", "KVTIER_CONFIG": "/etc/kvtier.toml", "KVTIER_TORCH": "x",
           "KVTIER_MOONCAKE_MASTER_ADDRESS": "127.0.0.1:1", "KVTIER_TEST_MORI_DIR": "/t",
           "KVTIER_SGLANG_HICACHE": '{"host_allocator": "mmap"}'}     # the SGLang plugin's
    assert config_from_env(Conf, "KVTIER_", env).name == "m"
    # a backend's own prefix is checked as strictly against its own fields
    with pytest.raises(ConfigError, match="KVTIER_MOONCAKE_MASTER_ADDRESS"):
        config_from_env(Conf, "KVTIER_MOONCAKE_", env)


def test_reference_lists_every_field_with_type_default_and_comment() -> None:
    md = reference_markdown([("Conf", Conf, "A test config.")])
    assert "| `threads` | an int | `2` | How many threads. |" in md
    assert "| `name` | a string | required |  |" in md
    assert "| `mode` | one of 'a', 'b' | `'a'` |" in md
    assert "Extra settings over two lines." in md


def test_docs_config_md_is_current() -> None:
    from pathlib import Path

    from kvtier.config_reference import reference
    doc = Path(__file__).resolve().parents[3] / "docs" / "config.md"
    if not doc.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{doc} is missing")
        pytest.skip("not in a checkout of the repository")
    assert doc.read_text() == reference(), \
        "docs/config.md is stale: python -m kvtier.config_reference > docs/config.md"


def test_cache_config_layers_file_then_environment(tmp_path) -> None:
    from kvtier.cache import CacheConfig
    p = tmp_path / "kvtier.toml"
    p.write_text('[cache]\nmodel_id = "file-model"\nhost_pool_pages = 8\n'
                 '[cache.l3_config]\nroot = "/srv/kv"\n')
    c = CacheConfig.load({"model_id": "base", "write_policy": "write_back"},
                         environ={"KVTIER_CONFIG": str(p), "KVTIER_HOST_POOL_PAGES": "16"})
    assert c.model_id == "file-model" and c.write_policy == "write_back"
    assert c.host_pool_pages == 16 and c.l3_config == {"root": "/srv/kv"}
    assert CacheConfig.from_file(str(p)).host_pool_pages == 8
    assert CacheConfig.load({"model_id": "m"}, environ={}).transfer_engine == "auto"
    p.write_text('[cache]\nmodel_id = "m"\nhost_pool_pagez = 8\n')
    with pytest.raises(ConfigError, match="host_pool_pagez"):
        CacheConfig.load(environ={"KVTIER_CONFIG": str(p)})


def test_cli_config_flag_and_verbosity(tmp_path, capsys) -> None:
    from kvtier.cli import main
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\n")
    assert main(["--config", str(bad), "backends", "--kind", "l3_store"]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and err.count("\n") == 1
    assert main(["--config", str(tmp_path / "missing.toml"), "backends"]) == 2
    assert "does not exist" in capsys.readouterr().err
    import logging
    good = tmp_path / "good.toml"
    good.write_text('[cache]\nmodel_id = "m"\n')
    old = os.environ.get("KVTIER_CONFIG")
    try:
        assert main(["-vv", "--config", str(good), "backends", "--kind", "l3_store"]) == 0
        assert logging.getLogger("kvtier").level == logging.DEBUG
        assert os.environ["KVTIER_CONFIG"] == str(good)
        assert main(["-q", "backends", "--kind", "l3_store"]) == 0
        assert logging.getLogger("kvtier").level == logging.ERROR
    finally:
        logging.getLogger("kvtier").setLevel(logging.NOTSET)
        if old is None:
            os.environ.pop("KVTIER_CONFIG", None)
        else:
            os.environ["KVTIER_CONFIG"] = old


def test_config_imports_nothing_above_it() -> None:
    """`kvtier.config` is the bottom floor every config is built with: nowhere in it (a
    function body included) does it import the controller, a backend or the reference."""
    import ast
    import inspect

    import kvtier.config
    tree = ast.parse(inspect.getsource(kvtier.config))
    inside = sorted({n.module or "" for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and n.level > 0})
    assert inside == ["errors"], inside
