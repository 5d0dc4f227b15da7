"""Presets from a paper's size table: one preset per row of published shapes."""

from __future__ import annotations

import functools
from collections.abc import Callable

from densetrain.models.config import ModelConfig


def presets_from_table(
    table: dict[str, tuple], build: Callable[..., ModelConfig], columns: tuple[str, ...]
) -> dict[str, Callable[[], ModelConfig]]:
    """``{name: build(**dict(zip(columns, row)))}`` as zero-argument builders, one per row."""
    return {
        name: functools.partial(build, **dict(zip(columns, row, strict=True)))
        for name, row in table.items()
    }
