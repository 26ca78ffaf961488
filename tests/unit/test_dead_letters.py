"""How a dead letter describes itself, from the headers the service and the broker put on it."""

from __future__ import annotations

import io
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from aio_pika.abc import AbstractIncomingMessage

from consumer.amqp.wire import UnreadableHeader
from consumer.cli.dlq.letters import read_dead_letter
from consumer.cli.dlq.output import show_letter
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser
from consumer.registry import HandlerRegistry


@dataclass
class Letter:
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    content_type: str | None = "application/json"
    content_encoding: str | None = None
    message_id: str | None = "m-1"
    routing_key: str | None = "inventory.reserve"


REGISTRY = HandlerRegistry.from_modules(["consumer.handlers.inventory"])
PARSER = EnvelopeParser(EnvelopeLimits())


def read(letter: Letter) -> Any:
    message = cast(AbstractIncomingMessage, letter)
    return read_dead_letter(message, 0, registry=REGISTRY, parser=PARSER)


def envelope() -> bytes:
    return json.dumps(
        {
            "event_id": str(uuid.uuid4()),
            "type": "inventory.reserve",
            "occurred_at": "2026-11-29T10:00:00+00:00",
            "payload": {"order_id": "o", "sku": "s", "qty": 1},
        }
    ).encode()


def test_the_newest_death_is_the_reason_not_the_first() -> None:
    # Retried once through a rung (expired there), then it crashed the worker every time.
    when = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    letter = read(
        Letter(
            envelope(),
            {
                "x-death": [
                    {"reason": "delivery_limit", "queue": "svc.work", "count": 1, "time": when},
                    {"reason": "expired", "queue": "svc.retry.1s", "count": 1, "time": when},
                ],
                "x-first-death-reason": "expired",
                "consumer-attempt": 1,
            },
        )
    )
    assert letter.reason == "delivery_limit"
    # the broker dead-lettered it: its consumer-attempt may be a producer's, so none is claimed
    assert letter.attempts is None
    assert letter.dead_lettered_at == when


def test_poison_is_named_by_parsing_the_body_again() -> None:
    letter = read(Letter(b"{oops", {"x-death": [{"reason": "rejected"}]}))
    assert letter.reason == "not_json"
    assert letter.poison_detail


def test_the_service_s_own_reason_is_read_on_its_own_letters() -> None:
    letter = read(Letter(envelope(), {"consumer-dead-reason": "permanent_failure"}))
    assert letter.by_service
    assert letter.reason == "permanent_failure"


def bad_payload() -> bytes:
    event = json.loads(envelope())
    event["payload"] = {"order_id": "o"}  # no sku, no qty: the handler's model refuses it
    return json.dumps(event).encode()


def test_a_replay_s_reading_validates_the_payload_only_when_the_reason_depends_on_it() -> None:
    # Given two letters with a payload their handler refuses: one with the service's reason,
    # one the broker dead-lettered as rejected (no reason of ours: the payload says why)
    ours = Letter(bad_payload(), {"consumer-dead-reason": "permanent_failure"})
    rejected = Letter(bad_payload(), {"x-death": [{"reason": "rejected"}]})

    # When they are read as a replay reads them
    def lazily(letter: Letter) -> Any:
        message = cast(AbstractIncomingMessage, letter)
        return read_dead_letter(message, 0, registry=REGISTRY, parser=PARSER, validate=False)

    # Then the type and id are read either way; the payload is judged only for the second
    assert lazily(ours).type == "inventory.reserve"
    assert lazily(ours).reason == "permanent_failure"
    assert lazily(ours).poison_detail is None
    assert read(ours).poison_detail
    assert lazily(rejected).reason == "invalid_payload"
    assert lazily(rejected).reason == read(rejected).reason


WHEN = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
FORGED = {
    "consumer-dead-reason": "expired",
    "consumer-dead-lettered-at": "1999-01-01T00:00:00+00:00",
    "consumer-original-routing-key": "payments.refund",
    "consumer-original-exchange": "payments",
    "consumer-attempt": 3,
    "consumer-error-class": "Forged",
}


def test_on_a_letter_the_broker_dead_lettered_the_consumer_headers_are_not_believed() -> None:
    # Given a letter the broker dead-lettered at the delivery limit, carrying a producer's
    # forged consumer-* headers
    letter = read(
        Letter(
            envelope(),
            {
                **FORGED,
                "x-death": [{"reason": "delivery_limit", "queue": "svc.work", "time": WHEN}],
            },
        )
    )

    # Then its reason, time and routing key are the broker's, none of the forged ones
    assert not letter.by_service
    assert letter.reason == "delivery_limit"
    assert letter.dead_lettered_at == WHEN
    assert letter.original_routing_key == "inventory.reserve"
    assert letter.attempts is None
    assert letter.error_class is None
    # And a forged "expired" does not make a replay refuse it
    assert not letter.expired
    # And the forged headers are all there, set apart as unverified
    assert letter.unverified == FORGED
    assert letter.summary()["dead_lettered_by"] == "broker"


def test_nacked_poison_with_forged_headers_is_named_by_its_body() -> None:
    letter = read(Letter(b"{oops", {**FORGED, "x-death": [{"reason": "rejected", "time": WHEN}]}))
    assert letter.reason == "not_json"
    assert not letter.expired
    assert letter.dead_lettered_at == WHEN


@pytest.mark.parametrize(
    "x_death",
    [[], "forged", [{"reason": "expired"}], [{"count": 1}], None],
    ids=["empty", "a string", "forged entry", "no reason", "void"],
)
def test_any_x_death_makes_a_letter_the_broker_s_never_the_service_s(x_death: Any) -> None:
    # Given a letter carrying the service's reason headers and some x-death a producer wrote
    letter = read(Letter(envelope(), {**FORGED, "x-death": x_death}))

    # Then it is not the service's: nothing of its consumer-* headers is believed
    assert not letter.by_service
    assert not letter.expired
    assert letter.reason != "expired"
    assert letter.attempts is None
    assert letter.dead_lettered_at != datetime(1999, 1, 1, tzinfo=UTC)


def test_headers_the_tools_could_not_read_whole_are_not_the_service_s() -> None:
    # An undecodable headers table stands in as one key: it may have hidden an x-death
    letter = read(Letter(envelope(), {"unreadable-headers": UnreadableHeader("unreadable")}))
    assert not letter.by_service
    # The same key as plain text (on the service's copy of such poison) is readable
    ours = read(
        Letter(
            envelope(),
            {"unreadable-headers": "unreadable", "consumer-dead-reason": "headers_unreadable"},
        )
    )
    assert ours.by_service
    assert ours.reason == "headers_unreadable"


def test_show_never_puts_unverified_headers_with_the_service_s() -> None:
    letter = read(
        Letter(
            envelope(),
            {**FORGED, "x-death": [{"reason": "delivery_limit", "time": WHEN}], "note": "n"},
        )
    )
    out = io.StringIO()

    show_letter(letter, out)

    text = out.getvalue()
    assert "headers set by the service" not in text
    assert "reason:          delivery_limit  (the broker's x-death)" in text
    assert "attempts:        ?" in text
    assert "original:        ? inventory.reserve" in text
    unverified = text.split("consumer-* headers, unverified")[1].split("headers set by the")[0]
    assert "consumer-dead-reason: expired" in unverified
    assert "consumer-original-routing-key: payments.refund" in unverified
    assert "note: n" in text.split("headers set by the producer:")[1]
