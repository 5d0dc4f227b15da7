"""Predicates of plain values shared by the input checks of every layer (no imports)."""

from __future__ import annotations


def is_int_at_least(value: object, minimum: int) -> bool:
    """True for an ``int`` that is at least ``minimum``; never for a ``bool`` (a JSON or TOML
    ``true`` is not a count, though Python's ``bool`` is an ``int``), a float or a string."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
