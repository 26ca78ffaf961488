"""The harness on the real broker: the same calls as in process, a real service consuming.

On entry it declares a topology of the test's own (every name under the harness's
``CONSUMER_NAME``, the ingress exchange ``<name>.events`` included), starts the service in this
process (:func:`consumer.service.app.build_service`, as ``consumer run`` does) and waits until it
consumes; on exit it stops the service gracefully and deletes every queue and exchange it
declared. A test's messages are published to the ingress exchange, confirmed; each outcome is
read off the line the service logs when it settles the delivery.

The retry ladder has as many rungs as the settings give, each an hour long (``1h``, ``3601s``...):
a copy never comes back by itself in the middle of a test. :meth:`BrokerHarness.redeliver` takes
the copies off their rung queues and dead-letters them to the work queue as the broker does when
a rung's delay runs out (through the redeliver exchange, routing key and headers kept), so a test
says when they come back, in either mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from datetime import timedelta
from types import TracebackType
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.exceptions import DeliveryError

from consumer.amqp.connect import connect
from consumer.amqp.publisher import PERSISTENT
from consumer.config.settings import Settings
from consumer.logs import make_logger
from consumer.observe.metrics import Metrics, ServiceRegistry
from consumer.pipeline.calls import HandlerCalls
from consumer.registry import HandlerRegistry
from consumer.service.app import build_service
from consumer.service.components import broker_config, names_for, topology_for
from consumer.service.supervisor import Service
from consumer.testing.harness import SETTLE_WITHIN, prepare_receipts, unroutable
from consumer.testing.messages import Message
from consumer.testing.outcomes import EventOutcome, Kind
from consumer.testing.tracking import HarnessError, OutcomeTracker
from topology.apply import apply_topology
from topology.names import rung_label

__all__ = ["BrokerHarness", "held_ladder"]

READY_WITHIN = 60.0
"""Seconds the service may take to consume after it starts (a hang guard)."""


def held_ladder(settings: Settings) -> tuple[timedelta, ...]:
    """As many rungs as ``settings`` give, each about an hour: copies wait for
    :meth:`BrokerHarness.redeliver`."""
    return tuple(timedelta(hours=1, seconds=index) for index in range(len(settings.retry_delays)))


class BrokerHarness:
    """The harness of :mod:`consumer.testing.harness`, on RabbitMQ: see the module docstring."""

    mode = "broker"

    def __init__(self, settings: Settings, registry: HandlerRegistry) -> None:
        self.settings = settings.model_copy(update={"retry_delays": held_ladder(settings)})
        self.registry = registry
        self._names = names_for(self.settings)
        self._topology = topology_for(self.settings, registry)
        self._ids = itertools.count(1)
        self._run = uuid.uuid4().hex[:8]
        self._tracker = OutcomeTracker()
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._stop = asyncio.Event()
        self._service_task: asyncio.Task[None] | None = None
        self._service: Service | None = None
        self._ladder = 0

    @property
    def database_url(self) -> str:
        return self.settings.database_url.get_secret_value()

    @property
    def lines(self) -> list[dict[str, Any]]:
        """The service's ``message settled`` log lines so far (their fields), in order."""
        return self._tracker.lines

    @property
    def waiting(self) -> int:
        return self._ladder

    async def __aenter__(self) -> BrokerHarness:
        settings = self.settings
        await prepare_receipts(settings, self.database_url)
        self._connection = await connect(broker_config(settings), "test")
        try:
            await apply_topology(self._connection, self._topology)
            self._channel = await self._connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            await self._start_service()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _start_service(self) -> None:
        settings = self.settings
        rungs = [rung_label(delay) for delay in settings.retry_delays]
        metrics = Metrics(ServiceRegistry(), self.registry, rungs, name=settings.name)
        logger = make_logger(settings.name, level="WARNING", log_format="console")
        service = self._service = build_service(
            settings,
            self.registry,
            logger,
            metrics,
            calls=HandlerCalls(),
            owner=uuid.uuid4(),
            message_log=self._tracker,
        )
        task = self._service_task = asyncio.create_task(service.run(self._stop), name="service")
        task.add_done_callback(self._service_ended)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_WITHIN
        while not (await service.readiness()).consuming:
            if task.done():
                task.result()  # what stopped it
                raise HarnessError("the service stopped before it consumed")
            if loop.time() > deadline:
                raise HarnessError(f"the service did not consume within {READY_WITHIN:g}s")
            await asyncio.sleep(0.02)

    def _service_ended(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        self._tracker.fail(f"the service stopped: {error!r}")

    async def _close(self) -> None:
        task, self._service_task = self._service_task, None
        if task is not None:
            task.remove_done_callback(self._service_ended)
            self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=SETTLE_WITHIN)
            except TimeoutError:
                task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            channel = await connection.channel()
            prefix = f"{self.settings.name}."
            for queue in self._topology.queues:
                if queue.name.startswith(prefix):
                    await channel.queue_delete(queue.name)
            for exchange in self._topology.exchanges:
                if exchange.name.startswith(prefix):
                    await channel.exchange_delete(exchange.name)
        finally:
            await connection.close()

    async def send(self, *messages: Message) -> list[EventOutcome]:
        """Publish ``messages`` to the ingress exchange, confirmed, and return each one's
        outcome, in their order. A routing key no queue is bound for (a type no handler
        registers) raises :class:`~consumer.errors.Unroutable`, as the broker returns it."""
        channel = self._open_channel()
        exchange = await channel.get_exchange(self._names.ingress, ensure=False)
        futures = []
        for message in messages:
            message_id = f"test-{self._run}-{next(self._ids)}"
            try:
                await exchange.publish(
                    aio_pika.Message(
                        message.body,
                        headers=dict(message.headers) or None,
                        content_type=message.content_type,
                        message_id=message_id,
                        delivery_mode=PERSISTENT,
                    ),
                    routing_key=message.routing_key,
                    mandatory=True,
                )
            except DeliveryError:
                raise unroutable(message.routing_key) from None
            futures.append(self._tracker.expect(message_id))
        return self._counted(await self._tracker.wait(futures, within=SETTLE_WITHIN))

    async def redeliver(self) -> list[EventOutcome]:
        """The copies on the retry ladder come back now, as the broker brings them back when
        their rung's delay runs out; their outcomes, rung by rung."""
        channel = self._open_channel()
        redeliver = await channel.get_exchange(self._names.redeliver, ensure=False)
        # Every copy taken first, then sent back: a copy the service retries again meanwhile
        # lands on the next rung, and waits for the next call.
        copies = []
        for delay in self.settings.retry_delays:
            queue = await channel.get_queue(self._names.rung(delay), ensure=False)
            while (copy := await queue.get(no_ack=False, fail=False)) is not None:
                copies.append(copy)
        futures = []
        for copy in copies:
            futures.append(self._tracker.expect(copy.message_id or ""))
            await redeliver.publish(
                aio_pika.Message(
                    copy.body,
                    headers=dict(copy.headers or {}),
                    content_type=copy.content_type,
                    message_id=copy.message_id,
                    delivery_mode=PERSISTENT,
                ),
                routing_key=copy.routing_key or "",
            )
            await copy.ack()
        self._ladder = 0
        return self._counted(await self._tracker.wait(futures, within=SETTLE_WITHIN))

    def _counted(self, outcomes: list[EventOutcome]) -> list[EventOutcome]:
        self._ladder += sum(1 for outcome in outcomes if outcome.kind is Kind.RETRIED)
        return outcomes

    def _open_channel(self) -> AbstractChannel:
        if self._channel is None:
            raise RuntimeError("use the harness with `async with`")
        return self._channel
