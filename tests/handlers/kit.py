"""``kit.*``: handlers for consumer.testing's own tests, each failing the way its payload says;
their tables are a migration set of their own (``MIGRATIONS``), as a team's are."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import asyncpg
from pydantic import BaseModel, Field

from consumer import Connection, Envelope, PermanentError, TransientError, register, register_batch

MIGRATIONS = "kit_sql"


class Spec(BaseModel):
    key: str = Field(min_length=1)
    fail: str | None = None
    """``transient``, ``permanent``, ``bug`` (an unclassified exception), ``swallow`` (a database
    error caught without a savepoint) or ``slow`` (past its time limit)."""


async def _apply(event: Envelope[Spec], conn: Connection) -> None:
    spec = event.payload
    if spec.fail == "transient":
        raise TransientError("not yet")
    if spec.fail == "permanent":
        raise PermanentError("never")
    if spec.fail == "bug":
        raise ZeroDivisionError("a bug")
    if spec.fail == "swallow":
        with contextlib.suppress(asyncpg.UniqueViolationError):
            await conn.execute("INSERT INTO kit_taken (key) VALUES ('taken')")
        return
    if spec.fail == "slow":
        await asyncio.sleep(60)
    await conn.execute(
        "INSERT INTO kit_effects (event_id, key) VALUES ($1, $2)", event.event_id, spec.key
    )


@register("kit.one", payload=Spec, timeout="200ms")
async def one(event: Envelope[Spec], conn: Connection) -> None:
    await _apply(event, conn)


@register_batch("kit.many", payload=Spec, key=lambda spec: spec.key)
async def many(
    events: Sequence[Envelope[Spec]], conn: asyncpg.Connection[Any]
) -> list[Exception | None]:
    results: list[Exception | None] = []
    for event in events:
        if event.payload.fail == "permanent":
            results.append(PermanentError(f"{event.payload.key}: never"))
            continue
        await conn.execute(
            "INSERT INTO kit_effects (event_id, key) VALUES ($1, $2)",
            event.event_id,
            event.payload.key,
        )
        results.append(None)
    return results
