"""A body over the limit, dropped unread as it arrived (issue 29): its delivery is poison
``body_too_large`` that says so, and the settler nacks it, whatever else the poison says, so that
the broker dead-letters the original with its body (no copy could carry it)."""

from __future__ import annotations

from typing import Any, cast

from pamqp.commands import Basic
from pamqp.header import ContentHeader

from consumer.amqp.acker import Acker
from consumer.amqp.delivery import Delivery
from consumer.amqp.direct_consume import BodyDiscarded
from consumer.errors import Poison, PoisonReason
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser
from consumer.pipeline.outcome import Outcome, OutcomeKind, Rejected
from consumer.pipeline.prepare import Preparer
from consumer.registry import HandlerRegistry
from consumer.service.settle import Settler
from topology.names import Names


class RecordingChannel:
    def __init__(self) -> None:
        self.frames: list[tuple[str, int]] = []
        self.is_closed = False

    async def basic_ack(self, tag: int, *, multiple: bool, wait: bool) -> None:
        self.frames.append(("ack", tag))

    async def basic_nack(self, tag: int, *, multiple: bool, requeue: bool, wait: bool) -> None:
        self.frames.append(("nack-requeue" if requeue else "nack", tag))


class RecordingPublisher:
    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, body: bytes, properties: Any, *, exchange: str, **_: Any) -> None:
        self.published.append(exchange)


def discarded_delivery(channel: RecordingChannel, declared: int) -> Delivery:
    acker = Acker(cast(Any, channel))
    acker.received(1)
    properties = Basic.Properties(headers={}, message_id="m1", content_type="application/json")
    message = BodyDiscarded(
        delivery=Basic.Deliver("ctag", 1, False, "events", "test.behave"),
        header=ContentHeader(0, declared, properties),
        body=b"",
        channel=cast(Any, None),
    )
    return Delivery(message, acker)


def test_a_discarded_body_is_poison_that_says_so_before_anything_else_is_read() -> None:
    channel = RecordingChannel()
    delivery = discarded_delivery(channel, 32 * 1024 * 1024)
    preparer = Preparer(HandlerRegistry.from_modules([]), EnvelopeParser(EnvelopeLimits()))

    poison = preparer.prepared(delivery)

    assert isinstance(poison, Poison)
    assert poison.reason is PoisonReason.BODY_TOO_LARGE
    assert poison.body_discarded
    assert poison.detail == "33554432 bytes, the limit is 262144 (dropped unread)"
    assert delivery.body == b""
    # The same for the way a delivery that came back is judged alone.
    assert isinstance(preparer.identified(delivery), Poison)


async def test_poison_whose_body_was_discarded_is_nacked_never_copied() -> None:
    channel = RecordingChannel()
    delivery = discarded_delivery(channel, 4 * 1024 * 1024)
    settler = Settler(names=Names(service="svc", ingress="events"))
    publisher = RecordingPublisher()
    settler.publisher = cast(Any, publisher)
    # Even poison that would otherwise be published with its class as a copy.
    poison = Poison(PoisonReason.BODY_TOO_LARGE, "x", error_class="Any", body_discarded=True)

    [settled] = await settler.settle([Outcome(delivery, Rejected(poison))])
    await cast(Acker, delivery.acker).send_all()

    assert settled.kind is OutcomeKind.POISON
    assert publisher.published == []
    assert channel.frames == [("nack", 1)]
