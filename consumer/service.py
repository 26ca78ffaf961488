"""The long-running consumer: deliveries in, verdicts settled, reconnects, pauses and draining.

::

    broker --deliveries--> inbox per worker --> N workers: pipeline (one transaction) --> settle
      ^                \\--> lane of deliveries to apply alone (came back after a death or a
      |                     broken connection): one at a time, nothing else in flight
      |  reconnect with backoff
      +-- connection or channel lost        database unreachable --> pause: hold what is here
                                                                     (the consumer stays, so the
                                                                     prefetch still bounds it),
                                                                     probe, resume

Shutdown (``stop`` set): cancel the consumer, return deliveries that never started, let the ones
in flight finish within ``CONSUMER_SHUTDOWN_GRACE``, then close the channels, connections and pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
import traceback
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

import aiormq

from consumer.amqp import BrokerRejected, BrokerUnreachable
from consumer.backoff import Backoff
from consumer.broker import BrokerSession, ConnectionLost
from consumer.calls import HandlerCalls
from consumer.crashes import CrashLedger
from consumer.database import Database
from consumer.delivery import ChannelGone, Delivery
from consumer.errors import (
    ConfigError,
    DatabaseUnavailable,
    PipelineFault,
    TopologyMissing,
    error_name,
)
from consumer.inbox import Inbox
from consumer.isolation import Isolation
from consumer.logs import Logger
from consumer.memory import BATCH_BYTES, KEEP_PARSED_BYTES
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
    # aiormq raises it (a RuntimeError) for a channel that closes under an operation.
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
)

READINESS_CACHE_SECONDS = 1.0
"""How long ``/readyz`` reuses the database's last answer: a probe opens a connection, and a
crowd of requests must not become a crowd of backends."""


class Phase(enum.Enum):
    """What the service does with a delivery in hand."""

    ACCEPTING = "accepting"
    """Route it to a worker."""
    PAUSED = "paused"
    """Hold it: the database cannot be reached."""
    DRAINING = "draining"
    """Give it back: the service is stopping."""


@dataclass(frozen=True, slots=True)
class Readiness:
    broker_connected: bool
    consuming: bool
    database: bool
    paused: bool
    workers: bool = True

    @property
    def ready(self) -> bool:
        return (
            self.broker_connected
            and self.consuming
            and self.database
            and not self.paused
            and self.workers
        )

    def as_dict(self) -> dict[str, bool]:
        return {
            "broker_connected": self.broker_connected,
            "consuming": self.consuming,
            "database": self.database,
            "paused": self.paused,
            "workers": self.workers,
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
        calls: HandlerCalls | None = None,
        owner: UUID | None = None,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._logger = logger
        self._metrics = metrics
        self._calls = calls or HandlerCalls()
        self._ledger = CrashLedger(consumer=settings.name, owner=owner or uuid4())
        self._names = names_for(settings)
        self._topology = build_topology(settings, registry)
        self._policy = RetryPolicy.from_delays(settings.retry_delays)
        self._reporter = OutcomeReporter(logger, metrics, log_payloads=settings.log_payloads)
        # One inbox per worker: events with equal keys always meet the same worker.
        self._inboxes: list[Inbox[Delivery]] = [
            Inbox(
                size=settings.batch_size,
                wait=settings.batch_wait.total_seconds(),
                max_weight=BATCH_BYTES,
                weight=_body_bytes,
            )
            for _ in range(settings.db_pool_size)
        ]
        self._isolation: Isolation[Delivery] = Isolation()
        self._next_inbox = 0
        self._pipeline: Pipeline | None = None
        self._held: list[Delivery] = []
        self._phase = Phase.ACCEPTING
        self._generation = 0
        self._database_down = asyncio.Event()
        self._fatal: BaseException | None = None
        self._fatal_event = asyncio.Event()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: BrokerSession | None = None
        self._settler: Settler | None = None
        self._database: Database | None = None
        self._database_answer: tuple[float, bool] | None = None
        self._database_probe: asyncio.Future[bool] | None = None
        metrics.in_flight.set_function(self.in_flight)

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
                ledger=self._ledger,
                calls=self._calls,
                on_conflict=self._metrics.batch_conflicts.inc,
            )
            self._pipeline = pipeline
            self._tasks = [
                asyncio.create_task(self._worker(pipeline, inbox), name=f"worker-{index}")
                for index, inbox in enumerate(self._inboxes)
            ]
            self._tasks.append(asyncio.create_task(self._alone(pipeline), name="alone"))
            for task in self._tasks:
                task.add_done_callback(self._task_ended)
            try:
                await self._run_broker(stop)
            finally:
                tasks, self._tasks = self._tasks, []
                for task in tasks:
                    task.remove_done_callback(self._task_ended)
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self._database = None
        if self._fatal is not None:
            raise self._fatal

    async def readiness(self) -> Readiness:
        """What ``/readyz`` reports: connected, consuming, database answering, not paused, and
        every worker alive."""
        session = self._session
        return Readiness(
            broker_connected=session is not None and session.is_open,
            consuming=session is not None and session.is_consuming,
            database=await self._database_answers(),
            paused=self._phase is Phase.PAUSED,
            workers=bool(self._tasks) and not any(task.done() for task in self._tasks),
        )

    def in_flight(self) -> int:
        """Deliveries received on the current channel and not yet settled."""
        session = self._session
        return session.unsettled if session is not None else 0

    async def _database_answers(self) -> bool:
        """The database's answer to a probe, shared by concurrent callers and reused briefly."""
        now = time.monotonic()
        if self._database_answer is not None:
            checked_at, answer = self._database_answer
            if now - checked_at < READINESS_CACHE_SECONDS:
                return answer
        if self._database_probe is None or self._database_probe.done():
            self._database_probe = asyncio.ensure_future(self._probe_database())
        return await asyncio.shield(self._database_probe)

    async def _probe_database(self) -> bool:
        database = self._database
        answer = False
        if database is not None:
            try:
                await database.probe()
                answer = True
            except (DatabaseUnavailable, ConfigError):
                answer = False
        self._database_answer = (time.monotonic(), answer)
        return answer

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A worker or the lane ended by itself: nothing would serve its deliveries any more, so
        the service stops (exit non-zero) and the supervisor starts a new one."""
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            error = PipelineFault(f"{task.get_name()} stopped")
        elif not isinstance(error, PipelineFault | ConfigError):
            self._logger.error(
                "a worker stopped on an unexpected error",
                task=task.get_name(),
                error_class=error_name(error),
                error=str(error),
                traceback="".join(traceback.format_exception(error)),
            )
            error = PipelineFault(
                f"{task.get_name()} stopped on an unexpected error: {error_name(error)}: {error}"
            )
        self._fail(error)

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
            missing = await conn.fetchval(
                "SELECT string_agg(name, ', ') FROM unnest($1::text[]) AS name"
                " WHERE to_regclass(name) IS NULL",
                ["receipts", "consumer_in_progress"],
            )
            if missing is not None:
                raise PipelineFault(
                    f"the database has no {missing} table: run `python -m consumer migrate` first"
                )
        return True

    def _on_database_down(self, error: BaseException, generation: int) -> None:
        # Outcomes of batches that started before the last resume say nothing about now.
        if generation != self._generation or self._phase is not Phase.ACCEPTING:
            return
        self._logger.warning("database unreachable, pausing consumption", error=str(error))
        self._phase = Phase.PAUSED
        self._metrics.paused.set(1)
        self._database_down.set()

    async def _pause(self, session: BrokerSession, stop: asyncio.Event) -> None:
        """Hold every delivery in hand and probe until the database answers, then resume.

        The consumer stays registered: what it holds counts against its prefetch, so the process
        never holds more than ``CONSUMER_PREFETCH`` however often the database comes and goes
        (a new consumer would open a new window). Handing deliveries back would only pass them
        to replicas that cannot reach the database either, each return counting towards the
        delivery limit. A shutdown or a lost channel returns them once.
        """
        self._held.extend(self._take_waiting())
        self._logger.warning("paused", holding=len(self._held))
        backoff = Backoff(0.25, self._settings.reconnect_max_delay.total_seconds())
        assert self._database is not None
        while not stop.is_set() and self._fatal is None and not session.closed.done():
            try:
                await self._database.probe()
            except DatabaseUnavailable as error:
                delay = backoff.next()
                self._logger.info(
                    "database still unreachable", error=str(error), retry_in_s=round(delay, 2)
                )
                await _wait(stop, delay, session.closed, self._fatal_event)
                continue
            self._generation += 1
            self._database_down.clear()
            self._phase = Phase.ACCEPTING
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
                    self._names.redeliver,
                    self._on_delivery,
                    self._metrics.settle_lost.inc,
                    self._metrics.settled_twice.inc,
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
                self._session = None
                self._settler = None
                self._metrics.broker_connected.set(0)
                self._metrics.consuming.set(0)
                # These came on a channel that is gone: the broker has them back already.
                self._take_waiting()
            delay = backoff.next()
            self._logger.info("reconnecting to RabbitMQ", in_s=round(delay, 2))
            await _wait(stop, delay, self._fatal_event)

    async def _consume(self, session: BrokerSession, stop: asyncio.Event) -> None:
        await session.start_consuming()
        self._metrics.consuming.set(1)
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
            await _wait(None, None, stop, self._database_down, self._fatal_event, session.closed)

    async def _drain(self, session: BrokerSession) -> None:
        """Graceful stop: no new deliveries, unstarted ones back, in-flight ones finish in time."""
        self._phase = Phase.DRAINING
        await session.stop_consuming()
        self._metrics.consuming.set(0)
        waiting = self._take_waiting()
        for delivery in waiting:
            await self._give_back(delivery)
        grace = self._settings.shutdown_grace.total_seconds()
        self._logger.info(
            "draining", returned_to_queue=len(waiting), in_flight=self._busy, grace_s=grace
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
        if delivery.redelivered:
            self._metrics.redeliveries.inc()
        await self._place(delivery)

    async def _place(self, delivery: Delivery) -> None:
        """Where a delivery in hand goes now: to a worker, held through a pause, or given back
        when stopping."""
        if self._phase is Phase.ACCEPTING:
            self._route(delivery)
        elif self._phase is Phase.PAUSED:
            self._held.append(delivery)
        else:
            await self._give_back(delivery)

    async def _give_back(self, delivery: Delivery) -> None:
        with contextlib.suppress(ChannelGone):
            await delivery.nack(requeue=True)

    def _route(self, delivery: Delivery) -> None:
        """To the lane if it must be applied alone; else to the inbox of the worker that owns
        the event's key; keyless ones in turn."""
        if delivery.isolated:
            self._isolation.put(delivery)
            return
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
        if isinstance(prepared, tuple) and len(delivery.body) > KEEP_PARSED_BYTES:
            # Parsed for its key only: the worker that applies it parses it again, so that the
            # prefetch holds bodies, not their many times larger objects (consumer.memory).
            delivery.prepared = None
        self._inboxes[index].put(delivery)

    def _take_waiting(self) -> list[Delivery]:
        """Every delivery in hand that no worker has started: held, in the inboxes, in the lane."""
        waiting = [*self._held, *self._isolation.drain()]
        waiting += [delivery for inbox in self._inboxes for delivery in inbox.drain()]
        self._held.clear()
        return waiting

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for delivery in held:
            if delivery.channel_open:
                self._route(delivery)

    async def _admit(self, deliveries: list[Delivery]) -> list[Delivery]:
        """The ones to apply now; the others are held, given back or (their channel gone) let go."""
        live: list[Delivery] = []
        for delivery in deliveries:
            if not delivery.channel_open:
                continue
            if self._phase is Phase.ACCEPTING:
                live.append(delivery)
            else:
                await self._place(delivery)
        return live

    def _enter(self) -> None:
        self._busy += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()

    async def _worker(self, pipeline: Pipeline, inbox: Inbox[Delivery]) -> None:
        while True:
            batch = await inbox.next_batch()
            self._enter()
            try:
                async with self._isolation.batch():
                    live = await self._admit(batch)
                    if live:
                        generation = self._generation
                        await self._settle_all(await pipeline.process(live), generation)
            except (PipelineFault, ConfigError) as error:
                self._fail(error)
                return
            finally:
                self._leave()

    async def _alone(self, pipeline: Pipeline) -> None:
        """The lane: each delivery applied alone, with no batch in flight."""
        while True:
            await self._isolation.wait_for_work()
            self._enter()
            try:
                async with self._isolation.alone():
                    while (delivery := self._isolation.take()) is not None:
                        for live in await self._admit([delivery]):
                            generation = self._generation
                            outcome = await pipeline.process_alone(live)
                            await self._settle_all([outcome], generation)
            except (PipelineFault, ConfigError) as error:
                self._fail(error)
                return
            finally:
                self._leave()

    async def _settle_all(self, outcomes: list[Outcome], generation: int) -> None:
        others: list[Outcome] = []
        for outcome in outcomes:
            verdict = outcome.verdict
            if isinstance(verdict, Applied):
                self._reporter.report(outcome, settle_applied(outcome.delivery, verdict))
            elif isinstance(verdict, Failed) and isinstance(verdict.decision, Return):
                # Not settled: the event waits for the database, no attempt counted.
                self._on_database_down(verdict.error, generation)
                await self._place(outcome.delivery)
            else:
                others.append(outcome)
        if others:
            # Publishes and nacks take a round trip: finish them even if shutdown cancels the
            # worker meanwhile.
            await asyncio.shield(self._settle_others(others))

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


def _body_bytes(delivery: Delivery) -> int:
    return len(delivery.body)


async def _wait(
    stop: asyncio.Event | None,
    seconds: float | None,
    *also: asyncio.Future[Any] | asyncio.Event,
) -> None:
    """Sleep up to ``seconds`` (for ever if None), waking early when ``stop`` or anything in
    ``also`` is set."""
    waiters: list[asyncio.Future[Any]] = []
    for item in (stop, *also):
        if isinstance(item, asyncio.Event):
            waiters.append(asyncio.ensure_future(item.wait()))
        elif item is not None and not item.done():
            waiters.append(asyncio.ensure_future(asyncio.shield(item)))
        elif item is not None:
            return
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
