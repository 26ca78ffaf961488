"""One message as the broker delivered it to this process, on one channel."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from consumer.amqp.direct_consume import BodyDiscarded
from consumer.errors import ChannelGone

__all__ = ["ChannelGone", "Delivery", "Settles"]


class Settles(Protocol):
    """What a delivery needs of the channel it came on: to ack or nack its tag. The consume
    channel's :class:`~consumer.amqp.acker.Acker` in the service; an in-memory stand-in in
    :mod:`consumer.testing`, which runs the same pipeline and settler with no broker."""

    @property
    def is_open(self) -> bool: ...

    def ack(self, tag: int) -> None: ...

    async def nack(self, tag: int, *, requeue: bool) -> None: ...


@dataclass(slots=True, eq=False, weakref_slot=True)
class Delivery:
    """A delivered message and what settles it on the channel it came on (:class:`Settles`,
    the channel's :class:`~consumer.amqp.acker.Acker`): what the broker said, nothing the
    service made of it. What the service learns of a delivery is kept by whom
    it concerns, keyed by the delivery itself (compared by identity): its parse by the
    :class:`~consumer.pipeline.prepare.Preparer`, its span by the tracer, whether it goes the
    isolated way next by the :class:`~consumer.service.dispatch.Dispatcher`.

    ``headers`` are the message's headers as the service may trust them: ``consumer-*`` headers
    only from the service's own retry ladder (:func:`consumer.amqp.headers.trusted_headers`).
    """

    message: DeliveredMessage
    acker: Settles
    headers: dict[str, Any] = field(default_factory=dict)
    received_at: float = field(default_factory=time.monotonic)

    @property
    def body(self) -> bytes:
        return self.message.body

    @property
    def body_discarded(self) -> bool:
        """Its body was over the limit and dropped as it arrived, unread: :attr:`body` is empty
        (:mod:`consumer.amqp.direct_consume`); :attr:`body_size` says how large it was."""
        return isinstance(self.message, BodyDiscarded)

    @property
    def body_size(self) -> int:
        """The body's size as its content header declares it (kept or not)."""
        return int(self.message.header.body_size or 0)

    @property
    def properties(self) -> Basic.Properties:
        return self.message.header.properties

    @property
    def content_type(self) -> str | None:
        return self.message.header.properties.content_type

    @property
    def content_encoding(self) -> str | None:
        return self.message.header.properties.content_encoding

    @property
    def message_id(self) -> str | None:
        return self.message.header.properties.message_id

    @property
    def routing_key(self) -> str:
        return self.message.routing_key or ""

    @property
    def exchange(self) -> str:
        return self.message.exchange or ""

    @property
    def redelivered(self) -> bool:
        return bool(self.message.redelivered)

    @property
    def delivery_tag(self) -> int:
        tag = self.message.delivery_tag
        assert tag is not None
        return tag

    @property
    def channel_open(self) -> bool:
        return self.acker.is_open

    def ack(self) -> None:
        """Ack after the commit; sent with the channel's next flush (see
        :mod:`consumer.amqp.acker`)."""
        self.acker.ack(self.delivery_tag)

    async def nack(self, *, requeue: bool) -> None:
        """Reject this one message; never ``multiple=True``, which takes innocent ones along."""
        await self.acker.nack(self.delivery_tag, requeue=requeue)
