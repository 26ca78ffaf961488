"""The outbox's rows as an operator reads and gives them back (``consumer outbox``): a listing by
state, one row in full, and the failed rows' ``failed_at`` cleared so that the relay takes them
again. Everything here runs as the run-time role: it reads the table and updates only the columns
sql/008 grants (``failed_at``, ``last_error``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import asyncpg

from consumer.db.outbox_rows import NOTIFY_CHANNEL

__all__ = [
    "Listing",
    "OutboxEntry",
    "Retried",
    "RowState",
    "list_rows",
    "retry_failed",
    "rows_of",
]

_OWED = "sent_at IS NULL AND failed_at IS NULL"
_FAILED = "sent_at IS NULL AND failed_at IS NOT NULL"

_COLUMNS = """
id, event_id, type, order_key, body, headers::text AS headers, caused_by, caused_by_consumer,
created_at, sent_at, failed_at, attempts, last_error,
extract(epoch FROM clock_timestamp() - created_at)::float8 AS age
"""

# The UPDATE's own WHERE decides which rows go back, so that a row sent or given back meanwhile
# (by the relay, by another operator) is neither counted nor touched.
_RETRY = f"""
UPDATE outbox SET failed_at = NULL, last_error = NULL
WHERE {_FAILED} AND ($1::uuid[] IS NULL OR event_id = ANY($1::uuid[]))
RETURNING event_id
"""
_WOULD_RETRY = f"""
SELECT event_id FROM outbox
WHERE {_FAILED} AND ($1::uuid[] IS NULL OR event_id = ANY($1::uuid[]))
ORDER BY id
"""
_WAKE_RELAYS = f"SELECT pg_notify('{NOTIFY_CHANNEL}', '')"
_SELECT = f"SELECT {_COLUMNS} FROM outbox"
_OF_EVENT = f"{_SELECT} WHERE event_id = $1 ORDER BY id"
_OLDEST = "ORDER BY id LIMIT $1"
_NEWEST = "ORDER BY id DESC LIMIT $1"
_KNOWN = "SELECT DISTINCT event_id FROM outbox WHERE event_id = ANY($1::uuid[])"


class RowState(enum.StrEnum):
    OWED = "owed"
    SENT = "sent"
    FAILED = "failed"


class Listing(enum.StrEnum):
    """Which rows ``consumer outbox list`` shows."""

    OWED = "owed"
    FAILED = "failed"
    ALL = "all"


# Each listing a statement of its own (no text joined at run time): by state, oldest or newest
# first.
_LISTINGS = {
    (Listing.OWED, False): f"{_SELECT} WHERE {_OWED} {_OLDEST}",
    (Listing.OWED, True): f"{_SELECT} WHERE {_OWED} {_NEWEST}",
    (Listing.FAILED, False): f"{_SELECT} WHERE {_FAILED} {_OLDEST}",
    (Listing.FAILED, True): f"{_SELECT} WHERE {_FAILED} {_NEWEST}",
    (Listing.ALL, False): f"{_SELECT} {_OLDEST}",
    (Listing.ALL, True): f"{_SELECT} {_NEWEST}",
}


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One outbox row as written and as the relay left it; ``age`` in seconds on the database's
    clock."""

    id: int
    event_id: UUID
    type: str
    order_key: str | None
    body: bytes
    headers: str
    caused_by: UUID | None
    caused_by_consumer: str | None
    created_at: datetime
    sent_at: datetime | None
    failed_at: datetime | None
    attempts: int
    last_error: str | None
    age: float

    @property
    def state(self) -> RowState:
        if self.sent_at is not None:
            return RowState.SENT
        if self.failed_at is not None:
            return RowState.FAILED
        return RowState.OWED

    def body_json(self) -> Any:
        """The envelope as JSON, or ``None`` if the bytes are not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class Retried:
    """What a retry gave back (or would): the rows' event ids, and the ids asked for that have
    no row at all."""

    event_ids: list[UUID]
    unknown: list[UUID]


async def list_rows(
    conn: asyncpg.Connection[Any], which: Listing, *, limit: int, newest_first: bool
) -> list[OutboxEntry]:
    records = await conn.fetch(_LISTINGS[which, newest_first], limit)
    return [_entry(record) for record in records]


async def rows_of(conn: asyncpg.Connection[Any], event_id: UUID) -> list[OutboxEntry]:
    """The rows of one event id, in the order written (one, unless it was enqueued twice)."""
    records = await conn.fetch(_OF_EVENT, event_id)
    return [_entry(record) for record in records]


async def retry_failed(
    conn: asyncpg.Connection[Any], event_ids: Sequence[UUID] | None, *, dry_run: bool
) -> Retried:
    """Clear ``failed_at`` and ``last_error`` of the failed rows among ``event_ids`` (``None``:
    every failed row), in one transaction; ``dry_run``: only say which. If an id asked for has no
    row, nothing is changed."""
    asked = None if event_ids is None else list(dict.fromkeys(event_ids))
    async with conn.transaction():
        unknown: list[UUID] = []
        if asked is not None:
            known = {record["event_id"] for record in await conn.fetch(_KNOWN, asked)}
            unknown = [event_id for event_id in asked if event_id not in known]
        if unknown or dry_run:
            records = [] if unknown else await conn.fetch(_WOULD_RETRY, asked)
        else:
            records = await conn.fetch(_RETRY, asked)
            if records:
                # The trigger notifies inserts only: wake the relays at this commit, as an
                # insert would, rather than at their next poll.
                await conn.execute(_WAKE_RELAYS)
    return Retried([record["event_id"] for record in records], unknown)


def _entry(record: asyncpg.Record) -> OutboxEntry:
    return OutboxEntry(
        id=record["id"],
        event_id=record["event_id"],
        type=record["type"],
        order_key=record["order_key"],
        body=bytes(record["body"]),
        headers=record["headers"],
        caused_by=record["caused_by"],
        caused_by_consumer=record["caused_by_consumer"],
        created_at=record["created_at"],
        sent_at=record["sent_at"],
        failed_at=record["failed_at"],
        attempts=record["attempts"],
        last_error=record["last_error"],
        age=record["age"],
    )
