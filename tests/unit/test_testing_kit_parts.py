"""consumer.testing's pure parts: an outcome read off a log line, waits matched to lines by
message id, and deliveries made as the consume channel makes them."""

from __future__ import annotations

import logging
import uuid

import pytest

from consumer.amqp import headers as h
from consumer.testing import EventOutcome, HarnessError, Kind, event
from consumer.testing.memory import MemoryChannel
from consumer.testing.tracking import OutcomeTracker


def test_a_retried_line_gives_its_rung_from_the_attempt() -> None:
    event_id = uuid.uuid4()
    fields = {
        "event_id": str(event_id),
        "type": "billing.refund",
        "message_id": "m-1",
        "attempt": 2,
        "outcome": "retried",
        "rung": "30s",
        "error_class": "TransientError",
        "error": "not yet",
    }

    outcome = EventOutcome.from_log_line(fields)

    assert outcome.kind is Kind.RETRIED
    assert (outcome.event_id, outcome.rung, outcome.delay) == (event_id, 2, "30s")
    assert str(outcome) == "retried at rung 2 (30s) TransientError: not yet"


def test_a_poison_line_has_no_event_and_its_reason() -> None:
    outcome = EventOutcome.from_log_line(
        {"event_id": None, "type": None, "outcome": "poison", "reason": "not_json", "error": "x"}
    )

    assert outcome.poison
    assert (outcome.event_id, outcome.rung, outcome.reason) == (None, None, "not_json")


async def test_lines_go_to_waits_in_order_and_early_lines_wait_for_theirs() -> None:
    tracker = OutcomeTracker()
    first, second = tracker.expect("m-1"), tracker.expect("m-1")

    tracker.write(logging.INFO, "message settled", {"message_id": "m-1", "outcome": "processed"})
    tracker.write(logging.INFO, "message settled", {"message_id": "m-1", "outcome": "duplicate"})
    tracker.write(logging.INFO, "message settled", {"message_id": "m-2", "outcome": "retried"})
    tracker.write(logging.INFO, "something else", {"message_id": "m-2", "outcome": "retried"})

    assert [f.result().kind for f in (first, second)] == [Kind.PROCESSED, Kind.DUPLICATE]
    assert (await tracker.expect("m-2")).kind is Kind.RETRIED
    assert len(tracker.lines) == 3


async def test_a_failure_fails_every_wait_now_and_later() -> None:
    tracker = OutcomeTracker()
    waiting = tracker.expect("m-1")

    tracker.fail("the service stopped")

    with pytest.raises(HarnessError, match="the service stopped"):
        await waiting
    with pytest.raises(HarnessError, match="the service stopped"):
        await tracker.expect("m-2")


async def test_a_wait_that_outlasts_its_guard_names_what_is_missing() -> None:
    tracker = OutcomeTracker()

    with pytest.raises(HarnessError, match="1 of 1 deliveries not settled"):
        await tracker.wait([tracker.expect("m-1")], within=0.01)


def test_deliveries_keep_the_services_own_headers_only_from_its_ladder() -> None:
    channel = MemoryChannel()
    message = event("billing.charge", {"order_id": "o-1", "cents": 1})
    own = {h.ATTEMPT: 3, "traceparent": "00-x"}

    fresh = channel.delivery(message.body, routing_key="billing.charge", exchange="e", headers=own)
    back = channel.delivery(
        message.body, routing_key="billing.charge", exchange="r", headers=own, trusted=True
    )

    assert fresh.headers == {"traceparent": "00-x"}
    assert back.headers == own
    assert fresh.delivery_tag != back.delivery_tag
    assert (fresh.routing_key, fresh.exchange, fresh.body) == ("billing.charge", "e", message.body)


async def test_the_channel_records_what_the_settler_does() -> None:
    channel = MemoryChannel()
    delivery = channel.delivery(b"{}", routing_key="t", exchange="e")

    delivery.ack()
    await delivery.nack(requeue=False)

    assert channel.acked == [delivery.delivery_tag]
    assert channel.nacked == [(delivery.delivery_tag, False)]
