"""The clocks' reading and the start-up refusal (consumer.db.clock): pure, no database."""

from __future__ import annotations

from datetime import timedelta

import pytest

from consumer.db.clock import ClockReading
from consumer.errors import ClockSkewed, PipelineFault

LIMIT = timedelta(minutes=1)


@pytest.mark.parametrize(
    ("ahead", "said"),
    [(600.2, "10m ahead of"), (-600.2, "10m behind"), (61.4, "61s ahead of")],
)
def test_a_skew_past_the_limit_refuses_with_one_line_naming_it(ahead: float, said: str) -> None:
    reading = ClockReading(ahead=ahead, uncertainty=0.002)

    with pytest.raises(ClockSkewed) as refused:
        reading.check(LIMIT)

    message = str(refused.value)
    assert "\n" not in message
    assert f"this host's clock is {said} the database's" in message
    assert "CONSUMER_MAX_CLOCK_SKEW (1m)" in message
    # The service stops on it as on any fault no event is to blame for (exit 1, one line).
    assert isinstance(refused.value, PipelineFault)


@pytest.mark.parametrize("ahead", [0.0, 30.0, -59.9, 60.0])
def test_a_skew_within_the_limit_passes(ahead: float) -> None:
    ClockReading(ahead=ahead, uncertainty=0.0).check(LIMIT)


def test_a_slow_round_trip_never_reads_as_skew() -> None:
    # 61s apart by the midpoint, but the database read its clock somewhere in a 4s round trip
    reading = ClockReading(ahead=61.0, uncertainty=2.0)

    assert not reading.beyond(LIMIT)
    reading.check(LIMIT)


def test_short_skews_are_described_in_milliseconds() -> None:
    assert ClockReading(ahead=-1.25, uncertainty=0).describe() == "1250ms behind"
