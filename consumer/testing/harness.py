"""The in-process harness: the service's real pipeline and settler, with no RabbitMQ.

A test's messages become deliveries as the consume channel would hand them over, and go the way
every delivery goes in the service: the dispatcher (inboxes by key, batches), the workers, the
pipeline (parse, validate, receipt, handler in the transaction, failure classification, retry
decision), the settler (ack, or a copy to the ladder or the dead-letter exchange) and the
reporter (the ``message settled`` line, the metrics). Only the channel is in memory
(:mod:`consumer.testing.memory`): the copies the settler publishes are kept, and
:meth:`InProcessHarness.redeliver` brings the ladder's back as the broker would when their rung's
delay runs out, with their attempt count.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import asyncpg

from consumer.amqp.headers import ORIGINAL_ROUTING_KEY, text
from consumer.config.settings import Settings
from consumer.db.pruning import ReceiptPruner
from consumer.errors import Unroutable
from consumer.observe.metrics import Metrics, ServiceRegistry
from consumer.observe.report import OutcomeReporter
from consumer.pipeline.calls import HandlerCalls
from consumer.registry import HandlerRegistry
from consumer.service.assembly import PipelineParts, build_pipeline
from consumer.service.components import (
    batch_size,
    batch_wait,
    names_for,
    receipt_window,
    topology_for,
    worker_count,
)
from consumer.service.dispatch import Dispatcher
from consumer.service.workers import Workers
from consumer.testing.memory import MemoryChannel, Published
from consumer.testing.messages import Message
from consumer.testing.outcomes import EventOutcome
from consumer.testing.tracking import OutcomeTracker
from topology.names import rung_label

__all__ = ["InProcessHarness", "prepare_receipts", "unroutable"]

SETTLE_WITHIN = 60.0
"""Seconds a send waits for its outcomes before failing the test (a hang guard, not a measure)."""


async def prepare_receipts(settings: Settings, database_url: str) -> None:
    """The receipt partitions for now and ahead, as the service makes them before it consumes."""
    conn = await asyncpg.connect(database_url)
    try:
        pruner = ReceiptPruner(receipt_window(settings), max_future_skew=settings.max_future_skew)
        await pruner.prune(conn, wait=True)
    finally:
        await conn.close()


def unroutable(routing_key: str) -> Unroutable:
    """What publishing with ``routing_key`` raises when no queue is bound for it."""
    return Unroutable(
        f"no queue is bound for routing key {routing_key!r}: no handler registers that type"
    )


class InProcessHarness:
    """Runs the service's pipeline on the messages a test sends; see the module docstring.

    Use it as an async context manager; ``settings`` name the database (a migrated one:
    :mod:`consumer.testing.database`) and configure everything as they configure the service.
    """

    mode = "in-process"

    def __init__(self, settings: Settings, registry: HandlerRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self._names = names_for(settings)
        # What the ingress exchange routes to the work queue: the handlers' types, as bound by
        # the topology's plan (anything else the broker would return to the producer).
        self._routed = frozenset(
            binding.routing_key
            for binding in topology_for(settings, registry).bindings
            if binding.exchange == self._names.ingress
        )
        self._ids = itertools.count(1)
        self._run = uuid.uuid4().hex[:8]
        self._tracker = OutcomeTracker()
        self._channel = MemoryChannel()
        self._tasks: list[asyncio.Task[None]] = []
        self._parts: PipelineParts | None = None
        self._dispatcher: Dispatcher | None = None
        self._ladder: list[Published] = []

    @property
    def database_url(self) -> str:
        return self.settings.database_url.get_secret_value()

    @property
    def lines(self) -> list[dict[str, Any]]:
        """The service's ``message settled`` log lines so far (their fields), in order."""
        return self._tracker.lines

    @property
    def dead_letters(self) -> list[Published]:
        """The copies the settler published to the dead-letter exchange: each body as it came,
        with the reason headers (``consumer-dead-reason``...)."""
        return [p for p in self._channel.published if p.exchange == self._names.dlx]

    @property
    def waiting(self) -> int:
        """Copies on the retry ladder, waiting to come back (:meth:`redeliver`)."""
        return len(self._ladder)

    async def __aenter__(self) -> InProcessHarness:
        settings = self.settings
        await prepare_receipts(settings, self.database_url)
        parts = self._parts = build_pipeline(
            settings, self.registry, calls=HandlerCalls(), owner=uuid.uuid4()
        )
        parts.settler.publisher = self._channel
        rungs = [rung_label(delay) for delay in settings.retry_delays]
        metrics = Metrics(ServiceRegistry(), self.registry, rungs, name=settings.name)
        # The worker count and batch size the service starts batch handlers at, fixed: a test
        # sends a handful of events, too few for the service's adaptive choice to matter, and a
        # fixed shape keeps its outcome the same run after run.
        dispatcher = self._dispatcher = Dispatcher(
            workers=worker_count(settings),
            batch_size=batch_size(settings),
            batch_wait=batch_wait(settings),
            preparer=parts.preparer,
            settler=parts.settler,
        )
        workers = Workers(
            dispatcher=dispatcher,
            pipeline=parts.pipeline,
            settler=parts.settler,
            reporter=OutcomeReporter(self._tracker, metrics, log_payloads=settings.log_payloads),
            on_pause=self._paused,
        )
        await parts.database.__aenter__()
        self._tasks = [
            asyncio.create_task(workers.worker(inbox), name=f"harness-worker-{index}")
            for index, inbox in enumerate(dispatcher.inboxes)
        ]
        self._tasks.append(asyncio.create_task(workers.isolated(), name="harness-isolated"))
        for task in self._tasks:
            task.add_done_callback(self._task_ended)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.remove_done_callback(self._task_ended)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._parts is not None:
            await self._parts.database.__aexit__(None, None, None)
            self._parts = None

    async def send(self, *messages: Message) -> list[EventOutcome]:
        """Deliver ``messages`` to the work queue together (batched as the service batches
        them), and return each one's outcome, in their order. A routing key no queue is bound
        for (a type no handler registers) raises :class:`~consumer.errors.Unroutable`, as the
        broker returns it to the producer."""
        for message in messages:
            if message.routing_key not in self._routed:
                raise unroutable(message.routing_key)
        deliveries = []
        for message in messages:
            message_id = f"test-{self._run}-{next(self._ids)}"
            deliveries.append(
                (
                    message_id,
                    self._channel.delivery(
                        message.body,
                        routing_key=message.routing_key,
                        exchange=self._names.ingress,
                        headers=dict(message.headers),
                        content_type=message.content_type,
                        message_id=message_id,
                    ),
                )
            )
        return await self._settled(deliveries)

    async def redeliver(self) -> list[EventOutcome]:
        """The copies on the retry ladder come back, as the broker brings them back when their
        rung's delay has run out (whatever the delay: no test waits for it), their attempt
        count raised; their outcomes, in the order they were retried."""
        ladder, self._ladder = self._ladder, []
        deliveries = []
        for copy in ladder:
            headers = copy.headers
            routing_key = text(headers.get(ORIGINAL_ROUTING_KEY)) or copy.routing_key
            message_id = copy.properties.message_id or ""
            deliveries.append(
                (
                    message_id,
                    self._channel.delivery(
                        copy.body,
                        routing_key=routing_key,
                        exchange=self._names.redeliver,
                        headers=headers,
                        content_type=copy.properties.content_type,
                        message_id=message_id,
                        trusted=True,
                    ),
                )
            )
        return await self._settled(deliveries)

    async def _settled(self, deliveries: Sequence[tuple[str, Any]]) -> list[EventOutcome]:
        assert self._dispatcher is not None, "use the harness with `async with`"
        published = len(self._channel.published)
        futures = [self._tracker.expect(message_id) for message_id, _ in deliveries]
        for _, delivery in deliveries:
            self._dispatcher.place_now(delivery)
        outcomes = await self._tracker.wait(futures, within=SETTLE_WITHIN)
        for copy in self._channel.published[published:]:
            if copy.exchange == self._names.retry:
                self._ladder.append(copy)
        return outcomes

    def _paused(self, error: BaseException) -> None:
        self._tracker.fail(f"the database went away: {error}")

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        self._tracker.fail(f"{task.get_name()} stopped: {error!r}")
