"""How many workers and how big their batches, from what the handlers were measured to do.

Pure: :func:`decide` takes the limits and a window of measurements
(:class:`~consumer.pipeline.handler_time.HandlerTimeWindow`) and returns a :class:`Choice`; the
service applies it (:mod:`consumer.service.concurrency`).

- One worker runs a batch's handlers one after another in one transaction, so with per-event
  handlers that await I/O (an HTTP call, a cache, their own queries) a process tops out near one
  over the handler's latency. When such awaiting is a large share of a batch's time, more workers
  overlap it: as many as keep the event loop busy (a batch's time over the time it runs Python),
  at most the pool's connections and the prefetch window's deliveries. Their batches are small:
  just big enough that the transaction's own round trips stay a small share next to the handlers'
  time, since every event of a batch holds the batch's row locks and waits for its commit.
- Batch handlers (``register_batch``), database-only or CPU-heavy handlers keep the base worker
  count (one at the default prefetch) and full batches: fewer, fuller transactions cost less per
  event, and more workers would only share one core.
- ``CONSUMER_WORKERS`` and ``CONSUMER_BATCH_SIZE`` pin either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from consumer.pipeline.handler_time import HandlerTimeWindow

__all__ = [
    "AWAITING_SHARE",
    "HANDLER_SHARE",
    "MAX_BATCH_SIZE",
    "MIN_BATCHES",
    "MIN_EVENTS",
    "Choice",
    "Limits",
    "decide",
    "initial",
]

MAX_BATCH_SIZE = 50
"""The batch size when the prefetch allows it: past it a batch saves little per event and makes
a conflict's retry (event by event) longer."""

WINDOW_PER_WORKER = 8 * MAX_BATCH_SIZE
"""Deliveries of the prefetch window per base worker: one at the default prefetch of 400."""

AWAITING_SHARE = 0.4
"""Per-event handlers awaiting at least this share of a batch's time get parallel workers."""

HANDLER_SHARE = 0.8
"""A small batch is sized so that its handlers take at least this share of its time (the rest is
the transaction's own round trips)."""

MIN_EVENTS = 50
"""A window with fewer events (and under :data:`MIN_SECONDS` of batches) decides nothing."""

MIN_SECONDS = 1.0
MIN_BATCHES = 3


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds the choice: the settings."""

    prefetch: int
    pool_size: int
    workers: int | None = None
    """``CONSUMER_WORKERS``: pinned when set."""
    batch_size: int | None = None
    """``CONSUMER_BATCH_SIZE``: pinned when set."""

    @property
    def max_workers(self) -> int:
        """The most workers ever run: one connection each, one delivery each at least."""
        if self.workers is not None:
            return self.workers
        return max(1, min(self.pool_size, self.prefetch))

    @property
    def base_workers(self) -> int:
        """Workers for batch, database-only and CPU-bound handlers: one per 400 deliveries of
        the window."""
        if self.workers is not None:
            return self.workers
        return min(self.max_workers, max(1, self.prefetch // WINDOW_PER_WORKER))

    def full_batch(self, workers: int) -> int:
        """The workers' share of the prefetch window, at most :data:`MAX_BATCH_SIZE`: a batch
        never waits for deliveries the window cannot hold."""
        if self.batch_size is not None:
            return self.batch_size
        return min(MAX_BATCH_SIZE, -(-self.prefetch // workers))


@dataclass(frozen=True, slots=True)
class Choice:
    workers: int
    batch_size: int
    reason: str
    """Why, for the log line: ``start``, ``pinned``, ``handlers await``, ``handlers do not
    await``."""


def initial(limits: Limits) -> Choice:
    """Before anything is measured: the base workers, full batches."""
    workers = limits.base_workers
    pinned = limits.workers is not None and limits.batch_size is not None
    return Choice(workers, limits.full_batch(workers), "pinned" if pinned else "start")


def enough(window: HandlerTimeWindow) -> bool:
    """Whether ``window`` holds enough to decide on."""
    return window.batches >= MIN_BATCHES and (
        window.events >= MIN_EVENTS or window.batch_seconds >= MIN_SECONDS
    )


def decide(limits: Limits, window: HandlerTimeWindow, current: Choice) -> Choice:
    """The choice for what ``window`` measured; ``current`` when it holds too little."""
    if limits.workers is not None and limits.batch_size is not None:
        return Choice(limits.workers, limits.batch_size, "pinned")
    if not enough(window) or window.batch_seconds <= 0:
        return current
    per_event = window.batch_seconds / window.events
    awaited = window.event_awaited / window.events
    if awaited < AWAITING_SHARE * per_event:
        workers = limits.base_workers
        return Choice(workers, limits.full_batch(workers), "handlers do not await")
    # Busy: what a batch holds the loop for. The handlers' CPU is measured; the rest of a
    # batch's time that the handlers do not await is the transaction's (round trips mostly,
    # counted as busy: an overestimate, so fewer workers rather than too many).
    busy = max(per_event - awaited, 1e-6)
    workers = limits.workers or _clamp(math.ceil(per_event / busy), 1, limits.max_workers)
    if limits.batch_size is not None:
        return Choice(workers, limits.batch_size, "handlers await")
    handler = (window.event_awaited + window.event_cpu) / window.events
    overhead = max(0.0, window.batch_seconds - window.event_awaited - window.event_cpu)
    overhead_per_batch = overhead / window.batches
    wanted = math.ceil(
        HANDLER_SHARE / (1 - HANDLER_SHARE) * overhead_per_batch / max(handler, 1e-6)
    )
    size = _clamp(wanted, 1, limits.full_batch(workers))
    return Choice(workers, size, "handlers await")


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))
