"""Handlers for the second review's reproductions (tests/integration/test_review_base_*.py).

Each writes its effect as a row in ``test_effects`` (no unique key: a double shows as two rows),
and records every call in ``handler_calls`` over a connection of its own (so failed calls count).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Literal

import asyncpg
from pydantic import BaseModel, Field, field_validator

from consumer import Envelope, PermanentError, register


class Escape(BaseModel):
    key: str = Field(min_length=1)
    escape: Literal[
        "none", "cancelled", "generator_exit", "base", "declined", "system_exit", "unprintable"
    ] = "none"
    """Raise this BaseException (not an Exception) from the handler; ``declined``: a business
    error, a PermanentError with a ``reason`` of its own."""


class Aborted(BaseException):
    """A BaseException of a library's own (as trio's Cancelled, pytest's Failed, gevent's
    GreenletExit are)."""


class Unprintable(Exception):
    """A handler's error class with a bug in its message: ``str()`` of it raises."""

    def __str__(self) -> str:
        return f"{self.code}: {self.args[0]}"  # type: ignore[attr-defined]


class Declined(PermanentError):
    """A business rule's error, as handler code writes it: it carries its own ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"declined: {reason}")
        self.reason = reason


async def _record_call(event_id: Any) -> None:
    conn = await asyncpg.connect(os.environ["CONSUMER_DATABASE_URL"])
    try:
        await conn.execute(
            "INSERT INTO handler_calls (event_id, pid) VALUES ($1, $2)", event_id, os.getpid()
        )
    finally:
        await conn.close()


@register("review_base.escape", payload=Escape)
async def escape(event: Envelope[Escape], conn: asyncpg.Connection[Any]) -> None:
    """Writes its effect, then raises what its payload says. ``cancelled``: as a handler does
    that awaits a future or task some library cancelled (the handler's own task is not)."""
    await _record_call(event.event_id)
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )
    if event.payload.escape == "cancelled":
        cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cancelled.cancel()
        await cancelled
    elif event.payload.escape == "generator_exit":
        raise GeneratorExit
    elif event.payload.escape == "base":
        raise Aborted("a library's own BaseException")
    elif event.payload.escape == "unprintable":
        raise Unprintable("out of stock")
    elif event.payload.escape == "system_exit":
        raise SystemExit(7)
    elif event.payload.escape == "declined":
        raise Declined("card_declined")


class Tagged(BaseModel):
    key: str = Field(min_length=1)
    tags: list[str] = []


@register("review_base.listkey", payload=Tagged, key=lambda payload: payload.tags)
async def listkey(event: Envelope[Tagged], conn: asyncpg.Connection[Any]) -> None:
    """An innocent handler whose ``key`` returns a list (it locks every tag): not hashable."""
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


class Strict(BaseModel):
    key: str = Field(min_length=1)

    @field_validator("key")
    @classmethod
    def _not_aborted(cls, value: str) -> str:
        if value == "abort":
            raise Aborted("a validator's library gave up")
        return value


@register("review_base.validated", payload=Strict)
async def validated(event: Envelope[Strict], conn: asyncpg.Connection[Any]) -> None:
    """An innocent handler whose payload model's validator may raise a BaseException."""
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


_spawned: set[asyncio.Task[None]] = set()


@register("review_base.spawn", payload=Escape)
async def spawn(event: Envelope[Escape], conn: asyncpg.Connection[Any]) -> None:
    """A faulty handler: writes its effect, and leaves a task of its own using ``conn`` after it
    returns (an audit row written "in the background")."""
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )

    async def audit() -> None:
        await asyncio.sleep(0)
        await conn.execute("SELECT pg_sleep(0.5)")

    task = asyncio.get_running_loop().create_task(audit())
    _spawned.add(task)
    task.add_done_callback(_spawned.discard)


@register("review_base.returns", payload=Escape)
async def returns(event: Envelope[Escape], conn: asyncpg.Connection[Any]) -> Any:
    """A faulty handler written the batch handlers' way: it returns the exception that fails its
    event instead of raising it (and writes nothing)."""
    return PermanentError(f"{event.payload.key}: out of stock")


@register("review_base.wrapslow", payload=Escape)
async def wrapslow(event: Envelope[Escape], conn: asyncpg.Connection[Any]) -> None:
    """An innocent handler in a common style: a slow statement, database errors translated into
    the service's own error type with a message of the handler's."""
    try:
        await conn.execute("SELECT pg_sleep(1.5)")
        await conn.execute(
            "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
            event.event_id,
            event.payload.key,
        )
    except asyncpg.PostgresError as error:
        raise PermanentError(f"could not record {event.payload.key}: {error}") from error
