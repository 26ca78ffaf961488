"""Handlers that publish through the outbox (``event.publish``), for the outbox's tests.

``test.outbox`` publishes ``count`` ``test.outboxed`` events, then fails as its payload says or
applies its effect (a row in ``test_effects``); ``test.outbox_many`` is its batch form, each
batch call's size recorded in ``batch_calls`` (outside the event's transaction).
``test.outboxed`` is the type they publish: its model checks what they publish, and its ``key``
is the rows' order key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import asyncpg
from pydantic import BaseModel, Field

from consumer import Envelope, PermanentError, TransientError, register, register_batch

OUTBOXED = "test.outboxed"


class Emit(BaseModel):
    key: str = Field(min_length=1)
    count: int = Field(default=1, ge=0)
    """How many ``test.outboxed`` events to publish (payload ``{"key": key, "n": 0..count-1}``)."""
    fail_transient: int = 0
    """After publishing, raise TransientError on this many first attempts."""
    permanent: bool = False
    """After publishing, fail for good."""
    invalid: bool = False
    """After publishing, publish a ``test.outboxed`` that its model refuses."""


class Outboxed(BaseModel):
    key: str = Field(min_length=1)
    n: int = Field(ge=0)


async def _publish(event: Envelope[Emit]) -> None:
    spec = event.payload
    for n in range(spec.count):
        await event.publish(OUTBOXED, Outboxed(key=spec.key, n=n))
    if spec.invalid:
        await event.publish(OUTBOXED, {"key": spec.key, "n": -1})


def _failure(event: Envelope[Emit]) -> Exception | None:
    if event.attempt <= event.payload.fail_transient:
        return TransientError(f"attempt {event.attempt}: a planned transient failure")
    if event.payload.permanent:
        return PermanentError("this event can never succeed")
    return None


@register("test.outbox", payload=Emit)
async def outbox(event: Envelope[Emit], conn: asyncpg.Connection[Any]) -> None:
    await _publish(event)
    failure = _failure(event)
    if failure is not None:
        raise failure
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


@register_batch("test.outbox_many", payload=Emit)
async def outbox_many(
    events: Sequence[Envelope[Emit]], conn: asyncpg.Connection[Any]
) -> list[Exception | None]:
    await _record_batch(len(events))
    results: list[Exception | None] = []
    for event in events:
        await _publish(event)
        results.append(_failure(event))
    applied = [event for event, result in zip(events, results, strict=True) if result is None]
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) SELECT * FROM unnest($1::uuid[], $2::text[])",
        [event.event_id for event in applied],
        [event.payload.key for event in applied],
    )
    return results


@register(OUTBOXED, payload=Outboxed, key=lambda outboxed: outboxed.key)
async def outboxed(event: Envelope[Outboxed], conn: asyncpg.Connection[Any]) -> None:
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


async def _record_batch(size: int) -> None:
    # A connection of its own: the call is recorded even when its transaction rolls back.
    conn = await asyncpg.connect(os.environ["CONSUMER_DATABASE_URL"])
    try:
        await conn.execute("INSERT INTO batch_calls (size) VALUES ($1)", size)
    finally:
        await conn.close()
