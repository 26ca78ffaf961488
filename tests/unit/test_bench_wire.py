"""The paced publisher's messages: what Celery and Dramatiq would send themselves, and its pace.

Celery and Dramatiq come with the ``bench`` extra, which ``make install`` installs: the comparisons
import them and fail without them, never skip.
"""

from __future__ import annotations

import json
import uuid

import celery
import dramatiq
import pytest

from bench import celery_app, dramatiq_app, wire
from bench.events import EVENT_TYPE, envelope
from bench.paced import due

EVENT = envelope(
    uuid.UUID("6b9f1f7e-0f5a-4c56-9a43-9d4b8b4a1c11"), "SKU-7", "o-1", occurred_at="2026-01-01"
)


def test_the_service_gets_its_envelope_on_its_exchange_routed_by_type() -> None:
    message = wire.service("bench_x.events")(EVENT, 1.0)
    assert (message.exchange, message.routing_key) == ("bench_x.events", EVENT_TYPE)
    assert json.loads(message.body) == EVENT
    assert message.properties["delivery_mode"] == 2


def test_celery_gets_task_protocol_2_as_its_own_client_builds_it() -> None:
    app = celery.Celery("wire", set_as_current=False)
    expected = app.amqp.as_task_v2(EVENT["event_id"], wire.CELERY_TASK, args=(EVENT,))

    message = wire.celery("bench_q")(EVENT, 1.0)
    headers = message.properties["headers"]
    assert set(headers) == set(expected.headers)
    for key in ("lang", "task", "id", "root_id", "retries", "timelimit", "eta", "expires"):
        assert headers[key] == expected.headers[key], key
    assert json.loads(message.body) == json.loads(json.dumps(expected.body))
    assert message.properties["correlation_id"] == expected.properties["correlation_id"]
    assert (message.exchange, message.routing_key) == ("bench_q", "bench_q")
    assert message.properties["content_type"] == "application/json"
    assert message.properties["delivery_mode"] == 2


def test_dramatiq_gets_the_bytes_of_its_own_message_encoding() -> None:
    message = wire.dramatiq("bench_q")(EVENT, 1_700_000_000.5)
    expected: dramatiq.Message[object] = dramatiq.Message(
        queue_name="bench_q",
        actor_name=wire.DRAMATIQ_ACTOR,
        args=(EVENT,),
        kwargs={},
        options={},
        message_id=EVENT["event_id"],
        message_timestamp=1_700_000_000_500,
    )
    assert message.body == expected.encode()
    assert (message.exchange, message.routing_key) == ("", "bench_q")
    assert message.properties["delivery_mode"] == 2


def test_the_harness_names_the_peers_task_and_actor_as_they_register_them() -> None:
    assert celery_app.TASK_NAME == wire.CELERY_TASK
    assert dramatiq_app.ACTOR_NAME == wire.DRAMATIQ_ACTOR


@pytest.mark.parametrize(
    ("elapsed", "expected"),
    [(-0.1, 0), (0.0, 1), (0.0009, 1), (0.0015, 2), (0.5, 501), (0.9985, 999), (5.0, 1000)],
)
def test_the_pace_is_one_at_once_then_the_rate_and_never_past_the_total(
    elapsed: float, expected: int
) -> None:
    assert due(elapsed, rate=1000, total=1000) == expected
