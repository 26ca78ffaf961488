"""The outbox's rows as built: derived ids, bodies, order keys, and the checks before the commit."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import asyncpg
import pytest
from pydantic import BaseModel, TypeAdapter, field_validator

from consumer import Envelope, register
from consumer.envelope import envelope_body, set_follow_ups
from consumer.errors import (
    HandlerEndedTransaction,
    InvalidPublish,
    OutboxMisuse,
    PermanentError,
    PipelineFault,
    TransientError,
)
from consumer.outbox import FOLLOW_UP_NAMESPACE, Publishes, enqueue, follow_up_id
from consumer.pipeline.calls import HandlerCaller, HandlerCalls
from consumer.pipeline.follow_ups import FollowUpWriter
from consumer.pipeline.ready import Ready
from consumer.pipeline.retry import DeadLetter, DeadLetterReason, RetryPolicy
from consumer.registry import Handler, HandlerRegistry, _marked_functions


class Wanted(BaseModel):
    sku: str
    qty: int

    @field_validator("qty")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be positive")
        return value


@register("t.wanted", payload=Wanted, key=lambda wanted: wanted.sku)
async def _wanted(event: Envelope[Wanted], conn: Any) -> None:
    pass


@register("t.unkeyed", payload=dict[str, Any])
async def _unkeyed(event: Envelope[dict[str, Any]], conn: Any) -> None:
    pass


def _registry() -> HandlerRegistry:
    return HandlerRegistry(_marked_functions([_wanted, _unkeyed], __name__))


def _cause(correlation_id: str | None = None) -> Envelope[Any]:
    return Envelope[Any](
        event_id=uuid.uuid4(),
        type="t.cause",
        occurred_at=datetime.now(UTC),
        payload={},
        correlation_id=correlation_id,
    )


def _publishes(cause: Envelope[Any], consumer: str = "svc") -> Publishes:
    return Publishes(cause, consumer=consumer, handlers=_registry())


def test_a_follow_up_id_is_the_same_for_the_same_cause_consumer_and_position() -> None:
    # Given one cause
    cause = uuid.uuid4()

    # Then its ids are uuid5 in the outbox's namespace, the same each time, and differ by
    # position, consumer and cause
    first = follow_up_id(cause, "svc", 0)
    assert first == follow_up_id(cause, "svc", 0)
    assert first == uuid.uuid5(FOLLOW_UP_NAMESPACE, f"svc\n{cause}\n0")
    assert first.version == 5
    others = {
        follow_up_id(cause, "svc", 1),
        follow_up_id(cause, "other", 0),
        follow_up_id(uuid.uuid4(), "svc", 0),
    }
    assert first not in others
    assert len(others) == 3


def test_a_handler_run_again_publishes_the_same_rows_but_for_their_time() -> None:
    # Given a cause, published for twice as two runs of its handler would
    cause = _cause()
    runs = []
    for _ in range(2):
        publishes = _publishes(cause)
        publishes.add("t.wanted", {"sku": "A", "qty": 1}, None)
        publishes.add("t.elsewhere", {"n": 2}, "k")
        runs.append(publishes.rows)

    # Then the ids, types and keys are the same in both, in the order published
    first, again = runs
    assert [row.event_id for row in first] == [row.event_id for row in again]
    derived = [follow_up_id(cause.event_id, "svc", n) for n in (0, 1)]
    assert [row.event_id for row in first] == derived
    assert [(row.type, row.order_key) for row in first] == [("t.wanted", "A"), ("t.elsewhere", "k")]
    assert {(row.caused_by, row.caused_by_consumer) for row in first} == {(cause.event_id, "svc")}


def test_the_body_is_the_envelope_consumer_publish_sends() -> None:
    # Given a cause without a correlation id
    cause = _cause()
    publishes = _publishes(cause)

    # When its handler publishes a model
    event_id = publishes.add("t.wanted", Wanted(sku="A", qty=3), None)

    # Then the body is envelope_body's bytes for it, correlated to the cause
    (row,) = publishes.rows
    sent = json.loads(row.body)
    occurred_at = datetime.fromisoformat(sent["occurred_at"])
    assert row.body == envelope_body(
        "t.wanted",
        {"sku": "A", "qty": 3},
        event_id=event_id,
        occurred_at=occurred_at,
        correlation_id=str(cause.event_id),
    )
    assert sent["event_id"] == str(event_id)
    assert dict(row.headers) == {}


def test_the_causes_correlation_id_goes_on() -> None:
    publishes = _publishes(_cause(correlation_id="order-7"))
    publishes.add("t.unkeyed", {"x": 1}, None)
    assert json.loads(publishes.rows[0].body)["correlation_id"] == "order-7"


def test_a_payload_the_targets_model_refuses_is_an_invalid_publish_that_dead_letters() -> None:
    # Given a handler of t.wanted in this service
    publishes = _publishes(_cause())

    # When a publish to it breaks its model
    with pytest.raises(InvalidPublish) as refused:
        publishes.add("t.wanted", {"sku": "A", "qty": 0}, None)

    # Then nothing is collected, the reason names the type and the field, and it is permanent:
    # the cause is dead-lettered with reason invalid_publish
    assert publishes.rows == []
    assert "t.wanted" in str(refused.value)
    assert "qty" in str(refused.value)
    assert isinstance(refused.value, PermanentError)
    decision = RetryPolicy.from_delays([]).decide(refused.value, 0)
    assert decision == DeadLetter(DeadLetterReason.INVALID_PUBLISH)


def test_a_refused_publish_keeps_its_position() -> None:
    # Given a publish refused between two good ones (the handler caught the error)
    cause = _cause()
    publishes = _publishes(cause)
    publishes.add("t.unkeyed", {}, None)
    with pytest.raises(InvalidPublish):
        publishes.add("not a type", {}, None)
    third = publishes.add("t.unkeyed", {}, None)

    # Then the ids after it are where they would be
    assert third == follow_up_id(cause.event_id, "svc", 2)
    assert len(publishes.rows) == 2


@pytest.mark.parametrize(
    ("event_type", "payload"),
    [
        ("bad type!", {}),
        ("", {}),
        ("t." + "x" * 300, {}),
        ("t.x", {"when": object()}),
        # JSON has no NaN nor infinity: the service's own parser takes such a body for poison
        ("t.x", {"ratio": float("nan")}),
        ("t.x", {"ratio": float("inf")}),
        ("t.unkeyed", {"ratio": float("-inf")}),
    ],
)
def test_no_type_or_no_json_is_refused(event_type: str, payload: Any) -> None:
    with pytest.raises(InvalidPublish):
        _publishes(_cause()).add(event_type, payload, None)


def test_a_type_this_service_does_not_handle_is_not_checked_and_has_no_key() -> None:
    publishes = _publishes(_cause())
    publishes.add("t.elsewhere", {"anything": [1, 2]}, None)
    assert publishes.rows[0].order_key is None


def test_the_publish_key_wins_over_the_targets_key() -> None:
    publishes = _publishes(_cause())
    publishes.add("t.wanted", {"sku": "A", "qty": 1}, "mine")
    assert publishes.rows[0].order_key == "mine"


async def test_publish_outside_a_handler_call_says_where_it_works() -> None:
    # Given an envelope the pipeline has not opened for a call
    event = _cause()

    # Then publish refuses, naming the way for code that is not a handler
    with pytest.raises(RuntimeError, match="enqueue"):
        await event.publish("t.unkeyed", {})

    # And inside a call it adds to the call's collection
    publishes = _publishes(event)
    set_follow_ups(event, publishes)
    event_id = await event.publish("t.unkeyed", {"a": 1})
    assert [row.event_id for row in publishes.rows] == [event_id]
    set_follow_ups(event, None)
    with pytest.raises(RuntimeError):
        await event.publish("t.unkeyed", {})


class _Recording:
    """A connection in a transaction that records the outbox's statements."""

    def __init__(self) -> None:
        self.written: list[list[tuple[Any, ...]]] = []

    def is_in_transaction(self) -> bool:
        return True

    def is_closed(self) -> bool:
        return False

    async def executemany(self, query: str, records: list[tuple[Any, ...]]) -> None:
        assert query.strip().startswith("INSERT INTO outbox")
        self.written.append(records)


def _caller() -> HandlerCaller:
    writer = FollowUpWriter(consumer="svc", handlers=_registry())
    return HandlerCaller(default_timeout=5, calls=HandlerCalls(), follow_ups=writer)


def _ready_for(handler: Handler, event: Envelope[Any]) -> Ready:
    return Ready(cast(Any, SimpleNamespace(message_id=None)), handler, event)


async def test_a_call_writes_its_publishes_once_and_only_for_the_events_it_applied() -> None:
    # Given a batch handler that publishes one event per event and fails the second
    async def many(events: Sequence[Envelope[Any]], conn: Any) -> list[Exception | None]:
        for event in events:
            await event.publish("t.unkeyed", {"of": str(event.event_id)})
        return [None, PermanentError("no"), None]

    async def one(event: Envelope[Any], conn: Any) -> None:
        return None

    handler = Handler("t.cause", one, TypeAdapter(dict), many=many)
    events = [_cause() for _ in range(3)]
    conn = _Recording()

    # When the caller runs it
    await _caller().run_batch(cast(Any, conn), [_ready_for(handler, e) for e in events])

    # Then one statement wrote the rows of the first and third, with their derived ids
    (records,) = conn.written
    assert [record[0] for record in records] == [
        follow_up_id(events[0].event_id, "svc", 0),
        follow_up_id(events[2].event_id, "svc", 0),
    ]
    # And a publish after the call raises
    with pytest.raises(RuntimeError):
        await events[0].publish("t.unkeyed", {})


async def test_a_call_that_raises_writes_nothing_and_the_next_starts_afresh() -> None:
    # Given a handler that publishes twice and fails on its first run
    runs: list[int] = []

    async def flaky(event: Envelope[Any], conn: Any) -> None:
        runs.append(1)
        await event.publish("t.unkeyed", {"n": 0})
        await event.publish("t.unkeyed", {"n": 1})
        if len(runs) == 1:
            raise TransientError("once")

    handler = Handler("t.cause", flaky, TypeAdapter(dict))
    event = _cause()
    conn = _Recording()
    caller = _caller()

    # When it runs twice
    with pytest.raises(TransientError):
        await caller.run(cast(Any, conn), _ready_for(handler, event))
    await caller.run(cast(Any, conn), _ready_for(handler, event))

    # Then only the second run wrote, its two rows, at positions 0 and 1
    (records,) = conn.written
    assert [record[0] for record in records] == [
        follow_up_id(event.event_id, "svc", n) for n in (0, 1)
    ]


class _Ended(_Recording):
    """A connection whose transaction the handler ended (COMMIT)."""

    def is_in_transaction(self) -> bool:
        return False


async def test_a_handler_that_ended_the_transaction_writes_nothing() -> None:
    # Given a handler that publishes and then commits the service's transaction itself
    async def commits(event: Envelope[Any], conn: Any) -> None:
        await event.publish("t.unkeyed", {})

    handler = Handler("t.cause", commits, TypeAdapter(dict))
    conn = _Ended()

    # When it is called, then it fails its event, and no row is written outside a transaction,
    # where it would commit alone
    with pytest.raises(HandlerEndedTransaction):
        await _caller().run(cast(Any, conn), _ready_for(handler, _cause()))
    assert conn.written == []


class _InTransaction:
    """A connection in a transaction that records enqueue's statement."""

    def __init__(self) -> None:
        self.executed: list[tuple[Any, ...]] = []

    def is_in_transaction(self) -> bool:
        return True

    async def execute(self, query: str, *arguments: Any) -> None:
        self.executed.append(arguments)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
async def test_enqueue_refuses_a_payload_json_cannot_carry(value: float) -> None:
    conn = _InTransaction()
    with pytest.raises(OutboxMisuse, match="not JSON"):
        await enqueue(cast(Any, conn), "t.x", {"ratio": value})
    assert conn.executed == []


@pytest.mark.parametrize("key", [7, uuid.UUID(int=7)])
async def test_a_key_that_is_no_text_is_written_as_its_text(key: object) -> None:
    # Given a handler that passes an order's id as it is, not as text
    async def keyed(event: Envelope[Any], conn: Any) -> None:
        await event.publish("t.unkeyed", {}, key=key)

    handler = Handler("t.cause", keyed, TypeAdapter(dict))
    conn = _Recording()

    # When it is called, then its row's key is the id's text, as the column takes it (a value of
    # another type fails the statement, and the event with it)
    await _caller().run(cast(Any, conn), _ready_for(handler, _cause()))
    (records,) = conn.written
    assert [record[2] for record in records] == [str(key)]

    # And so is an application's
    enqueued = _InTransaction()
    await enqueue(cast(Any, enqueued), "t.x", {}, key=key)
    assert enqueued.executed[0][2] == str(key)


class _NoPartition(_Recording):
    """A connection whose outbox has no partition for now (its upkeep failed for days)."""

    async def executemany(self, query: str, records: list[tuple[Any, ...]]) -> None:
        raise asyncpg.CheckViolationError('no partition of relation "outbox" found for row')


async def test_an_outbox_that_cannot_take_the_rows_stops_the_service_not_the_event() -> None:
    # Given a handler that publishes, and an outbox with no partition for the rows
    async def publishes(event: Envelope[Any], conn: Any) -> None:
        await event.publish("t.unkeyed", {})

    handler = Handler("t.cause", publishes, TypeAdapter(dict))

    # When it is called, then the failure is the service's (it stops; at its start the
    # partitions are made), not the event's: no event is dead-lettered for it
    with pytest.raises(PipelineFault, match="outbox"):
        await _caller().run(cast(Any, _NoPartition()), _ready_for(handler, _cause()))
