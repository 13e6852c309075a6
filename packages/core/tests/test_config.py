from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from kvtier.config import build_config, config_from_env, keys_for
from kvtier.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    depth: int = 1


@dataclass(frozen=True)
class Conf:
    name: str = "x"
    threads: int = 2
    ratio: float = 0.5
    direct: bool = False
    mode: Literal["a", "b"] = "a"
    limit: Optional[int] = None
    tags: tuple[str, ...] = ()
    inner: Inner = Inner()


def test_defaults_and_values():
    c = build_config(Conf, {"threads": 4, "ratio": 1, "mode": "b", "tags": ["p", "q"],
                            "inner": {"depth": 3}})
    assert c == Conf(threads=4, ratio=1.0, mode="b", tags=("p", "q"), inner=Inner(3))
    assert build_config(Conf, None) == Conf()
    assert build_config(Conf, c) is c


@pytest.mark.parametrize("data, key", [
    ({"thread": 3}, "thread"), ({"threads": "3"}, "threads"), ({"threads": True}, "threads"),
    ({"direct": 1}, "direct"), ({"mode": "c"}, "mode"), ({"limit": "x"}, "limit"),
    ({"inner": {"deep": 1}}, "inner.deep"), ({"ratio": "fast"}, "ratio"),
])
def test_bad_config_names_the_key(data, key):
    with pytest.raises(ConfigError) as ei:
        build_config(Conf, data, section="store")
    assert ei.value.key == f"store.{key}"
    assert key.split(".")[-1] in str(ei.value)


def test_not_a_mapping():
    with pytest.raises(ConfigError):
        build_config(Conf, ["threads", 3])


def test_env_parsing():
    env = {"KV_THREADS": "8", "KV_DIRECT": "yes", "KV_RATIO": "0.25", "KV_LIMIT": "none",
           "KV_TAGS": "a, b", "KV_MODE": "b", "OTHER": "1"}
    c = config_from_env(Conf, "KV_", env)
    assert c == Conf(threads=8, direct=True, ratio=0.25, limit=None, tags=("a", "b"), mode="b")
    with pytest.raises(ConfigError) as ei:
        config_from_env(Conf, "KV_", {"KV_THREADS": "many"})
    assert ei.value.key == "kv.threads"


@dataclass(frozen=True)
class _Path:
    ctas: int = 2
    side_stream: bool = False


@dataclass(frozen=True)
class _Composed:
    verify_mib: int = 32
    debug: bool = False
    copy: _Path = field(default_factory=_Path)
    sm: _Path = field(default_factory=_Path)


def test_keys_for_moves_a_flat_setting_under_the_nested_configs_that_have_it():
    """A tool's one flat setting reaches every backend that has it, a composed config's paths
    included; an explicit nested value wins; keys nobody has are left out."""
    got = keys_for(_Composed, {"ctas": 4, "debug": True, "bogus": 1, "sm": {"ctas": 8}})
    assert got == {"debug": True, "copy": {"ctas": 4}, "sm": {"ctas": 8}}
    assert build_config(_Composed, got).copy.ctas == 4
    assert keys_for(_Path, {"ctas": 4, "verify_mib": 1}) == {"ctas": 4}
    assert keys_for(_Composed, {}) == {}
