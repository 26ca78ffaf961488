"""The outbox's rows as the relay reads and marks them (``sql/008_outbox.sql``): a round's batch
claimed with ``FOR UPDATE SKIP LOCKED`` and cut to what keeps each key's order, the rows
confirmed marked sent, the rows refused counted, and the depth of what is still owed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg

__all__ = [
    "NOTIFY_CHANNEL",
    "OutboxDepth",
    "OutboxRow",
    "Refusal",
    "any_owed",
    "claim_batch",
    "in_key_order",
    "mark_refused",
    "mark_sent",
    "outbox_depth",
]

NOTIFY_CHANNEL = "consumer_outbox"
"""The channel sql/008's trigger notifies at the commit of every transaction that wrote rows."""

_CLAIM = """
SELECT id, event_id, type, order_key, body, headers::text AS headers,
       extract(epoch FROM clock_timestamp() - created_at)::float8 AS age
FROM outbox
WHERE sent_at IS NULL AND failed_at IS NULL
  AND id <> ALL($2::bigint[]) AND (order_key IS NULL OR order_key <> ALL($3::text[]))
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED
"""

# The first row still owed of each key that this batch does not hold: locked by another replica's
# round (a plain read sees it, where SKIP LOCKED passed it by), or past the batch's end.
_FIRST_OWED_ELSEWHERE = """
SELECT order_key, min(id) AS first
FROM outbox
WHERE sent_at IS NULL AND failed_at IS NULL
  AND order_key = ANY($1::text[]) AND id <> ALL($2::bigint[])
GROUP BY order_key
"""

# clock_timestamp(), not now(): now() is the round's start, before the publish it would date.
_MARK_SENT = "UPDATE outbox SET sent_at = clock_timestamp() WHERE id = ANY($1::bigint[])"

_MARK_REFUSED = """
UPDATE outbox AS o
SET attempts = o.attempts + 1,
    last_error = r.error,
    failed_at = CASE WHEN r.permanent THEN clock_timestamp() END
FROM unnest($1::bigint[], $2::text[], $3::bool[]) AS r(id, error, permanent)
WHERE o.id = r.id
"""

# Outside a transaction: whether a round has anything to claim. An idle relay then opens no
# transaction (no BEGIN/COMMIT round trips every poll, no COMMIT on the wire to take for the
# service's own); the partial index outbox_unsent answers it without reading sent rows.
_ANY_OWED = "SELECT EXISTS (SELECT 1 FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL)"

_DEPTH = """
SELECT count(*) AS rows,
       extract(epoch FROM clock_timestamp() - min(created_at))::float8 AS oldest
FROM outbox
WHERE sent_at IS NULL AND failed_at IS NULL
"""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One row to publish: the envelope's bytes and headers as written, and how old it was
    (the database's clock, from its ``created_at``) when the round read it."""

    id: int
    event_id: UUID
    type: str
    order_key: str | None
    body: bytes
    headers: dict[str, Any]
    age: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """A row the broker did not take: ``permanent`` (unroutable) sets its ``failed_at``."""

    id: int
    error: str
    permanent: bool


@dataclass(frozen=True, slots=True)
class OutboxDepth:
    rows: int
    oldest_age: float | None


def in_key_order(
    batch: Sequence[OutboxRow], first_owed_elsewhere: Mapping[str, int]
) -> list[OutboxRow]:
    """The rows of ``batch`` that may be published now: every row without a key, and each row
    whose key owes no earlier row outside the batch (``first_owed_elsewhere``: per key, the first
    id still owed that the batch does not hold). A later row of such a key waits for a round
    after that one is sent, so that a key's rows reach the queue in id order."""
    return [
        row
        for row in batch
        if row.order_key is None or row.id < first_owed_elsewhere.get(row.order_key, row.id + 1)
    ]


async def claim_batch(
    conn: asyncpg.Connection[Any],
    limit: int,
    *,
    skip_ids: Sequence[int] = (),
    skip_keys: Sequence[str] = (),
) -> tuple[list[OutboxRow], int]:
    """Inside the caller's transaction: up to ``limit`` rows owed, in id order, locked against
    the other replicas' rounds and cut by :func:`in_key_order`; and how many rows it held back.
    The rows ``skip_ids``, and every row of the keys ``skip_keys``, are left out (rows resting
    after a refusal: :mod:`consumer.service.outbox_resting`)."""
    records = await conn.fetch(_CLAIM, limit, list(skip_ids), list(skip_keys))
    batch = [_row(record) for record in records]
    keys = sorted({row.order_key for row in batch if row.order_key is not None})
    if not keys:
        return batch, 0
    elsewhere = {
        record["order_key"]: record["first"]
        for record in await conn.fetch(_FIRST_OWED_ELSEWHERE, keys, [row.id for row in batch])
    }
    ready = in_key_order(batch, elsewhere)
    return ready, len(batch) - len(ready)


async def any_owed(conn: asyncpg.Connection[Any]) -> bool:
    """Whether any row is owed (unsent and not failed): read outside a transaction."""
    return bool(await conn.fetchval(_ANY_OWED))


async def mark_sent(conn: asyncpg.Connection[Any], ids: Iterable[int]) -> None:
    await conn.execute(_MARK_SENT, list(ids))


async def mark_refused(conn: asyncpg.Connection[Any], refusals: Sequence[Refusal]) -> None:
    """Each row's attempt counted and its error kept; a permanent refusal sets ``failed_at``
    (skipped by every round until it is cleared)."""
    if not refusals:
        return
    await conn.execute(
        _MARK_REFUSED,
        [refusal.id for refusal in refusals],
        [refusal.error for refusal in refusals],
        [refusal.permanent for refusal in refusals],
    )


async def outbox_depth(conn: asyncpg.Connection[Any]) -> OutboxDepth:
    record = await conn.fetchrow(_DEPTH)
    assert record is not None
    return OutboxDepth(rows=record["rows"], oldest_age=record["oldest"])


def _row(record: asyncpg.Record) -> OutboxRow:
    headers = json.loads(record["headers"])
    return OutboxRow(
        id=record["id"],
        event_id=record["event_id"],
        type=record["type"],
        order_key=record["order_key"],
        body=bytes(record["body"]),
        # Headers are an object by contract; anything else is published without them.
        headers=headers if isinstance(headers, dict) else {},
        age=record["age"],
    )
