"""What became of one delivery: the pipeline's verdict, its kind, and the label it ends with."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from consumer.amqp.delivery import Delivery
from consumer.envelope import Envelope
from consumer.errors import Poison, PublishFailed
from consumer.pipeline.retry import DeadLetter, Decision, Retry

__all__ = [
    "Applied",
    "Failed",
    "Outcome",
    "OutcomeKind",
    "Rejected",
    "Settled",
    "Verdict",
    "VerdictKind",
]


class OutcomeKind(enum.StrEnum):
    """The label each message ends with, in logs and in ``consumer_messages_total``."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    POISON = "poison"
    RETURNED = "returned"


class VerdictKind(enum.Enum):
    """What a verdict asks of the settler (:mod:`consumer.service.settle`)."""

    APPLIED = "applied"
    """Committed: ack."""
    DUPLICATE = "duplicate"
    """The receipt was there already: ack."""
    POISON = "poison"
    """Never processable: to the dead-letter exchange."""
    RETRY = "retry"
    """A copy to a rung of the retry ladder, then ack."""
    DEAD_LETTER = "dead_letter"
    """A copy to the dead-letter exchange, then ack."""
    HOLD = "hold"
    """Not settled: kept until the database answers again."""


@dataclass(frozen=True, slots=True)
class Applied:
    """The transaction committed; ``duplicate`` when the receipt was already there (no effect)."""

    duplicate: bool
    committed_at: datetime
    note: str | None = None
    """What went wrong on the way that an operator should hear of (the handler's bug)."""

    @property
    def kind(self) -> VerdictKind:
        return VerdictKind.DUPLICATE if self.duplicate else VerdictKind.APPLIED


@dataclass(frozen=True, slots=True)
class Rejected:
    """The message can never be processed. If its body was dropped unread
    (``poison.body_discarded``), the settler can only nack it (:mod:`consumer.service.settle`)."""

    poison: Poison

    @property
    def kind(self) -> VerdictKind:
        return VerdictKind.POISON


@dataclass(frozen=True, slots=True)
class Failed:
    """Applying the event raised ``error`` and rolled back; ``decision`` says what next."""

    error: BaseException
    decision: Decision
    attempts_so_far: int
    isolated_next: bool = False
    """The database went away under it: applied again (after the pause), it goes isolated."""
    connection_losses: int = 0
    """Times in a row its connection broke while it was applied isolated, this time included."""

    @property
    def kind(self) -> VerdictKind:
        if isinstance(self.decision, Retry):
            return VerdictKind.RETRY
        if isinstance(self.decision, DeadLetter):
            return VerdictKind.DEAD_LETTER
        return VerdictKind.HOLD


Verdict = Applied | Rejected | Failed


@dataclass(frozen=True, slots=True)
class Outcome:
    """One delivery and the pipeline's verdict on it."""

    delivery: Delivery
    verdict: Verdict
    event: Envelope[Any] | None = None
    handler_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Settled:
    """What the settler did: the label the delivery ends with (None: held, not settled), and
    whether its ack or nack reached the broker."""

    kind: OutcomeKind | None
    channel_gone: bool = False
    publish_error: PublishFailed | None = None

    @property
    def held(self) -> bool:
        return self.kind is None
