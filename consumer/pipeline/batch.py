"""The batch engine: several events in one transaction, and what happens when that fails.

::

    BEGIN; every receipt in one statement; the handlers one after the other (a batch handler once
    for each run of consecutive events of its type); seal; COMMIT
      a handler failed       -> ROLLBACK, again without it, each event in a savepoint
      another batch's locks  -> commit what is done, the rest in a further round (after three,
                                one by one)
      anything else          -> each event isolated, in a transaction of its own

A handler can therefore run more than once for one event, but only its last, committed run has
any effect. A transaction a handler left aborted (it swallowed a database error) fails its seal
instead of committing (:func:`consumer.db.guard.guarded_transaction`), and a handler that ended the
transaction itself is caught after its call: either way the batch is applied again and only the
culprit fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import asyncpg

from consumer.classification import ErrorKind, classify
from consumer.db.database import Database
from consumer.db.guard import Guard, guarded_transaction
from consumer.db.receipts import Receipts
from consumer.envelope import Envelope
from consumer.error_text import message_of
from consumer.errors import IdConflict
from consumer.pipeline.calls import HandlerCaller
from consumer.pipeline.isolated import EPOCH, Isolated
from consumer.pipeline.judge import (
    Judge,
    aborted_before,
    on_a_connection,
    raise_unless_the_events_fault,
)
from consumer.pipeline.outcome import Applied, Failed, Verdict
from consumer.pipeline.ready import Ready
from consumer.pipeline.retry import Return
from consumer.pipeline.tracing import Tracing

__all__ = ["BatchEngine"]

MAX_ROUNDS = 3
"""A batch that keeps colliding with other batches is applied event by event after this many."""

# Conflicts that batching can cause between concurrent transactions: a lock wait past
# CONSUMER_BATCH_LOCK_TIMEOUT, a deadlock, a serialization failure.
_CONTENTION = (
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.LockNotAvailableError,
)


class _ApplyIsolated(Exception):
    """The batch's transaction failed as a whole; apply each event in its own."""


class _HandlerFailed(Exception):
    """A handler failed in an optimistic batch: roll it back, go again with savepoints.

    ``index`` is the event it failed, or None when no event can be blamed yet (a batch handler's
    call failed as a whole; a handler met a transaction an earlier one had aborted).
    """

    def __init__(self, index: int | None, error: Exception) -> None:
        super().__init__(message_of(error))
        self.index = index
        self.error = error


class BatchEngine:
    """Applies prepared events, together where it can; one verdict per event, in order."""

    def __init__(
        self,
        *,
        database: Database,
        guard: Guard,
        receipts: Receipts,
        caller: HandlerCaller,
        judge: Judge,
        isolated: Isolated,
        lock_timeout_ms: int,
        on_conflict: Callable[[], object] = lambda: None,
        tracing: Tracing | None = None,
    ) -> None:
        self._database = database
        self._tracing = tracing or Tracing()
        self._guard = guard
        self._receipts = receipts
        self._caller = caller
        self._judge = judge
        self._isolated = isolated
        self._lock_timeout_value = f"{lock_timeout_ms}ms"
        self._lock_timeout = f"SET LOCAL lock_timeout = '{lock_timeout_ms}ms'"
        self._on_conflict = on_conflict

    async def apply(self, items: list[Ready], rounds: int = 0) -> list[Verdict]:
        if len(items) == 1:
            return [await self._isolated.apply(items[0])]
        if rounds >= MAX_ROUNDS:
            # Still colliding with other batches: wait for locks like any single transaction.
            return await self._each_isolated(items)
        try:
            return await self._together(items, rounds)
        except _ApplyIsolated:
            return await self._each_isolated(items)

    async def _each_isolated(self, items: list[Ready]) -> list[Verdict]:
        verdicts: list[Verdict] = []
        for item in items:
            previous = verdicts[-1] if verdicts else None
            if isinstance(previous, Failed) and isinstance(previous.decision, Return):
                # The database went away: give the rest back without knocking for each.
                verdicts.append(
                    self._judge.failed(
                        item.delivery, previous.error, connection_losses=item.connection_losses
                    )
                )
                continue
            verdicts.append(await self._isolated.apply(item))
        return verdicts

    async def _together(self, items: list[Ready], rounds: int) -> list[Verdict]:
        """One transaction for the batch: optimistically first, then in savepoints if a handler
        failed. A lock conflict that batching itself causes (``_CONTENTION``) is no failure of
        the event: what is done commits, releasing its locks, and the rest goes round again."""
        deferred: list[int] = []

        async def applied(conn: asyncpg.Connection[Any]) -> list[Verdict | None]:
            try:
                with self._tracing.transaction(items):
                    return list(await self._optimistically(conn, items))
            except _HandlerFailed as failure:
                with self._tracing.transaction(items):
                    return await self._in_savepoints(conn, items, failure, deferred)

        def failed(error: Exception) -> list[Verdict | None]:
            if classify(error) is ErrorKind.UNAVAILABLE:
                deferred.clear()  # nothing committed: every event waits for the database
                return [
                    self._judge.failed(
                        item.delivery, error, connection_losses=item.connection_losses
                    )
                    for item in items
                ]
            raise _ApplyIsolated from error

        found = await on_a_connection(self._database, applied, failed=failed)
        committed_at = datetime.now(UTC)
        verdicts = [
            Applied(v.duplicate, committed_at) if isinstance(v, Applied) else v for v in found
        ]
        if deferred:
            # In the batch's order: the failed event deferred first may come before the rest.
            deferred.sort()
            again = await self.apply([items[index] for index in deferred], rounds + 1)
            for index, verdict in zip(deferred, again, strict=True):
                verdicts[index] = verdict
        done = [verdict for verdict in verdicts if verdict is not None]
        assert len(done) == len(verdicts), "every event of a batch gets a verdict"
        return done

    async def _optimistically(
        self, conn: asyncpg.Connection[Any], items: list[Ready]
    ) -> list[Verdict | None]:
        async with guarded_transaction(conn, within=self._guard.within):
            # A batch holds its row locks until it commits: never wait long behind another
            # batch (see _CONTENTION), so lock convoys cannot build up. The receipts' statement
            # sets the lock timeout.
            fresh = await self._receipts.insert_many(
                conn, [item.event for item in items], lock_timeout=self._lock_timeout_value
            )
            verdicts: list[Verdict | None] = [None] * len(items)
            if len(fresh) < len(items):
                # Only a batch with duplicates asks: is any of them another type's id?
                self._conflicts(
                    items, verdicts, await self._receipts.other_types(conn, _copies(items, fresh))
                )
            start = 0
            while start < len(items):
                # A run: consecutive events of one handler. A batch handler takes its run in one
                # call; runs stay in order, so a restock still comes before the reserve after it.
                handler = items[start].handler
                end = start + 1
                if handler.many is not None:
                    while end < len(items) and items[end].handler is handler:
                        end += 1
                run: list[int] = []
                for index in range(start, end):
                    if items[index].event.event_id in fresh:
                        run.append(index)
                    elif verdicts[index] is None:
                        verdicts[index] = Applied(True, EPOCH)
                if run:
                    await self._run(conn, items, run)
                    for index in run:
                        verdicts[index] = Applied(False, EPOCH)
                start = end
            await self._receipts.seal(conn, _fresh(items, verdicts))
        return verdicts

    def _conflicts(
        self, items: list[Ready], verdicts: list[Verdict | None], other_types: dict[UUID, str]
    ) -> None:
        """Fail each event whose id a receipt of another type holds (``other_types``)."""
        for index, item in enumerate(items):
            stored_type = other_types.get(item.event.event_id)
            if stored_type is not None:
                conflict = IdConflict.between(item.event.event_id, item.event.type, stored_type)
                verdicts[index] = self._judge.failed(item.delivery, conflict)

    async def _run(self, conn: asyncpg.Connection[Any], items: list[Ready], run: list[int]) -> None:
        """Apply one run of fresh events, or raise :class:`_HandlerFailed` (leaving the
        transaction, which rolls it back) or what makes the whole batch moot."""
        failed: int | None = run[0] if len(run) == 1 else None
        try:
            if len(run) == 1:
                await self._caller.run(conn, items[run[0]])
                return
            results = await self._caller.run_batch(conn, [items[index] for index in run])
            for index, result in zip(run, results, strict=True):
                if result is not None:
                    failed = None if aborted_before(result) else index
                    raise result
        except Exception as error:
            raise_unless_the_events_fault(conn, error)
            if aborted_before(error):
                failed = None  # a handler before this one swallowed an error: not this one's
            raise _HandlerFailed(failed, error) from error

    async def _in_savepoints(
        self,
        conn: asyncpg.Connection[Any],
        items: list[Ready],
        failure: _HandlerFailed,
        deferred: list[int],
    ) -> list[Verdict | None]:
        verdicts: list[Verdict | None] = [None] * len(items)
        if isinstance(failure.error, _CONTENTION):
            self._on_conflict()
            if failure.index is not None:
                deferred.append(failure.index)
        elif failure.index is not None:
            failed = items[failure.index]
            verdicts[failure.index] = self._judge.failed(
                failed.delivery, failure.error, connection_losses=failed.connection_losses
            )
        kept = [index for index in range(len(items)) if index != failure.index]
        async with guarded_transaction(conn, within=self._guard.within):
            await self._guard.run(conn, conn.execute(self._lock_timeout))
            for number, index in enumerate(kept):
                verdict = await self._isolated.in_savepoint(conn, items[index])
                if isinstance(verdict, Failed) and isinstance(verdict.error, _CONTENTION):
                    self._on_conflict()
                    # Commit what is done, so our locks go; the rest goes round again.
                    deferred.extend(kept[number:])
                    break
                verdicts[index] = verdict
            await self._receipts.seal(conn, _fresh(items, verdicts))
        return verdicts


def _copies(items: list[Ready], fresh: set[UUID]) -> list[Envelope[Any]]:
    """The events whose receipts were there already."""
    return [item.event for item in items if item.event.event_id not in fresh]


def _fresh(items: list[Ready], verdicts: Sequence[Verdict | None]) -> list[Envelope[Any]]:
    """The events whose receipts the transaction inserted and keeps: applied, not duplicates."""
    return [
        item.event
        for item, verdict in zip(items, verdicts, strict=True)
        if isinstance(verdict, Applied) and not verdict.duplicate
    ]
