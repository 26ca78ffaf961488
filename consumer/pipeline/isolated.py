"""One event isolated: in a transaction of its own, or in a savepoint of the batch's.

:meth:`Isolated.apply` runs an event in its own transaction (when a batch cannot be applied
together); :meth:`Isolated.mark` and :meth:`Isolated.apply_marked` do the same for a delivery that
came back after a process died, marked in progress first (:mod:`consumer.db.crashes`);
:meth:`Isolated.in_savepoint` runs it in a savepoint of an open transaction, whose failure rolls
back only itself. Each savepoint is taken and released inside the event's own failure handling: the
release fails if its handler swallowed a database error, which then blames it and no other.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import asyncpg

from consumer.amqp.delivery import Delivery
from consumer.db.crashes import CrashLedger, Mark
from consumer.db.database import Database
from consumer.db.guard import Guard, guarded_transaction
from consumer.db.receipts import Receipts, TransactionLost
from consumer.errors import HandlerEndedTransaction
from consumer.pipeline.calls import HandlerCaller
from consumer.pipeline.judge import (
    Judge,
    on_a_connection,
    own_fault,
    raise_unless_the_events_fault,
)
from consumer.pipeline.outcome import Applied, Failed, Verdict
from consumer.pipeline.ready import Ready
from consumer.pipeline.tracing import Tracing

__all__ = ["EPOCH", "Isolated"]

EPOCH = datetime.fromtimestamp(0, UTC)
"""The commit time of a verdict reached before its transaction committed (set after)."""

_SAVEPOINT = "SAVEPOINT consumer_event"
_RELEASE_SAVEPOINT = "RELEASE SAVEPOINT consumer_event"
_ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT consumer_event; RELEASE SAVEPOINT consumer_event"


class Isolated:
    """Applies one event at a time."""

    def __init__(
        self,
        *,
        database: Database,
        guard: Guard,
        receipts: Receipts,
        caller: HandlerCaller,
        judge: Judge,
        ledger: CrashLedger,
        tracing: Tracing | None = None,
    ) -> None:
        self._database = database
        self._tracing = tracing or Tracing()
        self._guard = guard
        self._receipts = receipts
        self._caller = caller
        self._judge = judge
        self._ledger = ledger

    async def apply(self, item: Ready) -> Verdict:
        """``item`` in a transaction of its own."""

        async def applied(conn: asyncpg.Connection[Any]) -> Verdict:
            try:
                with self._tracing.transaction([item]):
                    async with guarded_transaction(conn, within=self._guard.within):
                        fresh = await self._receipts.insert(conn, item.event)
                        if fresh:
                            await self._caller.run(conn, item)
                        await self._receipts.seal(conn, [item.event] if fresh else [])
            except (HandlerEndedTransaction, TransactionLost) as ended:
                return await self._after_ended_transaction(conn, item, ended)
            return Applied(duplicate=not fresh, committed_at=datetime.now(UTC))

        return await on_a_connection(
            self._database,
            applied,
            failed=lambda error: self._judge.failed(
                item.delivery,
                own_fault(error, item),
                isolated=True,
                connection_losses=item.connection_losses,
            ),
        )

    async def mark(
        self, delivery: Delivery, event_id: UUID, connection_losses: int = 0
    ) -> Mark | Failed:
        """Mark the event in progress, committed before any of its handler's code runs (its
        payload's validators included); the mark says if it is known to kill processes. A
        verdict instead if the database cannot take the mark."""

        async def marked(conn: asyncpg.Connection[Any]) -> Mark | Failed:
            begin = self._ledger.begin(conn, event_id)
            return self._ledger.mark_of(await self._guard.run(conn, begin, locks=True))

        return await on_a_connection(
            self._database,
            marked,
            failed=lambda error: self._judge.failed(
                delivery, error, isolated=True, connection_losses=connection_losses
            ),
        )

    async def clear(self, event_id: UUID) -> None:
        """Remove the event's mark (its fate is settled); best effort: a mark left behind by a
        live process is never counted as a death."""
        try:
            async with self._database.connection() as conn:
                await self._guard.run(conn, self._ledger.clear(conn, event_id))
        except Exception:  # the database is away: the next delivery judges the mark again
            return

    async def apply_marked(self, item: Ready) -> Verdict:
        """``item``, marked in progress, in a transaction of its own that clears the mark
        whatever the handler does (a handler's failure rolls back only its savepoint)."""
        event_id = item.event.event_id
        guard = self._guard

        async def applied(conn: asyncpg.Connection[Any]) -> Verdict:
            try:
                with self._tracing.transaction([item]):
                    async with guarded_transaction(conn, within=guard.within):
                        verdict = await self.in_savepoint(conn, item)
                        await guard.run(conn, self._ledger.clear(conn, event_id))
                        fresh = [item.event] if _fresh(verdict) else []
                        await self._receipts.seal(conn, fresh)
            except (HandlerEndedTransaction, TransactionLost) as ended:
                verdict = await self._after_ended_transaction(conn, item, ended)
                await guard.run(conn, self._ledger.clear(conn, event_id))
                return verdict
            if isinstance(verdict, Applied):
                return Applied(verdict.duplicate, datetime.now(UTC))
            return verdict

        return await on_a_connection(
            self._database,
            applied,
            failed=lambda error: self._judge.failed(
                item.delivery, error, isolated=True, connection_losses=item.connection_losses
            ),
        )

    async def in_savepoint(self, conn: asyncpg.Connection[Any], item: Ready) -> Verdict:
        """``item`` in a savepoint of the open transaction: its failure rolls back only itself.
        Raises what no event can be blamed for. An applied verdict's time is :data:`EPOCH`."""
        guard = self._guard
        await guard.run(conn, conn.execute(_SAVEPOINT))
        try:
            fresh = await self._receipts.insert(conn, item.event)
            if fresh:
                await self._caller.run(conn, item)
            await guard.run(conn, conn.execute(_RELEASE_SAVEPOINT))
        except Exception as error:
            raise_unless_the_events_fault(conn, error)
            await guard.run(conn, conn.execute(_ROLLBACK_TO_SAVEPOINT))
            return self._judge.failed(
                item.delivery, own_fault(error, item), connection_losses=item.connection_losses
            )
        return Applied(not fresh, EPOCH)

    async def _after_ended_transaction(
        self, conn: asyncpg.Connection[Any], item: Ready, ended: Exception
    ) -> Verdict:
        """The handler committed or rolled back the transaction itself. Receipts commit only
        sealed (sql/004), so nothing of it should have committed; if its receipt did, its effect
        went with it and the event is applied (and the bug reported), else it is dead-lettered."""
        if not isinstance(ended, HandlerEndedTransaction):
            ended = HandlerEndedTransaction.for_handler(item.handler.qualname)
        if await self._receipts.exists(conn, item.event):
            return Applied(False, datetime.now(UTC), note=str(ended))
        return self._judge.failed(item.delivery, ended, connection_losses=item.connection_losses)


def _fresh(verdict: Verdict) -> bool:
    return isinstance(verdict, Applied) and not verdict.duplicate
