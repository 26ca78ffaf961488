"""The event envelope producers publish: the model handlers receive.

:mod:`consumer.pipeline.envelope_parser` turns a message body into one, or says why it never can.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, PrivateAttr, field_validator

__all__ = ["EVENT_TYPE_PATTERN", "Envelope", "RawEnvelope", "set_attempt"]

PayloadT = TypeVar("PayloadT")

EVENT_TYPE_PATTERN = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"


class Envelope(BaseModel, Generic[PayloadT]):
    """One event: what producers publish as the JSON body of a message.

    Handlers receive it with ``payload`` already validated by their payload model, and
    :attr:`attempt` set.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: UUID
    type: str = Field(min_length=1, max_length=255, pattern=EVENT_TYPE_PATTERN)
    occurred_at: AwareDatetime
    payload: PayloadT
    correlation_id: str | None = Field(default=None, max_length=255)
    # Not a field: producers cannot set it (the body has no such key), and it is never published.
    _attempt: int = PrivateAttr(default=1)

    @property
    def attempt(self) -> int:
        """Which delivery of this event the handler is on: 1 the first time, 2 on the first
        retry, and so on. From the retry count the service's own header carries (a producer's
        copy of that header is dropped on arrival, an unreadable one reads as none, and it is
        capped), so a handler may trust it: to log, to give up early on its own terms, to call a
        slower fallback. Duplicates and isolated re-runs of the same delivery keep its number."""
        return self._attempt

    @field_validator("occurred_at", mode="before")
    @classmethod
    def _rfc3339_text(cls, value: object) -> object:
        # RFC 3339 text only: a bare number would be read as a Unix time, silently.
        if not isinstance(value, str | datetime):
            raise ValueError("must be an RFC 3339 timestamp with an offset")
        return value


RawEnvelope = Envelope[dict[str, Any]]


def set_attempt(event: Envelope[Any], attempt: int) -> None:
    """Set the :attr:`Envelope.attempt` a handler sees (the pipeline does, from the headers)."""
    event._attempt = attempt
