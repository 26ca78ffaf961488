"""Stock: ``inventory.restock`` adds to a SKU, ``inventory.reserve`` takes from it for an order."""

from __future__ import annotations

from typing import Any

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from consumer.envelope import Envelope
from consumer.errors import PermanentError
from consumer.registry import register

Sku = Field(min_length=1, max_length=64)
Quantity = Field(gt=0, le=1_000_000)


class Restock(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    sku: str = Sku
    qty: int = Quantity


class Reserve(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    order_id: str = Field(min_length=1, max_length=64)
    sku: str = Sku
    qty: int = Quantity


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

_RESERVE = """
WITH reserved AS (
    UPDATE stock SET available = available - $4
    WHERE sku = $3 AND available >= $4
    RETURNING sku
)
INSERT INTO stock_movements (event_id, order_id, sku, delta)
SELECT $1, $2, sku, -$4 FROM reserved
RETURNING id
"""


def _sku(payload: Restock | Reserve) -> str:
    return payload.sku


@register("inventory.restock", payload=Restock, key=_sku)
async def restock(event: Envelope[Restock], conn: asyncpg.Connection[Any]) -> None:
    """Add ``qty`` to the SKU's available stock, creating the SKU, and record the movement."""
    payload = event.payload
    await conn.execute(_RESTOCK, event.event_id, payload.sku, payload.qty)


@register("inventory.reserve", payload=Reserve, key=_sku)
async def reserve(event: Envelope[Reserve], conn: asyncpg.Connection[Any]) -> None:
    """Take ``qty`` from the SKU for an order; an unknown SKU or too little stock is permanent."""
    payload = event.payload
    movement = await conn.fetchval(
        _RESERVE, event.event_id, payload.order_id, payload.sku, payload.qty
    )
    if movement is not None:
        return
    available = await conn.fetchval("SELECT available FROM stock WHERE sku = $1", payload.sku)
    if available is None:
        raise PermanentError(f"unknown SKU {payload.sku!r}")
    raise PermanentError(
        f"insufficient stock for {payload.sku!r}: {available} available, {payload.qty} asked"
    )
