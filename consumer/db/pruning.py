"""Receipt partitions: made ahead, dropped whole once older than the retention; and the outbox's
alike, under the same retention.

The run-time role may not create or drop tables: it calls two functions that its owner made
(sql/005), ``consumer_receipts_extend`` and ``consumer_receipts_prune``. One replica at a time does
either, whoever takes the advisory lock first; the others find it taken and skip this round. Each
statement waits at most ``lock_wait`` for a table lock, so inserts queued behind it wait no longer
than that; a refused lock fails the round, tried again at the next.

The outbox's partitions (sql/008: ``consumer_outbox_extend``, ``consumer_outbox_prune``, which
never drops a partition holding an unsent row) are kept the same way in each round, after the
receipts', in transactions and under an advisory lock of their own: a round that fails on one
table has still done the other's part if it came first.

:class:`ReceiptPruner` runs one round (``consumer receipts prune``);
:class:`consumer.service.pruner.PeriodicPruner` runs one every ``CONSUMER_RECEIPT_PRUNE_INTERVAL``
inside the service.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from consumer.db.retention import ReceiptWindow

__all__ = ["Dropped", "PruneReport", "ReceiptPruner", "ReceiptStats"]

# Any constant works as long as every replica uses the same one ("receipts" in ASCII).
_LOCK_KEY = 0x7265636569707473
_OUTBOX_LOCK_KEY = 0x6F7574626F78  # "outbox"
DEFAULT_LOCK_WAIT = timedelta(milliseconds=200)

_TRY_LOCK = "SELECT pg_try_advisory_xact_lock($1)"
_LOCK = "SELECT pg_advisory_xact_lock($1)"
_EXTEND = "SELECT consumer_receipts_extend($1, $2, $3, $4)"
_PRUNE = "SELECT partition, starts, ends, estimated_rows FROM consumer_receipts_prune($1, $2, $3)"
_OUTBOX_EXTEND = "SELECT consumer_outbox_extend($1, $2, $3, $4)"
_OUTBOX_PRUNE = (
    "SELECT partition, starts, ends, estimated_rows FROM consumer_outbox_prune($1, $2, $3)"
)
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
    """One round: ``ran`` is False when another replica held the lock (the receipts'; the
    outbox's part has its own, ``outbox_ran``)."""

    ran: bool
    dry_run: bool = False
    created: int = 0
    dropped: list[Dropped] = field(default_factory=list)
    outbox_ran: bool = False
    outbox_created: int = 0
    outbox_dropped: list[Dropped] = field(default_factory=list)


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
        say which): the receipts', then the outbox's. Raises the database's error (a lock not
        had in time) for the caller to count; nothing of a failed step stays. ``wait``: make
        the partitions even if another replica holds the lock, after it (start-up: a replica
        must not consume before the partitions for now exist)."""
        receipts = await self._round(conn, _LOCK_KEY, _EXTEND, _PRUNE, dry_run=dry_run, wait=wait)
        outbox = await self._round(
            conn, _OUTBOX_LOCK_KEY, _OUTBOX_EXTEND, _OUTBOX_PRUNE, dry_run=dry_run, wait=wait
        )
        return PruneReport(
            ran=receipts.ran,
            dry_run=dry_run,
            created=receipts.created,
            dropped=receipts.dropped,
            outbox_ran=outbox.ran,
            outbox_created=outbox.created,
            outbox_dropped=outbox.dropped,
        )

    async def _round(
        self,
        conn: asyncpg.Connection[Any],
        lock_key: int,
        extend_sql: str,
        prune_sql: str,
        *,
        dry_run: bool,
        wait: bool,
    ) -> PruneReport:
        """One table's part: its partitions made ahead, then those past the retention dropped."""
        window = self.window
        created = 0
        if not dry_run:
            async with conn.transaction():
                if wait:
                    await conn.execute(_LOCK, lock_key)
                elif not await conn.fetchval(_TRY_LOCK, lock_key):
                    return PruneReport(ran=False)
                extend = (window.partition, window.retention, self._ahead, self._lock_wait)
                created = int(await conn.fetchval(extend_sql, *extend))
        async with conn.transaction():
            if not await conn.fetchval(_TRY_LOCK, lock_key):
                return PruneReport(ran=False, dry_run=dry_run, created=created)
            rows = await conn.fetch(prune_sql, window.retention, self._lock_wait, dry_run)
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
