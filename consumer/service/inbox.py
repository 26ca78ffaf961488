"""One worker's queue of deliveries, handed out in batches."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Inbox"]

T = TypeVar("T")

MAX_LINGER = 0.05
"""The longest a refill is ever waited for, whatever a batch is measured to take."""
GAPS_TO_WAIT = 4
"""A refill is over when no delivery came within this many measured gaps between arrivals."""
MIN_GAP_WAIT = 0.0005
"""The shortest wait for a refill's next delivery: below it the loop's own turns decide."""
GAP_WEIGHT = 0.1
"""The weight of the newest gap in the moving average."""
ARRIVAL_GAP_START = 0.001


class Inbox(Generic[T]):
    """A FIFO a worker takes batches from, group-commit style.

    A batch is what is waiting when the worker asks, up to ``size``: a worker that was idle takes
    the next arrival and goes at once, and one that comes back from a commit takes what arrived
    meanwhile. So at low and moderate load every delivery starts its transaction as it arrives,
    and batches grow by themselves exactly when deliveries arrive faster than transactions commit.

    One wait is left, for the refill of a prefetch window: when ``refill_due`` says the worker's
    last batch was settled with the window full, the broker sends its refill now, one delivery
    after another, and a batch that went with the first of them would leave the rest to batches
    of one or two (at a small prefetch most of the time then goes to per-transaction round trips).
    The batch lingers while deliveries keep coming: after each arrival for a few times the
    measured gap between arrivals, never longer in all than ``linger`` (the caller's measured time
    of a batch: waiting longer than a commit takes costs more than it saves) nor than ``wait``
    (``CONSUMER_BATCH_WAIT`` when set). Nor does it wait for deliveries that cannot come: when
    ``more_coming`` says the prefetch window is full (the broker sends nothing until something
    settles), and when :meth:`wake` says it has filled meanwhile.

    ``max_weight`` bounds a batch by the sum of its items' ``weight`` (their bodies' bytes).

    A plain deque and one future per wait, not an :class:`asyncio.Queue`: every delivery passes
    through here, and a timed ``get`` of a queue costs a task per item. Items stay
    in the inbox until the batch is handed out, so a worker cancelled while it waits loses none.
    """

    def __init__(
        self,
        *,
        size: int,
        wait: float | None = None,
        max_weight: int | None = None,
        weight: Callable[[T], int] = lambda _: 0,
        more_coming: Callable[[], bool] = lambda: True,
        max_linger: float = MAX_LINGER,
        min_gap_wait: float = MIN_GAP_WAIT,
    ) -> None:
        """``max_linger`` and ``min_gap_wait``: :data:`MAX_LINGER` and :data:`MIN_GAP_WAIT`
        (tests give them seconds to make a wait certain)."""
        self._items: deque[T] = deque()
        self._max_linger = max_linger
        self._min_gap_wait = min_gap_wait
        self._more_coming = more_coming
        self.size = size
        """The most items a batch takes (changed as the service runs:
        :mod:`consumer.service.concurrency`)."""
        self._wait = wait
        self._max_weight = max_weight
        self._weight = weight
        self._waiter: asyncio.Future[None] | None = None
        self._wanted = 1
        self._last_put = 0.0
        self._gap = ARRIVAL_GAP_START
        """Measured gap between arrivals (a moving average), in seconds."""

    def put(self, item: T) -> None:
        self._items.append(item)
        now = time.monotonic()
        gap = now - self._last_put
        self._last_put = now
        # Gaps longer than any linger say nothing about a refill's pace.
        if gap < self._max_linger:
            self._gap += (gap - self._gap) * GAP_WEIGHT
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

    @property
    def arrival_gap(self) -> float:
        """The measured gap between arrivals, in seconds."""
        return self._gap

    def linger_for(self, batch_seconds: float) -> float:
        """How long in all a refill's batch may wait, given the measured time of a batch."""
        linger = min(batch_seconds, self._max_linger)
        if self._wait is not None:
            linger = min(linger, self._wait)
        return linger

    async def next_batch(self, *, refill_due: bool = False, batch_seconds: float = 0.0) -> list[T]:
        """What is waiting, up to :attr:`size`; the next arrival if nothing is. ``refill_due``:
        the worker's last batch was settled with the window full; ``batch_seconds``: the
        measured time of its batches (the most a refill is waited for)."""
        loop = asyncio.get_running_loop()
        if not self._items:
            asked = loop.time()
            await self._until(1, None)
            linger = self.linger_for(batch_seconds) if refill_due else 0.0
            # A refill comes at once: a first delivery later than that is a lone event.
            if linger > 0 and loop.time() - asked <= linger:
                await self._linger(loop.time() + linger)
        return self._take()

    async def _linger(self, end: float) -> None:
        """Wait while deliveries keep coming, each within a few measured gaps of the one before,
        until a batch is full, the window is, or ``end``."""
        loop = asyncio.get_running_loop()
        while len(self._items) < self.size and self._more_coming():
            now = loop.time()
            deadline = min(end, now + max(self._gap * GAPS_TO_WAIT, self._min_gap_wait))
            if deadline <= now:
                return
            before = len(self._items)
            await self._until(before + 1, deadline)
            if len(self._items) == before:
                return  # none came within the gap: the refill is in

    def _take(self) -> list[T]:
        items = self._items
        count = min(self.size, len(items))
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
