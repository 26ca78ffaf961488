"""Publishing replayed dead letters: the publishes queued meanwhile written together, each
confirm tracked by aiormq.

:class:`consumer.amqp.publisher.Publisher` (the service's retries and dead letters) starts a task
per publish and waits for its confirm a timeout at a time, to tell a slow broker from a blocked one.
A replay publishes thousands a second with a window of them in flight, and per publish that
wrapping, aiormq's own (a lock, a timeout, a queued frame) and one socket write were most of its
CPU. Here the publishes asked for until the loop comes round are marshalled into one write, under
the channel's lock, each with its delivery tag and confirmation future registered in the
channel's own tables exactly as ``basic_publish`` does: aiormq settles them (ack, nack, return,
channel closed), we never read a confirm frame ourselves.

A write's publishes share one deadline, not a timer each: those unconfirmed ``confirm_within``
after their write fail (their letters stay), unless the broker has blocked the connection (a
memory or disk alarm), which the service's publisher waits out too: then they get another
``confirm_within``. A connection that closes rejects every confirmation in flight at once.
A publish waits while another of its message id is in flight (:class:`OnePerMessageId`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aiormq.abc import ChannelFrame
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from consumer.amqp.publishing import OnePerMessageId, acked, connection_blocked
from consumer.pipeline.tracing import Tracing, publish_span

__all__ = ["ReplaySender"]

# What of aiormq's channel the sender uses, none of it public: an aiormq without one of them
# (the pin allows any 7.x) is refused at once, rather than each write failing or, in its
# rollback, leaving its letters unsettled and the replay hung.
_CHANNEL_PARTS = (
    "confirmations",
    "create_future",
    "delivery_tag",
    "lock",
    "message_id_delivery_tag",
    "number",
    "_split_body",
    "write_queue",
)


@dataclass(frozen=True, slots=True)
class _Outgoing:
    frames: list[Any]
    confirmation: asyncio.Future[Any]
    message_id: str


class ReplaySender:
    """Publishes with ``mandatory`` on an aiormq channel of its own in confirm mode, opened with
    ``on_return_raises`` (a returned letter must fail, not count as confirmed); :meth:`send`
    returns once the broker confirmed, else raises."""

    def __init__(
        self, channel: Any, *, confirm_within: timedelta, tracing: Tracing | None = None
    ) -> None:
        missing = [part for part in _CHANNEL_PARTS if not hasattr(channel, part)]
        if missing:
            raise TypeError(f"not an aiormq channel the replay can publish on: no {missing}")
        if not getattr(channel, "publisher_confirms", True):
            raise TypeError("the replay publishes on a channel in confirm mode")
        self._channel = channel
        self._timeout = confirm_within.total_seconds()
        self._tracing = tracing or Tracing()
        self._outgoing: list[_Outgoing] = []
        self._writing: asyncio.Task[None] | None = None
        self._expiring: set[asyncio.Task[None]] = set()
        self._one_per_message_id = OnePerMessageId()

    @property
    def is_open(self) -> bool:
        return not self._channel.is_closed

    async def send(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> None:
        """Publish and wait for the confirm; raise :class:`Unroutable` or
        :class:`PublishFailed` otherwise."""
        with publish_span(self._tracing, properties, exchange=exchange, routing_key=routing_key):
            await acked(
                self._sent(body, properties, exchange=exchange, routing_key=routing_key),
                waited_s=self._timeout,
                exchange=exchange,
                routing_key=routing_key,
            )

    async def _sent(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> Any:
        """The confirm of the publish, once no other of its message id is in flight."""
        await self._one_per_message_id.turn(properties)
        return await self._queued(body, properties, exchange=exchange, routing_key=routing_key)

    def _queued(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> asyncio.Future[Any]:
        """The publish's confirmation; its frames go with the next write."""
        channel = self._channel
        assert properties.message_id is not None
        frames: list[Any] = [
            Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True),
            ContentHeader(properties=properties, body_size=len(body)),
            *channel._split_body(body),
        ]
        # A channel's future: rejected when the channel closes, at once if closed already.
        confirmation: asyncio.Future[Any] = channel.create_future()
        self._one_per_message_id.taken(properties.message_id, confirmation)
        self._outgoing.append(_Outgoing(frames, confirmation, properties.message_id))
        if self._writing is None:
            self._writing = asyncio.create_task(self._write())
        return confirmation

    async def _write(self) -> None:
        """The publishes queued so far, in one write; their tags in the order written."""
        channel = self._channel
        registered: list[tuple[int, _Outgoing]] = []
        batch: list[_Outgoing] | None = None
        try:
            async with channel.lock:
                # Those queued from here on go with the next write, which waits for this lock.
                batch, self._outgoing, self._writing = self._outgoing, [], None
                frames: list[Any] = []
                for outgoing in batch:
                    if outgoing.confirmation.done():
                        continue  # rejected already: the channel closed
                    channel.delivery_tag += 1
                    tag = channel.delivery_tag
                    channel.confirmations[tag] = outgoing.confirmation
                    channel.message_id_delivery_tag[outgoing.message_id] = tag
                    registered.append((tag, outgoing))
                    frames += outgoing.frames
                if frames:
                    await channel.write_queue.put(ChannelFrame.marshall(channel.number, frames))
        except BaseException as error:
            # Not written: the broker never saw these publishes, so their tags are free again
            # and their letters fail (and stay); as aiormq's own basic_publish rolls back.
            if batch is None:  # the lock was never taken (the channel closed)
                batch, self._outgoing, self._writing = self._outgoing, [], None
            for tag, outgoing in registered:
                channel.confirmations.pop(tag, None)
                if channel.message_id_delivery_tag.get(outgoing.message_id) == tag:
                    channel.message_id_delivery_tag.pop(outgoing.message_id)
            channel.delivery_tag -= len(registered)
            for outgoing in batch:
                if not outgoing.confirmation.done():
                    outgoing.confirmation.set_exception(
                        ConnectionError(f"the publish was not written: {error!r}")
                    )
            if not isinstance(error, Exception):
                raise
            return
        for tag, outgoing in registered:
            outgoing.confirmation.add_done_callback(_forgetting(channel, outgoing.message_id, tag))
        self._watch([outgoing.confirmation for _, outgoing in registered])

    def _watch(self, written: list[asyncio.Future[Any]]) -> None:
        asyncio.get_running_loop().call_later(self._timeout, self._overdue, written)

    def _overdue(self, written: list[asyncio.Future[Any]]) -> None:
        late = [confirmation for confirmation in written if not confirmation.done()]
        if late:
            expiring = asyncio.create_task(self._expire(late))
            self._expiring.add(expiring)
            expiring.add_done_callback(self._expiring.discard)

    async def _expire(self, late: list[asyncio.Future[Any]]) -> None:
        if await connection_blocked(self._channel.connection):
            self._watch(late)
            return
        for confirmation in late:
            if not confirmation.done():
                # Left in aiormq's table: a confirm that comes after all is ignored there (with
                # a warning), as it is for the service's publisher.
                confirmation.set_exception(TimeoutError())


def _forgetting(channel: Any, message_id: str, tag: int) -> Any:
    """Once settled, the message id no longer names this publish (aiormq does the same)."""

    def forget(_: asyncio.Future[Any]) -> None:
        if channel.message_id_delivery_tag.get(message_id) == tag:
            channel.message_id_delivery_tag.pop(message_id)

    return forget
