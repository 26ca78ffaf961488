"""A paced producer with publisher confirms that rides out connection loss, as a careful one does.

A publish that is not confirmed (the connection died, the broker nacked, no answer in time) is sent
again on a new connection with a message id of its own (:func:`~tests.chaos.workload.attempt_id`).
The unconfirmed attempt may or may not have reached the broker: the log says which attempts are
*confirmed* and which are *uncertain*, and the checks expect 0 or 1 copies of an uncertain one.
An event of a hostile producer's kind goes out with that producer's headers and message id
(:mod:`.hostile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, DeliveryMode

from tests.chaos import hostile
from tests.chaos.workload import Publication, attempt_id
from tests.support import connect_any
from topology.names import SHARD_KEY

PUBLISH_TIMEOUT = 10.0
TICK = 0.05


class Attempt(enum.Enum):
    CONFIRMED = "confirmed"
    UNCERTAIN = "uncertain"


class Gates:
    """Hold the stream a little past each fault's point until the fault has struck and the
    consumers have recovered, so that every fault lands while events still flow."""

    def __init__(self, positions: Sequence[int]) -> None:
        self.positions = list(positions)
        self.reached = [asyncio.Event() for _ in self.positions]
        self.opened = [asyncio.Event() for _ in self.positions]

    async def before(self, position: int) -> None:
        for gate, at in enumerate(self.positions):
            if position >= at and not self.opened[gate].is_set():
                self.reached[gate].set()
                await self.opened[gate].wait()

    def open(self, gate: int | None = None) -> None:
        for index, event in enumerate(self.opened):
            if gate is None or index == gate:
                event.set()


@dataclass
class PublishLog:
    attempts: dict[str, Attempt] = field(default_factory=dict)
    """Every attempt's message id and what became of it."""
    published: int = 0
    """Publications confirmed (each exactly once, whatever its attempts)."""
    unsent: list[Publication] = field(default_factory=list)
    """Publications never confirmed before the deadline."""
    reconnects: int = 0
    confirmed_at: dict[str, float] = field(default_factory=dict)
    """When each confirmed attempt's confirm came (wall clock, ``time.time()``): how long an
    event then waited for its commit (``queue-table*``'s figures)."""
    sent_at: dict[str, float] = field(default_factory=dict)
    """When each publication's first attempt went out (wall clock, epoch seconds), by its
    message id."""

    @property
    def resent(self) -> int:
        return sum(1 for state in self.attempts.values() if state is Attempt.UNCERTAIN)


def merged(*logs: PublishLog) -> PublishLog:
    """One log of several producers' (their message ids differ)."""
    out = PublishLog()
    for log in logs:
        out.attempts.update(log.attempts)
        out.published += log.published
        out.unsent += log.unsent
        out.reconnects += log.reconnects
        out.confirmed_at.update(log.confirmed_at)
        out.sent_at.update(log.sent_at)
    return out


class ResilientProducer:
    """Publishes a workload at a steady rate to ``exchange`` on ``url``."""

    def __init__(
        self,
        url: str,
        exchange: str,
        *,
        window: int = 200,
        shard_keys: Mapping[str, str] | None = None,
    ) -> None:
        """``shard_keys``: each event's ``consumer-shard-key`` by its plan key (a sharded
        queue's hash exchange hashes it); an event not in it goes without."""
        self._url = url
        self._exchange_name = exchange
        self._window = window
        self._shard_keys = shard_keys or {}
        self._connection: AbstractConnection | None = None
        self._exchange: AbstractExchange | None = None
        self.log = PublishLog()

    async def _target(self) -> AbstractExchange:
        if self._exchange is None:
            connection = await connect_any(self._url, timeout=5)
            try:
                channel: AbstractChannel = await connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
                self._exchange = await channel.get_exchange(self._exchange_name, ensure=False)
            except BaseException:
                await _close_quietly(connection)
                raise
            self._connection = connection
        return self._exchange

    async def _reset(self) -> None:
        connection, self._connection, self._exchange = self._connection, None, None
        if connection is not None:
            await _close_quietly(connection)
        self.log.reconnects += 1

    async def close(self) -> None:
        connection, self._connection, self._exchange = self._connection, None, None
        if connection is not None:
            await _close_quietly(connection)

    async def _publish(
        self, exchange: AbstractExchange, publication: Publication, attempt: int
    ) -> None:
        event = publication.event
        message = aio_pika.Message(
            event.body,
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
        )
        # Set after construction: the constructor makes an empty-looking raw table ``{}``.
        headers = hostile.headers(event.wire)
        if headers is None:
            headers = {}
            if (key := self._shard_keys.get(event.key)) is not None:
                headers[SHARD_KEY] = key
        message.headers = headers
        # Set after construction: the constructor makes it a plain str, losing hostile bytes.
        message.message_id = hostile.message_id(event.wire, attempt_id(publication, attempt))
        await exchange.publish(
            message,
            event.routing_key,
            mandatory=True,
            timeout=PUBLISH_TIMEOUT,
        )

    async def publish_all(
        self,
        publications: Sequence[Publication],
        *,
        rate: float,
        deadline: float,
        gates: Gates | None = None,
    ) -> PublishLog:
        """Publish everything at about ``rate`` a second, waiting at ``gates``; stop at
        ``deadline`` (monotonic)."""
        started = time.monotonic()
        chunk = max(1, min(self._window, round(rate * TICK)))
        position = 0
        hostile_wire = any(publication.event.wire is not None for publication in publications)
        # The whole stream: the encoder is patched per process, and publishes overlap.
        encoding = hostile.hostile_encoding() if hostile_wire else contextlib.nullcontext()
        try:
            with encoding:
                while position < len(publications):
                    if gates is not None:
                        held = time.monotonic()
                        await gates.before(position)
                        started += time.monotonic() - held  # the pace resumes where it stopped
                    batch = publications[position : position + chunk]
                    if not await self._publish_confirmed(batch, deadline):
                        self.log.unsent.extend(publications[position:])
                        break
                    position += len(batch)
                    self.log.published = position
                    pause = started + position / rate - time.monotonic()
                    if pause > 0:
                        await asyncio.sleep(pause)
        finally:
            await self.close()
        return self.log

    async def _publish_confirmed(self, batch: Sequence[Publication], deadline: float) -> bool:
        """Publish ``batch`` until every one is confirmed; False if the deadline came first."""
        pending = [(publication, 0) for publication in batch]
        now = time.time()
        for publication in batch:
            self.log.sent_at.setdefault(publication.message_id, now)
        while pending:
            if time.monotonic() > deadline:
                return False
            try:
                exchange = await self._target()
            except Exception:  # the broker is away: try again shortly
                await self._reset()
                await asyncio.sleep(0.25)
                continue
            results = await asyncio.gather(
                *(
                    self._publish(exchange, publication, attempt)
                    for publication, attempt in pending
                ),
                return_exceptions=True,
            )
            failed: list[tuple[Publication, int]] = []
            for (publication, attempt), result in zip(pending, results, strict=True):
                if isinstance(result, BaseException):
                    if isinstance(result, asyncio.CancelledError):
                        raise result
                    self.log.attempts[attempt_id(publication, attempt)] = Attempt.UNCERTAIN
                    failed.append((publication, attempt + 1))
                else:
                    self.log.attempts[attempt_id(publication, attempt)] = Attempt.CONFIRMED
                    self.log.confirmed_at[attempt_id(publication, attempt)] = time.time()
            if failed:
                await self._reset()
                await asyncio.sleep(0.25)
            pending = failed
        return True


async def _close_quietly(connection: AbstractConnection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(connection.close(), timeout=5)
