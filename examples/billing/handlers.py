"""``billing.charge`` records what an order was charged; ``billing.refund`` gives part of it back;
``billing.invoice`` records the invoice an order was issued.

A team's own handler module: name it in ``CONSUMER_HANDLERS`` (``billing.handlers``). Its tables
are in ``billing/sql/``, declared by ``MIGRATIONS`` below: ``consumer migrate`` applies them after
the service's own, and records them in its ledger as the set ``billing.sql``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from consumer import Connection, Envelope, PermanentError, TransientError, register

MIGRATIONS = "sql"

OrderId = Field(min_length=1, max_length=64)


class Charge(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    order_id: str = OrderId
    cents: int = Field(gt=0)
    currency: str = Field(default="EUR", pattern=r"^[A-Z]{3}$")


class Refund(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    order_id: str = OrderId
    cents: int = Field(gt=0)


class Invoice(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    order_id: str = OrderId
    number: str = Field(pattern=r"^[A-Z0-9-]{1,32}$")


@register("billing.charge", payload=Charge, key=lambda charge: charge.order_id)
async def charge(event: Envelope[Charge], conn: Connection) -> None:
    await conn.execute(
        "INSERT INTO charges (event_id, order_id, cents, currency) VALUES ($1, $2, $3, $4)",
        event.event_id,
        event.payload.order_id,
        event.payload.cents,
        event.payload.currency,
    )


@register("billing.refund", payload=Refund, key=lambda refund: refund.order_id)
async def refund(event: Envelope[Refund], conn: Connection) -> None:
    order_id = event.payload.order_id
    # Two refunds of one order (on two replicas) must not both pass the check below: the lock
    # holds until the event's transaction ends, and needs no grant beyond the tables'.
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", order_id)
    charged = await conn.fetchval(
        "SELECT sum(cents) FROM charges WHERE order_id = $1",
        order_id,
    )
    if charged is None:
        # No order between events is promised: the charge may still be on its way. Waiting
        # may fix it, so the event climbs the retry ladder (and is dead-lettered as
        # retries_exhausted if the charge never comes).
        raise TransientError(f"order {order_id}: no charge yet")
    refundable = charged - await conn.fetchval(
        "SELECT coalesce(sum(cents), 0) FROM refunds WHERE order_id = $1",
        order_id,
    )
    if event.payload.cents > refundable:
        # No retry can make it right: dead-lettered at once, for a person to look at.
        raise PermanentError(f"order {order_id}: refund of {event.payload.cents} > {refundable}")
    await conn.execute(
        "INSERT INTO refunds (event_id, order_id, cents) VALUES ($1, $2, $3)",
        event.event_id,
        order_id,
        event.payload.cents,
    )


@register("billing.invoice", payload=Invoice, key=lambda invoice: invoice.order_id)
async def invoice(event: Envelope[Invoice], conn: Connection) -> None:
    # A team would render and send the invoice here: the slow part, which its queue's time limit
    # (queues.toml) is for. One invoice per order: the unique order_id decides, also between two
    # replicas at once (the second insert waits for the first's transaction, then does nothing).
    order_id = event.payload.order_id
    recorded = await conn.fetchval(
        "INSERT INTO invoices (event_id, order_id, number) VALUES ($1, $2, $3)"
        " ON CONFLICT (order_id) DO NOTHING RETURNING number",
        event.event_id,
        order_id,
        event.payload.number,
    )
    if recorded is None:
        # Another event than the first invoice (a copy of one is a duplicate before it gets here).
        issued = await conn.fetchval("SELECT number FROM invoices WHERE order_id = $1", order_id)
        raise PermanentError(f"order {order_id}: already invoiced as {issued}")
