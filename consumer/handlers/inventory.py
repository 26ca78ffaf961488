"""Stock: ``inventory.restock`` adds to a SKU, ``inventory.reserve`` takes from it for an order
and, when the order names someone to tell (``notify``), publishes a ``notification.requested``
through the outbox, in the reservation's own transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from consumer import Envelope, PermanentError, register, register_batch
from consumer.handlers.notifications import NotificationRequested, Recipient

__all__ = [
    "MIGRATIONS",
    "RESERVED_TEMPLATE",
    "Quantity",
    "Reserve",
    "Restock",
    "Sku",
    "reserve",
    "restock",
]

# The reference handlers' tables and grants: consumer/handlers/sql, applied by `consumer migrate`
# when this module (or the other reference module) is in CONSUMER_HANDLERS.
MIGRATIONS = "sql"

Sku = Field(min_length=1, max_length=64)
Quantity = Field(gt=0, le=1_000_000)

RESERVED_TEMPLATE = "stock.reserved"
"""The template of the notification a reservation with ``notify`` requests."""


class Restock(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    sku: str = Sku
    qty: int = Quantity


class Reserve(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    order_id: str = Field(min_length=1, max_length=64)
    sku: str = Sku
    qty: int = Quantity
    notify: Recipient | None = None
    """Whom to tell once the stock is reserved (a ``notification.requested`` follows); without
    it, the reservation publishes nothing: the benchmarks' and the chaos suite's workloads."""


# One round trip each: the stock change and its movement row in a single statement.
_RESTOCK = """
WITH stocked AS (
    INSERT INTO stock (sku, available) VALUES ($2, $3)
    ON CONFLICT (sku) DO UPDATE SET available = stock.available + EXCLUDED.available
    RETURNING sku
)
INSERT INTO stock_movements (event_id, order_id, sku, delta)
SELECT $1, NULL, sku, $3 FROM stocked
"""

# One reservation in one round trip: the stock change and its movement row in a single statement.
_RESERVE_ONE = """
WITH reserved AS (
    UPDATE stock SET available = available - $4
    WHERE sku = $3 AND available >= $4
    RETURNING sku
)
INSERT INTO stock_movements (event_id, order_id, sku, delta)
SELECT $1, $2, sku, -$4 FROM reserved
RETURNING id
"""

# A batch of reservations in two round trips: lock the SKUs' rows (in one order, so two batches
# cannot deadlock) and read what is available; decide each event in order, as one at a time would;
# then take the stock of the ones that fit and write their movements in one statement.
_LOCK_STOCK = "SELECT sku, available FROM stock WHERE sku = ANY($1::text[]) ORDER BY sku FOR UPDATE"

_RESERVE = """
WITH taken AS (
    UPDATE stock SET available = stock.available - taken.qty
    FROM (
        SELECT sku, sum(qty) AS qty FROM unnest($3::text[], $4::integer[]) AS m (sku, qty)
        GROUP BY sku
    ) AS taken
    WHERE stock.sku = taken.sku
)
INSERT INTO stock_movements (event_id, order_id, sku, delta)
SELECT event_id, order_id, sku, -qty
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::integer[]) AS m (event_id, order_id, sku, qty)
"""


def _sku(payload: Restock | Reserve) -> str:
    return payload.sku


@register("inventory.restock", payload=Restock, key=_sku)
async def restock(event: Envelope[Restock], conn: asyncpg.Connection[Any]) -> None:
    """Add ``qty`` to the SKU's available stock, creating the SKU, and record the movement."""
    payload = event.payload
    await conn.execute(_RESTOCK, event.event_id, payload.sku, payload.qty)


@register_batch("inventory.reserve", payload=Reserve, key=_sku)
async def reserve(
    events: Sequence[Envelope[Reserve]], conn: asyncpg.Connection[Any]
) -> list[PermanentError | None]:
    """Take ``qty`` from the SKU for an order; an unknown SKU or too little stock is permanent.

    Events are decided in order against the locked rows: an event that does not fit fails alone
    and takes nothing, and a later, smaller one can still fit. Each reservation made with
    ``notify`` publishes its notification (:func:`_announce`); a failed one publishes nothing.
    """
    if len(events) == 1:
        return [await _reserve_one(events[0], conn)]
    rows = await conn.fetch(_LOCK_STOCK, sorted({event.payload.sku for event in events}))
    available: dict[str, int] = {row["sku"]: row["available"] for row in rows}
    results: list[PermanentError | None] = []
    taken: list[Envelope[Reserve]] = []
    for event in events:
        payload = event.payload
        left = available.get(payload.sku)
        if left is None:
            results.append(PermanentError(f"unknown SKU {payload.sku!r}"))
        elif left < payload.qty:
            results.append(_insufficient(payload, left))
        else:
            available[payload.sku] = left - payload.qty
            taken.append(event)
            results.append(None)
    if taken:
        await conn.execute(
            _RESERVE,
            [event.event_id for event in taken],
            [event.payload.order_id for event in taken],
            [event.payload.sku for event in taken],
            [event.payload.qty for event in taken],
        )
        for event in taken:
            await _announce(event)
    return results


async def _reserve_one(
    event: Envelope[Reserve], conn: asyncpg.Connection[Any]
) -> PermanentError | None:
    """A batch of one (an event applied alone): one statement, and one more only if it fails."""
    payload = event.payload
    movement = await conn.fetchval(
        _RESERVE_ONE, event.event_id, payload.order_id, payload.sku, payload.qty
    )
    if movement is not None:
        await _announce(event)
        return None
    available = await conn.fetchval("SELECT available FROM stock WHERE sku = $1", payload.sku)
    if available is None:
        return PermanentError(f"unknown SKU {payload.sku!r}")
    return _insufficient(payload, available)


def _insufficient(payload: Reserve, available: int) -> PermanentError:
    return PermanentError(
        f"insufficient stock for {payload.sku!r}: {available} available, {payload.qty} asked"
    )


async def _announce(event: Envelope[Reserve]) -> None:
    """The notification of a reservation made, if its order asked for one: keyed by the order,
    so an order's notifications are published in the order its reservations were made."""
    payload = event.payload
    if payload.notify is None:
        return
    params = {"order_id": payload.order_id, "sku": payload.sku, "qty": payload.qty}
    notification = NotificationRequested(
        recipient=payload.notify, template=RESERVED_TEMPLATE, params=params
    )
    await event.publish("notification.requested", notification, key=payload.order_id)
