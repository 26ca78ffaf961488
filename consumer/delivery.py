"""One message as the broker delivered it to this process, on one channel."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiormq
from aio_pika.abc import AbstractIncomingMessage


class ChannelGone(Exception):
    """The channel a delivery came on is closed: its tag means nothing any more.

    The broker has already put the message back in the queue; acking it on another channel would
    ack a different message, so the service never tries.
    """


@dataclass(slots=True)
class Delivery:
    """A delivered message plus what the service learns about it on the way."""

    message: AbstractIncomingMessage
    received_at: float = field(default_factory=time.monotonic)

    @property
    def body(self) -> bytes:
        return self.message.body

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.message.headers or {})

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
    def message_id(self) -> str | None:
        return self.message.message_id

    @property
    def channel_open(self) -> bool:
        channel = self.message.channel
        return not channel.is_closed

    async def ack(self) -> None:
        await self._settle(self.message.ack)

    async def nack(self, *, requeue: bool) -> None:
        """Reject this one message; never ``multiple=True``, which takes innocent ones along."""
        await self._settle(self.message.nack, requeue=requeue)

    async def _settle(self, method: Any, **kwargs: Any) -> None:
        if not self.channel_open:
            raise ChannelGone(
                f"delivery tag {self.message.delivery_tag} belongs to a closed channel"
            )
        try:
            await method(**kwargs)
        except (aiormq.exceptions.AMQPError, RuntimeError, ConnectionError) as error:
            raise ChannelGone(str(error)) from error
