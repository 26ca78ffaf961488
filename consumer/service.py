"""The long-running consumer: deliveries in, verdicts settled, reconnects, pauses and draining.

::

    broker --deliveries--> inbox --> N workers: pipeline (one transaction) --> settle (ack/publish)
      ^                                   |
      |  reconnect with backoff           +-- database unreachable --> pause: cancel the consumer,
      +-- connection or channel lost          return what has not started, probe, consume again

Shutdown (``stop`` set): cancel the consumer, return deliveries that never started, let the ones
in flight finish within ``CONSUMER_SHUTDOWN_GRACE``, then close the channels, connection and pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import aiormq

from consumer.amqp import BrokerRejected, BrokerUnreachable
from consumer.backoff import Backoff
from consumer.broker import BrokerSession, ConnectionLost
from consumer.database import Database
from consumer.delivery import ChannelGone, Delivery
from consumer.errors import ConfigError, DatabaseUnavailable, PipelineFault, TopologyMissing
from consumer.inbox import Inbox
from consumer.logs import Logger
from consumer.metrics import Metrics
from consumer.outcome import Applied, Failed, Outcome
from consumer.pipeline import Pipeline
from consumer.registry import HandlerRegistry
from consumer.report import OutcomeReporter
from consumer.retry import RetryPolicy, Return
from consumer.settings import Settings
from consumer.settle import Settled, Settler, label_for, settle_applied
from topology.plan import build_topology, names_for

_BROKER_ERRORS: tuple[type[BaseException], ...] = (
    BrokerUnreachable,
    ConnectionLost,
    aiormq.exceptions.AMQPError,
    ConnectionError,
    OSError,
    TimeoutError,
)


@dataclass(frozen=True, slots=True)
class Readiness:
    broker_connected: bool
    consuming: bool
    database: bool
    paused: bool

    @property
    def ready(self) -> bool:
        return self.broker_connected and self.consuming and self.database and not self.paused

    def as_dict(self) -> dict[str, bool]:
        return {
            "broker_connected": self.broker_connected,
            "consuming": self.consuming,
            "database": self.database,
            "paused": self.paused,
        }


class Service:
    """Consumes the work queue until told to stop. See the module docstring for the flow."""

    def __init__(
        self,
        *,
        settings: Settings,
        registry: HandlerRegistry,
        logger: Logger,
        metrics: Metrics,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._logger = logger
        self._metrics = metrics
        self._names = names_for(settings)
        self._topology = build_topology(settings, registry)
        self._policy = RetryPolicy.from_delays(settings.retry_delays)
        self._reporter = OutcomeReporter(logger, metrics, log_payloads=settings.log_payloads)
        # One inbox per worker: events with equal keys always meet the same worker.
        self._inboxes: list[Inbox[Delivery]] = [
            Inbox(size=settings.batch_size, wait=settings.batch_wait.total_seconds())
            for _ in range(settings.db_pool_size)
        ]
        self._next_inbox = 0
        self._pipeline: Pipeline | None = None
        self._held: list[Delivery] = []
        self._accepting = False
        self._database_down = asyncio.Event()
        self._fatal: BaseException | None = None
        self._fatal_event = asyncio.Event()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._generation = 0
        self._session: BrokerSession | None = None
        self._settler: Settler | None = None
        self._database: Database | None = None

    # -- the whole life ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then drain. Raises what made the service stop early."""
        async with Database(self._settings) as database:
            self._database = database
            self._metrics.watch_pool(lambda: database.size, lambda: database.in_use)
            if not await self._wait_for_database(database, stop):
                return
            pipeline = Pipeline(
                settings=self._settings,
                registry=self._registry,
                database=database,
                policy=self._policy,
                on_conflict=self._metrics.batch_conflicts.inc,
            )
            self._pipeline = pipeline
            workers = [
                asyncio.create_task(self._worker(pipeline, inbox), name=f"worker-{index}")
                for index, inbox in enumerate(self._inboxes)
            ]
            try:
                await self._run_broker(stop)
            finally:
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                self._database = None
        if self._fatal is not None:
            raise self._fatal

    async def readiness(self) -> Readiness:
        """What ``/readyz`` reports: connected, consuming, database answering, not paused."""
        session, database = self._session, self._database
        database_ok = False
        if database is not None:
            try:
                await database.probe()
                database_ok = True
            except (DatabaseUnavailable, ConfigError):
                database_ok = False
        return Readiness(
            broker_connected=session is not None and session.is_open,
            consuming=session is not None and session.is_consuming,
            database=database_ok,
            paused=self._database_down.is_set(),
        )

    def in_flight(self) -> int:
        return self._busy

    # -- database -----------------------------------------------------------------------------

    async def _wait_for_database(self, database: Database, stop: asyncio.Event) -> bool:
        """Probe until the database answers (False if stopped first); check the schema is there."""
        backoff = Backoff(0.5, self._settings.reconnect_max_delay.total_seconds())
        while not stop.is_set():
            try:
                await database.probe()
                break
            except DatabaseUnavailable as error:
                delay = backoff.next()
                self._logger.warning(
                    "database unreachable at start-up", error=str(error), retry_in_s=round(delay, 2)
                )
                await _wait(stop, delay)
        else:
            return False
        async with database.connection() as conn:
            if await conn.fetchval("SELECT to_regclass('receipts')") is None:
                raise PipelineFault(
                    "the database has no receipts table: run `python -m consumer migrate` first"
                )
        return True

    def _on_database_down(self, error: BaseException, generation: int) -> None:
        # Outcomes of batches that started before the last resume say nothing about now.
        if generation != self._generation or self._database_down.is_set():
            return
        self._logger.warning("database unreachable, pausing consumption", error=str(error))
        self._database_down.set()

    async def _pause(self, session: BrokerSession, stop: asyncio.Event) -> None:
        """Stop consuming and probe until the database answers, holding what was in hand.

        Held deliveries stay unacked on the channel, then go round again here: handing them
        back would only pass them to replicas that cannot reach the database either, and every
        return counts towards the delivery limit. A shutdown or a lost channel returns them once.
        """
        self._metrics.paused.set(1)
        self._accepting = False
        await session.stop_consuming()
        self._metrics.consuming.set(0)
        self._held.extend(self._drain_inboxes())
        self._logger.warning("paused", holding=len(self._held))
        backoff = Backoff(0.25, self._settings.reconnect_max_delay.total_seconds())
        assert self._database is not None
        while not stop.is_set() and not session.closed.done():
            try:
                await self._database.probe()
            except DatabaseUnavailable as error:
                delay = backoff.next()
                self._logger.info(
                    "database still unreachable", error=str(error), retry_in_s=round(delay, 2)
                )
                await _wait(stop, delay, session.closed)
                continue
            self._generation += 1
            self._database_down.clear()
            self._metrics.paused.set(0)
            self._logger.info("database answers again, resuming", held=len(self._held))
            self._release_held()
            return

    # -- broker -------------------------------------------------------------------------------

    async def _run_broker(self, stop: asyncio.Event) -> None:
        backoff = Backoff(0.2, self._settings.reconnect_max_delay.total_seconds())
        connected_once = False
        while not stop.is_set() and self._fatal is None:
            try:
                async with BrokerSession(
                    self._settings,
                    self._topology,
                    self._names.work,
                    self._on_delivery,
                    self._metrics.settle_lost.inc,
                ) as session:
                    self._session = session
                    assert session.publisher is not None
                    self._settler = Settler(
                        names=self._names,
                        publisher=session.publisher,
                        jitter=self._settings.retry_jitter,
                    )
                    self._metrics.broker_connected.set(1)
                    self._logger.info(
                        "connected to RabbitMQ",
                        url=self._settings.safe_amqp_url,
                        queue=self._names.work,
                        prefetch=self._settings.prefetch,
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
                self._accepting = False
                self._session = None
                self._settler = None
                self._metrics.broker_connected.set(0)
                self._metrics.consuming.set(0)
                self._forget_inboxes()
            delay = backoff.next()
            self._logger.info("reconnecting to RabbitMQ", in_s=round(delay, 2))
            await _wait(stop, delay, self._fatal_event)

    async def _consume(self, session: BrokerSession, stop: asyncio.Event) -> None:
        while True:
            if self._database_down.is_set():
                await self._pause(session, stop)
            if stop.is_set() or self._fatal is not None:
                await self._drain(session)
                return
            if session.closed.done():
                raise ConnectionLost(session.closed.result())
            if self._database_down.is_set():
                continue
            self._accepting = True
            await session.start_consuming()
            self._metrics.consuming.set(1)
            waiters: list[asyncio.Future[Any]] = [
                asyncio.ensure_future(stop.wait()),
                asyncio.ensure_future(self._database_down.wait()),
                asyncio.ensure_future(self._fatal_event.wait()),
                session.closed,
            ]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters[:-1]:
                    waiter.cancel()
            if session.closed.done():
                raise ConnectionLost(session.closed.result())

    async def _drain(self, session: BrokerSession) -> None:
        """Graceful stop: no new deliveries, unstarted ones back, in-flight ones finish in time."""
        self._accepting = False
        await session.stop_consuming()
        self._metrics.consuming.set(0)
        returned = await self._return_inboxes()
        grace = self._settings.shutdown_grace.total_seconds()
        self._logger.info(
            "draining", returned_to_queue=returned, in_flight=self._busy, grace_s=grace
        )
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace)
        except TimeoutError:
            self._logger.warning(
                "shutdown grace expired; unfinished deliveries go back to the queue",
                in_flight=self._busy,
            )

    # -- deliveries ---------------------------------------------------------------------------

    async def _on_delivery(self, delivery: Delivery) -> None:
        self._metrics.in_flight.inc()
        if delivery.redelivered:
            self._metrics.redeliveries.inc()
        if self._accepting:
            self._route(delivery)
        elif self._database_down.is_set():
            self._held.append(delivery)  # arrived between our basic.cancel and its cancel-ok
        else:
            await self._give_back(delivery)

    async def _give_back(self, delivery: Delivery) -> None:
        self._metrics.in_flight.dec()
        with contextlib.suppress(ChannelGone):
            await delivery.nack(requeue=True)

    def _route(self, delivery: Delivery) -> None:
        """To the inbox of the worker that owns the event's key; keyless ones in turn."""
        assert self._pipeline is not None
        prepared = self._pipeline.prepared(delivery)
        index: int | None = None
        if isinstance(prepared, tuple) and (key := prepared[0].key) is not None:
            # The key alone: a restock and a reserve of one SKU lock the same row. A key function
            # that fails only costs the routing; the handler still meets the event.
            with contextlib.suppress(Exception):
                index = hash(key(prepared[1].payload)) % len(self._inboxes)
        if index is None:
            index = self._next_inbox
            self._next_inbox = (index + 1) % len(self._inboxes)
        self._inboxes[index].put(delivery)

    async def _return_inboxes(self) -> int:
        """Give back, once each, everything received that has not started (shutdown)."""
        waiting = [*self._held, *self._drain_inboxes()]
        self._held.clear()
        for delivery in waiting:
            await self._give_back(delivery)
        return len(waiting)

    def _drain_inboxes(self) -> list[Delivery]:
        return [delivery for inbox in self._inboxes for delivery in inbox.drain()]

    def _forget_inboxes(self) -> None:
        # These came on a channel that is gone: the broker has them back already.
        for _ in [*self._held, *self._drain_inboxes()]:
            self._metrics.in_flight.dec()
        self._held.clear()

    def _hold_or_retry(self, delivery: Delivery) -> None:
        """A delivery the database could not take: keep it for after the pause."""
        if self._database_down.is_set():
            self._held.append(delivery)
        else:
            # The database answered again already (a batch that started before the resume).
            self._route(delivery)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for delivery in held:
            if delivery.channel_open:
                self._route(delivery)
            else:
                self._metrics.in_flight.dec()

    async def _worker(self, pipeline: Pipeline, inbox: Inbox[Delivery]) -> None:
        while True:
            batch = await inbox.next_batch()
            live: list[Delivery] = []
            for delivery in batch:
                if not delivery.channel_open:
                    self._metrics.in_flight.dec()
                elif self._database_down.is_set():
                    self._held.append(delivery)
                elif not self._accepting:
                    await self._give_back(delivery)
                else:
                    live.append(delivery)
            if not live:
                continue
            self._busy += 1
            self._idle.clear()
            generation = self._generation
            try:
                outcomes = await pipeline.process(live)
                others: list[Outcome] = []
                for outcome in outcomes:
                    verdict = outcome.verdict
                    if isinstance(verdict, Applied):
                        self._reporter.report(outcome, settle_applied(outcome.delivery, verdict))
                    elif isinstance(verdict, Failed) and isinstance(verdict.decision, Return):
                        # Not settled: the event waits for the database, no attempt counted.
                        self._on_database_down(verdict.error, generation)
                        self._hold_or_retry(outcome.delivery)
                    else:
                        others.append(outcome)
                if others:
                    # Publishes and nacks take a round trip: finish them even if shutdown
                    # cancels the worker meanwhile.
                    await asyncio.shield(self._settle_others(others))
            except (PipelineFault, ConfigError) as error:
                self._fail(error)
                return
            finally:
                self._busy -= 1
                if self._busy == 0:
                    self._idle.set()

    async def _settle_others(self, outcomes: list[Outcome]) -> None:
        settled = await asyncio.gather(*(self._settle(outcome) for outcome in outcomes))
        for outcome, result in zip(outcomes, settled, strict=True):
            self._reporter.report(outcome, result)

    async def _settle(self, outcome: Outcome) -> Settled:
        settler = self._settler
        if settler is None:
            return Settled(label_for(outcome.verdict), channel_gone=True)
        return await settler.settle(outcome)

    def _fail(self, error: BaseException) -> None:
        if self._fatal is None:
            self._logger.error("cannot go on", error=str(error), error_class=type(error).__name__)
            self._fatal = error
            self._fatal_event.set()


async def _wait(
    stop: asyncio.Event, seconds: float, *also: asyncio.Future[Any] | asyncio.Event
) -> None:
    """Sleep up to ``seconds``, waking early when ``stop`` (or anything in ``also``) is set."""
    waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
    for item in also:
        if isinstance(item, asyncio.Event):
            waiters.append(asyncio.ensure_future(item.wait()))
        elif not item.done():
            waiters.append(asyncio.ensure_future(asyncio.shield(item)))
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
