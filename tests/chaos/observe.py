"""Reading a scenario's end state from the database and the broker, never from the consumers.

Messages are read through the service's hardened frame decoder (:func:`consumer.amqp.wire.install`),
as ``dlq`` reads them: a hostile producer's header (nested 3,000 deep, not UTF-8) in the dead-letter
queue would otherwise end the runner's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aio_pika
import asyncpg

from consumer.amqp import wire
from tests.support import REPO, connect_any
from topology.names import SHARD

FIRST_DEATH_REASON = "x-first-death-reason"
DEAD_REASON = "consumer-dead-reason"
ERROR_CLASS = "consumer-error-class"
ATTEMPT = "consumer-attempt"
ROUTING_KEY = "consumer-original-routing-key"
DEAD_LETTERED_AT = "consumer-dead-lettered-at"


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


@dataclass(frozen=True, slots=True)
class DeadCopy:
    """One message in ``<name>.dead``."""

    message_id: str | None
    reason: str | None
    """``consumer-dead-reason``: set by the service on what it dead-letters itself."""
    first_death_reason: str | None
    """``x-first-death-reason``: set by the broker (``rejected`` for poison, ``delivery_limit``)."""
    deaths: str = ""
    """The broker's ``x-death``, newest first: ``queue:reason xcount`` for each."""
    error_class: str | None = None
    """``consumer-error-class``: the exception the service dead-lettered it for."""
    routing_key: str | None = None
    """``consumer-original-routing-key``: where a replay of it would go."""
    attempt: object = None
    """``consumer-attempt`` as it came (an int where the service wrote it)."""
    header_names: frozenset[str] = frozenset()
    dead_lettered_at: str | None = None
    """``consumer-dead-lettered-at``: the service's clock when it dead-lettered the copy."""
    queue: str = ""
    """The queue table's queue whose dead-letter queue held it (``""``: the service's one)."""
    shard: str | None = None
    """``consumer-shard``: the shard of a sharded queue it was consumed from (``s2``)."""


def _deaths(headers: dict[str, Any]) -> str:
    found = headers.get("x-death")
    if not isinstance(found, list):
        return ""
    parts = []
    for death in found:
        if isinstance(death, dict):
            parts.append(
                f"{_text(death.get('queue'))}:{_text(death.get('reason'))} x{death.get('count')}"
            )
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    """The ``outbox`` rows of one event id (one, unless a row was written twice)."""

    rows: int = 1
    sent: int = 1
    """Of :attr:`rows`, those marked sent (``sent_at``)."""
    failed: int = 0
    """Of :attr:`rows`, those the relay failed for good (``failed_at``)."""
    caused_by: uuid.UUID | None = None


@dataclass
class EndState:
    effects: Counter[uuid.UUID] = field(default_factory=Counter)
    """``test_effects`` rows per event id (the chaos schema has no unique key there)."""
    movements: Counter[uuid.UUID] = field(default_factory=Counter)
    """``stock_movements`` rows per event id (no unique key there in the chaos template)."""
    notifications: Counter[uuid.UUID] = field(default_factory=Counter)
    """``notifications`` rows per event id (no unique key there either)."""
    receipts: Counter[uuid.UUID] = field(default_factory=Counter)
    foreign_receipts: int = 0
    stock: dict[str, int] = field(default_factory=dict)
    handler_calls: int = 0
    dead: list[DeadCopy] = field(default_factory=list)
    listed: list[dict[str, Any]] = field(default_factory=list)
    """``python -m consumer dlq list --json``, one object per dead letter."""
    list_error: str | None = None
    dead_read_at: datetime | None = None
    """When the dead-letter queue was read to its end: no copy can have been dead-lettered
    later (the checker's bound on ``consumer-dead-lettered-at``)."""
    leftovers: dict[str, int] = field(default_factory=dict)
    """Messages still in the work queue or a delay queue after the consumers stopped."""
    leftover_samples: list[str] = field(default_factory=list)
    """What some of them are: message id, redelivered, delivery count, attempt, x-death."""
    outbox: dict[uuid.UUID, OutboxRecord] = field(default_factory=dict)
    """``outbox`` rows by event id."""
    outbox_owed: int = 0
    """``outbox`` rows neither sent nor failed: what the relays still owe (0 at the end)."""
    republished: list[uuid.UUID] = field(default_factory=list)
    """Event ids of the rows a relay had published and seen confirmed, but not yet marked sent,
    when its process was SIGKILLed (``outbox-relay-kill``): the relay must publish each again,
    and the consumers' receipts absorb the copy."""
    republished_missing: int = 0
    """Row ids a relay kill recorded that are not in ``outbox`` at the end (a violation)."""

    @property
    def applied(self) -> int:
        return (
            sum(self.effects.values())
            + sum(self.movements.values())
            + sum(self.notifications.values())
        )


async def read_database(dsn: str, consumer: str, state: EndState) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        for row in await conn.fetch("SELECT event_id, count(*) FROM test_effects GROUP BY 1"):
            state.effects[row[0]] = int(row[1])
        for row in await conn.fetch("SELECT event_id, count(*) FROM stock_movements GROUP BY 1"):
            state.movements[row[0]] = int(row[1])
        for row in await conn.fetch("SELECT event_id, count(*) FROM notifications GROUP BY 1"):
            state.notifications[row[0]] = int(row[1])
        for row in await conn.fetch(
            "SELECT event_id, count(*) FROM receipts WHERE consumer = $1 GROUP BY 1", consumer
        ):
            state.receipts[row[0]] = int(row[1])
        state.foreign_receipts = int(
            await conn.fetchval("SELECT count(*) FROM receipts WHERE consumer <> $1", consumer)
        )
        state.stock = {
            row["sku"]: int(row["available"])
            for row in await conn.fetch("SELECT sku, available FROM stock")
        }
        state.handler_calls = int(await conn.fetchval("SELECT count(*) FROM handler_calls"))
        for row in await conn.fetch(
            "SELECT event_id, count(*) AS rows, count(sent_at) AS sent, count(failed_at) AS failed,"
            " min(caused_by::text) AS caused_by FROM outbox GROUP BY event_id"
        ):
            cause = row["caused_by"]
            state.outbox[row["event_id"]] = OutboxRecord(
                rows=int(row["rows"]),
                sent=int(row["sent"]),
                failed=int(row["failed"]),
                caused_by=uuid.UUID(cause) if cause is not None else None,
            )
        state.outbox_owed = int(
            await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL"
            )
        )
    finally:
        await conn.close()


async def read_republished(dsn: str, row_ids: list[int], state: EndState) -> None:
    """The event ids of the ``outbox`` rows ``row_ids`` (those a relay kill left published,
    confirmed and unmarked): :attr:`EndState.republished`."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch(
            "SELECT event_id FROM outbox WHERE id = ANY($1::bigint[]) ORDER BY id", row_ids
        )
    finally:
        await conn.close()
    state.republished = [row["event_id"] for row in rows]
    if len(rows) != len(set(row_ids)):
        state.republished_missing = len(set(row_ids)) - len(rows)


async def list_dead_letters(
    environment: dict[str, str], state: EndState, queue: str | None = None
) -> None:
    """``python -m consumer dlq list --json`` with the scenario's settings (``--queue``: a queue
    table's queue), added to what earlier calls listed."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumer",
        "dlq",
        *(["--queue", queue] if queue else []),
        "list",
        "--json",
        env=environment,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=300)
    except TimeoutError:
        process.kill()
        await process.wait()
        state.list_error = "dlq list did not finish within 300s"
        return
    if process.returncode != 0:
        state.list_error = f"dlq list exited {process.returncode}: {err.decode()[-500:]}"
        return
    state.listed += [json.loads(line) for line in out.decode().splitlines() if line.strip()]


async def take_dead_letters(url: str, queue: str, state: EndState, label: str = "") -> None:
    """Every message in the dead-letter queue, removed (the queue is deleted afterwards);
    ``label``: the queue table's queue it belongs to."""
    wire.install()
    connection = await connect_any(url)
    try:
        channel = await connection.channel()
        target = await channel.get_queue(queue)
        while (message := await target.get(no_ack=True, fail=False, timeout=30)) is not None:
            headers = message.headers or {}
            state.dead.append(
                DeadCopy(
                    message_id=message.message_id,
                    reason=_text(headers.get(DEAD_REASON)),
                    first_death_reason=_text(headers.get(FIRST_DEATH_REASON)),
                    deaths=_deaths(headers),
                    error_class=_text(headers.get(ERROR_CLASS)),
                    routing_key=_text(headers.get(ROUTING_KEY)),
                    attempt=headers.get(ATTEMPT),
                    header_names=frozenset(headers),
                    dead_lettered_at=_text(headers.get(DEAD_LETTERED_AT)),
                    queue=label,
                    shard=_text(headers.get(SHARD)),
                )
            )
        state.dead_read_at = datetime.now(UTC)
    finally:
        await connection.close()


async def sample_messages(url: str, queue: str, state: EndState, limit: int = 50) -> None:
    """Describe up to ``limit`` messages left in ``queue`` (read, then returned)."""
    wire.install()
    connection = await connect_any(url)
    try:
        channel = await connection.channel()
        target = await channel.get_queue(queue)
        held: list[aio_pika.abc.AbstractIncomingMessage] = []
        while len(held) < limit:
            message = await target.get(no_ack=False, fail=False, timeout=10)
            if message is None:
                break
            held.append(message)
            headers = message.headers or {}
            state.leftover_samples.append(
                f"{queue}: {message.message_id} redelivered={message.redelivered} "
                f"delivery-count={_text(headers.get('x-delivery-count'))} "
                f"attempt={_text(headers.get('consumer-attempt'))} deaths=[{_deaths(headers)}]"
            )
        for message in held:
            await message.nack(requeue=True)
    finally:
        await connection.close()


class QueueProbe:
    """Ready messages in a queue by passive declare, on one connection kept open (and reopened
    after a broker fault); None while the broker cannot say."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._connection: aio_pika.abc.AbstractConnection | None = None

    async def ready(self, queue: str) -> int | None:
        try:
            if self._connection is None or self._connection.is_closed:
                self._connection = await connect_any(self._url, timeout=5)
            channel = await self._connection.channel()
            try:
                declared = await channel.declare_queue(queue, passive=True, timeout=5)
                return int(declared.declaration_result.message_count or 0)
            finally:
                if not channel.is_closed:
                    await channel.close()
        except Exception:
            await self.close()
            return None

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), timeout=5)
