"""The pure parts of the dead-letter tools: pacing, the replay's summary, argument parsing."""

from __future__ import annotations

import argparse

import pytest

from consumer.cli.common import positive_int
from consumer.cli.dlq.replay import Pacer, Tally


def test_the_pacer_spaces_starts_evenly_and_earns_no_burst_when_late() -> None:
    pacer = Pacer(4, start=100.0)
    # Four a second: each start a quarter second after the one before
    assert [pacer.delay(100.0) for _ in range(3)] == [0.0, 0.25, 0.5]
    # Late by a whole second: the next goes at once, and the one after keeps the spacing
    assert pacer.delay(102.0) == 0.0
    assert pacer.delay(102.0) == 0.25


def test_no_rate_means_no_wait() -> None:
    pacer = Pacer(None, start=0.0)
    assert {pacer.delay(0.0) for _ in range(100)} == {0.0}


def test_a_rate_is_above_zero() -> None:
    with pytest.raises(ValueError, match="above 0"):
        Pacer(0, start=0.0)


def test_the_summary_counts_by_reason_and_says_what_stays() -> None:
    tally = Tally(read=10, selected=6, replayed=3, not_removed=1)
    tally.kept["expired"] += 1
    tally.failed["unroutable"] += 2
    lines = tally.lines()
    assert lines[0] == (
        "replayed 3 of 6 selected (10 read); 1 kept, 2 failed: those stay in the dead-letter queue"
    )
    assert "  kept 1: expired" in lines
    assert "  failed 2: unroutable" in lines
    assert "1 replayed but still in the dead-letter queue too" in lines[-1]


@pytest.mark.parametrize("text", ["0", "-3", "x", "1.5"])
def test_a_limit_is_a_whole_number_above_zero(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(text)
    assert positive_int("100000") == 100_000
