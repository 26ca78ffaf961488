"""``inventory.reserve``'s ``notify``: what the payload accepts, and the notification a reservation
with it publishes (the rows as built; the chain on the real broker and database is in
tests/integration/test_reserve_chain.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from consumer.handlers.inventory import RESERVED_TEMPLATE, Reserve, _announce
from consumer.registry import HandlerRegistry
from tests.support import REFERENCE_HANDLERS, reservation_in_a_call

REFERENCE = HandlerRegistry.from_modules(REFERENCE_HANDLERS.split(","))
ORDER = {"order_id": "o-1", "sku": "A-1", "qty": 2}


def test_notify_is_optional_and_absent_by_default() -> None:
    # The benchmarks' and the chaos suite's reservations: no notify, the payload as before
    assert Reserve.model_validate(ORDER).notify is None
    assert Reserve.model_validate({**ORDER, "notify": None}).notify is None


@pytest.mark.parametrize("recipient", ["a", "ops@example.com", "+15550100", "x" * 320])
def test_notify_takes_a_recipient_of_1_to_320_characters(recipient: str) -> None:
    assert Reserve.model_validate({**ORDER, "notify": recipient}).notify == recipient


@pytest.mark.parametrize("recipient", ["", "x" * 321, 15550100, ["ops@example.com"], {"to": "a"}])
def test_notify_refuses_what_is_no_recipient(recipient: object) -> None:
    # An empty or over-long name, or one that is not text, is refused: the event is poison
    with pytest.raises(ValidationError) as refused:
        Reserve.model_validate({**ORDER, "notify": recipient})
    assert [error["loc"] for error in refused.value.errors()] == [("notify",)]


def test_the_reserve_handler_refuses_a_bad_notify_as_it_would_on_arrival() -> None:
    # The registry's check is the one `consumer publish` and the outbox apply
    reserve = REFERENCE["inventory.reserve"]
    assert reserve.refusal({**ORDER, "notify": "ops@example.com"}) is None
    assert reserve.refusal({**ORDER, "notify": ""}) is not None
    assert reserve.refusal({**ORDER, "notify": "x" * 321}) is not None


async def test_a_reservation_with_notify_publishes_one_notification_keyed_by_its_order() -> None:
    # Given a reservation that names whom to tell, in a handler call
    event, publishes = reservation_in_a_call({**ORDER, "notify": "ops@example.com"}, REFERENCE)

    # When its reservation is announced
    await _announce(event)

    # Then one notification.requested, keyed by the order, that its own handler accepts
    [row] = publishes.rows
    assert (row.type, row.order_key, row.caused_by) == (
        "notification.requested",
        "o-1",
        event.event_id,
    )
    payload = json.loads(row.body)["payload"]
    assert payload == {
        "recipient": "ops@example.com",
        "template": RESERVED_TEMPLATE,
        "params": {"order_id": "o-1", "sku": "A-1", "qty": 2},
    }
    assert REFERENCE["notification.requested"].refusal(payload) is None


async def test_a_reservation_without_notify_publishes_nothing() -> None:
    event, publishes = reservation_in_a_call(ORDER, REFERENCE)
    await _announce(event)
    assert publishes.rows == []
