"""Receipt partitions: made ahead, dropped whole once older than the retention.

The run-time role may not create or drop tables: it calls two functions that its owner made
(sql/005), ``consumer_receipts_extend`` and ``consumer_receipts_prune``. One replica at a time does
either, whoever takes the advisory lock first; the others find it taken and skip this round. Each
statement waits at most ``lock_wait`` for a table lock, so inserts queued behind it wait no longer
than that; a refused lock fails the round, tried again at the next.

:class:`ReceiptPruner` runs one round (``consumer receipts prune``); :class:`PeriodicPruner` runs
one every ``CONSUMER_RECEIPT_PRUNE_INTERVAL`` inside the service, and the first before it
consumes, so the partitions its receipts need exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import asyncpg

from consumer.db.retention import ReceiptWindow
from consumer.error_text import error_name
from consumer.logs import Logger
from consumer.observe.metrics import Metrics

__all__ = ["Dropped", "PeriodicPruner", "PruneReport", "ReceiptPruner", "ReceiptStats"]

# Any constant works as long as every replica uses the same one ("receipts" in ASCII).
_LOCK_KEY = 0x7265636569707473
DEFAULT_LOCK_WAIT = timedelta(milliseconds=200)

_TRY_LOCK = "SELECT pg_try_advisory_xact_lock($1)"
_LOCK = "SELECT pg_advisory_xact_lock($1)"
_EXTEND = "SELECT consumer_receipts_extend($1, $2, $3, $4)"
_PRUNE = "SELECT partition, starts, ends, estimated_rows FROM consumer_receipts_prune($1, $2, $3)"
# The legacy table's oldest receipt is not known without reading it all: it counts from its newest.
_STATS = """
SELECT count(*) FILTER (WHERE p.name <> 'receipts_legacy') AS partitions,
       coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint AS estimated_rows,
       extract(epoch FROM now() - min(
           CASE WHEN p.name <> 'receipts_legacy' THEN p.starts
                WHEN p.ends > '-infinity' THEN p.ends END
       ))::float8 AS oldest_age,
       max(p.ends - p.starts) FILTER (WHERE p.name <> 'receipts_legacy') AS widest
FROM consumer_receipt_partitions AS p
LEFT JOIN pg_class AS c ON c.oid = to_regclass(p.name)
"""


@dataclass(frozen=True, slots=True)
class Dropped:
    """A partition dropped (or that would be, in a dry run)."""

    partition: str
    starts: datetime
    ends: datetime
    estimated_rows: int


@dataclass(frozen=True, slots=True)
class PruneReport:
    """One round: ``ran`` is False when another replica held the lock."""

    ran: bool
    dry_run: bool = False
    created: int = 0
    dropped: list[Dropped] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReceiptStats:
    partitions: int
    estimated_rows: int
    oldest_age: float | None
    """Seconds: no receipt kept is older (None when none is kept)."""
    widest: timedelta | None = None
    """The widest partition kept. Partitions made under another
    ``CONSUMER_RECEIPT_PARTITION`` (the migration's are a day wide) keep their width until they
    go, and a day-wide one is rightly kept up to a day past the retention."""


class ReceiptPruner:
    """One round of partition upkeep on a connection the caller holds."""

    def __init__(
        self,
        window: ReceiptWindow,
        *,
        max_future_skew: timedelta,
        lock_wait: timedelta = DEFAULT_LOCK_WAIT,
    ) -> None:
        self.window = window
        self._ahead = window.ahead(max_future_skew)
        self._lock_wait = lock_wait

    async def prune(
        self, conn: asyncpg.Connection[Any], *, dry_run: bool = False, wait: bool = False
    ) -> PruneReport:
        """Make the partitions ahead, then drop those past the retention (``dry_run``: only
        say which). Raises the database's error (a lock not had in time) for the caller to
        count; nothing of a failed step stays. ``wait``: make the partitions even if another
        replica holds the lock, after it (start-up: a replica must not consume before the
        partitions for now exist)."""
        window = self.window
        created = 0
        if not dry_run:
            async with conn.transaction():
                if wait:
                    await conn.execute(_LOCK, _LOCK_KEY)
                elif not await conn.fetchval(_TRY_LOCK, _LOCK_KEY):
                    return PruneReport(ran=False)
                extend = (window.partition, window.retention, self._ahead, self._lock_wait)
                created = int(await conn.fetchval(_EXTEND, *extend))
        async with conn.transaction():
            if not await conn.fetchval(_TRY_LOCK, _LOCK_KEY):
                return PruneReport(ran=False, dry_run=dry_run, created=created)
            rows = await conn.fetch(_PRUNE, window.retention, self._lock_wait, dry_run)
        dropped = [
            Dropped(row["partition"], row["starts"], row["ends"], int(row["estimated_rows"] or 0))
            for row in rows
        ]
        return PruneReport(ran=True, dry_run=dry_run, created=created, dropped=dropped)

    async def stats(self, conn: asyncpg.Connection[Any]) -> ReceiptStats:
        row = await conn.fetchrow(_STATS)
        assert row is not None
        return ReceiptStats(
            int(row["partitions"]), int(row["estimated_rows"]), row["oldest_age"], row["widest"]
        )


class PeriodicPruner:
    """Runs a round every prune interval on a connection of its own, for the life of the
    ``async with`` block, and keeps the receipts' metrics. :meth:`first` runs the first round
    (start-up: the partitions must exist before anything is consumed)."""

    def __init__(
        self,
        pruner: ReceiptPruner,
        *,
        connect: Callable[[], Awaitable[asyncpg.Connection[Any]]],
        logger: Logger,
        metrics: Metrics,
    ) -> None:
        self._pruner = pruner
        self._connect = connect
        self._logger = logger
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        metrics.describe_receipt_window(pruner.window)

    async def __aenter__(self) -> PeriodicPruner:
        self._task = asyncio.create_task(self._keep(), name="receipt-pruner")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def first(self) -> None:
        await self._round(wait=True)

    async def _keep(self) -> None:
        interval = self._pruner.window.prune_interval.total_seconds()
        while True:
            await asyncio.sleep(interval)
            await self._round()

    async def _round(self, *, wait: bool = False) -> None:
        """One round; a failure is logged and counted, never raised: receipts are kept a little
        longer, and the alert on their age says so if it goes on."""
        metrics = self._metrics
        try:
            conn = await self._connect()
        except Exception as error:
            metrics.receipt_prune_failures.inc()
            self._logger.warning("receipt pruning: no database connection", error=str(error))
            return
        try:
            report = await self._pruner.prune(conn, wait=wait)
            if report.ran:
                metrics.receipt_prunes.inc()
                if report.dropped or report.created:
                    self._logger.info(
                        "receipt partitions pruned",
                        created=report.created,
                        dropped=[dropped.partition for dropped in report.dropped],
                        estimated_rows=sum(dropped.estimated_rows for dropped in report.dropped),
                    )
            stats = await self._pruner.stats(conn)
            metrics.observe_receipts(stats.partitions, stats.estimated_rows, stats.oldest_age)
            metrics.describe_receipt_window(self._pruner.window, widest=stats.widest)
        except Exception as error:
            metrics.receipt_prune_failures.inc()
            self._logger.warning(
                "receipt pruning failed; tried again at the next interval",
                error_class=error_name(error),
                error=str(error),
            )
        finally:
            conn.terminate()
