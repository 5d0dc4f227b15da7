"""Type coercion of config values from TOML, JSON and command-line strings (below every layer:
job configs, model configs and the planner's files share it).

Each value is checked against its dataclass annotation: ``int``, ``float``, ``bool``, ``str``,
``list[...]``, ``dict``, nested dataclasses and ``X | None``. Strings (from the command line)
are parsed: booleans as true/false/1/0/yes/no/on/off, lists as comma-separated items or a TOML
literal (``[1, 2]``), tables as TOML inline tables (``{factor = 8.0}``), ``none``/``null`` as
None where the annotation allows it. Errors are ``ValueError`` naming the field.

``strict=True`` is for values read from JSON, which already carry their types: nothing is
parsed from a string, so ``"4"`` is refused for an ``int`` and ``"false"`` for a ``bool``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from densetrain.errors import UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


def coerce(value: Any, annotation: Any, name: str, *, strict: bool = False) -> Any:
    """Return ``value`` converted to ``annotation``; raise ``ValueError`` naming ``name``.

    ``strict`` parses no strings (values from JSON): each value must already have its type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _coerce_optional(value, args, name, strict)
    if annotation is typing.Any:
        return value
    if strict and isinstance(value, str) and annotation is not str:
        raise UserError(f"{name} expects {_kind(annotation, strict)}, got the string {value!r}")
    if annotation is bool:
        return _coerce_bool(value, name)
    if annotation is int:
        return _coerce_int(value, name)
    if annotation is float:
        number = _coerce_float(value, name)
        if strict and not math.isfinite(number):
            raise UserError(f"{name} expects a finite number, got {value!r}")
        return number
    if annotation is str:
        return value if strict and isinstance(value, str) else _coerce_str(value, name)
    if origin is list or annotation is list:
        return _coerce_list(value, args[0] if args else typing.Any, name, strict)
    if origin is dict or annotation is dict:
        return _coerce_dict(value, name, strict)
    if dataclasses.is_dataclass(annotation):
        return coerce_dataclass(_coerce_dict(value, name, strict), annotation, name,
                                strict=strict)
    raise TypeError(f"{name}: unsupported config annotation {annotation!r}")


def _kind(annotation: Any, strict: bool) -> str:
    """What a value of ``annotation`` is called in messages."""
    if annotation is bool:
        return "a boolean (true/false)"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is list or typing.get_origin(annotation) is list:
        return "a list"
    return "an object ({...})" if strict else "a table (e.g. {key = 1})"


def coerce_dataclass(data: dict, cls: type, name: str, *, strict: bool = False) -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys raise with close-match suggestions.

    ``name`` prefixes the field names in messages (``model.dim``); an empty ``name`` names the
    fields alone (a file holding one dataclass's fields at its top level). ``strict``: see
    ``coerce``."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    where = f"[{name}]" if name else cls.__name__
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            raise UserError(unknown_key_message(_join(name, key), key, known, where))
        kwargs[key] = coerce(value, hints[key], _join(name, key), strict=strict)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise UserError(f"[{name}] misses required field(s) {', '.join(missing)}" if name else
                        f"required {cls.__name__} field(s) {', '.join(missing)} missing")
    try:
        return cls(**kwargs)
    except TypeError as error:  # a constructor that refuses the fields' combination
        raise UserError(f"{name or cls.__name__}: {error}") from None


def _join(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


def unknown_key_message(full_name: str, key: str, known: list[str], where: str) -> str:
    """``unknown field ...; did you mean ...? allowed: ...`` with difflib close matches."""
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown key {full_name!r} in {where}{hint} (allowed: {', '.join(known)})"


def _coerce_optional(value: Any, args: tuple, name: str, strict: bool = False) -> Any:
    non_none = [a for a in args if a is not type(None)]
    if value is None or (not strict and isinstance(value, str)
                         and value.strip().lower() in _NONE):
        return None
    errors = []
    for arg in non_none:
        try:
            return coerce(value, arg, name, strict=strict)
        except ValueError as error:
            errors.append(str(error))
    raise UserError(errors[0] if len(errors) == 1 else f"{name}: {'; '.join(errors)}")


def _coerce_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise UserError(f"{name} expects a boolean (true/false), got {value!r}")


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
    raise UserError(f"{name} expects an integer, got {value!r}")


def _coerce_float(value: Any, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            pass
    raise UserError(f"{name} expects a number, got {value!r}")


def _coerce_str(value: Any, name: str) -> str:
    if isinstance(value, str):
        text = value.strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
            return _toml_literal(text, name)
        return value
    raise UserError(f"{name} expects a string, got {value!r}")


def _coerce_list(value: Any, item_type: Any, name: str, strict: bool = False) -> list:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = _toml_literal(text, name)
        else:
            value = [item.strip() for item in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{name} expects a list, got {value!r}")
    return [coerce(item, item_type, f"{name}[{i}]", strict=strict)
            for i, item in enumerate(value)]


def _coerce_dict(value: Any, name: str, strict: bool = False) -> dict:
    if not strict and isinstance(value, str) and value.strip().startswith("{"):
        value = _toml_literal(value.strip(), name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise UserError(f"{name} expects {_kind(dict, strict)}, got {value!r}")
    return dict(value)


def _toml_literal(text: str, name: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"{name}: {text!r} is not a valid TOML value ({error})") from None
