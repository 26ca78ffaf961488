"""What a handler and an operator are told about an event the service has not applied yet: the
attempt a handler is on (``event.attempt``, from the service's own retry header, whatever a
producer forged), and the type of a payload its model refused (in the line and the metrics, the
metrics' labels bounded to the registered types)."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from consumer.amqp import headers as h
from consumer.config.settings import Settings
from consumer.errors import Poison, PoisonReason
from consumer.observe.metrics import Metrics, ServiceRegistry
from consumer.observe.report import OutcomeReporter
from consumer.pipeline.envelope_parser import EnvelopeParser
from consumer.pipeline.outcome import Outcome, OutcomeKind, Rejected, Settled
from consumer.pipeline.prepare import Preparer
from consumer.registry import HandlerRegistry
from consumer.service.components import envelope_limits
from tests.support import FakeDelivery

REGISTRY = HandlerRegistry.from_modules(["consumer.handlers.inventory"])
PREPARER = Preparer(REGISTRY, EnvelopeParser(envelope_limits(Settings.model_validate({}))))


def _delivery(
    payload: dict[str, Any],
    *,
    event_type: str = "inventory.restock",
    headers: dict[str, Any] | None = None,
) -> Any:
    body = {
        "event_id": str(uuid.uuid4()),
        "type": event_type,
        "occurred_at": datetime.now(UTC).isoformat(),
        "payload": payload,
    }
    return FakeDelivery(
        content_type=None,
        content_encoding=None,
        headers=headers or {},
        body=json.dumps(body).encode(),
        body_discarded=False,
        message_id=None,
        routing_key=event_type,
        redelivered=False,
        received_at=time.monotonic(),
        message=SimpleNamespace(
            header=SimpleNamespace(properties=SimpleNamespace(message_id=None)),
            routing_key=event_type,
            redelivered=False,
        ),
    )


def _attempt(delivery: Any) -> int:
    prepared = PREPARER.prepared(delivery)
    assert not isinstance(prepared, Poison), prepared
    return prepared.event.attempt


def test_the_first_delivery_is_attempt_one() -> None:
    assert _attempt(_delivery({"sku": "A", "qty": 1})) == 1


@pytest.mark.parametrize(("header", "attempt"), [(1, 2), ("3", 4), (b"2", 3)])
def test_a_retried_delivery_is_on_the_attempt_after_the_retries_published(
    header: object, attempt: int
) -> None:
    assert _attempt(_delivery({"sku": "A", "qty": 1}, headers={h.ATTEMPT: header})) == attempt


@pytest.mark.parametrize("forged", ["abc", -4, True, "9" * 5000, 10**30, "", None, 1.5])
def test_an_unreadable_or_absurd_attempt_header_stays_a_small_whole_number(forged: object) -> None:
    attempt = _attempt(_delivery({"sku": "A", "qty": 1}, headers={h.ATTEMPT: forged}))

    assert 1 <= attempt <= h.MAX_ATTEMPT + 1


def test_the_attempt_is_not_part_of_what_is_published_or_accepted_from_a_producer() -> None:
    # A body that names an attempt is not an envelope (extra fields are refused)...
    delivery = _delivery({"sku": "A", "qty": 1})
    body = json.loads(delivery.body)
    delivery.body = json.dumps({**body, "attempt": 7}).encode()
    assert isinstance(PREPARER.prepared(delivery), Poison)
    # ...and the envelope's JSON does not carry it
    prepared = PREPARER.prepared(_delivery({"sku": "A", "qty": 1}, headers={h.ATTEMPT: 2}))
    assert not isinstance(prepared, Poison)
    assert "attempt" not in prepared.event.model_dump()


class _Lines:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        self.lines.append(fields)


def _reported(delivery: Any) -> tuple[dict[str, Any], Metrics]:
    poison = PREPARER.prepared(delivery)
    assert isinstance(poison, Poison)
    metrics = Metrics(ServiceRegistry(), list(REGISTRY))
    lines = _Lines()
    OutcomeReporter(lines, metrics).report(
        Outcome(delivery, Rejected(poison)), Settled(OutcomeKind.POISON)
    )
    (line,) = lines.lines
    return line, metrics


def test_a_payload_its_model_refuses_is_logged_and_counted_under_its_type() -> None:
    line, metrics = _reported(_delivery({"sku": "A", "qty": "lots"}))

    assert line["type"] == "inventory.restock"
    assert line["reason"] == PoisonReason.INVALID_PAYLOAD.value
    sample = metrics.registry.get_sample_value(
        "consumer_messages_total", {"type": "inventory.restock", "outcome": "poison"}
    )
    assert sample == 1


def test_a_type_no_handler_takes_is_logged_but_counted_as_unknown() -> None:
    # Given many types no handler is registered for, garbage among them
    metrics_seen: set[str] = set()
    for event_type in ("no.such", "x" * 200, "a-b.c_d"):
        line, metrics = _reported(_delivery({}, event_type=event_type))
        # Then the line names it, and the metric's label stays the one bounded value
        assert line["type"] == event_type
        labels = {
            sample.labels["type"]
            for family in metrics.registry.collect()
            if family.name == "consumer_messages"
            for sample in family.samples
            if sample.name == "consumer_messages_total" and sample.value > 0
        }
        metrics_seen |= labels
    assert metrics_seen == {"unknown"}


def test_a_body_that_never_named_a_type_has_none() -> None:
    delivery = _delivery({})
    delivery.body = b"{not json"
    line, _ = _reported(delivery)

    assert line["type"] is None
