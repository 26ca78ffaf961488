"""``test.behave``: a handler told by its payload how to fail, for failure-path tests, and
``test.behave_many``, its batch form.

Each call is recorded in ``handler_calls`` over a connection of its own (outside the event's
transaction, so failed attempts are counted too), and each batch call's size in ``batch_calls``;
the effect is a row in ``test_effects``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import asyncpg
from pydantic import BaseModel, Field, field_validator

from consumer import Envelope, PermanentError, TransientError, register, register_batch


class Behaviour(BaseModel):
    key: str = Field(min_length=1)
    fail_transient: int = 0
    """Raise TransientError on this many first calls."""
    permanent: bool = False
    bug: bool = False
    """Raise an unclassified exception (a programming error: permanent)."""
    crash: bool = False
    """End the process on every call, as a segfault or OOM kill would."""
    block_s: float = 0.0
    """Block the event loop this long (synchronous sleep)."""
    sleep_s: float = 0.0
    """Await this long before applying (cooperative)."""
    sleep_calls: int = 0
    """Sleep ``sleep_s`` only on this many first calls (0: on every call)."""
    swallow: bool = False
    """Write "insert or ignore" the wrong way: catch the unique violation without a savepoint,
    which leaves the transaction aborted, and return as if all went well."""
    end_transaction: Literal["commit", "rollback"] | None = None
    """COMMIT or ROLLBACK the service's transaction from inside the handler, and return."""
    kill_connection: bool = False
    """Terminate its own database backend, as a backend crash or an idle-in-transaction timeout
    would: every call breaks the connection."""


async def _swallow_unique_violation(conn: asyncpg.Connection[Any]) -> None:
    # The mistake under test: no savepoint, so the transaction is now aborted.
    with contextlib.suppress(asyncpg.UniqueViolationError):
        await conn.execute("INSERT INTO test_taken (key) VALUES ('taken')")


class _CallLog:
    """A small pool per process for recording calls outside the event's transaction."""

    pool: asyncpg.Pool[Any] | None = None
    lock = asyncio.Lock()

    @classmethod
    async def _pool(cls) -> asyncpg.Pool[Any]:
        async with cls.lock:
            if cls.pool is None:
                cls.pool = await asyncpg.create_pool(
                    os.environ["CONSUMER_DATABASE_URL"], min_size=1, max_size=4
                )
        return cls.pool

    @classmethod
    async def record_batch(cls, size: int) -> None:
        pool = await cls._pool()
        await pool.execute("INSERT INTO batch_calls (size) VALUES ($1)", size)

    @classmethod
    async def record(cls, event_id: object) -> int:
        pool = await cls._pool()
        return int(
            await pool.fetchval(
                "WITH added AS (INSERT INTO handler_calls (event_id, pid) VALUES ($1, $2)) "
                "SELECT count(*) + 1 FROM handler_calls WHERE event_id = $1",
                event_id,
                os.getpid(),
            )
        )


@register("test.behave", payload=Behaviour)
async def behave(event: Envelope[Behaviour], conn: asyncpg.Connection[Any]) -> None:
    spec = event.payload
    call = await _CallLog.record(event.event_id)
    if spec.crash:
        os._exit(17)
    if spec.kill_connection:
        await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    if spec.end_transaction:
        await conn.execute(spec.end_transaction.upper())
        return
    if spec.block_s:
        time.sleep(spec.block_s)  # deliberately blocks the loop: the hard limit's test
    if spec.sleep_s and (not spec.sleep_calls or call <= spec.sleep_calls):
        await asyncio.sleep(spec.sleep_s)
    if call <= spec.fail_transient:
        raise TransientError(f"call {call} of {spec.fail_transient} planned failures")
    if spec.permanent:
        raise PermanentError("this event can never succeed")
    if spec.bug:
        raise ZeroDivisionError("a bug in the handler")
    if spec.swallow:
        await _swallow_unique_violation(conn)
        return
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)", event.event_id, spec.key
    )


class BatchBehaviour(BaseModel):
    key: str = Field(min_length=1)
    fail_transient: int = 0
    """Report TransientError for this event on this many first calls."""
    permanent: bool = False
    """Report PermanentError for this event."""
    spoil_batch: bool = False
    """Make the whole call raise whenever it holds more than this one event."""
    miscount: bool = False
    """Make the call return one result too few."""
    sleep_s: float = 0.0
    """Await this long before applying (the call as a whole)."""
    swallow: bool = False
    """Make the call swallow a unique violation without a savepoint (the transaction aborts)."""


@register_batch("test.behave_many", payload=BatchBehaviour, timeout="2s")
async def behave_many(
    events: Sequence[Envelope[BatchBehaviour]], conn: asyncpg.Connection[Any]
) -> list[Exception | None]:
    await _CallLog.record_batch(len(events))
    calls = [await _CallLog.record(event.event_id) for event in events]
    specs = [event.payload for event in events]
    if len(events) > 1 and any(spec.spoil_batch for spec in specs):
        raise RuntimeError("this batch is spoiled")
    if any(spec.sleep_s for spec in specs):
        await asyncio.sleep(max(spec.sleep_s for spec in specs))
    if any(spec.swallow for spec in specs):
        await _swallow_unique_violation(conn)
    results: list[Exception | None] = []
    applied: list[Envelope[BatchBehaviour]] = []
    for event, call in zip(events, calls, strict=True):
        spec = event.payload
        if call <= spec.fail_transient:
            results.append(TransientError(f"call {call} of {spec.fail_transient} planned failures"))
        elif spec.permanent:
            results.append(PermanentError("this event can never succeed"))
        else:
            results.append(None)
            applied.append(event)
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) SELECT * FROM unnest($1::uuid[], $2::text[])",
        [event.event_id for event in applied],
        [event.payload.key for event in applied],
    )
    if any(spec.miscount for spec in specs):
        return results[:-1]
    return results


class OddPayload(BaseModel):
    key: str = Field(min_length=1)
    name: str

    @field_validator("name", mode="before")
    @classmethod
    def _strip(cls, value: Any) -> Any:
        # An int has no .strip(): AttributeError, which pydantic lets through unwrapped.
        return value.strip()


@register("test.odd", payload=OddPayload)
async def odd(event: Envelope[OddPayload], conn: asyncpg.Connection[Any]) -> None:
    """A handler whose payload model has a validator that raises something other than
    ValueError for some inputs."""
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )
