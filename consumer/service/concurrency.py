"""The worker count and batch size in force, changed as the handlers' measured time says.

Every batch adds its time to :class:`~consumer.pipeline.handler_time.HandlerTime` (the handlers
add theirs as they run); once a window holds enough, the policy
(:mod:`consumer.service.concurrency_policy`) decides, and a choice that differs from the one in
force twice in a row is applied: the dispatcher routes to that many inboxes and their batches take
at most that many events. Shown in ``consumer_workers`` and ``consumer_batch_size``, counted in
``consumer_concurrency_changes_total``, and logged (``concurrency changed``).
"""

from __future__ import annotations

from consumer.logs import Logger
from consumer.observe.metrics import Metrics
from consumer.pipeline.handler_time import HandlerTime, HandlerTimeWindow
from consumer.service.concurrency_policy import (
    Choice,
    Limits,
    decide,
    enough,
    initial,
    material,
)
from consumer.service.dispatch import Dispatcher

__all__ = ["Concurrency"]


class Concurrency:
    """Applies the policy's choices to the dispatcher."""

    def __init__(
        self,
        *,
        limits: Limits,
        handler_time: HandlerTime,
        dispatcher: Dispatcher,
        metrics: Metrics,
        logger: Logger,
    ) -> None:
        self._limits = limits
        self._time = handler_time
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._logger = logger
        self._proposed: Choice | None = None
        self.choice = initial(limits)
        self._apply(self.choice)

    def batch_done(self, *, events: int, seconds: float, cpu: float) -> None:
        """A batch of ``events`` took ``seconds``, ``cpu`` of them holding the loop: counted, and
        the choice decided anew once the window holds enough."""
        self._time.batch(events=events, seconds=seconds, cpu=cpu)
        if not enough(self._time.peek()):
            return
        window = self._time.take()
        choice = decide(self._limits, window, self.choice)
        if not material(choice, self.choice):
            self._proposed = None
            return
        first = self.choice.reason in ("start", "pinned")
        if not first and (self._proposed is None or material(choice, self._proposed)):
            # One window can be an accident (a slow moment of the machine): wait for a second
            # that agrees before changing a choice made from measurements (the first is made at
            # once).
            self._proposed = choice
            return
        self._proposed = None
        before = self.choice
        self.choice = choice
        self._apply(choice)
        self._metrics.concurrency_changes.inc()
        self._logger.info(
            "concurrency changed",
            workers=choice.workers,
            batch_size=choice.batch_size,
            was_workers=before.workers,
            was_batch_size=before.batch_size,
            reason=choice.reason,
            **_measured(window),
        )

    def _apply(self, choice: Choice) -> None:
        self._dispatcher.resize(workers=choice.workers, batch_size=choice.batch_size)
        self._metrics.workers.set(choice.workers)
        self._metrics.batch_size.set(choice.batch_size)


def _measured(window: HandlerTimeWindow) -> dict[str, float]:
    """Per event, in milliseconds: what the log line shows the choice was made from."""
    events = max(window.events, 1)
    return {
        "batch_ms_per_event": round(window.batch_seconds / events * 1000, 3),
        "batch_cpu_ms_per_event": round(window.batch_cpu / events * 1000, 3),
        "handler_awaited_ms_per_event": round(window.event_awaited / events * 1000, 3),
        "handler_cpu_ms_per_event": round(window.event_cpu / events * 1000, 3),
        "batch_handler_ms_per_event": round(window.batch_handler_seconds / events * 1000, 3),
    }
