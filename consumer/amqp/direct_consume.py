"""Deliveries handed to the consumer as they are read, without a task for each.

aiormq's channel starts a task for every delivery to run the consumer's callback in, tracked by two
future stores with a done-callback each: about a tenth of the service's CPU at full rate, for a
callback that only files the delivery with a worker (:mod:`consumer.service.dispatch`).
:class:`DirectDeliveryChannel` calls such a callback straight from the channel's reader, in
delivery order, for the consumers registered through :func:`consume_direct`; every other consumer
and every other frame go aiormq's way. :func:`install` makes aiormq build its channels from this
class (:mod:`consumer.amqp.fast_paths`).

A direct consumer may have a body limit: a delivery whose content header declares a larger body
has its body frames read and dropped as they arrive, never kept, and is handed over as a
:class:`BodyDiscarded` with an empty body. The broker allows bodies up to its
``max_message_size`` (128 MiB by default on RabbitMQ 3.x): without this, every body of the
prefetch window would be held whole before anything could look at its size. What reading a
discarded body holds at a time is a frame (``frame_max``, 128 KiB) and the channel's frame queue
(aiormq's, ten frames).

The callback should not raise. If it does (a bug), the channel is closed at once, so every
delivery in hand goes back to the queue and the service opens a new session: closed from a task,
with the reader still alive to read the broker's reply (an exception ending the reader would leave
the close waiting ten seconds for a reply nobody reads, while workers went on acking on a channel
the broker had closed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import aiormq.connection
from aiormq.abc import DeliveredMessage
from pamqp import commands
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

__all__ = ["BodyDiscarded", "DirectDeliveryChannel", "consume_direct", "install", "uninstall"]

DirectCallback = Callable[[DeliveredMessage], None]


@dataclasses.dataclass(frozen=True)
class BodyDiscarded(DeliveredMessage):
    """A delivery whose body was over the consumer's limit: read off the wire and dropped.
    ``body`` is empty; the content header's ``body_size`` says what it was."""


@dataclasses.dataclass(frozen=True, slots=True)
class _DirectConsumer:
    callback: DirectCallback
    max_body_bytes: int | None


_log = logging.getLogger(__name__)


class DirectDeliveryChannel(aiormq.Channel):
    """aiormq's channel, calling a direct consumer's callback in its reader (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct_consumers: dict[str, _DirectConsumer] = {}
        self._closing_for: asyncio.Task[None] | None = None

    async def _on_deliver_frame(self, frame: commands.Basic.Deliver) -> None:
        tag = frame.consumer_tag
        consumer = self.direct_consumers.get(tag) if tag is not None else None
        if consumer is None or tag not in self.consumers:
            # Not ours, or cancelled since: aiormq's own way (which drops it if cancelled).
            await super()._on_deliver_frame(frame)
            return
        header = await self._get_frame()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"Unexpected frame {header!r} instead of ContentHeader", header)
        limit = consumer.max_body_bytes
        message: DeliveredMessage
        if limit is not None and header.body_size > limit:
            await self._read_body(header.body_size, keep=False)
            message = BodyDiscarded(delivery=frame, header=header, body=b"", channel=self)
        else:
            body = await self._read_body(header.body_size, keep=True)
            message = DeliveredMessage(delivery=frame, header=header, body=body, channel=self)
        try:
            consumer.callback(message)
        except Exception as error:
            # The module docstring: closed from a task, the reader reads the reply.
            if self._closing_for is None:
                _log.error("delivery callback failed; closing the channel", exc_info=error)
                self._closing_for = asyncio.get_running_loop().create_task(self.close(error))

    async def _read_body(self, size: int, *, keep: bool) -> bytes:
        """The body frames of ``size`` bytes, joined; or, not ``keep``, each dropped as it is
        read and ``b""``."""
        parts: list[bytes] = []
        read = 0
        while read < size:
            content = await self._get_frame()
            if not isinstance(content, ContentBody):
                raise ValueError(f"Unexpected frame {content!r}", content)
            read += len(content.value)
            if keep:
                parts.append(content.value)
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)


async def consume_direct(
    channel: Any, queue: str, callback: DirectCallback, *, max_body_bytes: int | None = None
) -> commands.Basic.ConsumeOk:
    """Consume ``queue`` on ``channel`` (an aiormq channel), ``callback`` called with each
    delivery: straight from the reader on a :class:`DirectDeliveryChannel`, in a task of its own
    (aiormq's way) on any other. On a :class:`DirectDeliveryChannel`, a body larger than
    ``max_body_bytes`` is dropped unread (:class:`BodyDiscarded`); aiormq's way keeps every
    body whole."""
    if isinstance(channel, DirectDeliveryChannel):
        # Our own tag, registered before the broker can deliver anything to it.
        tag = f"direct.{uuid4().hex}"
        channel.direct_consumers[tag] = _DirectConsumer(callback, max_body_bytes)
        try:
            return await channel.basic_consume(
                queue, _in_a_task(callback), no_ack=False, consumer_tag=tag
            )
        except BaseException:
            channel.direct_consumers.pop(tag, None)
            raise
    consume_ok: commands.Basic.ConsumeOk = await channel.basic_consume(
        queue, _in_a_task(callback), no_ack=False
    )
    return consume_ok


def _in_a_task(callback: DirectCallback) -> Callable[[DeliveredMessage], Any]:
    async def deliver(message: DeliveredMessage) -> None:
        callback(message)

    return deliver


def install() -> None:
    """Build every aiormq channel opened after this from :class:`DirectDeliveryChannel` (aiormq
    builds them by this module-level name). Through :func:`consumer.amqp.fast_paths.install`,
    which checks aiormq first."""
    aiormq.connection.Channel = DirectDeliveryChannel  # type: ignore[attr-defined]


def uninstall() -> None:
    """aiormq's own channel again, for the channels opened after this."""
    aiormq.connection.Channel = DirectDeliveryChannel.__mro__[1]  # type: ignore[attr-defined,assignment]
