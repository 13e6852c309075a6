"""Typed configs: frozen dataclasses built once at the boundary from a dict, env or CLI.

Unknown keys and values of the wrong type are a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any, Literal, Mapping, TypeVar

from .errors import ConfigError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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
        raise ConfigError(f"{where}: {value!r} matches none of {tp}", key=where, value=value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise ConfigError(f"{where} must be one of {list(choices)}, got {value!r}", key=where,
                          value=value)
    if origin in (tuple, list):
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}", key=where, value=value)
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
        raise ConfigError(f"{where} must be a bool, got {value!r}", key=where, value=value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value, 0)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be an int, got {value!r}", key=where, value=value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}", key=where, value=value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}", key=where, value=value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return build_config(tp, value, section=where)
        raise ConfigError(f"{where} must be a mapping for {tp.__name__}, got {value!r}",
                          key=where, value=value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{where} must be {tp.__name__}, got {value!r}", key=where, value=value)
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
    hints = _hints(cls)
    fields = {f.name: f for f in config_fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        where = f"{section}." if section else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]!r} for {cls.__name__}; "
                          f"known keys: {sorted(fields)}", key=f"{where}{unknown[0]}",
                          value=data[unknown[0]])
    kwargs = {k: _coerce(section, k, hints[k], v, from_text=from_text) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field missing
        raise ConfigError(f"{section or cls.__name__}: {exc}", key=section or None) from None


def config_from_env(cls: type[T], prefix: str, environ: Mapping[str, str] | None = None,
                    base: Mapping[str, Any] | None = None) -> T:
    """Build ``cls`` from ``PREFIX_FIELD`` environment variables layered over ``base``."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = dict(base or {})
    for f in config_fields(cls):
        name = f"{prefix}{f.name}".upper()
        if name in env:
            data[f.name] = env[name]
    return build_config(cls, data, section=prefix.rstrip("_").lower(), from_text=True)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (nested configs become dicts)."""
    return dataclasses.asdict(config)
