"""Typed configs: frozen dataclasses built once at the boundary from a dict, env or CLI.

Unknown keys and values of the wrong type are a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import os
import stat
import types
import typing
from typing import Any, BinaryIO, Literal, Mapping, TypeVar

from .errors import ConfigError, show_value

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

#: Deepest nesting of tables, arrays and objects any parsed config input may have.
MAX_DEPTH = 32
#: Range of every int config field: what a 64-bit integer holds (fields narrow it further).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
#: Largest config file read (a config is a few KiB; this only stops a runaway read).
MAX_CONFIG_FILE_BYTES = 16 << 20


def _coerce(section: str, key: str, tp: Any, value: Any, *, from_text: bool) -> Any:
    """Check (and, for text from env/CLI, parse) one value against its annotated type."""
    where = f"{section}.{key}" if section else key
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if from_text and isinstance(value, str) and value.lower() in ("", "none", "null") \
                and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(section, key, arg, value, from_text=from_text)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where} must be {_describe(tp)}, got {_show(value)}", key=where,
                          value=value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise ConfigError(f"{where} must be one of {list(choices)}, got {show_value(value)}",
                          key=where, value=value)
    if origin in (tuple, list):
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {show_value(value)}", key=where,
                              value=value)
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(section, key, item_tp, v, from_text=from_text) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where} must be a bool, got {show_value(value)}", key=where,
                          value=value)
    if tp is int:
        n = value if isinstance(value, int) and not isinstance(value, bool) else None
        if from_text and isinstance(value, str):
            try:
                n = int(value, 0)
            except ValueError:          # not an int, or past the interpreter's digit limit
                pass
        if n is None:
            raise ConfigError(f"{where} must be an int, got {show_value(value)}", key=where,
                              value=value)
        if not INT_MIN <= n <= INT_MAX:
            raise ConfigError(f"{where} must be an int in [-2**63, 2**63), got "
                              f"{show_value(n)}", key=where, value=value)
        return n
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:       # an int past the largest float
                raise ConfigError(f"{where} is too large for a number: {show_value(value)}",
                                  key=where, value=value) from None
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {show_value(value)}", key=where,
                          value=value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {show_value(value)}", key=where,
                          value=value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return build_config(tp, value, section=where)
        raise ConfigError(f"{where} must be a mapping for {tp.__name__}, got "
                          f"{show_value(value)}", key=where, value=value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{where} must be {tp.__name__}, got {show_value(value)}", key=where,
                          value=value)
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def config_fields(cls: type) -> list[dataclasses.Field]:
    """The init fields of a config dataclass."""
    return [f for f in dataclasses.fields(cls) if f.init]


def build_config(cls: type[T], data: Mapping[str, Any] | T | None = None, *, section: str = "",
                 from_text: bool = False) -> T:
    """Build the frozen dataclass ``cls`` from a mapping; unknown keys are a ConfigError."""
    if data is None:
        data = {}
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{section or cls.__name__}: expected a mapping, got "
                          f"{type(data).__name__}", key=section or None, value=data)
    check_depth(data, section or cls.__name__)
    hints = _hints(cls)
    fields = {f.name: f for f in config_fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        where = f"{section}." if section else ""
        near = difflib.get_close_matches(str(unknown[0]), list(fields), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"unknown config key {where}{show_value(unknown[0])} for "
                          f"{cls.__name__}; {hint}known keys: {sorted(fields)}",
                          key=f"{where}{unknown[0]}", value=data[unknown[0]])
    kwargs = {k: _coerce(section, k, hints[k], v, from_text=from_text) for k, v in data.items()}
    missing = [f.name for f in fields.values() if f.name not in kwargs
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]  # type: ignore[misc]
    if missing:
        where = f"{section}." if section else ""
        raise ConfigError(f"{where}{missing[0]} is required (no default); give it in the config "
                          f"dict, the config file or the environment", key=f"{where}{missing[0]}")
    return cls(**kwargs)


def keys_for(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``data`` the config dataclass ``cls`` has, and those one of its nested
    config fields has (but it does not) moved under that field (a nested value given
    explicitly wins): how a tool gives one flat setting to many backends, each taking the keys
    it has, a config composed of others' included."""
    hints = _hints(cls)
    own = {f.name for f in config_fields(cls)}
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items() if k in own}
    for name in own:
        if not dataclasses.is_dataclass(hints[name]):
            continue
        keys = {f.name for f in config_fields(hints[name])}
        moved = {k: v for k, v in data.items() if k not in own and k in keys}
        if moved and isinstance(out.get(name, {}), dict):
            out[name] = {**moved, **out.get(name, {})}
    return out


#: Variables under the ``KVTIER_`` prefix that are not `CacheConfig` fields: the config file's
#: path, tools' own settings, and the prefixes backends read their own configs from.
ENV_RESERVED = frozenset({"KVTIER_CONFIG", "KVTIER_CACHE_DIR", "KVTIER_TORCH", "KVTIER_TRACE",
                          "KVTIER_LOG_LEVEL", "KVTIER_MOONCAKE_NETNS"})
ENV_RESERVED_PREFIXES = ("KVTIER_MOONCAKE_", "KVTIER_TEST_", "KVTIER_NOX_", "KVTIER_UMBP_",
                         "KVTIER_MEMFABRIC_", "KVTIER_NVIDIA_", "KVTIER_BENCH_",
                         "KVTIER_SGLANG_")


def config_from_env(cls: type[T], prefix: str, environ: Mapping[str, str] | None = None,
                    base: Mapping[str, Any] | None = None, *, strict: bool = True) -> T:
    """Build ``cls`` from ``PREFIX_FIELD`` environment variables layered over ``base``.

    With ``strict`` a variable under ``prefix`` that names no field (and is not reserved,
    `ENV_RESERVED`) is a ConfigError with a did-you-mean: a typo never goes unnoticed.
    """
    env = os.environ if environ is None else environ
    data: dict[str, Any] = dict(base or {})
    names = {f"{prefix}{f.name}".upper(): f.name for f in config_fields(cls)}
    up = prefix.upper()
    for var in sorted(env):
        if not var.startswith(up):
            continue
        if var in names:
            data[names[var]] = env[var]
        elif strict and var not in ENV_RESERVED and not any(
                p != up and p.startswith(up) and var.startswith(p)
                for p in ENV_RESERVED_PREFIXES):
            near = difflib.get_close_matches(var, list(names), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else f"; known: {sorted(names)}"
            raise ConfigError(f"environment variable {var} is not a {cls.__name__} setting"
                              f"{hint}", key=var, value=env[var])
    return build_config(cls, data, section=prefix.rstrip("_").lower(), from_text=True)


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH, *,
                key: str | None = None) -> None:
    """A ConfigError naming ``where`` (and the keys down to the deep part) if ``value`` nests
    mappings and lists more than ``limit`` deep. Iterative: any depth is checked safely."""
    stack: list[tuple[Any, int, str]] = [(value, 0, where)]
    while stack:
        v, depth, at = stack.pop()
        if isinstance(v, Mapping):
            items = [(k, x) for k, x in v.items()]
        elif isinstance(v, (list, tuple)):
            items = list(enumerate(v))
        else:
            continue
        if depth >= limit:
            raise ConfigError(f"{at} nests more than {limit} levels of tables, arrays or "
                              f"objects", key=key or where)
        for k, x in items:
            if isinstance(x, (Mapping, list, tuple)):
                inner = f"{at}.{k}" if isinstance(k, str) else f"{at}[{k}]"
                stack.append((x, depth + 1, at if len(inner) > 80 else inner))


def parse_json(text: str, where: str, *, what: str = "a JSON object") -> Any:
    """``text`` parsed as JSON for the config value ``where``: bad JSON, an int of more
    digits than Python converts, or nesting past `MAX_DEPTH` is a ConfigError naming it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} must be {what}, got {show_value(text)}: {exc}", key=where,
                          value=text) from None
    except RecursionError:
        raise ConfigError(f"{where} nests more than {MAX_DEPTH} levels of objects or arrays",
                          key=where, value=text) from None
    except ValueError as exc:           # an int past sys.get_int_max_str_digits()
        raise ConfigError(f"{where} must be {what}, got {show_value(text)}: {exc}", key=where,
                          value=text) from None
    check_depth(value, where)
    return value


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _refuse_unless_regular(mode: int, path: str) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "it is a directory", path)
    what = next((name for test, name in _NOT_REGULAR if test(mode)), "not a plain file")
    raise OSError(errno.EINVAL, f"it is {what}, not a regular file", path)


def open_regular_file(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading in binary, if it is a regular file; anything else (a
    directory, a FIFO, a device, a socket) is an OSError whose ``strerror`` says what it is.

    Never blocks: the type is checked before opening (a FIFO's open() waits for a writer, a
    device's read may never end) and again, on the open descriptor, after opening with
    O_NONBLOCK (the path may have been swapped in between).
    """
    p = os.fspath(path)
    _refuse_unless_regular(os.stat(p).st_mode, p)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse_unless_regular(os.fstat(fd).st_mode, p)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_config_file(path: str | os.PathLike[str], section: str | None = None
                     ) -> dict[str, Any]:
    """The table ``section`` (or the whole document) of a TOML config file, as a dict.

    A missing, unreadable or malformed file is a ConfigError naming the file (and the line,
    for TOML syntax errors); so is a missing section, a path that is not a regular file (a
    FIFO is refused, never waited on), a file over `MAX_CONFIG_FILE_BYTES`, an int of more
    digits than Python converts and nesting deeper than `MAX_DEPTH`.
    """
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    p = os.fspath(path)
    try:
        with open_regular_file(p) as fh:
            raw = fh.read(MAX_CONFIG_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist", key="config", value=p) from None
    except IsADirectoryError:
        raise ConfigError(f"config file {p} is a directory", key="config", value=p) from None
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read: {exc.strerror or exc}",
                          key="config", value=p) from None
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"config file {p} is larger than {MAX_CONFIG_FILE_BYTES >> 20} MiB; "
                          "it cannot be a kvtier config", key="config", value=p)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}", key="config",
                          value=p) from None
    except RecursionError:
        raise ConfigError(f"config file {p} nests more than {MAX_DEPTH} levels of tables or "
                          "arrays", key="config", value=p) from None
    except ValueError as exc:           # an int past sys.get_int_max_str_digits()
        raise ConfigError(f"config file {p} holds a value that cannot be read: {exc}",
                          key="config", value=p) from None
    check_depth(data, f"config file {p}", key="config")
    if section is not None:
        if section not in data:
            raise ConfigError(f"config file {p} has no [{section}] table", key=section,
                              value=p)
        data = data[section]
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: {section} must be a table", key=section,
                              value=p)
    return data


def _describe(tp: Any) -> str:
    """An annotated type in words: ``int | None`` -> ``an int or None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if origin in (list, tuple):
        return "a list"
    words = {int: "an int", float: "a number", str: "a string", bool: "a bool (true/false)"}
    if tp in words:
        return words[tp]
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {show_value(value)}"
    return f"{show_value(value)} ({type(value).__name__})"


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (nested configs become dicts)."""
    return dataclasses.asdict(config)
