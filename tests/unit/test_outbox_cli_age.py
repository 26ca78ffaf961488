"""``consumer outbox list``'s age column: a row's age in its two largest units."""

from __future__ import annotations

import pytest

from consumer.cli.outbox import _age


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (-0.5, "0s"),  # never below 0
        (0.9, "0s"),
        (42, "42s"),
        (312, "5m12s"),
        (3 * 3600 + 4 * 60 + 59, "3h04m"),
        (2 * 86_400 + 5 * 3600, "2d05h"),
    ],
)
def test_an_age_reads_in_its_two_largest_units(seconds: float, shown: str) -> None:
    assert _age(seconds) == shown
