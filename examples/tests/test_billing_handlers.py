"""billing's handlers, tested with consumer.testing: the service's own pipeline on each event,
in process with no RabbitMQ (or on the real broker: ``pytest --consumer-broker``).

Each test gets a fresh copy of a database migrated once for the run (the service's migrations
and ``billing/sql``), and a harness that returns what became of each event.
"""

from __future__ import annotations

import asyncpg
import pytest
from billing.handlers import Charge, Invoice, Refund

from consumer.testing import Harness, Message, Unroutable, event


async def rows(harness: Harness, query: str) -> list[tuple[object, ...]]:
    conn = await asyncpg.connect(harness.database_url)
    try:
        return [tuple(row) for row in await conn.fetch(query)]
    finally:
        await conn.close()


async def test_a_charge_is_processed(consumer_harness: Harness) -> None:
    [outcome] = await consumer_harness.send(
        event("billing.charge", Charge(order_id="o-1", cents=1250))
    )

    assert outcome.processed, outcome
    assert await rows(consumer_harness, "SELECT order_id, cents, currency FROM charges") == [
        ("o-1", 1250, "EUR")
    ]


async def test_the_same_charge_twice_is_applied_once(consumer_harness: Harness) -> None:
    charge = event("billing.charge", Charge(order_id="o-1", cents=1250))

    first = await consumer_harness.send(charge)
    again = await consumer_harness.send(charge, charge)

    assert [o.kind for o in first + again] == ["processed", "duplicate", "duplicate"]
    assert await rows(consumer_harness, "SELECT count(*) FROM charges") == [(1,)]


async def test_a_refund_before_its_charge_is_retried_then_processed(
    consumer_harness: Harness,
) -> None:
    refund = event("billing.refund", Refund(order_id="o-1", cents=250))

    [early] = await consumer_harness.send(refund)
    [charged] = await consumer_harness.send(
        event("billing.charge", Charge(order_id="o-1", cents=1250))
    )
    [later] = await consumer_harness.redeliver()

    assert early.retried, early
    assert early.rung == 0
    assert early.error_class == "TransientError"
    assert charged.processed
    assert later.processed, later
    assert later.attempt == 1
    assert later.event_id == refund.event_id
    assert await rows(consumer_harness, "SELECT cents FROM refunds") == [(250,)]


async def test_a_refund_whose_charge_never_comes_climbs_the_whole_ladder(
    consumer_harness: Harness,
) -> None:
    [outcome] = await consumer_harness.send(
        event("billing.refund", Refund(order_id="o-9", cents=1))
    )
    rungs = [outcome.rung]
    while outcome.retried:
        [outcome] = await consumer_harness.redeliver()
        rungs.append(outcome.rung)

    assert outcome.dead_lettered, outcome
    assert outcome.reason == "retries_exhausted"
    assert rungs == [*range(len(rungs) - 1), None]  # one retry per rung of the ladder
    assert consumer_harness.waiting == 0


async def test_a_refund_larger_than_the_charge_is_dead_lettered_at_once(
    consumer_harness: Harness,
) -> None:
    await consumer_harness.send(event("billing.charge", Charge(order_id="o-2", cents=800)))

    [outcome] = await consumer_harness.send(
        event("billing.refund", Refund(order_id="o-2", cents=9999))
    )

    assert outcome.dead_lettered, outcome
    assert outcome.reason == "permanent_failure"
    assert outcome.error == "order o-2: refund of 9999 > 800"
    assert await rows(consumer_harness, "SELECT count(*) FROM refunds") == [(0,)]


async def test_an_invoice_is_recorded_once_per_order(consumer_harness: Harness) -> None:
    [issued] = await consumer_harness.send(
        event("billing.invoice", Invoice(order_id="o-5", number="INV-0001"))
    )
    [again] = await consumer_harness.send(
        event("billing.invoice", Invoice(order_id="o-5", number="INV-0002"))
    )

    assert issued.processed, issued
    assert again.dead_lettered, again
    assert again.reason == "permanent_failure"
    assert again.error == "order o-5: already invoiced as INV-0001"
    assert await rows(consumer_harness, "SELECT order_id, number FROM invoices") == [
        ("o-5", "INV-0001")
    ]


async def test_a_payload_the_model_refuses_is_poison(consumer_harness: Harness) -> None:
    outcomes = await consumer_harness.send(
        event("billing.charge", {"order_id": "o-3", "cents": -5}),
        event("billing.charge", {"order_id": "o-3", "cents": 5, "currency": "euro"}),
        event("billing.charge", {"order_id": "o-3", "cents": 5}, routing_key="billing.refund"),
        Message(b"{not json", routing_key="billing.charge"),
    )

    assert [(o.kind, o.reason) for o in outcomes] == [
        ("poison", "invalid_payload"),
        ("poison", "invalid_payload"),
        ("poison", "routing_key_mismatch"),
        ("poison", "not_json"),
    ]
    assert "cents" in (outcomes[0].error or "")
    assert await rows(consumer_harness, "SELECT count(*) FROM charges") == [(0,)]


async def test_an_event_type_no_handler_registers_is_not_routed(consumer_harness: Harness) -> None:
    with pytest.raises(Unroutable, match=r"billing\.unknown"):
        await consumer_harness.send(event("billing.unknown", {"order_id": "o-4"}))
