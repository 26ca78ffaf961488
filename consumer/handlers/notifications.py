"""``notification.requested``: record a notification for a sender to pick up."""

from __future__ import annotations

import json
from typing import Annotated, Any

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from consumer import Envelope, register

__all__ = ["MIGRATIONS", "NotificationRequested", "Recipient", "notification_requested"]

# The reference handlers' tables and grants: consumer/handlers/sql, applied by `consumer migrate`
# when this module (or the other reference module) is in CONSUMER_HANDLERS.
MIGRATIONS = "sql"

Recipient = Annotated[str, Field(min_length=1, max_length=320)]
"""Whom a notification goes to (an address, a number): what ``notifications.recipient`` holds,
and what an ``inventory.reserve`` names to be told of its reservation."""


class NotificationRequested(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    recipient: Recipient
    template: str = Field(min_length=1, max_length=100)
    params: dict[str, Any] = Field(default_factory=dict)


_INSERT = """
INSERT INTO notifications (event_id, recipient, template, params)
VALUES ($1, $2, $3, $4::jsonb)
"""


@register("notification.requested", payload=NotificationRequested)
async def notification_requested(
    event: Envelope[NotificationRequested], conn: asyncpg.Connection[Any]
) -> None:
    """Insert the notification row: the auditable task a sender delivers and marks sent."""
    payload = event.payload
    await conn.execute(
        _INSERT, event.event_id, payload.recipient, payload.template, json.dumps(payload.params)
    )
