"""A queue read from its head with bounded memory, every message held until taken or given back.

AMQP 0-9-1 has no browse: a message read stays in the queue only while it is held unacked, and a
message given back (``nack(requeue)``) goes to the head of a quorum queue, to be read again at
once. So a scan holds everything it reads until it ends, then gives back what it did not take,
in reading order: the queue keeps its order.

Holding is cheap for the client: the caller drops each body once read, and only the broker keeps
the messages. What bounds the client's memory is the consumer's prefetch window: the broker sends
at most ``window`` unsettled messages to one consumer. When a consumer's window is full of held
messages, it is cancelled (its deliveries stay held: ``basic.cancel`` returns nothing) and a new
one is started, with a new window (QoS is per consumer). So at most one window of bodies is ever
in the client, whatever the queue's length.

Each message given back counts as a delivery (its ``x-delivery-count`` rises): the dead-letter
queue's delivery limit is set out of reach (topology/plan.py); other queues are scanned only a
bounded number of messages at a time (``consumer events show``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from pamqp.commands import Basic

__all__ = ["DEFAULT_WINDOW", "Delivered", "Held", "QueueScan"]

DEFAULT_WINDOW = 500
# How long a scan waits for the next message before asking the broker whether any are left: the
# queue may have shrunk under it (another operator, a purge), and nothing more would come.
_IDLE_CHECK = 1.0


@dataclass(frozen=True, slots=True)
class Delivered:
    """A delivery's body, properties and routing key: all a dead letter is read from. Lighter
    than aio-pika's message, which copies every property into attributes of its own."""

    body: bytes
    properties: Basic.Properties
    routing_key: str | None

    @property
    def headers(self) -> dict[str, Any] | None:
        return self.properties.headers

    @property
    def content_type(self) -> str | None:
        return self.properties.content_type

    @property
    def content_encoding(self) -> str | None:
        return self.properties.content_encoding

    @property
    def message_id(self) -> str | None:
        return self.properties.message_id


@dataclass(frozen=True, slots=True)
class Held:
    """One message read and held unacked; ``take`` removes it from the queue."""

    message: Delivered
    tag: int
    consumer: int


class QueueScan:
    """One pass over the messages a queue held when the scan began (up to a limit).

    An async context manager: on exit every message read and not taken is given back, in reading
    order, and the channel is closed. If the process dies instead, the broker gives them back.
    """

    def __init__(
        self, connection: AbstractConnection, *, queue: str, window: int = DEFAULT_WINDOW
    ) -> None:
        if window < 1:
            raise ValueError("a scan's window holds at least one message")
        self._connection = connection
        self._queue = queue
        self._window = window
        self._channel: AbstractChannel | None = None
        self._raw: Any = None
        self._arrived: asyncio.Queue[aiormq.abc.DeliveredMessage] = asyncio.Queue()
        self._consumer_tag: str | None = None
        self._consumers = 0
        self._unsettled: dict[int, int] = {}
        self._returned_up_to = 0
        self._last_tag = 0
        self.present = 0
        """How many messages were ready in the queue when the scan began."""

    async def __aenter__(self) -> QueueScan:
        self._channel = await self._connection.channel(publisher_confirms=False)
        self._raw = await self._channel.get_underlay_channel()
        declared = await self._raw.queue_declare(self._queue, passive=True)
        # What is there now is what a scan sees: letters that keep arriving while it reads (a
        # crash loop dead-lettering away) must not keep it reading, and holding, for ever.
        self.present = int(declared.message_count or 0)
        await self._raw.basic_qos(prefetch_count=self._window)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        channel, self._channel = self._channel, None
        if channel is None or channel.is_closed:
            return
        with contextlib.suppress(aiormq.exceptions.AMQPError, ConnectionError, RuntimeError):
            await asyncio.shield(self._give_back())
        with contextlib.suppress(aiormq.exceptions.AMQPError, ConnectionError, RuntimeError):
            await channel.close()

    async def _give_back(self) -> None:
        # One multiple nack returns every unsettled message up to the last one read, in tag order,
        # which is reading order: the taken ones are acked already and untouched by it. (The
        # service never nacks with multiple: there the held messages are other events'; here
        # every one of them is this scan's to give back.)
        if self._consumer_tag is not None:
            await self._raw.basic_cancel(self._consumer_tag)
            self._consumer_tag = None
        # Deliveries that arrived after the last one read (a freed window slot refilled) are
        # held too: give back everything up to the newest tag.
        while not self._arrived.empty():
            self._last_tag = max(self._last_tag, self._arrived.get_nowait().delivery_tag or 0)
        if self._last_tag > self._returned_up_to:
            await self._raw.basic_nack(self._last_tag, multiple=True, requeue=True)
            self._returned_up_to = self._last_tag

    async def messages(self, limit: int | None = None) -> AsyncIterator[Held]:
        """The messages the queue held when the scan began (at most ``limit``), in queue order,
        each held until :meth:`take` or the scan's end."""
        bound = self.present if limit is None else min(limit, self.present)
        read = 0
        while read < bound:
            if self._consumer_tag is None or self._unsettled[self._consumers] >= self._window:
                await self._next_consumer()
            delivered = await self._next()
            if delivered is None:
                return
            read += 1
            tag = int(delivered.delivery_tag or 0)
            self._last_tag = max(self._last_tag, tag)
            self._unsettled[self._consumers] += 1
            message = Delivered(delivered.body, delivered.header.properties, delivered.routing_key)
            yield Held(message, tag, self._consumers)

    async def purge_ready(self) -> int:
        """Delete every message ready in the queue (none this scan holds); returns how many."""
        result = await self._raw.queue_purge(self._queue)
        return int(result.message_count or 0)

    async def take(self, held: Held) -> None:
        """Remove a held message from the queue (ack it)."""
        await self._raw.basic_ack(held.tag)
        self._unsettled[held.consumer] -= 1

    async def _next_consumer(self) -> None:
        # The full consumer has received exactly its window and settled none of it: nothing of
        # it is in flight, and cancelling it returns nothing.
        if self._consumer_tag is not None:
            await self._raw.basic_cancel(self._consumer_tag)
        self._consumers += 1
        self._unsettled[self._consumers] = 0
        consumed = await self._raw.basic_consume(self._queue, self._arrive, no_ack=False)
        self._consumer_tag = consumed.consumer_tag

    async def _arrive(self, message: aiormq.abc.DeliveredMessage) -> None:
        self._arrived.put_nowait(message)

    async def _next(self) -> aiormq.abc.DeliveredMessage | None:
        """The next delivery; ``None`` once the queue has nothing ready left to send."""
        while True:
            if not self._arrived.empty():  # the common case, without a timer
                return self._arrived.get_nowait()
            try:
                return await asyncio.wait_for(self._arrived.get(), _IDLE_CHECK)
            except TimeoutError:
                pass
            if self._raw.is_closed:
                raise ConnectionError(f"the channel reading {self._queue} closed")
            declared = await self._raw.queue_declare(self._queue, passive=True)
            if not declared.message_count and self._arrived.empty():
                return None
