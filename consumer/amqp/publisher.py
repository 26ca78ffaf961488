"""Publishing with confirms: each publish is confirmed or raises :class:`PublishFailed`."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Protocol

from aio_pika.abc import AbstractChannel
from pamqp.commands import Basic

from consumer.amqp.publishing import (
    OnePerMessageId,
    acked,
    connection_blocked,
)
from topology.durations import to_milliseconds

__all__ = ["PERSISTENT", "Publisher", "Publishes", "copy_properties"]

PERSISTENT = 2


def copy_properties(
    original: Basic.Properties,
    *,
    headers: dict[str, Any],
    expiration: timedelta | None = None,
) -> Basic.Properties:
    """The original's properties with new headers, made persistent.

    ``user_id`` is dropped: the broker refuses a publish whose user_id is not the publisher's own.
    The original's expiration is dropped too: a retry copy waits exactly as long as its rung.
    """
    return Basic.Properties(
        content_type=original.content_type,
        content_encoding=original.content_encoding,
        headers=headers,
        delivery_mode=PERSISTENT,
        priority=original.priority,
        correlation_id=original.correlation_id,
        reply_to=original.reply_to,
        expiration=str(to_milliseconds(expiration)) if expiration is not None else None,
        message_id=original.message_id,
        timestamp=original.timestamp,
        message_type=original.message_type,
        app_id=original.app_id,
    )


class Publishes(Protocol):
    """What the settler needs to publish a retry or dead-letter copy: a confirmed publish.
    :class:`Publisher` in the service; an in-memory stand-in in :mod:`consumer.testing`."""

    async def publish(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> None: ...


class Publisher:
    """Publishes on a channel in confirm mode; each publish waits for the broker's ack.

    Unroutable messages are returned by the broker (``mandatory``) and count as failed: a message
    nobody would receive is not "published". A confirm late because the broker has blocked the
    connection (a memory or disk alarm) is waited for, not given up: the copy is on its way and
    would land after a timeout anyway, beside the original it was meant to replace.
    """

    def __init__(self, channel: Any, *, timeout: timedelta) -> None:
        self._channel = channel
        self._timeout = timeout.total_seconds()
        self._one_per_message_id = OnePerMessageId()

    @classmethod
    async def on(
        cls,
        channel: AbstractChannel,
        *,
        confirm_within: timedelta,
    ) -> Publisher:
        """A publisher on an aio-pika channel opened with ``publisher_confirms=True``."""
        return cls(await channel.get_underlay_channel(), timeout=confirm_within)

    @property
    def is_open(self) -> bool:
        return not self._channel.is_closed

    async def publish(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> None:
        """Publish and wait for the confirm; raise :class:`PublishFailed` otherwise. A span
        around it is the caller's (:func:`consumer.pipeline.tracing.publish_span`)."""
        message_id = await self._one_per_message_id.turn(properties)
        await self._publish(
            body, properties, message_id, exchange=exchange, routing_key=routing_key
        )

    async def _publish(
        self,
        body: bytes,
        properties: Basic.Properties,
        message_id: str,
        *,
        exchange: str,
        routing_key: str,
    ) -> None:
        sending = asyncio.ensure_future(
            self._channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=True,
            )
        )
        self._one_per_message_id.taken(message_id, sending)
        try:
            await acked(
                self._confirmed(sending),
                waited_s=self._timeout,
                exchange=exchange,
                routing_key=routing_key,
            )
        finally:
            if not sending.done():
                sending.cancel()

    async def _confirmed(self, sending: asyncio.Future[Any]) -> Any:
        """The confirm, waited for ``timeout`` at a time for as long as the broker blocks the
        connection."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(sending), self._timeout)
            except TimeoutError:
                if not await connection_blocked(self._channel.connection):
                    raise
            await self._until_unblocked()

    async def _until_unblocked(self) -> None:
        """Until the broker unblocks the connection; a connection that closes meanwhile is never
        unblocked (its own frame would say so), and fails the publish."""
        ready = asyncio.ensure_future(self._channel.connection.ready())
        closing = self._channel.closing
        try:
            await asyncio.wait({ready, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            closing.cancel()
        if closing.done() and not ready.done():
            raise ConnectionError("the connection closed while the broker blocked it")
