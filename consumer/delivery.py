"""One message as the broker delivered it to this process, on one channel."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from consumer.acker import Acker
from consumer.direct_consume import BodyDiscarded
from consumer.envelope import Envelope
from consumer.errors import ChannelGone, Poison
from consumer.registry import Handler

__all__ = ["ChannelGone", "Delivery", "Prepared", "Ready"]


@dataclass(slots=True)
class Delivery:
    """A delivered message and the :class:`Acker` of the channel it came on.

    ``headers`` are the message's headers as the service may trust them: ``consumer-*`` headers
    only from the service's own retry ladder (:func:`consumer.headers.trusted_headers`).
    """

    message: DeliveredMessage
    acker: Acker
    headers: dict[str, Any] = field(default_factory=dict)
    received_at: float = field(default_factory=time.monotonic)
    prepared: Prepared | Poison | None = None
    """What :class:`~consumer.prepare.Preparer` made of the body, kept so that it is parsed
    once (a large body's is dropped while it waits: :mod:`consumer.memory`)."""
    alone: bool = False
    """Apply it alone, with nothing else in flight: it came back after its database connection
    broke (see :mod:`consumer.crashes`; redelivered ones are applied alone too)."""
    connection_losses: int = 0
    """Times its database connection broke while it was applied alone, in a row."""
    span: Any = None
    """Its processing span while a worker has it, when tracing is on (:mod:`consumer.tracing`)."""

    @property
    def body(self) -> bytes:
        return self.message.body

    @property
    def body_discarded(self) -> bool:
        """Its body was over the limit and dropped as it arrived, unread: :attr:`body` is empty
        (:mod:`consumer.direct_consume`); :attr:`body_size` says how large it was."""
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
    def isolated(self) -> bool:
        """Whether it must be applied alone: it came back after a death or a broken connection."""
        return self.alone or self.redelivered

    @property
    def delivery_tag(self) -> int:
        tag = self.message.delivery_tag
        assert tag is not None
        return tag

    @property
    def channel_open(self) -> bool:
        return self.acker.is_open

    def ack(self) -> None:
        """Ack after the commit; sent with the channel's next flush (see :mod:`consumer.acker`)."""
        self.acker.ack(self.delivery_tag)

    async def nack(self, *, requeue: bool) -> None:
        """Reject this one message; never ``multiple=True``, which takes innocent ones along."""
        await self.acker.nack(self.delivery_tag, requeue=requeue)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A delivery's event, validated by its handler's payload model, and that handler."""

    handler: Handler
    event: Envelope[Any]

    def key(self) -> Hashable | None:
        """What the handler locks (its ``key``), None without one or when the function fails:
        a failing key function only costs the routing; the handler still meets the event."""
        key = self.handler.key
        if key is None:
            return None
        try:
            value = key(self.event.payload)
            hash(value)  # routed by its hash: an unhashable key (a list) fails here, not there
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            return None
        return value


@dataclass(slots=True)
class Ready:
    """A prepared delivery on its way through a transaction, and the time its handler took."""

    delivery: Delivery
    handler: Handler
    event: Envelope[Any]
    handler_seconds: float | None = None
