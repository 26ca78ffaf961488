"""The isolated deliveries: each applied with nothing else of this process in flight, whichever
queue of the process's queue table it came through.

A delivery that comes back after its process died, or after its database connection broke, may
be the one that kills processes or connections; applied isolated, a second death names it
(:mod:`consumer.db.crashes`). Workers enter each batch through :meth:`IsolatedQueue.batch`; the
isolated worker takes its deliveries one at a time in :meth:`IsolatedQueue.turn`, which waits
until no batch is in flight and keeps new batches out until the queue is empty. Isolated
deliveries go first.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["IsolatedQueue", "IsolationGate"]


class IsolationGate:
    """What the isolated queues of one process share: the batches in flight in all of them, and
    whose isolated turn it is. A queue table's services share one (:func:`consumer.service.app.
    serve_table`): a crash mark says that its event was the only one in flight *in the process*
    when the process died, so while one queue applies a delivery isolated, no other queue's batch
    runs either; otherwise another queue's event could kill the process and the mark would blame
    this one (two such deaths, and an innocent event of one queue is dead-lettered ``crashed``
    for another queue's crash). The cost: after a crash or a broken connection, the deliveries
    that came back are applied one at a time in the whole process, every queue's batches waiting
    meanwhile (a deployment per queue, ``--queues``, has no such coupling)."""

    def __init__(self) -> None:
        self.batches = 0
        self.turn: object | None = None
        self._waiters: list[asyncio.Future[None]] = []

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
    (``gate``: shared by every queue of the process, :class:`IsolationGate`)."""

    def __init__(self, gate: IsolationGate | None = None) -> None:
        self._queue: deque[T] = deque()
        self._gate = gate if gate is not None else IsolationGate()

    def put(self, item: T) -> None:
        self._queue.append(item)
        self._gate.changed()

    def take(self) -> T | None:
        return self._queue.popleft() if self._queue else None

    def take_all(self) -> list[T]:
        """Everything queued, taken out at once."""
        taken = list(self._queue)
        self._queue.clear()
        if taken:
            # Batches that waited for the queue to empty may start now.
            self._gate.changed()
        return taken

    def __len__(self) -> int:
        return len(self._queue)

    async def wait_for_work(self) -> None:
        await self._gate.until(lambda: bool(self._queue))

    def batch(self) -> _Batch:
        """A worker's batch (``async with``): waits while anything is queued here, or any queue
        of the process applies deliveries isolated."""
        return _Batch(self)

    async def _enter_batch(self) -> None:
        gate = self._gate
        if gate.turn is not None or self._queue:
            await gate.until(lambda: gate.turn is None and not self._queue)
        gate.batches += 1

    def _leave_batch(self) -> None:
        self._gate.batches -= 1
        self._gate.changed()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """The isolated deliveries' turn: no other queue's turn, no batch of any queue starts, and
        the ones in flight have ended."""
        gate = self._gate
        await gate.until(lambda: gate.turn is None)
        gate.turn = self
        try:
            await gate.until(lambda: gate.batches == 0)
            yield
        finally:
            gate.turn = None
            gate.changed()


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
