"""The service's own statements under a time limit: a server that stops answering is a
:class:`~consumer.errors.DatabaseStalled`, not a connection held for as long as TCP lasts.

Handlers' statements are not guarded here: the handler's own time limit covers them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import asyncpg

from consumer.db.database import Database
from consumer.deadlines import Deadline
from consumer.errors import DatabaseStalled

__all__ = ["Guard", "GuardedTransaction", "LockCheck", "guarded", "guarded_transaction"]

T = TypeVar("T")

LockCheck = Callable[[int], Awaitable[bool]]
"""Whether the server backend with this pid waits for a lock: :meth:`Database.waiting_on_lock`."""


async def guarded(
    conn: asyncpg.Connection[Any],
    step: Awaitable[T],
    *,
    within: float,
    lock_check: LockCheck | None = None,
) -> T:
    """``step`` on ``conn``, or :class:`DatabaseUnavailable` if no answer comes ``within`` seconds.

    For the service's own statements (BEGIN, receipts, savepoints, COMMIT): a server that stops
    answering (frozen, partitioned) would otherwise hold the connection for as long as TCP does.
    The connection is dropped; whatever it was doing is rolled back by the server or, if the
    COMMIT got through, found as a receipt when the message comes back.

    A statement that can wait for another transaction's row lock (a receipt whose first copy is
    still being applied) passes ``lock_check``: while the server says the backend waits for a
    lock, that is contention and the statement goes on waiting; only a silent server is a stall.
    """
    if lock_check is not None:
        return await _guarded_with_locks(conn, step, within, lock_check)
    deadline = Deadline(within)
    try:
        async with deadline:
            return await step
    except TimeoutError:
        if not deadline.expired:
            raise
        conn.terminate()
        raise DatabaseStalled(f"the database did not answer within {within:g}s") from None


async def _guarded_with_locks(
    conn: asyncpg.Connection[Any], step: Awaitable[T], within: float, lock_check: LockCheck
) -> T:
    pid = conn.get_server_pid()
    stalled = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal stalled
        while True:
            if not await lock_check(pid):
                stalled = True
                conn.terminate()
                return
            await asyncio.sleep(within)

    def start_watching() -> None:
        # A timer first, the watching task only once the limit has passed: almost every
        # statement answers long before, and a task for each would cost more than the timer.
        nonlocal watcher
        watcher = loop.create_task(watch())

    loop = asyncio.get_running_loop()
    timer = loop.call_later(within, start_watching)
    try:
        return await step
    except Exception:
        if stalled:
            raise DatabaseStalled(f"the database did not answer within {within:g}s") from None
        raise
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


def guarded_transaction(conn: asyncpg.Connection[Any], *, within: float) -> GuardedTransaction:
    """A transaction whose BEGIN, COMMIT and ROLLBACK are each :func:`guarded`. Its receipts
    commit only if it is sealed first (:meth:`consumer.db.receipts.Receipts.seal`)."""
    return GuardedTransaction(conn, within)


class GuardedTransaction:
    """What :func:`guarded_transaction` returns: ``async with`` it. A class, not a generator's
    context manager: every batch enters one."""

    __slots__ = ("_conn", "_transaction", "_within")

    def __init__(self, conn: asyncpg.Connection[Any], within: float) -> None:
        self._conn = conn
        self._within = within
        self._transaction = conn.transaction()

    async def __aenter__(self) -> None:
        await guarded(self._conn, self._transaction.start(), within=self._within)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn = self._conn
        if exc_type is None:
            await guarded(conn, self._transaction.commit(), within=self._within)
        elif not _closed(conn):
            await guarded(conn, self._transaction.rollback(), within=self._within)


def _closed(conn: asyncpg.Connection[Any]) -> bool:
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True  # the pool has already taken back a connection that died


class Guard:
    """Runs the service's own statements on a connection, each :func:`guarded` against a server
    that stops answering; those that may wait for another transaction's row lock ask ``database``
    whether they do before they count as stalled."""

    def __init__(self, database: Database, *, within: float) -> None:
        self._database = database
        self.within = within

    async def run(
        self, conn: asyncpg.Connection[Any], step: Awaitable[T], *, locks: bool = False
    ) -> T:
        lock_check = self._database.waiting_on_lock if locks else None
        return await guarded(conn, step, within=self.within, lock_check=lock_check)
