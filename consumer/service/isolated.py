"""The isolated deliveries: each applied with nothing else of this process in flight.

A delivery that comes back after its process died, or after its database connection broke, may
be the one that kills processes or connections; applied isolated, a second death names it
(:mod:`consumer.db.crashes`). Workers enter each batch through :meth:`IsolatedQueue.batch`; the
isolated worker takes its deliveries one at a time in :meth:`IsolatedQueue.turn`, which waits
until no batch is in flight and keeps new batches out until the queue is empty. Isolated
deliveries go first. A queue table's services share the gate (:class:`IsolationGate`): isolated
means nothing else of the process in flight, whichever queue it came through.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["IsolatedQueue", "IsolationGate"]


class IsolationGate:
    """The process's gate between isolated deliveries and batches: what "nothing else in flight"
    means for crash attribution. A queue table's services share one, so that a delivery applied
    isolated in one queue has no batch and no isolated delivery of any other queue beside it: a
    death then names it alone, never an innocent of another queue applied at the same moment.
    The price: an isolated turn waits for every queue's batches in flight to end (each within its
    queue's handler timeout), and holds new ones back meanwhile."""

    def __init__(self) -> None:
        self.batches = 0
        self.turn_taken = False
        self._turns = asyncio.Lock()
        self._waiters: list[asyncio.Future[None]] = []

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """One isolated worker's turn (one queue's at a time): no batch starts, and the ones in
        flight have ended."""
        async with self._turns:
            self.turn_taken = True
            try:
                await self.until(lambda: self.batches == 0)
                yield
            finally:
                self.turn_taken = False
                self.changed()

    async def until(self, condition: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while not condition():
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def changed(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class IsolatedQueue(Generic[T]):
    """A FIFO of deliveries to apply isolated, and the gate between it and the workers' batches
    (the process's, where several services share one: :class:`IsolationGate`)."""

    def __init__(self, gate: IsolationGate | None = None) -> None:
        self._queue: deque[T] = deque()
        self._gate = gate or IsolationGate()

    def put(self, item: T) -> None:
        self._queue.append(item)
        self._gate.changed()

    def take(self) -> T | None:
        return self._queue.popleft() if self._queue else None

    def take_all(self) -> list[T]:
        """Everything queued, taken out at once."""
        taken = list(self._queue)
        self._queue.clear()
        return taken

    def __len__(self) -> int:
        return len(self._queue)

    async def wait_for_work(self) -> None:
        await self._gate.until(lambda: bool(self._queue))

    def batch(self) -> _Batch:
        """A worker's batch (``async with``): waits while anything is queued here or being
        applied isolated (in any queue sharing the gate)."""
        return _Batch(self)

    async def _enter_batch(self) -> None:
        gate = self._gate
        if gate.turn_taken or self._queue:
            await gate.until(lambda: not gate.turn_taken and not self._queue)
        gate.batches += 1

    def _leave_batch(self) -> None:
        self._gate.batches -= 1
        self._gate.changed()

    def turn(self) -> AbstractAsyncContextManager[None]:
        """The isolated deliveries' turn: no batch starts, and the ones in flight have ended."""
        return self._gate.turn()


class _Batch:
    """:meth:`IsolatedQueue.batch`'s context: a class, not a generator's context manager, as every
    batch enters one."""

    __slots__ = ("_queue",)

    def __init__(self, queue: IsolatedQueue[Any]) -> None:
        self._queue = queue

    async def __aenter__(self) -> None:
        await self._queue._enter_batch()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._queue._leave_batch()
