"""Where handlers' time goes: running Python (CPU) or awaiting something (I/O, the database).

A handler's coroutine is stepped through :class:`Stepped`, which times each of its synchronous
steps: the sum is the time the handler held the event loop (its CPU, the pure Python of it), the
rest of its wall time it awaited something. Process or thread CPU clocks cannot tell that apart
in one event loop: while one handler awaits, the loop runs every other task, and their CPU would
count as its own. The tally (:class:`HandlerTime`) is what the worker count and batch size are
decided from (:mod:`consumer.service.concurrency`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["HandlerTime", "HandlerTimeWindow", "Stepped"]

T = TypeVar("T")


class Stepped(Generic[T]):
    """Awaits a coroutine as ``await`` would, summing the time spent inside its steps in
    :attr:`busy`."""

    __slots__ = ("_coro", "busy")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro
        self.busy = 0.0

    def __await__(self) -> Generator[Any, Any, T]:
        coro = self._coro
        clock = time.perf_counter
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            started = clock()
            try:
                step = coro.throw(thrown) if thrown is not None else coro.send(sent)
            except StopIteration as stop:
                self.busy += clock() - started
                return stop.value  # type: ignore[no-any-return]
            except BaseException:
                self.busy += clock() - started
                raise
            self.busy += clock() - started
            try:
                sent = yield step
                thrown = None
            except BaseException as error:  # a cancellation, thrown into the handler
                thrown = error
                sent = None


@dataclass(slots=True)
class HandlerTimeWindow:
    """What handlers and batches took since the window opened (:meth:`HandlerTime.take`)."""

    events: int = 0
    """Events in the batches applied."""
    batches: int = 0
    batch_seconds: float = 0.0
    """Wall time of the batches, from taking them to their verdicts (the transaction's)."""
    batch_cpu: float = 0.0
    """Of that, the time the batches held the loop (parsing, handlers' Python, the driver's)."""
    event_awaited: float = 0.0
    """Per-event handlers: time they awaited (I/O, the database)."""
    event_cpu: float = 0.0
    """Per-event handlers: time they ran Python, holding the loop."""
    event_calls: int = 0
    batch_handler_seconds: float = 0.0
    """Batch handlers (``register_batch``): their calls' wall time."""
    batch_handler_calls: int = 0


class HandlerTime:
    """The running tally, added to by every handler call and batch; read and reset together.

    A handler call's time waits with the task that made it (a worker's) until that task's batch
    is counted: a window then holds whole batches, their handlers' time and theirs together,
    whatever other workers have under way."""

    def __init__(self) -> None:
        self._window = HandlerTimeWindow()
        self._pending: dict[object, HandlerTimeWindow] = {}

    def handler(self, *, batch: bool, wall: float, cpu: float) -> None:
        owner = _current_task()
        window = self._pending.get(owner)
        if window is None:
            window = self._pending[owner] = HandlerTimeWindow()
        if batch:
            window.batch_handler_seconds += wall
            window.batch_handler_calls += 1
        else:
            window.event_awaited += max(0.0, wall - cpu)
            window.event_cpu += cpu
            window.event_calls += 1

    def batch(self, *, events: int, seconds: float, cpu: float) -> None:
        """The current task's batch is done: it and its handlers' calls go in the window."""
        window = self._window
        window.events += events
        window.batches += 1
        window.batch_seconds += seconds
        window.batch_cpu += cpu
        calls = self._pending.pop(_current_task(), None)
        if calls is not None:
            window.event_awaited += calls.event_awaited
            window.event_cpu += calls.event_cpu
            window.event_calls += calls.event_calls
            window.batch_handler_seconds += calls.batch_handler_seconds
            window.batch_handler_calls += calls.batch_handler_calls

    def peek(self) -> HandlerTimeWindow:
        return self._window

    def take(self) -> HandlerTimeWindow:
        """The window so far, and a new one opened."""
        window, self._window = self._window, HandlerTimeWindow()
        return window


def _current_task() -> object:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop: a tool or a test calling a handler directly
        return None
