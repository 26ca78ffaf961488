"""What became of one delivery: the pipeline's verdict, and the label it ends up with."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from consumer.delivery import Delivery
from consumer.envelope import Envelope, Poison
from consumer.retry import Decision


class OutcomeKind(enum.StrEnum):
    """The label each message ends with, in logs and in ``consumer_messages_total``."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    POISON = "poison"
    RETURNED = "returned"


@dataclass(frozen=True, slots=True)
class Applied:
    """The transaction committed; ``duplicate`` when the receipt was already there (no effect)."""

    duplicate: bool
    committed_at: datetime
    note: str | None = None
    """What went wrong on the way that an operator should hear of (the handler's bug)."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """The message can never be processed."""

    poison: Poison


@dataclass(frozen=True, slots=True)
class Failed:
    """Applying the event raised ``error`` and rolled back; ``decision`` says what next."""

    error: BaseException
    decision: Decision
    attempts_so_far: int


Verdict = Applied | Rejected | Failed


@dataclass(frozen=True, slots=True)
class Outcome:
    """One delivery and the pipeline's verdict on it."""

    delivery: Delivery
    verdict: Verdict
    event: Envelope[Any] | None = None
    handler_seconds: float | None = None
