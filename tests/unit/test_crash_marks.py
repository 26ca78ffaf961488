"""A crash mark's conviction: it names the queue the delivery came through (the dead letter
goes to that queue's dead-letter queue), and none below the strikes."""

from __future__ import annotations

from consumer.db.crashes import CRASH_STRIKES, Mark
from consumer.errors import CrashedRepeatedly, HardTimeLimitExceeded


def test_a_conviction_names_the_queue_of_a_table() -> None:
    error = Mark(crashes=CRASH_STRIKES, verdict=None, detail=None, queue="order").conviction()

    assert isinstance(error, CrashedRepeatedly)
    assert (
        str(error)
        == f"{CRASH_STRIKES} processes died while applying this event alone (queue order)"
    )


def test_without_a_table_no_queue_is_named() -> None:
    error = Mark(crashes=CRASH_STRIKES, verdict=None, detail=None).conviction()

    assert str(error) == f"{CRASH_STRIKES} processes died while applying this event alone"


def test_below_the_strikes_nothing_is_convicted_and_a_verdict_is_at_once() -> None:
    assert (
        Mark(crashes=CRASH_STRIKES - 1, verdict=None, detail=None, queue="a").conviction() is None
    )
    verdict = Mark(0, "hard_time_limit", "blocked (queue a)", "a").conviction()
    assert isinstance(verdict, HardTimeLimitExceeded)
