"""Waiting without missing a stop: sleeps that wake on whatever ends them, and the start-up wait
for a database with the service's schema, every migration of its sets applied.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import asyncpg

from consumer.db.database import Database
from consumer.db.migration_sets import Migration
from consumer.db.migrations import LEDGER, pending
from consumer.errors import DatabaseUnavailable, PipelineFault
from consumer.logs import Logger
from consumer.service.backoff import Backoff

__all__ = ["database_ready", "wait_any"]

# The schema the service cannot run without (`consumer migrate` makes it).
_TABLES = ["receipts", "consumer_in_progress", "consumer_receipt_partitions"]


# Pending migrations named in the start-up refusal; the rest are counted.
_NAMED = 5


async def database_ready(
    database: Database,
    stop: asyncio.Event,
    logger: Logger,
    *,
    max_delay: float,
    migrations: Sequence[Migration] = (),
) -> bool:
    """Probe until the database answers (False if stopped first); check the schema is there and
    none of ``migrations`` (the service's set and its handler modules') is pending.

    A pending migration stops the start: handler code deployed before its tables would otherwise
    send every event down the retry ladder (:mod:`consumer.classification`) until someone runs
    ``consumer migrate``."""
    backoff = Backoff(0.5, max_delay)
    while not stop.is_set():
        try:
            await database.probe()
            break
        except DatabaseUnavailable as error:
            delay = backoff.next()
            logger.warning(
                "database unreachable at start-up", error=str(error), retry_in_s=round(delay, 2)
            )
            await wait_any(stop, delay)
    else:
        return False
    async with database.connection() as conn:
        missing = await conn.fetchval(
            "SELECT string_agg(name, ', ') FROM unnest($1::text[]) AS name"
            " WHERE to_regclass(name) IS NULL",
            _TABLES,
        )
        if missing is not None:
            raise PipelineFault(
                f"the database has no {missing} table: run `consumer migrate` first"
            )
        if migrations:
            await _check_migrated(conn, migrations)
    return True


async def _check_migrated(conn: asyncpg.Connection[Any], migrations: Sequence[Migration]) -> None:
    try:
        waiting = await pending(conn, migrations)
    except asyncpg.InsufficientPrivilegeError:
        # The run-time role reads the ledger from consumer.sql/006 on: before it, it cannot.
        raise PipelineFault(
            f"this database role may not read the migrations ledger ({LEDGER}), so pending "
            "migrations cannot be checked: run `consumer migrate` (sql/006 grants consumer_app "
            "SELECT on it) or grant this role SELECT on it"
        ) from None
    if waiting:
        named = ", ".join(waiting[:_NAMED])
        more = f" and {len(waiting) - _NAMED} more" if len(waiting) > _NAMED else ""
        raise PipelineFault(f"migrations pending: {named}{more}: run `consumer migrate` first")


async def wait_any(
    stop: asyncio.Event | None,
    seconds: float | None,
    *also: asyncio.Future[Any] | asyncio.Event,
) -> None:
    """Sleep up to ``seconds`` (for ever if None), waking early when ``stop`` or anything in
    ``also`` is set."""
    waiters: list[asyncio.Future[Any]] = []
    for item in (stop, *also):
        if isinstance(item, asyncio.Event):
            waiters.append(asyncio.ensure_future(item.wait()))
        elif item is not None and not item.done():
            waiters.append(asyncio.ensure_future(asyncio.shield(item)))
        elif item is not None:
            return
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
