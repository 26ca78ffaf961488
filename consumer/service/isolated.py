"""The isolated deliveries: each applied with nothing else of this process in flight.

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

__all__ = ["IsolatedQueue"]


class IsolatedQueue(Generic[T]):
    """A FIFO of deliveries to apply isolated, and the gate between it and the workers' batches."""

    def __init__(self) -> None:
        self._queue: deque[T] = deque()
        self._batches = 0
        self._turn_taken = False
        self._waiters: list[asyncio.Future[None]] = []

    def put(self, item: T) -> None:
        self._queue.append(item)
        self._changed()

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
        await self._until(lambda: bool(self._queue))

    def batch(self) -> _Batch:
        """A worker's batch (``async with``): waits while anything is queued here or being
        applied isolated."""
        return _Batch(self)

    async def _enter_batch(self) -> None:
        if self._turn_taken or self._queue:
            await self._until(lambda: not self._turn_taken and not self._queue)
        self._batches += 1

    def _leave_batch(self) -> None:
        self._batches -= 1
        self._changed()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """The isolated deliveries' turn: no batch starts, and the ones in flight have ended."""
        self._turn_taken = True
        try:
            await self._until(lambda: self._batches == 0)
            yield
        finally:
            self._turn_taken = False
            self._changed()

    async def _until(self, condition: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while not condition():
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _changed(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


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
