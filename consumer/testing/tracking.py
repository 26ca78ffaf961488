"""Waiting for the service's word on each delivery a test sent: the ``message settled`` lines,
matched to the deliveries by message id (each delivery the harness makes has its own; a retry
copy keeps its original's)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

from consumer.testing.outcomes import EventOutcome

__all__ = ["HarnessError", "OutcomeTracker"]


class HarnessError(AssertionError):
    """The harness cannot say what became of a delivery: the service stopped, the database went
    away, or no outcome came in time. An assertion error: the test fails with this message."""


class OutcomeTracker:
    """A :class:`~consumer.logs.MessageLog` that keeps each settled delivery's outcome for whoever
    waits on its message id. Lines for a message id nobody waits on yet (a retry copy that came
    back by itself, on the broker) are kept for the next wait."""

    def __init__(self) -> None:
        self._waiting: dict[str, deque[asyncio.Future[EventOutcome]]] = defaultdict(deque)
        self._early: dict[str, deque[EventOutcome]] = defaultdict(deque)
        self._failure: BaseException | None = None
        self.lines: list[dict[str, Any]] = []
        """Every line the service logged for a settled delivery, in order."""

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if event != "message settled" or "outcome" not in fields:
            return
        self.lines.append(dict(fields, level=logging.getLevelName(level).lower()))
        outcome = EventOutcome.from_log_line(fields)
        message_id = str(fields.get("message_id"))
        waiting = self._waiting.get(message_id)
        while waiting:
            future = waiting.popleft()
            if not future.done():
                future.set_result(outcome)
                return
        self._early[message_id].append(outcome)

    def expect(self, message_id: str) -> asyncio.Future[EventOutcome]:
        """The outcome of the next delivery of ``message_id`` to be settled."""
        future: asyncio.Future[EventOutcome] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            future.set_exception(HarnessError(str(self._failure)))
        elif self._early[message_id]:
            future.set_result(self._early[message_id].popleft())
        else:
            self._waiting[message_id].append(future)
        return future

    def fail(self, reason: str) -> None:
        """Nothing more will be settled: every wait, now and later, fails with ``reason``."""
        self._failure = HarnessError(reason)
        for futures in self._waiting.values():
            for future in futures:
                if not future.done():
                    future.set_exception(HarnessError(reason))
            futures.clear()

    async def wait(
        self, futures: Sequence[asyncio.Future[EventOutcome]], *, within: float
    ) -> list[EventOutcome]:
        """The outcomes, in order; :class:`HarnessError` if some do not come within ``within``
        seconds (a guard against a hung test, not a measure)."""
        _, pending = await asyncio.wait(futures, timeout=within)
        if pending:
            for future in pending:
                future.cancel()
            raise HarnessError(
                f"{len(pending)} of {len(futures)} deliveries not settled within {within:g}s"
            )
        return [future.result() for future in futures]
