"""One worker's queue of deliveries, handed out in batches."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    """A FIFO a worker takes batches from.

    A batch is what is ready, up to ``size``. It waits up to ``wait`` (from its first item) for
    more only while items are arriving faster than one per ``wait``: under steady load a short
    wait turns many one-event transactions into a few larger ones, which is what keeps the CPU
    per event, and so the latency, down; an event arriving alone is never held back.
    """

    def __init__(self, *, size: int, wait: float) -> None:
        self._queue: asyncio.Queue[T] = asyncio.Queue()
        self._size = size
        self._wait = wait
        self._last_arrival = -math.inf
        self._arriving_fast = False

    def put(self, item: T) -> None:
        now = time.monotonic()
        self._arriving_fast = now - self._last_arrival < self._wait
        self._last_arrival = now
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
        batch = [await self._queue.get()]
        deadline = time.monotonic() + self._wait
        while len(batch) < self._size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - time.monotonic()
            if not self._arriving_fast or remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return batch
