"""The one door: each verdict becomes exactly one broker action, against a recording channel."""

from __future__ import annotations

import asyncio
import gc
import warnings
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pamqp.commands import Basic

from consumer.amqp import headers as h
from consumer.amqp.acker import Acker
from consumer.amqp.delivery import Delivery
from consumer.errors import PermanentError, Poison, PoisonReason, PublishFailed, TransientError
from consumer.pipeline.outcome import Applied, Failed, Outcome, OutcomeKind, Rejected
from consumer.pipeline.retry import DeadLetter, DeadLetterReason, Retry, Return
from consumer.service.settle import Settler
from topology.names import RETRY_RUNG, Names

NAMES = Names(service="svc", ingress="events")


class RecordingChannel:
    """The consume channel: the acks and nacks the settler has the acker send."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, int, bool]] = []
        self.is_closed = False

    async def basic_ack(self, tag: int, *, multiple: bool, wait: bool) -> None:
        self.frames.append(("ack", tag, multiple))

    async def basic_nack(self, tag: int, *, multiple: bool, requeue: bool, wait: bool) -> None:
        self.frames.append(("nack-requeue" if requeue else "nack", tag, multiple))


class RecordingPublisher:
    """The publish channel: what was published where, or a refusal."""

    def __init__(self, refuse: bool = False) -> None:
        self.published: list[tuple[str, str, dict[str, Any]]] = []
        self.refuse = refuse

    async def publish(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> None:
        if self.refuse:
            raise PublishFailed("the broker did not confirm")
        self.published.append((exchange, routing_key, dict(properties.headers or {})))


def deliveries(channel: RecordingChannel, count: int) -> list[Delivery]:
    acker = Acker(channel)
    made = []
    for tag in range(1, count + 1):
        acker.received(tag)
        properties = Basic.Properties(headers={}, message_id=f"m{tag}")
        message = SimpleNamespace(
            body=b"{}",
            header=SimpleNamespace(properties=properties),
            routing_key="t.x",
            exchange="events",
            delivery_tag=tag,
            redelivered=False,
        )
        made.append(Delivery(cast(Any, message), acker))
    return made


def settled_as(frames: list[tuple[str, int, bool]], delivered: set[int]) -> dict[str, set[int]]:
    """What the broker makes of the frames, in order (a multiple ack covers what is left)."""
    outstanding = set(delivered)
    result: dict[str, set[int]] = {}
    for kind, tag, multiple in frames:
        covered = {t for t in outstanding if t <= tag} if multiple else {tag}
        outstanding -= covered
        result.setdefault(kind, set()).update(covered)
    return result


def settler(publisher: RecordingPublisher | None) -> Settler:
    made = Settler(names=NAMES, publish_failure_pause=0.0)
    made.publisher = cast(Any, publisher)
    return made


NOW = datetime.now(UTC)
PERMANENT = DeadLetterReason.PERMANENT_FAILURE


async def test_every_kind_of_verdict_becomes_its_one_action() -> None:
    channel, publisher = RecordingChannel(), RecordingPublisher()
    d = deliveries(channel, 6)
    outcomes = [
        Outcome(d[0], Applied(False, NOW)),
        Outcome(d[1], Applied(True, NOW)),
        Outcome(d[2], Rejected(Poison(PoisonReason.NOT_JSON, "x"))),
        Outcome(d[3], Failed(TransientError("t"), Retry(0, timedelta(seconds=1), 1), 0)),
        Outcome(
            d[4], Failed(PermanentError("p"), DeadLetter(DeadLetterReason.PERMANENT_FAILURE), 0)
        ),
        Outcome(d[5], Failed(ConnectionError("down"), Return(), 0)),
    ]

    settled = await settler(publisher).settle(outcomes)
    await cast(Acker, d[0].acker).send_all()

    assert [s.kind for s in settled] == [
        OutcomeKind.PROCESSED,
        OutcomeKind.DUPLICATE,
        OutcomeKind.POISON,
        OutcomeKind.RETRIED,
        OutcomeKind.DEAD_LETTERED,
        None,  # held: not settled
    ]
    assert sorted((exchange, key) for exchange, key, _ in publisher.published) == [
        ("svc.dlx", "t.x"),
        ("svc.dlx", "t.x"),
        ("svc.retry", "t.x"),
    ]
    by_reason = {headers.get(h.REASON): headers for *_, headers in publisher.published}
    assert by_reason[None][h.ATTEMPT] == 1
    assert by_reason[None][RETRY_RUNG] == "1s"
    assert by_reason["permanent_failure"][h.ERROR_CLASS] == "PermanentError"
    assert by_reason["not_json"][h.ERROR_CLASS] == "not_json"
    # acks for 1, 2 (joined into one multiple ack), the poison, 4 and 5 after their copies; the
    # held one untouched
    assert settled_as(channel.frames, {1, 2, 3, 4, 5, 6}) == {"ack": {1, 2, 3, 4, 5}}
    assert cast(Acker, d[5].acker).unsettled == 1


async def test_poison_from_a_validators_exception_is_published_with_its_class() -> None:
    channel, publisher = RecordingChannel(), RecordingPublisher()
    [delivery] = deliveries(channel, 1)
    poison = Poison(PoisonReason.INVALID_PAYLOAD, "AttributeError: ...", "AttributeError")

    [settled] = await settler(publisher).settle([Outcome(delivery, Rejected(poison))])
    await cast(Acker, delivery.acker).send_all()

    assert settled.kind is OutcomeKind.POISON
    [(exchange, _, headers)] = publisher.published
    assert exchange == "svc.dlx"
    assert headers[h.REASON] == "invalid_payload"
    assert headers[h.ERROR_CLASS] == "AttributeError"
    assert channel.frames == [("ack", 1, True)]


async def test_poison_is_published_with_the_service_s_reason_and_no_broker_headers() -> None:
    # Given poison whose headers (as the service trusts them) carry an x-death a producer wrote
    channel, publisher = RecordingChannel(), RecordingPublisher()
    [delivery] = deliveries(channel, 1)
    delivery.headers = {"x-death": [{"reason": "expired"}], "x-anything": 1, "note": "kept"}
    poison = Poison(PoisonReason.INVALID_ENVELOPE, "no event_id")

    # When it is settled
    [settled] = await settler(publisher).settle([Outcome(delivery, Rejected(poison))])
    await cast(Acker, delivery.acker).send_all()

    # Then a copy goes to the dead-letter exchange with the service's reason headers, no x-*
    # header, the producer's others kept; and only then is the original acked
    assert settled.kind is OutcomeKind.POISON
    [(exchange, routing_key, headers)] = publisher.published
    assert (exchange, routing_key) == ("svc.dlx", "t.x")
    assert headers[h.REASON] == "invalid_envelope"
    assert headers[h.ERROR_MESSAGE] == "no event_id"
    assert headers[h.ORIGINAL_ROUTING_KEY] == "t.x"
    assert headers[h.ATTEMPT] == 0
    assert headers[h.DEAD_LETTERED_AT]
    assert headers["note"] == "kept"
    assert not [key for key in headers if key.startswith("x-")]
    assert channel.frames == [("ack", 1, True)]


@pytest.mark.parametrize(
    "poison",
    [
        Poison(PoisonReason.BODY_TOO_LARGE, "dropped unread", body_discarded=True),
        Poison(PoisonReason.HEADERS_TOO_LARGE, "headers over 65536 bytes"),
    ],
    ids=["body discarded", "headers too large"],
)
async def test_poison_no_copy_can_carry_is_nacked_for_the_broker_to_dead_letter(
    poison: Poison,
) -> None:
    channel, publisher = RecordingChannel(), RecordingPublisher()
    [delivery] = deliveries(channel, 1)

    [settled] = await settler(publisher).settle([Outcome(delivery, Rejected(poison))])
    await cast(Acker, delivery.acker).send_all()

    assert settled.kind is OutcomeKind.POISON
    assert publisher.published == []
    assert channel.frames == [("nack", 1, False)]


async def test_a_copy_the_broker_refuses_returns_the_original_never_acks_it() -> None:
    channel, publisher = RecordingChannel(), RecordingPublisher(refuse=True)
    [delivery] = deliveries(channel, 1)
    failed = Failed(PermanentError("p"), DeadLetter(DeadLetterReason.PERMANENT_FAILURE), 0)

    [settled] = await settler(publisher).settle([Outcome(delivery, failed)])

    assert settled.kind is OutcomeKind.RETURNED
    assert settled.publish_error is not None
    assert channel.frames == [("nack-requeue", 1, False)]


@pytest.mark.parametrize("publisher", [RecordingPublisher(), None])
async def test_a_closed_channel_settles_nothing_and_copies_nothing(
    publisher: RecordingPublisher | None,
) -> None:
    channel = RecordingChannel()
    [delivery] = deliveries(channel, 1)
    channel.is_closed = True
    failed = Failed(TransientError("t"), Retry(0, timedelta(seconds=1), 1), 0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        [settled] = await settler(publisher).settle([Outcome(delivery, failed)])
        gc.collect()

    assert settled.channel_gone
    assert channel.frames == []
    assert publisher is None or publisher.published == []
    # No copy was begun: not even a coroutine left unawaited.
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


async def test_giving_back_is_a_single_nack_with_requeue() -> None:
    channel = RecordingChannel()
    first, second = deliveries(channel, 2)

    assert (await settler(None).give_back(second)).kind is OutcomeKind.RETURNED
    await asyncio.sleep(0)

    assert channel.frames == [("nack-requeue", 2, False)]
    assert cast(Acker, first.acker).unsettled == 1


async def test_a_queue_s_copies_go_to_its_own_ladder_and_dlx_and_say_the_queue() -> None:
    # Given the settler of queue "sms" of a queue table
    channel, publisher = RecordingChannel(), RecordingPublisher()
    d = deliveries(channel, 3)
    made = Settler(names=replace(NAMES, queue="sms"), publish_failure_pause=0.0)
    made.publisher = cast(Any, publisher)

    # When it retries one event, dead-letters one and finds one poison
    await made.settle(
        [
            Outcome(d[0], Failed(TransientError("t"), Retry(0, timedelta(seconds=1), 1), 0)),
            Outcome(d[1], Failed(PermanentError("p"), DeadLetter(PERMANENT), 0)),
            Outcome(d[2], Rejected(Poison(PoisonReason.NOT_JSON, "x"))),
        ]
    )

    # Then the copies go to the queue's own exchanges, and each dead letter names the queue
    assert sorted(exchange for exchange, _, _ in publisher.published) == [
        "svc.sms.dlx",
        "svc.sms.dlx",
        "svc.sms.retry",
    ]
    for exchange, _, headers in publisher.published:
        assert headers.get(h.QUEUE) == ("sms" if exchange.endswith(".dlx") else None)
        assert headers.get(h.SERVICE) in (None, "svc")


async def test_without_a_table_dead_letters_carry_no_queue_header() -> None:
    channel, publisher = RecordingChannel(), RecordingPublisher()
    (delivery,) = deliveries(channel, 1)

    await settler(publisher).settle(
        [Outcome(delivery, Failed(PermanentError("p"), DeadLetter(PERMANENT), 0))]
    )

    ((_, _, headers),) = publisher.published
    assert h.QUEUE not in headers


async def test_a_batch_of_acks_is_settled_at_once_and_any_other_verdict_leaves_it_to_settle() -> (
    None
):
    channel = RecordingChannel()
    d = deliveries(channel, 4)
    acks = [Outcome(d[0], Applied(False, NOW)), Outcome(d[1], Applied(True, NOW))]
    mixed = [
        Outcome(d[2], Applied(False, NOW)),
        Outcome(d[3], Failed(ConnectionError("down"), Return(), 0)),
    ]
    made = settler(RecordingPublisher())

    assert made.acked_now(mixed) is None  # nothing settled: settle() does it all
    settled = made.acked_now(acks)
    await cast(Acker, d[0].acker).send_all()

    assert settled is not None
    assert [s.kind for s in settled] == [OutcomeKind.PROCESSED, OutcomeKind.DUPLICATE]
    assert settled_as(channel.frames, {1, 2, 3, 4}) == {"ack": {1, 2}}
    assert cast(Acker, d[0].acker).unsettled == 2
