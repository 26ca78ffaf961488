"""The outbox relay: the outbox's committed rows published to the ingress exchange with
publisher confirms, on the service's publishing connection, each marked sent only after its
confirm. It wakes on the commit of every transaction that wrote rows (LISTEN) and on a slow
poll, the fallback for a notification lost; its errors are logged and retried, never raised.

A crash between a confirm and the mark publishes the same ``event_id`` again later: the
consumers' receipts absorb the copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import asyncpg
from pamqp.commands import Basic

from consumer.amqp.publisher import PERSISTENT, Publishes
from consumer.db.outbox_rows import (
    NOTIFY_CHANNEL,
    OutboxRow,
    Refusal,
    any_owed,
    claim_batch,
    mark_refused,
    mark_sent,
    outbox_depth,
)
from consumer.error_text import error_name, message_of
from consumer.errors import Unroutable
from consumer.logs import Logger
from consumer.observe.metrics import Metrics
from consumer.service.backoff import Backoff
from consumer.service.outbox_resting import RestingRows
from topology.names import SHARD_KEY

__all__ = ["OutboxRelay", "RelayConfig", "RoundResult"]

_DEPTH_EVERY = 1.0
"""Seconds between two counts of the rows owed (the depth metrics), however many rounds run."""
_MAX_SHORTSTR = 255
"""AMQP's short strings (a routing key) are at most this many bytes."""
_RETRY_FIRST = 0.05
"""The first wait after a round held rows back or had a publish fail: a replica's round ends
within milliseconds, and its marks notify nobody."""


@dataclass(frozen=True, slots=True)
class RelayConfig:
    exchange: str
    """The ingress exchange; each row goes out with its event type as the routing key."""
    batch_size: int = 100
    poll: float = 5.0
    reconnect_max_delay: float = 30.0
    statement_timeout: float = 60.0
    """The longest one of the relay's statements may take before its connection counts as lost."""
    publish_limit: float = 30.0
    """The longest a round's publishes may take, its transaction open and its rows locked
    meanwhile (against the other replicas, and holding back the outbox's prune and the database's
    vacuum): past it, the rows not yet confirmed are released, unsent, for a later round. A
    confirm the broker holds back (a memory or disk alarm) is otherwise waited for without end."""
    stop_grace: float = 10.0
    """How long a stop waits for the round in progress (its publishes confirmed and marked)."""
    max_body_bytes: int | None = None
    """A larger row is failed for good, unpublished: the service's consumers would take it for
    poison, and a body past the broker's own limit would close the publishing channel each time
    it was tried, the consumers' settles with it."""


@dataclass(slots=True)
class RoundResult:
    """What one round did: rows confirmed and marked, refused, held back for their key's order;
    ``full``: it took a whole batch, so more may be owed now."""

    published: int = 0
    refused: list[Refusal] = field(default_factory=list)
    held: int = 0
    full: bool = False
    no_publisher: bool = False
    resting: bool = False
    """Rows refused for the moment were left out of the claim, for a while."""

    @property
    def again_soon(self) -> bool:
        """Rows are owed that a short wait may let through (a transient failure, another
        replica's round holding a key's earlier row, the broker connection being made, rows
        resting after a refusal)."""
        return (
            self.no_publisher
            or self.resting
            or self.held > 0
            or any(not r.permanent for r in self.refused)
        )


class OutboxRelay:
    """The relay's task, for the life of the ``async with`` block, on a database connection of
    its own (``connect``: LISTEN and the rounds) and the publisher the service has at the moment
    (``publisher``: None while the broker is away)."""

    def __init__(
        self,
        config: RelayConfig,
        *,
        connect: Callable[[], Awaitable[asyncpg.Connection[Any]]],
        publisher: Callable[[], Publishes | None],
        logger: Logger,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._connect = connect
        self._publisher = publisher
        self._logger = logger.bind(component="outbox-relay")
        self._metrics = metrics
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_depth = float("-inf")
        self._resting = RestingRows(_RETRY_FIRST, config.poll)

    async def __aenter__(self) -> OutboxRelay:
        if self._task is not None or self._stopped.is_set():
            raise RuntimeError("an outbox relay runs once")
        self._task = asyncio.create_task(self._keep(), name="outbox-relay")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """No round after the one in progress, which gets ``stop_grace`` to finish (its
        confirmed rows marked sent); idempotent."""
        self._stopped.set()
        self._wake.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), self._config.stop_grace)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- the connection -----------------------------------------------------------------------

    async def _keep(self) -> None:
        """Connections one after another, for as long as the relay runs: a lost one (the
        database restarted, the backend terminated) is made again with backoff."""
        backoff = Backoff(0.2, self._config.reconnect_max_delay)
        failed = False
        while not self._stopped.is_set():
            try:
                conn = await self._connect()
            except Exception as error:
                self._metrics.outbox_relay_errors.inc()
                # One warning for an outage, not one per attempt (as the service's own probe).
                log = self._logger.info if failed else self._logger.warning
                log("outbox relay: no database connection", error=str(error))
                failed = True
            else:
                failed = False
                try:
                    await self._listen(conn, backoff)
                except Exception as error:
                    self._metrics.outbox_relay_errors.inc()
                    self._logger.warning(
                        "outbox relay: database connection lost; connecting again",
                        error_class=error_name(error),
                        error=message_of(error),
                    )
                finally:
                    conn.terminate()
            if not self._stopped.is_set():
                await self._sleep(backoff.next())

    async def _listen(self, conn: asyncpg.Connection[Any], backoff: Backoff) -> None:
        conn.add_termination_listener(lambda _: self._wake.set())
        await conn.add_listener(NOTIFY_CHANNEL, lambda *_: self._wake.set())
        # Whatever committed while no one listened is owed: a round at once.
        self._wake.set()
        retry = Backoff(_RETRY_FIRST, self._config.poll)
        while not self._stopped.is_set():
            if conn.is_closed():
                raise ConnectionError("the relay's database connection closed")
            woken = await self._wait(self._wake, self._config.poll)
            if self._stopped.is_set():
                return
            self._wake.clear()
            try:
                result = await self._round(conn)
            except asyncpg.PostgresError:
                # The server answered with an error (a read-only session, a grant missing): the
                # rows owed and their age are counted all the same, or with every round failing
                # they would never show, and no alert on them could fire. (Not after a timeout
                # or a lost session: it would only put off the new session.)
                with contextlib.suppress(Exception):
                    await self._observe_depth(conn, force=False)
                raise
            backoff.reset()
            await self._observe_depth(conn, force=not woken)
            if result.published:
                # The broker takes rows: what it refused meanwhile (resting now) or a key held
                # elsewhere waits a short while again, not a wait doubled round after round.
                retry.reset()
            if result.full and (result.published or not result.again_soon):
                self._wake.set()
                retry.reset()
            elif result.again_soon:
                await self._sleep(retry.next())
                self._wake.set()
            else:
                retry.reset()

    # -- one round ----------------------------------------------------------------------------

    async def _round(self, conn: asyncpg.Connection[Any]) -> RoundResult:
        """Claim, publish, wait for the confirms, mark: one transaction, so that the rows stay
        locked against the other replicas until they are marked (or released unsent)."""
        publisher = self._publisher()
        if publisher is None:
            return RoundResult(no_publisher=True)
        timeout = self._config.statement_timeout
        async with asyncio.timeout(timeout):
            if not await any_owed(conn):
                return RoundResult()
        skipped = self._resting.skipped()
        async with conn.transaction():
            async with asyncio.timeout(timeout):
                batch, held = await claim_batch(
                    conn, self._config.batch_size, skip_ids=skipped.ids, skip_keys=skipped.keys
                )
            result = RoundResult(
                held=held,
                full=len(batch) + held >= self._config.batch_size,
                resting=bool(skipped.ids),
            )
            if not batch:
                return result
            confirmed = await self._publish_all(publisher, batch, result)
            async with asyncio.timeout(timeout):
                if confirmed:
                    await mark_sent(conn, confirmed)
                await mark_refused(conn, result.refused)
        result.published = len(confirmed)
        keys = {row.id: row.order_key for row in batch}
        for row_id in confirmed:
            self._resting.done(row_id)
        for refusal in result.refused:
            if refusal.permanent:
                self._resting.done(refusal.id)
            else:
                self._resting.refused(refusal.id, keys[refusal.id])
        self._metrics.outbox_published.inc(len(confirmed))
        for refusal in result.refused:
            self._metrics.outbox_refused.labels(
                kind="permanent" if refusal.permanent else "transient"
            ).inc()
        if result.refused:
            self._logger.warning(
                "outbox relay: the broker did not take rows",
                refused=len(result.refused),
                failed_for_good=sum(refusal.permanent for refusal in result.refused),
                first_error=result.refused[0].error,
            )
        return result

    async def _publish_all(
        self, publisher: Publishes, batch: Sequence[OutboxRow], result: RoundResult
    ) -> list[int]:
        """Every row published, the ids confirmed. A key's rows go one after another, each after
        the confirm of the one before, and a key stops at its first transient failure (its later
        rows must not overtake it); rows without a key, and different keys, go side by side. A
        chain still waiting after ``publish_limit`` is cut there: the row it waits for counts as
        a transient failure, and neither it nor the rest of its chain is marked."""
        started = time.monotonic()
        confirmed: list[int] = []
        waiting: dict[int, OutboxRow] = {}

        async def chain(number: int, rows: Sequence[OutboxRow]) -> None:
            limit = self._config.max_body_bytes
            for row in rows:
                waiting[number] = row
                if limit is not None and len(row.body) > limit:
                    text = (
                        f"a body of {len(row.body)} bytes, larger than CONSUMER_MAX_BODY_BYTES "
                        f"({limit})"
                    )
                    result.refused.append(Refusal(row.id, text, permanent=True))
                    continue
                properties = _properties(row)
                unsendable = _unsendable(row, properties)
                if unsendable is not None:
                    result.refused.append(Refusal(row.id, unsendable, permanent=True))
                    continue
                try:
                    await publisher.publish(
                        row.body,
                        properties,
                        exchange=self._config.exchange,
                        routing_key=row.type,
                    )
                except Unroutable as error:
                    result.refused.append(Refusal(row.id, str(error), permanent=True))
                    continue
                except Exception as error:
                    text = f"{error_name(error)}: {message_of(error)}"
                    result.refused.append(Refusal(row.id, text, permanent=False))
                    return
                confirmed.append(row.id)
                self._metrics.outbox_publish_latency.observe(row.age + time.monotonic() - started)
            del waiting[number]

        chains = [
            asyncio.create_task(chain(number, rows)) for number, rows in enumerate(_chains(batch))
        ]
        try:
            _, late = await asyncio.wait(chains, timeout=self._config.publish_limit)
        finally:
            # Also on the round's own cancel (a stop past its grace): no chain outlives it.
            for task in chains:
                task.cancel()
            await asyncio.gather(*chains, return_exceptions=True)
        for number, task in enumerate(chains):
            row = waiting.get(number)
            if task in late and row is not None:
                text = (
                    f"no confirm within the round's limit ({self._config.publish_limit:g}s): "
                    "the broker blocking the connection?"
                )
                result.refused.append(Refusal(row.id, text, permanent=False))
        return confirmed

    async def _observe_depth(self, conn: asyncpg.Connection[Any], *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_depth < _DEPTH_EVERY:
            return
        self._last_depth = now
        async with asyncio.timeout(self._config.statement_timeout):
            depth = await outbox_depth(conn)
        self._metrics.outbox_depth.set(depth.rows)
        self._metrics.outbox_oldest_age.set(depth.oldest_age or 0.0)

    # -- waiting ------------------------------------------------------------------------------

    async def _wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Whether ``event`` was set within ``seconds``."""
        try:
            async with asyncio.timeout(seconds):
                await event.wait()
        except TimeoutError:
            return False
        return True

    async def _sleep(self, seconds: float) -> None:
        """A pause that a stop cuts short (a notification meanwhile stays set for after it)."""
        await self._wait(self._stopped, seconds)


def _chains(batch: Sequence[OutboxRow]) -> list[list[OutboxRow]]:
    """The batch as chains published side by side: one per key, in id order, and one per row
    without a key."""
    keyed: dict[str, list[OutboxRow]] = {}
    chains: list[list[OutboxRow]] = []
    for row in batch:
        if row.order_key is None:
            chains.append([row])
        elif row.order_key in keyed:
            keyed[row.order_key].append(row)
        else:
            keyed[row.order_key] = chain = [row]
            chains.append(chain)
    return chains


def _unsendable(row: OutboxRow, properties: Basic.Properties) -> str | None:
    """Why the row's publish cannot be put into AMQP frames at all, or None: a header value no
    AMQP table can hold (an integer past 64 bits, which JSON and jsonb take), a type past 255
    bytes (a row written with SQL). Such a publish raises the same encoder error every time:
    counted transient, it would be tried for ever and hold every later row of its key behind it.
    Only a row with headers of its own is encoded to see (about 20 us): the relay's own
    properties always encode."""
    if len(row.type.encode()) > _MAX_SHORTSTR:
        return f"not sendable as AMQP: a type of more than {_MAX_SHORTSTR} bytes"
    if not row.headers:
        return None
    try:
        properties.marshal()
    except (TypeError, ValueError, struct.error) as error:
        return f"not sendable as AMQP: {error}"
    return None


def _properties(row: OutboxRow) -> Basic.Properties:
    """Persistent JSON under the event's id, as ``consumer publish`` sends an event, with the
    headers written beside the row; and, unless they give one, the shard key a sharded queue
    hashes: the row's key (its handler's), else the event id, as ``consumer publish`` sets it."""
    return Basic.Properties(
        content_type="application/json",
        delivery_mode=PERSISTENT,
        message_id=str(row.event_id),
        headers={SHARD_KEY: row.order_key or str(row.event_id), **row.headers},
    )
