"""How many workers and how big their batches, from what the handlers were measured to do.

Pure: :func:`decide` takes the limits and a window of measurements
(:class:`~consumer.pipeline.handler_time.HandlerTimeWindow`) and returns a :class:`Choice`; the
service applies it (:mod:`consumer.service.concurrency`).

- One worker runs a batch's per-event handlers one after another in one transaction, so a
  process tops out near one over the handler's latency. A batch holds the event loop (its Python:
  parsing, the handlers', the driver's) for part of its time and awaits the rest (the database,
  the handlers' I/O): workers enough that one's awaiting overlaps another's running (a batch's
  time over the time it holds the loop, rounded) keep the process busy, at most the pool's
  connections and the prefetch window's deliveries. A CPU-heavy handler stays at one.
- Handlers that await most of a batch's time (an HTTP call, a cache) also get small batches: just
  big enough that the transaction's own round trips are a small share next to the handlers'
  time, since every event of a batch waits for its commit and holds its row locks until then.
- Batch handlers (``register_batch``) keep the base worker count (one at the default prefetch)
  and full batches: one call does a batch's work in a few statements, and more workers would
  make fewer, emptier transactions.
- ``CONSUMER_WORKERS`` and ``CONSUMER_BATCH_SIZE`` pin either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from consumer.pipeline.handler_time import HandlerTimeWindow

__all__ = [
    "BATCH_TOLERANCE",
    "HANDLER_SHARE",
    "MAX_BATCH_SIZE",
    "MIN_BATCHES",
    "MIN_EVENTS",
    "START_BATCH_SIZE",
    "Choice",
    "Limits",
    "decide",
    "initial",
    "material",
]

MAX_BATCH_SIZE = 50
"""The batch size when the prefetch allows it: past it a batch saves little per event and makes
a conflict's retry (event by event) longer."""

WINDOW_PER_WORKER = 8 * MAX_BATCH_SIZE
"""Deliveries of the prefetch window per base worker: one at the default prefetch of 400."""

START_BATCH_SIZE = 5
"""The batch size per-event handlers start with, before their time is measured (:func:`initial`)."""

BATCH_TOLERANCE = 1.5
"""Batch sizes closer than this factor are the same choice (:func:`material`)."""

HANDLER_SHARE = 0.95
"""A small batch is sized so that its handlers take at least this share of its time (the rest is
the transaction's own round trips)."""

MIN_EVENTS = 200
"""A window with fewer events (and under :data:`MIN_SECONDS` of batches) decides nothing."""

MIN_SECONDS = 2.0
"""Batches' time (summed over workers) that is enough whatever their events: a slow handler's."""
MIN_BATCHES = 4


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds the choice: the settings."""

    prefetch: int
    pool_size: int
    workers: int | None = None
    """``CONSUMER_WORKERS``: pinned when set."""
    batch_size: int | None = None
    """``CONSUMER_BATCH_SIZE``: pinned when set."""
    per_event_handlers: bool = False
    """Whether every handler is a per-event one (``register``): then the start is
    :func:`initial`'s guess for handlers that may await, not the batch handlers' single worker."""

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
    """Why, for the log line: ``start``, ``pinned``, ``batch handlers``, ``handlers await``
    (more than one worker), ``handlers do not await``."""


def initial(limits: Limits) -> Choice:
    """Before anything is measured. Batch handlers only: the base workers, full batches (what
    they keep). Per-event handlers: every worker the pool allows, small batches. A handler that
    awaits (an HTTP call of 50 ms) would otherwise spend its first batch, fifty calls one after
    another, before anything could be decided (2.5 s); small batches are measured within a few
    hundred milliseconds whatever the handler, and a database-only or CPU-bound one is moved to
    its own choice as soon as they are."""
    pinned = limits.workers is not None and limits.batch_size is not None
    reason = "pinned" if pinned else "start"
    if not limits.per_event_handlers:
        workers = limits.base_workers
        return Choice(workers, limits.full_batch(workers), reason)
    workers = limits.max_workers
    if limits.batch_size is not None:
        return Choice(workers, limits.batch_size, reason)
    return Choice(workers, min(START_BATCH_SIZE, limits.full_batch(workers)), reason)


def enough(window: HandlerTimeWindow) -> bool:
    """Whether ``window`` holds enough to decide on: a few batches of enough events, or enough
    time."""
    if window.batches >= MIN_BATCHES and window.events >= MIN_EVENTS:
        return True
    return window.batches >= 1 and window.batch_seconds >= MIN_SECONDS


def decide(limits: Limits, window: HandlerTimeWindow, current: Choice) -> Choice:
    """The choice for what ``window`` measured; ``current`` when it holds too little."""
    if limits.workers is not None and limits.batch_size is not None:
        return Choice(limits.workers, limits.batch_size, "pinned")
    if not enough(window) or window.batch_seconds <= 0:
        return current
    if window.event_calls == 0:
        # Batch handlers only: one call does a batch's work in a few statements, and more
        # workers would make fewer, emptier transactions (README "Performance").
        workers = limits.base_workers
        return Choice(workers, limits.full_batch(workers), "batch handlers")
    # A batch holds the loop for ``cpu`` of its ``seconds``; the rest it awaits (the database,
    # the handlers' I/O). Workers enough that their awaiting overlaps another's running keep the
    # process busy: ``seconds / cpu``, rounded (a CPU-bound handler, 2 ms of Python and a round
    # trip, stays at one).
    cpu = max(window.batch_cpu, 1e-6 * window.batches)
    wanted = math.floor(window.batch_seconds / cpu + 0.5)
    workers = limits.workers or _clamp(wanted, 1, limits.max_workers)
    reason = "handlers await" if workers > 1 else "handlers do not await"
    if limits.batch_size is not None:
        return Choice(workers, limits.batch_size, reason)
    # A batch just big enough that the transaction's own time is a small share next to its
    # handlers': for handlers that await long (an HTTP call) a few events, since every event of
    # a batch waits for its commit and holds its row locks until then; for quick ones the
    # window's share.
    handler = (window.event_awaited + window.event_cpu) / window.event_calls
    overhead = max(0.0, window.batch_seconds - window.event_awaited - window.event_cpu)
    overhead_per_batch = overhead / window.batches
    size = math.ceil(HANDLER_SHARE / (1 - HANDLER_SHARE) * overhead_per_batch / max(handler, 1e-6))
    return Choice(workers, _clamp(size, 1, limits.full_batch(workers)), reason)


def material(one: Choice, other: Choice) -> bool:
    """Whether ``one`` and ``other`` differ by more than measuring noise: another worker count,
    or batch sizes more than :data:`BATCH_TOLERANCE` times apart."""
    if one.workers != other.workers:
        return True
    low, high = sorted((one.batch_size, other.batch_size))
    return high > low * BATCH_TOLERANCE


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))
