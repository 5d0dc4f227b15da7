"""`is_int_at_least`, the count check every layer's input checks share."""

from __future__ import annotations

import pytest

from densetrain.values import is_int_at_least


@pytest.mark.parametrize(("value", "minimum", "expected"), [
    (1, 1, True), (0, 0, True), (10**12, 1, True), (0, 1, False), (-3, 0, False),
    (True, 0, False), (False, 0, False),  # JSON/TOML true is not a count
    (1.0, 1, False), ("2", 1, False), (None, 0, False),
])
def test_only_ints_at_least_the_minimum_pass(value, minimum, expected) -> None:
    assert is_int_at_least(value, minimum) is expected
