"""The broker's part, in memory: deliveries made from messages as the consume channel makes them,
and a channel that records the acks, the nacks and the copies the settler publishes.

No AMQP is spoken: the harness's deliveries go through the service's own pipeline and settler
(:mod:`consumer.service.settle`), and this channel stands where the consume channel's acker and
the publish channel's publisher stand (:class:`~consumer.amqp.delivery.Settles`,
:class:`~consumer.amqp.publisher.Publishes`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from consumer.amqp.delivery import Delivery
from consumer.amqp.headers import trusted_headers
from consumer.amqp.publisher import PERSISTENT

__all__ = ["MemoryChannel", "Published"]


@dataclass(frozen=True, slots=True)
class Published:
    """A copy the settler published: a retry to the ladder or a dead letter."""

    body: bytes
    properties: Basic.Properties
    exchange: str
    routing_key: str

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})


class MemoryChannel:
    """Settles the harness's deliveries and takes the settler's copies, confirming each at once."""

    def __init__(self, *, consumer_tag: str = "consumer-testing") -> None:
        self._tags = itertools.count(1)
        self._consumer_tag = consumer_tag
        self.acked: list[int] = []
        self.nacked: list[tuple[int, bool]] = []
        self.published: list[Published] = []

    @property
    def is_open(self) -> bool:
        return True

    def ack(self, tag: int) -> None:
        self.acked.append(tag)

    async def nack(self, tag: int, *, requeue: bool) -> None:
        self.nacked.append((tag, requeue))

    async def publish(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> None:
        self.published.append(Published(body, properties, exchange, routing_key))

    def delivery(
        self,
        body: bytes,
        *,
        routing_key: str,
        exchange: str,
        headers: dict[str, Any] | None = None,
        content_type: str | None = "application/json",
        message_id: str | None = None,
        trusted: bool = False,
    ) -> Delivery:
        """A delivery as the consume channel hands it over (:mod:`consumer.amqp.session`): the
        ``consumer-*`` headers kept only if ``trusted`` (it came back from the service's own
        ladder)."""
        properties = Basic.Properties(
            content_type=content_type,
            delivery_mode=PERSISTENT,
            headers=headers or None,
            message_id=message_id,
        )
        deliver = Basic.Deliver(
            consumer_tag=self._consumer_tag,
            delivery_tag=next(self._tags),
            redelivered=False,
            exchange=exchange,
            routing_key=routing_key,
        )
        message = DeliveredMessage(
            delivery=deliver,
            header=ContentHeader(body_size=len(body), properties=properties),
            body=body,
            channel=None,  # type: ignore[arg-type]  # nothing here talks to a channel
        )
        return Delivery(message, self, trusted_headers(headers, trusted=trusted))
