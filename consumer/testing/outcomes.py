"""What became of one delivery in a test: the service's own word for it, read off the line the
service logs for every settled delivery (``message settled``), in either mode."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

__all__ = ["EventOutcome", "Kind"]


class Kind(enum.StrEnum):
    """How a delivery ended: the ``outcome`` field of the service's log line."""

    PROCESSED = "processed"
    """Its effect committed with its receipt; acked."""
    DUPLICATE = "duplicate"
    """Its receipt was there already: nothing applied, acked."""
    RETRIED = "retried"
    """A transient failure: a copy went to a rung of the retry ladder, the original acked."""
    DEAD_LETTERED = "dead_lettered"
    """A permanent failure, or the ladder exhausted: a copy went to the dead-letter queue."""
    POISON = "poison"
    """It can never be processed (not an envelope, a payload its model refuses, no handler)."""


@dataclass(frozen=True, slots=True)
class EventOutcome:
    """One delivery's outcome.

    ``attempt`` is how many retries came before this delivery (0 on the first). For a retried
    delivery, ``rung`` is the rung its copy waits on (0 for the first delay of
    ``CONSUMER_RETRY_DELAYS``) and ``delay`` that rung's label (``1s``). ``reason`` is the dead
    letter's ``consumer-dead-reason`` (``permanent_failure``, ``retries_exhausted``...) or the
    poison's reason (``invalid_payload``, ``unknown_type``...). ``error_class`` and ``error`` name
    what the handler raised, or what made the message poison.
    """

    kind: Kind
    event_id: UUID | None
    event_type: str | None
    message_id: str | None
    attempt: int = 0
    rung: int | None = None
    delay: str | None = None
    reason: str | None = None
    error_class: str | None = None
    error: str | None = None

    @property
    def processed(self) -> bool:
        return self.kind is Kind.PROCESSED

    @property
    def duplicate(self) -> bool:
        return self.kind is Kind.DUPLICATE

    @property
    def retried(self) -> bool:
        return self.kind is Kind.RETRIED

    @property
    def dead_lettered(self) -> bool:
        return self.kind is Kind.DEAD_LETTERED

    @property
    def poison(self) -> bool:
        return self.kind is Kind.POISON

    def __str__(self) -> str:
        parts = [self.kind.value]
        if self.rung is not None:
            parts.append(f"at rung {self.rung} ({self.delay})")
        if self.reason is not None:
            parts.append(f"reason={self.reason}")
        if self.error is not None:
            parts.append(f"{self.error_class or 'error'}: {self.error}")
        return " ".join(parts)

    @classmethod
    def from_log_line(cls, fields: Mapping[str, Any]) -> EventOutcome:
        """The outcome the fields of a ``message settled`` line tell
        (:class:`consumer.observe.report.OutcomeReporter`)."""
        kind = Kind(fields["outcome"])
        event_id = fields.get("event_id")
        attempt = int(fields.get("attempt") or 0)
        retried = kind is Kind.RETRIED
        return cls(
            kind=kind,
            event_id=UUID(event_id) if event_id else None,
            event_type=fields.get("type"),
            message_id=fields.get("message_id"),
            attempt=attempt,
            # The ladder's rung i is taken by the i+1-th retry (consumer.pipeline.retry).
            rung=attempt if retried else None,
            delay=fields.get("rung") if retried else None,
            reason=fields.get("reason"),
            error_class=fields.get("error_class"),
            error=fields.get("error"),
        )
