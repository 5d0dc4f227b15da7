"""Type coercion of config values from TOML and from command-line strings.

Each value is checked against its dataclass annotation: ``int``, ``float``, ``bool``, ``str``,
``list[...]``, ``dict``, nested dataclasses and ``X | None``. Strings (from the command line)
are parsed: booleans as true/false/1/0/yes/no/on/off, lists as comma-separated items or a TOML
literal (``[1, 2]``), tables as TOML inline tables (``{factor = 8.0}``), ``none``/``null`` as
None where the annotation allows it. Errors are ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


def coerce(value: Any, annotation: Any, name: str) -> Any:
    """Return ``value`` converted to ``annotation``; raise ``ValueError`` naming ``name``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _coerce_optional(value, args, name)
    if annotation is typing.Any:
        return value
    if annotation is bool:
        return _coerce_bool(value, name)
    if annotation is int:
        return _coerce_int(value, name)
    if annotation is float:
        return _coerce_float(value, name)
    if annotation is str:
        return _coerce_str(value, name)
    if origin is list or annotation is list:
        return _coerce_list(value, args[0] if args else typing.Any, name)
    if origin is dict or annotation is dict:
        return _coerce_dict(value, name)
    if dataclasses.is_dataclass(annotation):
        return coerce_dataclass(_coerce_dict(value, name), annotation, name)
    raise TypeError(f"{name}: unsupported config annotation {annotation!r}")


def coerce_dataclass(data: dict, cls: type, name: str) -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys raise with close-match suggestions."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(unknown_key_message(f"{name}.{key}", key, known, f"[{name}]"))
        kwargs[key] = coerce(value, hints[key], f"{name}.{key}")
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"[{name}] misses required field(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except TypeError as error:  # a constructor that refuses the fields' combination
        raise ValueError(f"{name}: {error}") from None


def unknown_key_message(full_name: str, key: str, known: list[str], where: str) -> str:
    """``unknown field ...; did you mean ...? allowed: ...`` with difflib close matches."""
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown key {full_name!r} in {where}{hint} (allowed: {', '.join(known)})"


def _coerce_optional(value: Any, args: tuple, name: str) -> Any:
    non_none = [a for a in args if a is not type(None)]
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
        return None
    errors = []
    for arg in non_none:
        try:
            return coerce(value, arg, name)
        except ValueError as error:
            errors.append(str(error))
    raise ValueError(errors[0] if len(errors) == 1 else f"{name}: {'; '.join(errors)}")


def _coerce_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} expects a boolean (true/false), got {value!r}")


def _coerce_int(value: Any, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text.replace("_", ""))
        except ValueError:
            pass
        try:  # 4e6 or 1.2e9 are fine when they are whole numbers
            number = float(text.replace("_", ""))
        except ValueError:
            number = math.nan
        if math.isfinite(number) and number.is_integer():
            return int(number)
    raise ValueError(f"{name} expects an integer, got {value!r}")


def _coerce_float(value: Any, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            pass
    raise ValueError(f"{name} expects a number, got {value!r}")


def _coerce_str(value: Any, name: str) -> str:
    if isinstance(value, str):
        text = value.strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
            return _toml_literal(text, name)
        return value
    raise ValueError(f"{name} expects a string, got {value!r}")


def _coerce_list(value: Any, item_type: Any, name: str) -> list:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = _toml_literal(text, name)
        else:
            value = [item.strip() for item in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} expects a list, got {value!r}")
    return [coerce(item, item_type, f"{name}[{i}]") for i, item in enumerate(value)]


def _coerce_dict(value: Any, name: str) -> dict:
    if isinstance(value, str) and value.strip().startswith("{"):
        value = _toml_literal(value.strip(), name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{name} expects a table (e.g. {{key = 1}}), got {value!r}")
    return dict(value)


def _toml_literal(text: str, name: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{name}: {text!r} is not a valid TOML value ({error})") from None
