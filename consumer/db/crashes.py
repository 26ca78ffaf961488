"""Crash attribution: naming the event a process died on, so that only it is dead-lettered.

When a process dies, every delivery it held comes back redelivered, each with its delivery count
raised. Without attribution the culprit comes back in the same company and kills the next process
too, until the broker's delivery limit dead-letters it and every innocent neighbour alike.

So a delivery that comes back (redelivered, or held back after its database connection broke) is
applied *isolated*, with nothing else in flight in its process, and before its handler runs a mark
is committed in ``consumer_in_progress``; the event's own transaction deletes the mark. A mark left
by another process says that process died while applying this event and nothing else. After
:data:`CRASH_STRIKES` such deaths the event is dead-lettered (reason ``crashed``). Two, not one: an
operator's SIGKILL that happens to land while one event is applied isolated must not condemn it.

The watchdog, which knows exactly which handler blocked the loop, writes a verdict instead
(``hard_time_limit``) from its own thread before the process exits: that event is dead-lettered at
its next delivery, without running again.

With a queue table, a mark records the queue its delivery came through (the conviction names it,
and the dead letter goes to that queue's dead-letter queue), and "nothing else in flight" holds
for the whole process: the queues share one isolation gate
(:class:`consumer.service.isolated.IsolationGate`), so a crash while one queue's event is applied
isolated is never counted against another queue's delivery. Each queue's service has an owner of
its own; a process's death ends them all.

A mark counts as a death only if its owner is dead. Each process holds a session advisory lock on
its owner id for as long as it lives (:class:`Liveness`), so a mark left by a live process (its
connection broke, or another replica got the same event redelivered meanwhile) counts for
nothing; a process stopping gracefully removes its own marks; and a mark older than the database
server's last start counts for nothing either (the restart broke its owner's work, and may have
kept it from removing the mark as it stopped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg

from consumer.errors import CrashedRepeatedly, HardTimeLimitExceeded, PermanentError

__all__ = ["CRASH_STRIKES", "CrashLedger", "Mark", "owner_key"]

CRASH_STRIKES = 2
"""Deaths of other processes while the event was applied isolated before it is dead-lettered."""

HARD_TIME_LIMIT = "hard_time_limit"

# An owner's advisory lock key: the first 8 bytes of its id, as Python's owner_key computes them.
_KEY_OF_OWNER = "('x' || left(replace(mark.owner::text, '-', ''), 16))::bit(64)::bigint"

# Another owner's mark is a death only if that owner's lock is free (its session has ended: the
# transaction-level lock taken to find out is released as the statement commits), and the server
# has not restarted since the mark was taken (then the restart broke the owner's work, and may
# have kept it from removing its mark as it stopped).
_BEGIN = f"""
INSERT INTO consumer_in_progress AS mark (consumer, event_id, owner, queue)
VALUES ($1, $2, $3, $4)
ON CONFLICT (consumer, event_id) DO UPDATE
SET crashes = mark.crashes + (
        mark.owner <> EXCLUDED.owner
        AND mark.updated_at > pg_postmaster_start_time()
        AND pg_try_advisory_xact_lock({_KEY_OF_OWNER})
    )::integer,
    owner = EXCLUDED.owner,
    queue = EXCLUDED.queue,
    updated_at = now()
RETURNING crashes, verdict, detail, queue
"""

_CLEAR = "DELETE FROM consumer_in_progress WHERE consumer = $1 AND event_id = $2"

_CLEAR_OWN = """
DELETE FROM consumer_in_progress WHERE consumer = $1 AND owner = $2 AND verdict IS NULL
"""

_HOLD = "SELECT pg_advisory_lock($1)"

_CONVICT = """
INSERT INTO consumer_in_progress AS mark (consumer, event_id, owner, verdict, detail, queue)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (consumer, event_id) DO UPDATE
SET verdict = EXCLUDED.verdict, detail = EXCLUDED.detail,
    queue = coalesce(EXCLUDED.queue, mark.queue), updated_at = now()
"""

Connector = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Mark:
    """What the ledger knew of an event when this process began to apply it isolated."""

    crashes: int
    verdict: str | None
    detail: str | None
    queue: str | None = None
    """The queue of the queue table the delivery came through (``None``: no table)."""

    def conviction(self) -> PermanentError | None:
        """The error to dead-letter the event with, if it is known to kill processes; it names
        the queue (the dead letter goes to that queue's dead-letter queue)."""
        if self.verdict == HARD_TIME_LIMIT:
            return HardTimeLimitExceeded(self.detail or "it blocked the event loop before")
        if self.crashes >= CRASH_STRIKES:
            where = f" (queue {self.queue})" if self.queue is not None else ""
            return CrashedRepeatedly(
                f"{self.crashes} processes died while applying this event alone{where}"
            )
        return None


def owner_key(owner: UUID) -> int:
    """The advisory lock key of an owner: the first 8 bytes of its id, as a signed bigint."""
    return int.from_bytes(owner.bytes[:8], "big", signed=True)


class CrashLedger:
    """The marks in ``consumer_in_progress`` of one service and one process (``owner``); with a
    queue table, of one ``queue`` (its marks record it)."""

    def __init__(self, *, consumer: str, owner: UUID, queue: str | None = None) -> None:
        self._consumer = consumer
        self.owner = owner
        self.queue = queue

    def begin(self, conn: asyncpg.Connection[Any], event_id: UUID) -> Awaitable[Any]:
        """Mark ``event_id`` as being applied by this process (run outside a transaction, so it
        is committed before the handler runs); resolves to the row for :meth:`mark_of`."""
        return conn.fetchrow(_BEGIN, self._consumer, event_id, self.owner, self.queue)

    @staticmethod
    def mark_of(row: Any) -> Mark:
        return Mark(
            crashes=row["crashes"], verdict=row["verdict"], detail=row["detail"], queue=row["queue"]
        )

    def clear(self, conn: asyncpg.Connection[Any], event_id: UUID) -> Awaitable[str]:
        """Remove the mark; inside the event's transaction it commits with the event's fate."""
        return conn.execute(_CLEAR, self._consumer, event_id)

    def clear_own(self, conn: asyncpg.Connection[Any]) -> Awaitable[str]:
        """Remove every mark of this process's (a graceful stop: no death to count); verdicts
        stay."""
        return conn.execute(_CLEAR_OWN, self._consumer, self.owner)

    def hold(self, conn: asyncpg.Connection[Any]) -> Awaitable[str]:
        """Take this process's liveness lock on ``conn`` (a session lock: it lasts as long as the
        connection does)."""
        return conn.execute(_HOLD, owner_key(self.owner))

    def convict_blocking(
        self,
        connect: Connector,
        dsn: str,
        event_id: UUID,
        detail: str,
        *,
        timeout: float = 3.0,
    ) -> bool:
        """Record, from a thread other than the blocked event loop's, that ``event_id`` blocked
        the loop past the hard time limit. True if it was recorded within ``timeout``."""

        async def write() -> None:
            conn = await connect(dsn, timeout=timeout)
            try:
                await conn.execute(
                    _CONVICT,
                    self._consumer,
                    event_id,
                    self.owner,
                    HARD_TIME_LIMIT,
                    detail,
                    self.queue,
                )
            finally:
                conn.terminate()

        try:
            asyncio.run(asyncio.wait_for(write(), timeout))
        except Exception:  # the process exits either way; the next one isolates the event
            return False
        return True


class Liveness:
    """This process's liveness lock (:meth:`CrashLedger.hold`), kept on a connection of its own
    for as long as the process runs, taken again whenever that connection is lost."""

    def __init__(
        self, ledger: CrashLedger, connect: Callable[[], Awaitable[asyncpg.Connection[Any]]]
    ) -> None:
        self._ledger = ledger
        self._connect = connect
        self._conn: asyncpg.Connection[Any] | None = None
        self._stopped = False

    async def keep(self, every: float = 1.0) -> None:
        """Hold the lock until :meth:`stop` (a task)."""
        while not self._stopped:
            if self._conn is None or self._conn.is_closed():
                self._conn = None
                try:
                    conn = await self._connect()
                    await asyncio.wait_for(self._ledger.hold(conn), every * 5)
                except Exception:  # the database is away: try again
                    pass
                else:
                    self._conn = conn
            await asyncio.sleep(every)

    async def stop(self, *, keep_marks: bool = False) -> None:
        """A graceful stop: remove this process's marks (nothing of it died), let the lock go.

        ``keep_marks``: the process stops because a worker died of an error nobody expected (a
        bug the event's handling ran into); its marks stay, as a killed process's would, so the
        event that ends every process it meets is convicted instead of looping until the delivery
        limit with its neighbours.
        """
        self._stopped = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not keep_marks:
                await asyncio.wait_for(self._ledger.clear_own(conn), 5)
        except Exception:  # the database is away: a dead owner's mark counts once, no more
            pass
        finally:
            conn.terminate()
