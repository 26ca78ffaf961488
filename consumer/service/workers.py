"""The workers: each takes batches from its inbox, applies them and settles them; one more takes
the isolated deliveries one at a time, with nothing else in flight.

A verdict that holds (the database went away) pauses the dispatcher, which keeps the delivery;
every other verdict goes through the settler (:mod:`consumer.service.settle`), shielded from a
shutdown's cancellation, and is reported once (:mod:`consumer.observe.report`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from consumer.amqp.delivery import Delivery
from consumer.observe.report import OutcomeReporter
from consumer.pipeline.handler_time import Stepped
from consumer.pipeline.outcome import Failed, Outcome, OutcomeKind
from consumer.pipeline.pipeline import Pipeline
from consumer.pipeline.tracing import Started, Tracing
from consumer.service.dispatch import Dispatcher
from consumer.service.inbox import Inbox
from consumer.service.settle import Settler

__all__ = ["Workers"]


class Workers:
    """The work done on deliveries between the dispatcher and the broker, and how much of it is
    in flight (a graceful stop waits for :meth:`idle`)."""

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        pipeline: Pipeline,
        settler: Settler,
        reporter: OutcomeReporter,
        on_pause: Callable[[BaseException], None],
        tracing: Tracing | None = None,
        queue: str = "",
        on_batch: Callable[[int, float, float], None] = lambda events, seconds, cpu: None,
    ) -> None:
        """``queue``: the work queue the deliveries come from (the name their spans give).
        ``on_batch``: told each batch's events, wall time and the time it held the loop
        (:mod:`consumer.service.concurrency`)."""
        self._on_batch = on_batch
        self._dispatcher = dispatcher
        self._tracing = tracing or Tracing()
        self._queue = queue
        self._pipeline = pipeline
        self._settler = settler
        self._reporter = reporter
        self._on_pause = on_pause
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def busy(self) -> int:
        return self._busy

    async def idle(self) -> None:
        await self._idle.wait()

    async def worker(self, inbox: Inbox[Delivery]) -> None:
        """Batches from one inbox, for ever."""
        isolated = self._dispatcher.isolated
        refill_due = False
        # This worker's batches' time, a moving average: the most a refill is waited for.
        batch_seconds = 0.0
        clock = time.perf_counter
        while True:
            batch = await inbox.next_batch(refill_due=refill_due, batch_seconds=batch_seconds)
            refill_due = False
            self._enter()
            started: Started = None
            try:
                async with isolated.batch():
                    live = await self._dispatcher.admit(batch)
                    started = self._tracing.processing(live, self._queue)
                    generation = self._dispatcher.state.generation
                    outcomes: list[Outcome] = []
                    if live:
                        started_at = clock()
                        # Stepped: its CPU apart from what it awaited (the database, handlers' I/O).
                        stepped = Stepped(self._pipeline.process(live))
                        outcomes = await stepped
                        took = clock() - started_at
                        batch_seconds += (took - batch_seconds) * 0.2
                        self._on_batch(len(live), took, stepped.busy)
                # Settling runs no handler's code: isolated ones need not wait for it (a copy can
                # wait long for its confirm, while the broker blocks publishing).
                if outcomes:
                    # Settled with the window full: the broker refills it now
                    # (consumer.service.inbox).
                    refill_due = self._dispatcher.window_full()
                    await self._settle(outcomes, generation)
            finally:
                self._tracing.abandoned(started)
                self._leave()

    async def isolated(self) -> None:
        """The isolated deliveries, one at a time, with no batch in flight."""
        isolated = self._dispatcher.isolated
        while True:
            await isolated.wait_for_work()
            self._enter()
            try:
                async with isolated.turn():
                    while (delivery := isolated.take()) is not None:
                        for live in await self._dispatcher.admit([delivery]):
                            started = self._tracing.processing([live], self._queue)
                            try:
                                generation = self._dispatcher.state.generation
                                outcome = await self._pipeline.process_isolated(
                                    live,
                                    connection_losses=self._dispatcher.connection_losses(live),
                                )
                                await self._settle([outcome], generation)
                            finally:
                                self._tracing.abandoned(started)
            finally:
                self._leave()

    async def _settle(self, outcomes: list[Outcome], generation: int) -> None:
        # Acks only, the usual batch: settled at once, without the task a shield makes.
        settled = self._settler.acked_now(outcomes)
        if settled is None:
            # Publishes and nacks take a round trip: finish them even if shutdown cancels the
            # worker.
            settled = await asyncio.shield(self._settler.settle(outcomes))
        for outcome, result in zip(outcomes, settled, strict=True):
            if result.held:
                self._tracing.settled(outcome, result)
                # Not settled: it waits for the database, no attempt counted.
                verdict = outcome.verdict
                assert isinstance(verdict, Failed)
                if self._dispatcher.pause(generation):
                    self._on_pause(verdict.error)
                await self._dispatcher.place_held(outcome)
                continue
            self._reporter.report(outcome, result)
            self._tracing.settled(outcome, result)
            if result.kind is OutcomeKind.DEAD_LETTERED and not result.channel_gone:
                await self._pipeline.dead_lettered(outcome)

    def _enter(self) -> None:
        self._busy += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()
