"""Publishing with confirms: each publish is confirmed or raises :class:`PublishFailed`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage, DeliveryMode

from consumer.errors import PublishFailed


def copy_message(
    original: AbstractIncomingMessage,
    *,
    headers: dict[str, Any],
    expiration: timedelta | None = None,
) -> aio_pika.Message:
    """A persistent copy of a delivered message: same body and properties, new headers.

    ``user_id`` is dropped: the broker refuses a publish whose user_id is not the publisher's own.
    The original's expiration is dropped too: a retry copy waits exactly as long as its rung.
    """
    return aio_pika.Message(
        original.body,
        headers=headers,
        content_type=original.content_type,
        content_encoding=original.content_encoding,
        delivery_mode=DeliveryMode.PERSISTENT,
        priority=original.priority,
        correlation_id=original.correlation_id,
        reply_to=original.reply_to,
        expiration=expiration,
        message_id=original.message_id,
        timestamp=original.timestamp,
        type=original.type,
        app_id=original.app_id,
    )


class Publisher:
    """Publishes on a channel in confirm mode; each publish waits for the broker's ack.

    Unroutable messages are returned by the broker (``mandatory``) and count as failed: a message
    nobody would receive is not "published".
    """

    def __init__(self, channel: AbstractChannel, *, timeout: timedelta) -> None:
        self._channel = channel
        self._timeout = timeout.total_seconds()
        self._exchanges: dict[str, AbstractExchange] = {}

    @property
    def is_open(self) -> bool:
        return not self._channel.is_closed

    async def _exchange(self, name: str) -> AbstractExchange:
        exchange = self._exchanges.get(name)
        if exchange is None:
            exchange = await self._channel.get_exchange(name, ensure=False)
            self._exchanges[name] = exchange
        return exchange

    async def publish(self, message: aio_pika.Message, *, exchange: str, routing_key: str) -> None:
        """Publish and wait for the confirm; raise :class:`PublishFailed` otherwise."""
        try:
            target = await self._exchange(exchange)
            await target.publish(message, routing_key, mandatory=True, timeout=self._timeout)
        except aiormq.exceptions.PublishError as error:
            raise PublishFailed(f"{exchange!r} could not route {routing_key!r}") from error
        except aiormq.exceptions.DeliveryError as error:
            raise PublishFailed(f"the broker refused the message for {exchange!r}") from error
        except TimeoutError as error:
            raise PublishFailed(f"no confirm from the broker within {self._timeout:g}s") from error
        except (aiormq.exceptions.AMQPError, RuntimeError, ConnectionError) as error:
            raise PublishFailed(f"publishing channel failed: {type(error).__name__}") from error
