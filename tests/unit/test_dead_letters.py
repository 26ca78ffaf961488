"""How a dead letter describes itself, from the headers the service and the broker put on it."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from aio_pika.abc import AbstractIncomingMessage

from consumer.cli.dlq.letters import read_dead_letter
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
    assert letter.attempts == 1
    assert letter.dead_lettered_at == when


def test_poison_is_named_by_parsing_the_body_again() -> None:
    letter = read(Letter(b"{oops", {"x-death": [{"reason": "rejected"}]}))
    assert letter.reason == "not_json"
    assert letter.poison_detail


def test_the_service_s_own_reason_wins() -> None:
    letter = read(Letter(envelope(), {"consumer-dead-reason": "permanent_failure", "x-death": []}))
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
