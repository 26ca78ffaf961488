"""The service's clock against the database's.

Two clocks decide things here. The service's (this host's) judges each event: ``occurred_at``
further ahead than ``CONSUMER_MAX_FUTURE_SKEW`` is poison, and older than the retention less the
margin is ``expired`` (:mod:`consumer.db.retention`). The database's (``now()``) makes and drops
the receipts' partitions and stamps the crash marks (:mod:`consumer.db.crashes`, which compare it
only with itself). With the service 10 minutes behind, every event from a producer on time looks
10 minutes ahead, and an event the database's pruning already let go looks 10 minutes younger;
ahead, events are refused as ``expired`` 10 minutes before their receipts go. The receipts hold
either way (a range once dropped is never made again, so a copy that slips past the service's
check finds no partition and is refused), but events are refused that should not be: so the
service measures the difference at start-up and on every prune round, and refuses to start past
``CONSUMER_MAX_CLOCK_SKEW``.

One round trip: ``clock_timestamp()`` is read between two readings of the service's clock, and
the difference is taken from their midpoint. Half the round trip is the reading's uncertainty,
counted in the service's favour: a slow answer never reads as skew.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import asyncpg

from consumer.errors import ClockSkewed
from topology.durations import format_duration

__all__ = ["ClockReading", "read_clocks"]

_DATABASE_NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"


@dataclass(frozen=True, slots=True)
class ClockReading:
    """How far the service's clock is ahead of the database's, in seconds (negative: behind)."""

    ahead: float
    uncertainty: float
    """Half the round trip: the database read its clock somewhere within it."""

    def beyond(self, limit: timedelta) -> bool:
        """Apart by more than ``limit``, whatever the round trip hid."""
        return abs(self.ahead) - self.uncertainty > limit.total_seconds()

    def describe(self) -> str:
        """``10m ahead of`` / ``10m behind`` the database's clock, as people write durations."""
        seconds = abs(self.ahead)
        # Whole seconds past ten: the round trip blurs what is finer.
        apart = format_duration(
            timedelta(seconds=round(seconds))
            if seconds >= 10
            else timedelta(milliseconds=round(seconds * 1000))
        )
        return f"{apart} {'ahead of' if self.ahead >= 0 else 'behind'}"

    def check(self, limit: timedelta) -> None:
        """Raise :class:`ClockSkewed` if apart by more than ``limit``."""
        if self.beyond(limit):
            raise ClockSkewed(
                f"this host's clock is {self.describe()} the database's (PostgreSQL "
                f"clock_timestamp()), more than CONSUMER_MAX_CLOCK_SKEW ({format_duration(limit)}):"
                " the service would judge events' age and future skew by the wrong time; "
                "synchronise the clocks (NTP)"
            )


async def read_clocks(
    conn: asyncpg.Connection[Any], clock: Callable[[], float] = time.time
) -> ClockReading:
    """Read both clocks on ``conn``; ``clock`` is the service's (a seam for tests)."""
    before = clock()
    database = float(await conn.fetchval(_DATABASE_NOW))
    after = clock()
    return ClockReading(ahead=(before + after) / 2 - database, uncertainty=(after - before) / 2)
