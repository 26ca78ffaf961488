"""The event envelope producers publish: the model handlers receive.

:mod:`consumer.pipeline.envelope_parser` turns a message body into one, or says why it never can;
:func:`envelope_body` writes one, as ``consumer publish`` and the outbox send it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, Generic, Protocol, TypeVar
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, PrivateAttr, field_validator

__all__ = [
    "EVENT_TYPE_PATTERN",
    "Envelope",
    "FollowUps",
    "RawEnvelope",
    "envelope_body",
    "set_attempt",
    "set_follow_ups",
]

PayloadT = TypeVar("PayloadT")

EVENT_TYPE_PATTERN = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"


class FollowUps(Protocol):
    """Where :meth:`Envelope.publish` puts what a handler publishes: the outbox rows of one handler
    call (:class:`consumer.outbox.Publishes`), written when the call returns."""

    def add(self, event_type: str, payload: Any, key: object) -> UUID: ...


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
    # Set by the pipeline for the length of one handler call only (set_follow_ups).
    _follow_ups: FollowUps | None = PrivateAttr(default=None)

    @property
    def attempt(self) -> int:
        """Which delivery of this event the handler is on: 1 the first time, 2 on the first
        retry, and so on. From the retry count the service's own header carries (a producer's
        copy of that header is dropped on arrival, an unreadable one reads as none, and it is
        capped), so a handler may trust it: to log, to give up early on its own terms, to call a
        slower fallback. Duplicates and isolated re-runs of the same delivery keep its number."""
        return self._attempt

    async def publish(self, event_type: str, payload: Any, *, key: object = None) -> UUID:
        """Publish an event that this one caused, through the transactional outbox: its row is
        written in this event's own transaction when the handler returns, so it is published if
        and only if this event's effect commits. Returns the new event's ``event_id``.

        ``payload`` is a pydantic model or anything pydantic can turn into JSON (a dict). When
        this service has a handler for ``event_type``, the payload must pass that handler's model
        (else :class:`~consumer.errors.InvalidPublish`, and this event is dead-lettered). ``key``
        orders the rows that share it, as text (an order's int id is its ``str()``; default: the
        target handler's ``key`` of the payload, as text too).

        The id is derived from this event's id, the consumer and the publish's position in the
        call (first, second...), so a handler run again writes the same ids. Only inside a
        handler call: anywhere else it raises ``RuntimeError``."""
        follow_ups = self._follow_ups
        if follow_ups is None:
            raise RuntimeError(
                "Envelope.publish works only inside a handler call the service makes "
                "(outside one, use consumer.outbox.enqueue in a transaction)"
            )
        return follow_ups.add(event_type, payload, key)

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


def set_follow_ups(event: Envelope[Any], follow_ups: FollowUps | None) -> None:
    """Where :meth:`Envelope.publish` collects, for one handler call (None after it)."""
    # Into pydantic's store of private attributes itself: the pipeline sets this twice in every
    # handler call, publishing or not, and BaseModel.__setattr__ costs several times more.
    private = event.__pydantic_private__
    assert private is not None  # a model with private attributes always has the store
    private["_follow_ups"] = follow_ups


def envelope_body(
    event_type: str,
    payload: Any,
    *,
    event_id: UUID,
    occurred_at: datetime | None = None,
    correlation_id: str | None = None,
) -> bytes:
    """The JSON envelope producers publish (``payload`` already JSON: a dict, a list...).
    ``ValueError`` for a NaN or an infinity in it: JSON has no way to write them, and the
    service's parser takes a body with one for poison."""
    envelope: dict[str, Any] = {
        "event_id": str(event_id),
        "type": event_type,
        "occurred_at": (occurred_at or datetime.now(UTC)).isoformat(),
        "payload": payload,
    }
    if correlation_id is not None:
        envelope["correlation_id"] = correlation_id
    return json.dumps(envelope, separators=(",", ":"), allow_nan=False).encode()
