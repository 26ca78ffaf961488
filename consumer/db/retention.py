"""The receipts' retention window, and the rule that keeps deduplication whole inside it.

Pure: no I/O. Receipts live in partitions of ``receipts`` by the event's ``occurred_at`` (sql/005),
each ``partition`` wide; a partition is dropped once its upper bound is older than ``retention``,
and a range once dropped is never created again. So an event is deduplicated for as long as its
receipt can exist, and an event older than that is never applied: the service refuses any event
whose ``occurred_at`` is older than ``retention - margin`` (dead-lettered, reason ``expired``),
before its handler runs. The margin covers what lies between that check and the commit (a batch
waiting, a retry on its way) and the clocks of the service and the database disagreeing; if a copy
slips past it anyway, its receipt finds no partition and the database refuses it
(:class:`~consumer.errors.EventExpired`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from consumer.envelope import Envelope
from consumer.errors import Poison, PoisonReason

__all__ = ["EXPIRED_CLASS", "ReceiptWindow"]

EXPIRED_CLASS = "EventExpired"
"""The ``consumer-error-class`` of an expired dead letter."""


@dataclass(frozen=True, slots=True)
class ReceiptWindow:
    """How long receipts are kept and how old an event may be to be applied."""

    retention: timedelta
    margin: timedelta
    partition: timedelta
    prune_interval: timedelta

    def __post_init__(self) -> None:
        if not timedelta(0) <= self.margin < self.retention:
            raise ValueError("the margin must be shorter than the retention")
        if self.partition <= timedelta(0) or self.prune_interval <= timedelta(0):
            raise ValueError("the partition and the prune interval must be longer than zero")

    @property
    def max_age(self) -> timedelta:
        """The oldest an event's occurred_at may be for it to be applied."""
        return self.retention - self.margin

    def oldest_accepted(self, now: datetime) -> datetime:
        return now - self.max_age

    def expired(self, occurred_at: datetime, now: datetime) -> bool:
        return occurred_at < self.oldest_accepted(now)

    def check(self, event: Envelope[Any], now: datetime) -> None:
        """Raise :class:`Poison` (``expired``) for an event too old to be applied."""
        if self.expired(event.occurred_at, now):
            raise Poison(
                PoisonReason.EXPIRED,
                f"occurred_at {event.occurred_at.isoformat()} is older than "
                f"{self.max_age} (CONSUMER_RECEIPT_RETENTION less CONSUMER_RECEIPT_MARGIN): "
                "its receipt may be gone, so applying it could apply it twice",
                error_class=EXPIRED_CLASS,
            )

    def ahead(self, max_future_skew: timedelta) -> timedelta:
        """How far past now partitions must exist: an event may come from that far in the
        future (``CONSUMER_MAX_FUTURE_SKEW``), and the next prune, which extends them, may be a
        prune interval away."""
        return max_future_skew + self.prune_interval + self.partition

    def late_after(self, widest: timedelta | None = None) -> timedelta:
        """The oldest a receipt range may get before pruning counts as behind: the retention,
        one partition (it goes whole: the ``widest`` kept, when wider than the setting's, as the
        migration's day-wide ones are) and two intervals (a round may fail once: its lock not
        had in time)."""
        partition = max(self.partition, widest) if widest is not None else self.partition
        return self.retention + partition + 2 * self.prune_interval
