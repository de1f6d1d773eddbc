"""Turns JSON dicts into frozen dataclasses, field by field, with errors that name the key.

A section is a frozen dataclass whose fields carry their JSON rules in `metadata` (see `option`).
`parse_section` is the single place that checks names, types, ranges and choices; inner code
trusts the objects it returns.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from infinity.config.errors import ConfigError
from infinity.config.sizes import parse_bytes

__all__ = ["AUTO", "ConfigError", "json_fields", "option", "parse_section", "to_dict", "unknown_key_error"]

AUTO = "auto"
INT64_MAX = 2**63 - 1  # torch's index type: a larger integer cannot reach a tensor
EXACT_FLOAT_INT_MAX = 2**53  # above this a JSON number like 1e30 is no exact integer


def option(
    default: Any = dataclasses.MISSING,
    *,
    aliases: tuple[str, ...] = (),
    choices: tuple[Any, ...] | None = None,
    min_value: float | None = None,
    max_value: float | None = None,
    allow_auto: bool = False,
    allow_bytes: bool = False,
    default_factory: Any = dataclasses.MISSING,
    doc: str = "",
    null_error: str | None = None,
    from_json: bool = True,
) -> Any:
    """A dataclass field with the JSON rules `parse_section` enforces.

    `allow_bytes`: an element count that may be written as a size in bytes ("64MB"); the string is kept
    until `resolve_auto` converts it with the compute dtype (see `infinity.config.sizes`).
    `null_error`: JSON null is refused with this advice (where null would silently mean the default).
    `from_json` False: set by the loader, never by a JSON key (and left out of `to_dict`).
    """
    meta = {
        "aliases": aliases,
        "choices": choices,
        "min": min_value,
        "max": max_value,
        "auto": allow_auto,
        "bytes": allow_bytes,
        "doc": doc,
        "null_error": null_error,
        "from_json": from_json,
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _suggest(key: str, known: list[str], also: tuple[str, ...] = ()) -> str:
    close = difflib.get_close_matches(key, [*known, *also], n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    return "known keys: " + ", ".join(sorted(known))


def unknown_key_error(full: str, path: str, key: str, known: list[str], also: tuple[str, ...] = ()) -> ConfigError:
    """The error for `key` (at `full`, in section `path`) that no field of the section has: the closest of
    `known` and `also` (other keys accepted there), else the list of `known`."""
    where = f"in '{path}'" if path else "at the top level"
    return ConfigError(f"unknown config key '{full}' {where}: {_suggest(key, known, also)}")


def json_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of section `cls` by every name JSON may give them (name and aliases)."""
    by_name: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("from_json", True):
            continue
        by_name[f.name] = f
        for alias in f.metadata.get("aliases", ()):
            by_name[alias] = f
    return by_name


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        errors = []
        for arg in args:
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"'{path}' must be an object (a JSON dict), got {value!r}")
        return parse_section(tp, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{path}' must be a list, got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp)
        return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{path}' must be an object (a JSON dict), got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"'{path}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"'{path}' must be an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer() and abs(value) <= EXACT_FLOAT_INT_MAX:
            value = int(value)  # DeepSpeed configs write sizes as 5e8
        elif isinstance(value, float) and value.is_integer():
            raise ConfigError(f"'{path}' is {value!r}; it must be an integer below 2**63 (torch's int64)")
        if not isinstance(value, int):
            raise ConfigError(f"'{path}' must be an integer, got {value!r}")
        if not -INT64_MAX <= value <= INT64_MAX:
            raise ConfigError(f"'{path}' is {value!r}; it must be an integer below 2**63 (torch's int64)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{path}' must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"'{path}' is {value!r}; it must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"'{path}' must be a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"schema type {_type_name(tp)} at '{path}' is not supported")


def parse_section(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build `cls` from `data`, rejecting unknown keys and bad values with the key's full path."""
    hints = typing.get_type_hints(cls)
    by_name = json_fields(cls)
    values: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        f = by_name.get(key)
        if f is None:
            raise unknown_key_error(full, path, key, list(by_name))
        if f.name in values:
            raise ConfigError(f"'{full}' is given twice (also under another of its names)")
        meta = f.metadata
        if value is None and meta.get("null_error"):
            raise ConfigError(f"'{full}' is null: {meta['null_error']}")
        if value == AUTO:
            if not meta.get("auto"):
                raise ConfigError(f"'{full}' does not accept \"auto\"")
            values[f.name] = AUTO
            continue
        if meta.get("bytes") and isinstance(value, str):
            parse_bytes(value, full)  # a ConfigError naming the key unless it is a size with a unit
            values[f.name] = value.strip()
            continue
        converted = _convert(value, hints[f.name], full)
        choices = meta.get("choices")
        if choices is not None and converted not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(f"'{full}' is {value!r}; allowed values: {allowed}")
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and converted is not None and converted < lo:
            raise ConfigError(f"'{full}' is {value!r}; it must be >= {lo}")
        if hi is not None and converted is not None and converted > hi:
            raise ConfigError(f"'{full}' is {value!r}; it must be <= {hi}")
        values[f.name] = converted
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"'{path or 'config'}' is missing required key(s): {', '.join(missing)}")
    return cls(**values)


def to_dict(section: Any) -> dict[str, Any]:
    """The resolved section as plain JSON-able data, every default filled in."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        if not f.metadata.get("from_json", True):
            continue
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out
