"""One worker's queue of deliveries, handed out in batches."""

from __future__ import annotations

import asyncio
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    """A FIFO a worker takes batches from.

    A batch is what is ready, up to ``size``. Only when the worker comes back to find deliveries
    already waiting (it is the bottleneck) does a batch wait up to ``wait`` from its first item
    for more: there, fuller batches cost less CPU per event in the service, PostgreSQL and
    RabbitMQ, and on a busy machine that CPU is what the latency is made of. A worker that was
    idle takes the next arrival and goes, so a lone event is never held back.
    """

    def __init__(self, *, size: int, wait: float) -> None:
        self._queue: asyncio.Queue[T] = asyncio.Queue()
        self._size = size
        self._wait = wait

    def put(self, item: T) -> None:
        self._queue.put_nowait(item)

    def drain(self) -> list[T]:
        """Everything queued, taken out at once."""
        taken = []
        while not self._queue.empty():
            taken.append(self._queue.get_nowait())
        return taken

    def __len__(self) -> int:
        return self._queue.qsize()

    async def next_batch(self) -> list[T]:
        backlog = not self._queue.empty()
        batch = [await self._queue.get()]
        deadline = time.monotonic() + self._wait
        while len(batch) < self._size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - time.monotonic()
            if not backlog or remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return batch
