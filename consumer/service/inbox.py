"""One worker's queue of deliveries, handed out in batches."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(Generic[T]):
    """A FIFO a worker takes batches from.

    A batch is what is ready, up to ``size``. Only when the worker comes back to find deliveries
    already waiting (it is the bottleneck) does a batch wait up to ``wait`` for more: there,
    fuller batches cost less CPU per event in the service, PostgreSQL and RabbitMQ, and on a busy
    machine that CPU is what the latency is made of. A worker that was idle takes the next arrival
    and goes, so a lone event is never held back; unless ``refill_due`` says its last batch was
    settled with the prefetch window full: the broker had more for it and sends that refill now,
    one delivery after another, and a batch that went with the first of them would leave the rest
    to batches of one or two (at a small prefetch, most of the time goes to per-transaction round
    trips). Nor does a batch wait for deliveries that cannot come: when ``more_coming`` says the
    prefetch window is full (the broker sends nothing until something settles), and when
    :meth:`wake` says it has filled meanwhile.

    ``max_weight`` bounds a batch by the sum of its items' ``weight`` (their bodies' bytes).

    A plain deque and one future per wait, not an :class:`asyncio.Queue`: every delivery passes
    through here, and a timed ``get`` of a queue costs a task per item. Items stay
    in the inbox until the batch is handed out, so a worker cancelled while it waits loses none.
    """

    def __init__(
        self,
        *,
        size: int,
        wait: float,
        max_weight: int | None = None,
        weight: Callable[[T], int] = lambda _: 0,
        more_coming: Callable[[], bool] = lambda: True,
    ) -> None:
        self._items: deque[T] = deque()
        self._more_coming = more_coming
        self._size = size
        self._wait = wait
        self._max_weight = max_weight
        self._weight = weight
        self._waiter: asyncio.Future[None] | None = None
        self._wanted = 1

    def put(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and len(self._items) >= self._wanted:
            _wake(waiter)

    def wake(self) -> None:
        """Hand out what is queued now instead of waiting for more (none is coming)."""
        waiter = self._waiter
        if waiter is not None and self._items:
            _wake(waiter)

    def take_all(self) -> list[T]:
        """Everything queued, taken out at once."""
        taken = list(self._items)
        self._items.clear()
        return taken

    def __len__(self) -> int:
        return len(self._items)

    async def next_batch(self, *, refill_due: bool = False) -> list[T]:
        loop = asyncio.get_running_loop()
        waits = bool(self._items)
        if not waits:
            asked = loop.time()
            await self._until(1, None)
            # A refill comes at once: a first delivery later than a batch's wait is a lone event.
            waits = refill_due and loop.time() - asked <= self._wait
        if waits and len(self._items) < self._size and self._wait > 0 and self._more_coming():
            await self._until(self._size, loop.time() + self._wait)
        items = self._items
        count = min(self._size, len(items))
        if self._max_weight is not None:
            # A batch's bodies are parsed together: bound their bytes (at least one, whatever
            # its size).
            total = 0
            for index in range(count):
                total += self._weight(items[index])
                if total > self._max_weight and index > 0:
                    count = index
                    break
        return [items.popleft() for _ in range(count)]

    async def _until(self, count: int, deadline: float | None) -> None:
        """Wait until ``count`` items are queued, or the loop's clock reaches ``deadline``."""
        loop = asyncio.get_running_loop()
        self._wanted = count
        self._waiter = waiter = loop.create_future()
        timer = loop.call_at(deadline, _wake, waiter) if deadline is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
