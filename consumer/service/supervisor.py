"""Supervision: the broker session and its reconnects, pauses while the database is away, and
the graceful stop. :mod:`consumer.service.app` builds one.

::

    BrokerSession --delivery--> Dispatcher (inboxes, isolated, held) --> Workers --> Pipeline
          ^                                                               |
          |  reconnect with backoff                                 Settler (ack, publish, nack)
          +-- connection or channel lost        database away: pause (hold, probe, resume)

Shutdown (``stop`` set): cancel the consumer, hand back the deliveries that never started, let
the ones in flight finish within ``CONSUMER_SHUTDOWN_GRACE``, close the channels, connections
and the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import aiormq

from consumer.amqp.connect import BrokerConfig
from consumer.amqp.delivery import Delivery
from consumer.amqp.session import BrokerSession, Consumed
from consumer.db.clock import read_clocks
from consumer.db.crashes import Liveness
from consumer.db.database import Database
from consumer.db.migration_sets import Migration
from consumer.errors import (
    BrokerRejected,
    BrokerUnreachable,
    ConfigError,
    ConnectionLost,
    DatabaseUnavailable,
    TopologyMissing,
)
from consumer.logs import Logger
from consumer.observe.metrics import Metrics
from consumer.observe.readiness import DatabaseAnswer, Readiness
from consumer.service.backoff import Backoff
from consumer.service.dispatch import Dispatcher, Phase
from consumer.service.outbox_relay import OutboxRelay
from consumer.service.pruner import PeriodicPruner
from consumer.service.settle import Settler
from consumer.service.waiting import database_ready, wait_any
from consumer.service.window import PrefetchWindow
from consumer.service.worker_tasks import WorkerTasks
from consumer.service.workers import Workers
from topology.model import Topology
from topology.names import Names

__all__ = ["Service", "ServiceConfig"]

_BROKER_ERRORS: tuple[type[BaseException], ...] = (
    BrokerUnreachable,
    ConnectionLost,
    aiormq.exceptions.AMQPError,
    # aiormq raises it (a RuntimeError) for a channel that closes under an operation.
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
)


@dataclass(frozen=True)
class ServiceConfig:
    broker: BrokerConfig
    reconnect_max_delay: float = 30.0
    shutdown_grace: float = 30.0
    migrations: tuple[Migration, ...] = ()
    """The service's and its handler modules' migrations: none may be pending at start-up."""
    max_clock_skew: timedelta | None = None
    """Start-up refuses past this difference between this host's clock and the database's
    (:mod:`consumer.db.clock`); None: not checked."""


class Service:
    """Consumes the work queue until told to stop. See the module docstring for the flow."""

    def __init__(
        self,
        *,
        config: ServiceConfig,
        names: Names,
        topology: Topology,
        database: Database,
        dispatcher: Dispatcher,
        workers: Workers,
        settler: Settler,
        window: PrefetchWindow,
        liveness: Liveness,
        logger: Logger,
        metrics: Metrics,
        pruner: PeriodicPruner | None = None,
        relay: OutboxRelay | None = None,
        consumed: Sequence[Consumed] = (),
    ) -> None:
        self._config = config
        # What the session consumes: the work queue, or each shard of a sharded one.
        self._consumed = tuple(consumed) or (Consumed(names.work),)
        self._pruner = pruner
        self._relay = relay
        self._names = names
        self._topology = topology
        self._database = database
        self._dispatcher = dispatcher
        self._workers = workers
        self._settler = settler
        self._window = window
        self._liveness = liveness
        self._logger = logger
        self._metrics = metrics
        self._session: BrokerSession | None = None
        self._tasks = WorkerTasks(
            workers=workers, inboxes=dispatcher.inboxes, liveness=liveness, logger=logger
        )
        self._database_answer = DatabaseAnswer()
        metrics.in_flight.set_function(window.in_flight)

    # -- the whole life ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then drain. Raises what made the service stop early."""
        async with self._database as database:
            self._metrics.watch_pool(
                lambda: database.size, lambda: database.in_use, database.max_size
            )
            if not await database_ready(
                self._database,
                stop,
                self._logger,
                max_delay=self._config.reconnect_max_delay,
                migrations=self._config.migrations,
            ):
                return
            await self._check_clocks()
            async with self._tasks:
                if self._pruner is None:
                    await self._run_relaying(stop)
                else:
                    # The receipts' partitions for now and ahead exist before the first delivery.
                    await self._pruner.first()
                    async with self._pruner:
                        await self._run_relaying(stop)
        if self._tasks.fatal is not None:
            raise self._tasks.fatal

    async def _run_relaying(self, stop: asyncio.Event) -> None:
        """The broker, with the outbox relay beside it when this service runs one: the relay
        publishes on the session's publisher while there is one, and waits while there is not."""
        if self._relay is None:
            await self._run_broker(stop)
            return
        async with self._relay:
            await self._run_broker(stop)

    async def _check_clocks(self) -> None:
        """:class:`~consumer.errors.ClockSkewed` if this host's clock is too far from the
        database's."""
        limit = self._config.max_clock_skew
        if limit is None:
            return
        async with self._database.connection() as conn:
            reading = await read_clocks(conn)
        self._metrics.clock_ahead.set(reading.ahead)
        reading.check(limit)

    async def readiness(self) -> Readiness:
        session = self._session
        return Readiness(
            broker_connected=session is not None and session.is_open,
            consuming=session is not None and session.is_consuming,
            database=await self._database_answer.ask(self._database),
            paused=self._dispatcher.state.phase is Phase.PAUSED,
            workers=self._tasks.running,
        )

    # -- database -----------------------------------------------------------------------------

    async def _pause(self, session: BrokerSession, stop: asyncio.Event) -> None:
        """Probe until the database answers, then resume with what was held.

        The consumer stays registered: what it holds counts against its prefetch, so the process
        never holds more than ``CONSUMER_PREFETCH`` however often the database comes and goes
        (a new consumer would open a new window). Handing deliveries back would only pass them
        to replicas that cannot reach the database either, each return counting towards the
        delivery limit. A shutdown or a lost channel returns them once.
        """
        self._logger.warning("paused", holding=self._dispatcher.held)
        started = self._database.server_started
        backoff = Backoff(0.25, self._config.reconnect_max_delay)
        while not stop.is_set() and self._tasks.fatal is None and not session.closed.done():
            try:
                await self._database.probe()
            except DatabaseUnavailable as error:
                delay = backoff.next()
                self._logger.info(
                    "database still unreachable", error=str(error), retry_in_s=round(delay, 2)
                )
                await wait_any(stop, delay, session.closed, self._tasks.failed)
                continue
            restarted = started is not None and self._database.server_started != started
            held = self._dispatcher.resume(restarted=restarted)
            self._metrics.paused.set(0)
            self._logger.info(
                "database answers again, resuming", held=held, server_restarted=restarted
            )
            return

    # -- broker -------------------------------------------------------------------------------

    async def _run_broker(self, stop: asyncio.Event) -> None:
        backoff = Backoff(0.2, self._config.reconnect_max_delay)
        connected_once = False
        while not stop.is_set() and self._tasks.fatal is None:
            try:
                async with BrokerSession(
                    self._config.broker,
                    self._topology,
                    self._consumed,
                    self._names.redeliver,
                    self._on_delivery,
                    self._metrics.settle_lost.inc,
                    self._metrics.settled_twice.inc,
                ) as session:
                    self._session = self._window.session = session
                    self._settler.publisher = session.publisher
                    self._metrics.broker_connected.set(1)
                    self._logger.info(
                        "connected to RabbitMQ",
                        url=self._config.broker.safe_url,
                        queue=self._names.work,
                        consumed=[consumed.queue for consumed in self._consumed],
                        prefetch=self._config.broker.prefetch,
                    )
                    connected_once = True
                    backoff.reset()
                    await self._consume(session, stop)
                    return
            except TopologyMissing as error:
                if not connected_once:
                    raise
                self._logger.error("topology missing", error=str(error))
            except BrokerRejected as error:
                # Wrong credentials or an untrusted certificate at start-up are a bad setting, as
                # for the database; later (a rotated password) they are an outage to wait out.
                if not connected_once:
                    raise ConfigError(str(error)) from None
                self._logger.error("RabbitMQ rejected the connection", error=str(error))
            except _BROKER_ERRORS as error:
                self._logger.warning("lost RabbitMQ", error=str(error) or type(error).__name__)
            finally:
                self._session = self._window.session = None
                self._settler.publisher = None
                self._metrics.broker_connected.set(0)
                self._metrics.consuming.set(0)
                # These came on a channel that is gone: the broker has them back already.
                self._dispatcher.take_waiting()
            delay = backoff.next()
            self._logger.info("reconnecting to RabbitMQ", in_s=round(delay, 2))
            await wait_any(stop, delay, self._tasks.failed)

    async def _consume(self, session: BrokerSession, stop: asyncio.Event) -> None:
        await session.start_consuming()
        self._metrics.consuming.set(1)
        database_down = self._dispatcher.database_down
        while True:
            if database_down.is_set():
                await self._pause(session, stop)
            if stop.is_set() or self._tasks.fatal is not None:
                await self._stop_gracefully(session)
                return
            if session.closed.done():
                raise ConnectionLost(session.closed.result())
            if database_down.is_set():
                continue
            await wait_any(None, None, stop, database_down, self._tasks.failed, session.closed)

    async def _stop_gracefully(self, session: BrokerSession) -> None:
        """No new deliveries, unstarted ones back, in-flight ones finish in time."""
        await session.stop_consuming()
        self._metrics.consuming.set(0)
        returned = await self._dispatcher.give_back_waiting()
        if self._relay is not None:
            # Its round in progress ends confirmed and marked while the publisher is still open.
            await self._relay.stop()
        grace = self._config.shutdown_grace
        self._logger.info(
            "draining", returned_to_queue=returned, in_flight=self._workers.busy, grace_s=grace
        )
        try:
            await asyncio.wait_for(self._workers.idle(), timeout=grace)
        except TimeoutError:
            self._logger.warning(
                "shutdown grace expired; unfinished deliveries go back to the queue",
                in_flight=self._workers.busy,
            )
        await self._liveness.stop(keep_marks=self._tasks.died_of_a_bug)

    def _on_delivery(self, delivery: Delivery) -> None:
        if delivery.redelivered:
            self._metrics.redeliveries.inc()
        self._dispatcher.place_now(delivery)
