"""Receipt partitions kept inside the service: a round of
:class:`~consumer.db.pruning.ReceiptPruner` every ``CONSUMER_RECEIPT_PRUNE_INTERVAL``, and the
first before it consumes, so the partitions its receipts (and its outbox rows) need exist; each
round's news in the log and the metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

import asyncpg

from consumer.db.clock import read_clocks
from consumer.db.pruning import Dropped, ReceiptPruner
from consumer.error_text import error_name
from consumer.logs import Logger
from consumer.observe.metrics import Metrics

__all__ = ["PeriodicPruner"]


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
        max_clock_skew: timedelta | None = None,
    ) -> None:
        self._pruner = pruner
        self._max_clock_skew = max_clock_skew
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
                self._log_pruned("receipt", report.created, report.dropped)
            if report.outbox_ran:
                self._log_pruned("outbox", report.outbox_created, report.outbox_dropped)
            stats = await self._pruner.stats(conn)
            metrics.observe_receipts(stats.partitions, stats.estimated_rows, stats.oldest_age)
            metrics.describe_receipt_window(self._pruner.window, widest=stats.widest)
            await self._watch_clocks(conn)
        except Exception as error:
            metrics.receipt_prune_failures.inc()
            self._logger.warning(
                "receipt pruning failed; tried again at the next interval",
                error_class=error_name(error),
                error=str(error),
            )
        finally:
            conn.terminate()

    def _log_pruned(self, table: str, created: int, dropped: list[Dropped]) -> None:
        if dropped or created:
            self._logger.info(
                f"{table} partitions pruned",
                created=created,
                dropped=[one.partition for one in dropped],
                estimated_rows=sum(one.estimated_rows for one in dropped),
            )

    async def _watch_clocks(self, conn: asyncpg.Connection[Any]) -> None:
        """The clocks measured again: a running service does not stop for a skew grown since
        start-up (what it refuses to start with), it says so and the gauge shows it."""
        if self._max_clock_skew is None:
            return
        reading = await read_clocks(conn)
        self._metrics.clock_ahead.set(reading.ahead)
        if reading.beyond(self._max_clock_skew):
            self._logger.warning(
                "clock skew past CONSUMER_MAX_CLOCK_SKEW: synchronise the clocks (NTP)",
                clocks=f"this host's clock is {reading.describe()} the database's",
                ahead_s=round(reading.ahead, 3),
            )
