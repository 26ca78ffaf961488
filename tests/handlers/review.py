"""Handlers for the review's reproductions (tests/integration/test_review_*.py).

Each writes its effect as a row in ``test_effects`` (no unique key: a double shows as two rows).
"""

from __future__ import annotations

import time
from typing import Any

import asyncpg
from pydantic import BaseModel, Field, field_validator

from consumer import Envelope, PermanentError, register


class Keyed(BaseModel):
    key: str = Field(min_length=1)


@register("review.wrap", payload=Keyed)
async def wrap(event: Envelope[Keyed], conn: asyncpg.Connection[Any]) -> None:
    """An innocent handler written in a common style: database errors are translated into the
    service's own error type with a message of the handler's."""
    try:
        await conn.execute(
            "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
            event.event_id,
            event.payload.key,
        )
    except asyncpg.PostgresError as error:
        raise PermanentError(f"could not record {event.payload.key}: {error}") from error


@register("review.immediate", payload=Keyed)
async def immediate(event: Envelope[Keyed], conn: asyncpg.Connection[Any]) -> None:
    """An innocent handler that checks its deferred constraints early (a common idiom with
    deferrable foreign keys), then writes its effect."""
    await conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


@register("review.restart", payload=Keyed)
async def restart(event: Envelope[Keyed], conn: asyncpg.Connection[Any]) -> None:
    """A faulty handler: rolls back the service's transaction and opens a new one of its own,
    then writes its effect (it ends "in a transaction", as the service checks)."""
    await conn.execute("ROLLBACK")
    await conn.execute("BEGIN")
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


@register("review.reset_all", payload=Keyed)
async def reset_all(event: Envelope[Keyed], conn: asyncpg.Connection[Any]) -> None:
    """An innocent handler that sets a parameter for its own statements, then puts every
    parameter back to its default with ``RESET ALL`` (legal in a transaction), and writes its
    effect."""
    await conn.execute("SET search_path TO public")
    await conn.execute("RESET ALL")
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


class SlowToValidate(BaseModel):
    key: str = Field(min_length=1)
    name: str
    block_s: float = 0.0

    @field_validator("block_s")
    @classmethod
    def _expensive(cls, value: float) -> float:
        # Stands for a validator that is pathologically slow on some input (a backtracking
        # regular expression, a synchronous lookup): it blocks the event loop.
        if value:
            time.sleep(value)
        return value


@register("review.slow_validator", payload=SlowToValidate)
async def slow_validator(event: Envelope[SlowToValidate], conn: asyncpg.Connection[Any]) -> None:
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )
