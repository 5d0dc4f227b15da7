"""argparse types shared by the commands: a value out of range is refused by the parser, which
names the flag (``argument --seq-len: must be an integer >= 1, got '0'``), before any file is
read or any model built. Torch-free: ``densetrain plan`` and ``--help`` stay fast."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def count(minimum: int, meaning: str = "") -> Callable[[str], int]:
    """An integer >= ``minimum``; ``meaning`` (e.g. "0 = all") is shown with the error."""
    note = f" ({meaning})" if meaning else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}{note}, got {text!r}")
        return value

    return parse


def number(*, above: float | None = None, at_least: float | None = None,
           at_most: float | None = None, meaning: str = "") -> Callable[[str], float]:
    """A finite float in the given bounds (``above`` exclusive, the others inclusive)."""
    bounds = [f"above {above:g}" if above is not None else "",
              f"at least {at_least:g}" if at_least is not None else "",
              f"at most {at_most:g}" if at_most is not None else ""]
    allowed = " and ".join(b for b in bounds if b) or "finite"
    note = f" ({meaning})" if meaning else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (above is None or value > above)
                and (at_least is None or value >= at_least)
                and (at_most is None or value <= at_most)):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {allowed}{note}, got {text!r}")
        return value

    return parse
