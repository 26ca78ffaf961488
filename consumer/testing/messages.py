"""The messages a test gives the harness: events as producers publish them, or any bytes."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from consumer.cli.producer import envelope_body

__all__ = ["Message", "event"]


@dataclass(frozen=True, slots=True)
class Message:
    """A message for the work queue: its body, routing key, headers and content type.

    Sent twice, it is the same event delivered twice (a duplicate the second time). Build one with
    :func:`event`, or directly for a body no producer should send (poison)::

        Message(b"not json", routing_key="billing.charge")
    """

    body: bytes
    routing_key: str
    headers: Mapping[str, Any] = field(default_factory=dict)
    content_type: str | None = "application/json"
    event_id: UUID | None = None
    """The event's id when :func:`event` built it (for the test's own assertions)."""


def event(
    event_type: str,
    payload: BaseModel | Mapping[str, Any],
    *,
    event_id: UUID | None = None,
    occurred_at: datetime | None = None,
    correlation_id: str | None = None,
    routing_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> Message:
    """An event's message as a producer publishes it (``consumer publish``'s envelope): a new
    event id and now as ``occurred_at`` unless given; routed by its type unless ``routing_key``
    says otherwise. ``payload`` may be the handler's pydantic model or a plain mapping (which
    may be invalid: that is what a poison test sends)."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload)
    event_id = event_id or uuid.uuid4()
    body = envelope_body(
        event_type,
        data,
        event_id=event_id,
        occurred_at=occurred_at,
        correlation_id=correlation_id,
    )
    return Message(
        body=body,
        routing_key=routing_key if routing_key is not None else event_type,
        headers=dict(headers or {}),
        event_id=event_id,
    )
