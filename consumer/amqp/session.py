"""Two connections to RabbitMQ, one to consume and one to publish, for as long as both live.

The consume channel carries deliveries and their acks (its prefetch bounds what is in flight); a
sharded queue's shards each have a consume channel of their own, with its own prefetch window
and acks, and each delivery carries the shard it came from (``consumer-shard``) so that its
retry copies come back to it. The publish channel is in confirm mode, for retry and dead-letter
copies. They are separate connections, as RabbitMQ advises: during a memory or disk alarm the
broker blocks every connection that publishes, and the acks of committed events must not wait
behind a blocked retry publish. A :class:`BrokerSession` never reconnects by itself: when a
connection or a channel closes, :attr:`closed` resolves and the service opens a new session.
Delivery tags of the old channel die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage

from consumer.amqp.acker import Acker
from consumer.amqp.connect import BrokerConfig, check_broker_supports, connect, describe_amqp_error
from consumer.amqp.delivery import Delivery
from consumer.amqp.direct_consume import consume_direct
from consumer.amqp.headers import trusted_headers
from consumer.amqp.publisher import Publisher
from consumer.errors import ConnectionLost, TopologyMissing
from topology.apply import missing
from topology.model import Topology

__all__ = ["BrokerSession", "Consumed"]


@dataclass(frozen=True, slots=True)
class Consumed:
    """A queue the session consumes, on a channel of its own."""

    queue: str
    shard: str | None = None
    """A shard's label (``s2``), set as :data:`~topology.names.SHARD` on each of its deliveries'
    headers (:func:`~consumer.amqp.headers.trusted_headers`)."""


class _Consumer:
    """One consume channel: its queue, prefetch window, acks and consumer tag."""

    def __init__(self, consumed: Consumed, channel: AbstractChannel, underlay: Any, acker: Acker):
        self.consumed = consumed
        self.channel = channel
        self.underlay = underlay
        self.acker = acker
        self.tag: str | None = None

    @property
    def is_consuming(self) -> bool:
        # The broker cancels a consumer when its queue is deleted: aiormq then drops the tag.
        return (
            self.tag is not None
            and not self.channel.is_closed
            and self.tag in self.underlay.consumers
        )


class BrokerSession:
    """An open connection, a consume channel and a confirm-mode publish channel."""

    def __init__(
        self,
        config: BrokerConfig,
        topology: Topology,
        work_queues: str | Sequence[Consumed],
        own_exchange: str,
        on_delivery: Callable[[Delivery], None],
        on_lost_acks: Callable[[int], None],
        on_settled_twice: Callable[[], None] = lambda: None,
    ) -> None:
        self._config = config
        self._topology = topology
        self._work_queues = (
            (Consumed(work_queues),) if isinstance(work_queues, str) else tuple(work_queues)
        )
        # Only what comes back from the service's own retry ladder may carry its headers.
        self._own_exchange = own_exchange
        self._on_delivery = on_delivery
        self._on_lost_acks = on_lost_acks
        self._on_settled_twice = on_settled_twice
        self._connection: AbstractConnection | None = None
        self._publish_connection: AbstractConnection | None = None
        self._consumers: list[_Consumer] = []
        self.publisher: Publisher | None = None
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def __aenter__(self) -> BrokerSession:
        self._connection = await connect(self._config, "consume")
        try:
            self._connection.close_callbacks.add(self._closed_callback("consume connection"))
            check_broker_supports(self._connection, self._topology)
            lacking = await missing(self._connection, self._topology)
            if lacking:
                raise TopologyMissing(
                    f"the broker lacks {', '.join(lacking)}: run `consumer topology apply` first"
                )
            for consumed in self._work_queues:
                self._consumers.append(await self._open_consumer(self._connection, consumed))
            self._publish_connection = await connect(self._config, "publish")
            self._publish_connection.close_callbacks.add(
                self._closed_callback("publish connection")
            )
            publish_channel = await self._publish_connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            publish_channel.close_callbacks.add(self._closed_callback("publish channel"))
            self.publisher = await Publisher.on(
                publish_channel, confirm_within=timedelta(seconds=self._config.publish_timeout)
            )
        except RuntimeError as error:
            # aiormq refuses a channel on a connection that closed meanwhile (the broker closing
            # connections while the session starts) with a bare RuntimeError: a lost connection,
            # to reconnect from, not a fault that ends the process (and, in a queue table, every
            # other queue's work with it).
            lost = self._lost()
            await self._close()
            if lost:
                raise ConnectionLost(f"connection closed while starting: {error}") from error
            raise
        except BaseException:
            await self._close()
            raise
        return self

    async def _open_consumer(self, connection: AbstractConnection, consumed: Consumed) -> _Consumer:
        channel = await connection.channel(publisher_confirms=False)
        channel.close_callbacks.add(self._closed_callback(f"consume channel of {consumed.queue}"))
        await channel.set_qos(prefetch_count=self._config.prefetch)
        underlay = await channel.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(self._cancelled_by_broker)
        acker = Acker(
            underlay,
            window=self._config.prefetch,
            on_lost=self._on_lost_acks,
            on_settled_twice=self._on_settled_twice,
        )
        return _Consumer(consumed, channel, underlay, acker)

    def _lost(self) -> bool:
        """A connection of the session's has closed (or the broker closed one we watch)."""
        connections = (self._connection, self._publish_connection)
        return self.closed.done() or any(c is not None and c.is_closed for c in connections)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    def _closed_callback(self, what: str) -> Callable[..., None]:
        def closed(_: object, reason: BaseException | None = None, *__: object) -> None:
            if not self.closed.done():
                detail = describe_amqp_error(reason) if reason is not None else "closed"
                self.closed.set_result(f"{what} closed: {detail}")

        return closed

    def _cancelled_by_broker(self, _: object) -> None:
        # The work queue was deleted (or its leader moved away): start over with a new session,
        # whose topology check says what is missing.
        if not self.closed.done():
            self.closed.set_result("the broker cancelled our consumer")

    async def _close(self) -> None:
        for consumer in self._consumers:
            # Acks for what has committed go out before the channel closes, while the consume
            # channel lives (whichever of the session's parts closed first).
            if consumer.acker.is_open:
                await consumer.acker.send_all()
            consumer.acker.close()
            consumer.tag = None
        connections = (self._connection, self._publish_connection)
        self._connection = self._publish_connection = None
        if not self.closed.done():
            self.closed.set_result("closed by the service")
        for connection in connections:
            if connection is not None and not connection.is_closed:
                with contextlib.suppress(
                    TimeoutError, OSError, aiormq.exceptions.AMQPError, RuntimeError
                ):
                    await asyncio.wait_for(connection.close(), timeout=5)

    @property
    def is_open(self) -> bool:
        return self._connection is not None and not self.closed.done()

    @property
    def unsettled(self) -> int:
        """Deliveries received on the consume channels and not yet acked or nacked."""
        if not self.is_open:
            return 0
        return sum(consumer.acker.unsettled for consumer in self._consumers)

    def _delivering(self, consumer: _Consumer) -> Callable[[DeliveredMessage], None]:
        """What takes each delivery of ``consumer``'s channel as it reads it
        (:mod:`consumer.amqp.direct_consume`)."""
        acker, shard = consumer.acker, consumer.consumed.shard

        def deliver(message: DeliveredMessage) -> None:
            raw = message.header.properties.headers
            trusted = message.exchange == self._own_exchange
            headers = trusted_headers(raw, trusted=trusted, shard=shard)
            delivery = Delivery(message, acker, headers)
            # Called in delivery order: the acker learns every tag in order.
            acker.received(delivery.delivery_tag)
            self._on_delivery(delivery)

        return deliver

    async def start_consuming(self) -> None:
        if not self._consumers:
            raise RuntimeError("the session is not open")
        for consumer in self._consumers:
            if consumer.tag is None:
                consume_ok = await consume_direct(
                    consumer.underlay,
                    consumer.consumed.queue,
                    self._delivering(consumer),
                    max_body_bytes=self._config.max_body_bytes,
                )
                consumer.tag = consume_ok.consumer_tag

    async def stop_consuming(self) -> None:
        """Cancel the consumers: no new deliveries; those already here stay ours to settle."""
        for consumer in self._consumers:
            tag, consumer.tag = consumer.tag, None
            if tag is None or not self.is_open:
                continue
            # If the channel is going away, it takes the consumer with it.
            with contextlib.suppress(
                TimeoutError, aiormq.exceptions.AMQPError, RuntimeError, ConnectionError
            ):
                await consumer.underlay.basic_cancel(tag, timeout=self._config.publish_timeout)

    @property
    def is_consuming(self) -> bool:
        """True only if the broker still has our consumer on every queue the session consumes."""
        if not self._consumers or not self.is_open:
            return False
        return all(consumer.is_consuming for consumer in self._consumers)
