"""Receipt + effect in one transaction, and the verdict on each delivery.

::

    parse (bytes -> envelope -> handler's payload model) --invalid--> Rejected (poison)
    BEGIN
      INSERT receipt ON CONFLICT DO NOTHING --already there--> Applied(duplicate)
      handler(event, conn) under the soft time limit
    COMMIT -------------------------------------------------> Applied
    the handler raised: ROLLBACK -> Failed(error, policy's decision)

Several deliveries can share one transaction (``CONSUMER_BATCH_SIZE``): the handlers run one after
the other, a batch handler once for each run of consecutive events of its type; if one fails, the
transaction is rolled back and the others run again, each in a savepoint, so a failing one rolls
back only itself. A handler can therefore run more than once for one delivery, but only its last,
committed run has any effect. A batch that runs into another's row locks commits what it has and
applies the rest in a further round. If the commit itself fails, each event is applied again
alone.
Nothing here talks to the broker; :mod:`consumer.settle` turns verdicts into acks and publishes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

import asyncpg
from pydantic import ValidationError

from consumer.database import Database, guarded, guarded_transaction
from consumer.delivery import Delivery
from consumer.durations import format_duration, to_milliseconds
from consumer.envelope import (
    Envelope,
    EnvelopeLimits,
    EnvelopeParser,
    Poison,
    check_content_type,
)
from consumer.errors import (
    ConfigError,
    DatabaseUnavailable,
    ErrorKind,
    HandlerTimeout,
    PipelineFault,
    classify,
)
from consumer.headers import attempts_so_far
from consumer.outcome import Applied, Failed, Outcome, Rejected, Verdict
from consumer.registry import Handler, HandlerRegistry
from consumer.retry import RetryPolicy, Return
from consumer.settings import Settings

T = TypeVar("T")

_INSERT_RECEIPT = """
INSERT INTO receipts (consumer, event_id, type) VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING
RETURNING true
"""

# Sorted, so concurrent batches take the receipts' row locks in the same order (no deadlock).
_INSERT_RECEIPTS = """
INSERT INTO receipts (consumer, event_id, type)
SELECT $1, batch.event_id, batch.type
FROM unnest($2::uuid[], $3::text[]) AS batch (event_id, type)
ORDER BY batch.event_id
ON CONFLICT DO NOTHING
RETURNING event_id
"""

# One savepoint name, re-established between events: one round trip per event.
_FIRST_SAVEPOINT = "SAVEPOINT consumer_event"
_NEXT_SAVEPOINT = "RELEASE SAVEPOINT consumer_event; SAVEPOINT consumer_event"
_ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT consumer_event"

# A batch that keeps colliding with others is applied event by event after this many rounds.
_MAX_BATCH_ROUNDS = 3

# Conflicts that batching can cause between concurrent transactions: a lock wait past
# CONSUMER_BATCH_LOCK_TIMEOUT, a deadlock, a serialization failure.
_CONTENTION = (
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.LockNotAvailableError,
)


@dataclass(slots=True)
class _Ready:
    """A delivery that parsed: its handler and its bound event."""

    delivery: Delivery
    handler: Handler
    event: Envelope[Any]
    handler_seconds: float | None = None


class _ApplyAlone(Exception):
    """The batch's transaction failed as a whole; apply each event in its own."""


class _HandlerFailed(Exception):
    """A handler failed in an optimistic batch: roll it back, go again with savepoints.

    ``index`` is the event it failed, or None when a batch handler's call failed as a whole.
    """

    def __init__(self, index: int | None, error: Exception) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error


def _complete(verdicts: list[Verdict | None]) -> list[Verdict]:
    done = [verdict for verdict in verdicts if verdict is not None]
    assert len(done) == len(verdicts), "every event of a batch gets a verdict"
    return done


class Pipeline:
    """Applies deliveries to the database and returns one :class:`Outcome` per delivery."""

    def __init__(
        self,
        *,
        settings: Settings,
        registry: HandlerRegistry,
        database: Database,
        policy: RetryPolicy,
        on_conflict: Callable[[], object] = lambda: None,
    ) -> None:
        self._on_conflict = on_conflict
        self._consumer = settings.name
        self._parser = EnvelopeParser(EnvelopeLimits.from_settings(settings))
        self._default_timeout = settings.handler_timeout.total_seconds()
        lock_ms = to_milliseconds(settings.batch_lock_timeout)
        self._batch_lock_timeout = f"SET LOCAL lock_timeout = '{lock_ms}ms'"
        self._stall = settings.db_stall_timeout.total_seconds()
        self._registry = registry
        self._database = database
        self._policy = policy
        # Per event type, the envelope model with the handler's payload model in it: a valid
        # event is validated in one pass; any other goes the long way, which says what is wrong.
        self._typed: dict[str, tuple[Handler, type[Envelope[Any]]]] = {}
        for event_type, handler in registry.items():
            typed = self._parser.typed(handler.payload_type)
            if typed is not None:
                self._typed[event_type] = (handler, typed)

    def prepared(self, delivery: Delivery) -> tuple[Handler, Envelope[Any]] | Poison:
        """The delivery parsed and bound to its handler (or why it is poison), parsed once."""
        if delivery.prepared is None:
            try:
                delivery.prepared = self.prepare(delivery)
            except Poison as poison:
                delivery.prepared = poison
        result: tuple[Handler, Envelope[Any]] | Poison = delivery.prepared
        return result

    def prepare(self, delivery: Delivery) -> tuple[Handler, Envelope[Any]]:
        """Parse and bind a delivery, or raise :class:`Poison`."""
        check_content_type(delivery.content_type, delivery.content_encoding)
        self._parser.check_headers(delivery.headers)
        decoded = self._parser.decode(delivery.body)
        event_type = decoded.get("type")
        typed = self._typed.get(event_type) if isinstance(event_type, str) else None
        if typed is not None:
            handler, model = typed
            try:
                event = model.model_validate(decoded)
            except ValidationError:
                pass
            else:
                self._parser.check_skew(event)
                return handler, event
        return self._registry.resolve(self._parser.validate(decoded))

    async def process(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """Verdicts for ``deliveries``, in their order."""
        outcomes: dict[int, Outcome] = {}
        ready: list[tuple[int, _Ready]] = []
        for index, delivery in enumerate(deliveries):
            prepared = self.prepared(delivery)
            if isinstance(prepared, Poison):
                outcomes[index] = Outcome(delivery, Rejected(prepared))
            else:
                handler, event = prepared
                ready.append((index, _Ready(delivery, handler, event)))
        if ready:
            verdicts = await self._blame_a_stalled_database(
                await self._apply([item for _, item in ready])
            )
            for (index, item), verdict in zip(ready, verdicts, strict=True):
                outcomes[index] = Outcome(item.delivery, verdict, item.event, item.handler_seconds)
        return [outcomes[index] for index in range(len(deliveries))]

    async def _blame_a_stalled_database(self, verdicts: list[Verdict]) -> list[Verdict]:
        """A handler that timed out may have waited on a database that stopped answering (a
        frozen server, a network partition): if the database does not answer a probe now, the
        events are returned and the service pauses, instead of spending their retries."""
        if not any(_timed_out(verdict) for verdict in verdicts):
            return verdicts
        try:
            await self._database.probe()
        except DatabaseUnavailable as down:
            return [
                Failed(down, Return(), verdict.attempts_so_far)
                if isinstance(verdict, Failed) and _timed_out(verdict)
                else verdict
                for verdict in verdicts
            ]
        return verdicts

    async def _apply(self, items: list[_Ready], rounds: int = 0) -> list[Verdict]:
        if len(items) == 1:
            return [await self._apply_alone(items[0])]
        if rounds >= _MAX_BATCH_ROUNDS:
            # Still colliding with other batches: wait for locks like any single transaction.
            return await self._apply_each_alone(items)
        try:
            return await self._apply_together(items, rounds)
        except _ApplyAlone:
            return await self._apply_each_alone(items)

    async def _apply_each_alone(self, items: list[_Ready]) -> list[Verdict]:
        verdicts: list[Verdict] = []
        for item in items:
            previous = verdicts[-1] if verdicts else None
            if isinstance(previous, Failed) and isinstance(previous.decision, Return):
                # The database went away: give the rest back without knocking for each.
                verdicts.append(self._failed(item, previous.error))
                continue
            verdicts.append(await self._apply_alone(item))
        return verdicts

    async def _apply_alone(self, item: _Ready) -> Verdict:
        try:
            async with self._database.connection() as conn:
                try:
                    async with guarded_transaction(conn, within=self._stall):
                        fresh = await self._insert_receipt(conn, item)
                        if fresh:
                            await self._run_handler(conn, item)
                except Exception as error:
                    _raise_if_connection_lost(conn, error)
                    raise
        except (ConfigError, PipelineFault):
            raise
        except Exception as error:
            return self._failed(item, error)
        return Applied(duplicate=not fresh, committed_at=datetime.now(UTC))

    async def _apply_together(self, items: list[_Ready], rounds: int) -> list[Verdict]:
        """One transaction for the batch.

        First optimistically: every receipt in one statement, the handlers one after the other.
        If a handler fails, that transaction is rolled back and the batch runs again without the
        failed event, each event in a savepoint, so any further failure rolls back only itself.
        A lock conflict that batching itself causes (see ``_CONTENTION``) is no failure of the
        event: the batch commits what it has done so far, releasing its locks, and the rest is
        applied in a further round.
        """
        deferred: list[int] = []
        try:
            async with self._database.connection() as conn:
                try:
                    try:
                        found = await self._apply_optimistically(conn, items)
                    except _HandlerFailed as failure:
                        found = await self._apply_in_savepoints(conn, items, failure, deferred)
                except Exception as error:
                    _raise_if_connection_lost(conn, error)
                    raise
        except (ConfigError, PipelineFault):
            raise
        except Exception as error:
            if classify(error) is ErrorKind.UNAVAILABLE:
                return [self._failed(item, error) for item in items]
            raise _ApplyAlone from error
        committed_at = datetime.now(UTC)
        verdicts: list[Verdict | None] = [
            Applied(v.duplicate, committed_at) if isinstance(v, Applied) else v for v in found
        ]
        if deferred:
            # In the batch's order: the failed event deferred first may come before the rest.
            deferred.sort()
            again = await self._apply([items[index] for index in deferred], rounds + 1)
            for index, verdict in zip(deferred, again, strict=True):
                verdicts[index] = verdict
        return _complete(verdicts)

    async def _apply_optimistically(
        self, conn: asyncpg.Connection[Any], items: list[_Ready]
    ) -> list[Verdict | None]:
        async with guarded_transaction(conn, within=self._stall):
            # A batch holds its row locks until it commits: never wait long behind another
            # batch (see _CONTENTION), so lock convoys cannot build up.
            await self._step(conn, conn.execute(self._batch_lock_timeout))
            fresh = await self._insert_receipts(conn, items)
            verdicts: list[Verdict | None] = [None] * len(items)
            claimed: set[UUID] = set()
            start = 0
            while start < len(items):
                # A run: consecutive events of one handler. A batch handler takes its run in one
                # call; runs stay in order, so a restock still comes before the reserve after it.
                handler = items[start].handler
                end = start + 1
                if handler.many is not None:
                    while end < len(items) and items[end].handler is handler:
                        end += 1
                run: list[int] = []
                for index in range(start, end):
                    event_id = items[index].event.event_id
                    if event_id not in fresh or event_id in claimed:
                        verdicts[index] = Applied(True, _EPOCH)
                    else:
                        claimed.add(event_id)
                        run.append(index)
                if run:
                    await self._apply_run(conn, items, run)
                    for index in run:
                        verdicts[index] = Applied(False, _EPOCH)
                start = end
        return verdicts

    async def _apply_run(
        self, conn: asyncpg.Connection[Any], items: list[_Ready], run: list[int]
    ) -> None:
        """Apply one run of fresh events, or raise :class:`_HandlerFailed` (leaving the
        transaction, which rolls it back) or what makes the whole batch moot."""
        failed: int | None = run[0] if len(run) == 1 else None
        try:
            if len(run) == 1:
                await self._run_handler(conn, items[run[0]])
                return
            results = await self._run_batch_handler(conn, [items[index] for index in run])
            for index, result in zip(run, results, strict=True):
                if result is not None:
                    failed = index
                    raise result
        except Exception as error:
            _raise_unless_the_events_fault(conn, error)
            # Leaving the transaction rolls it back; ``None``: no event to blame.
            raise _HandlerFailed(failed, error) from error

    async def _apply_in_savepoints(
        self,
        conn: asyncpg.Connection[Any],
        items: list[_Ready],
        failure: _HandlerFailed,
        deferred: list[int],
    ) -> list[Verdict | None]:
        verdicts: list[Verdict | None] = [None] * len(items)
        if isinstance(failure.error, _CONTENTION):
            self._on_conflict()
            if failure.index is not None:
                deferred.append(failure.index)
        elif failure.index is not None:
            verdicts[failure.index] = self._failed(items[failure.index], failure.error)
        kept = [index for index in range(len(items)) if index != failure.index]
        async with guarded_transaction(conn, within=self._stall):
            await self._step(conn, conn.execute(self._batch_lock_timeout))
            for number, index in enumerate(kept):
                item = items[index]
                await self._step(
                    conn, conn.execute(_NEXT_SAVEPOINT if number else _FIRST_SAVEPOINT)
                )
                try:
                    fresh = await self._insert_receipt(conn, item)
                    if fresh:
                        await self._run_handler(conn, item)
                except Exception as error:
                    _raise_unless_the_events_fault(conn, error)
                    await self._step(conn, conn.execute(_ROLLBACK_TO_SAVEPOINT))
                    if isinstance(error, _CONTENTION):
                        self._on_conflict()
                        # Commit what is done, so our locks go; the rest goes round again.
                        deferred.extend(kept[number:])
                        break
                    verdicts[index] = self._failed(item, error)
                else:
                    verdicts[index] = Applied(not fresh, _EPOCH)
        return verdicts

    async def _step(self, conn: asyncpg.Connection[Any], step: Awaitable[T]) -> T:
        return await guarded(conn, step, within=self._stall)

    async def _insert_receipt(self, conn: asyncpg.Connection[Any], item: _Ready) -> bool:
        event = item.event
        try:
            return bool(
                await self._step(
                    conn, conn.fetchval(_INSERT_RECEIPT, self._consumer, event.event_id, event.type)
                )
            )
        except Exception as error:
            _stop_if_receipts_broken(error)
            raise

    async def _insert_receipts(
        self, conn: asyncpg.Connection[Any], items: list[_Ready]
    ) -> set[UUID]:
        """Insert every receipt of the batch; the event ids whose receipt is new."""
        ids = [item.event.event_id for item in items]
        types = [item.event.type for item in items]
        try:
            rows = await self._step(conn, conn.fetch(_INSERT_RECEIPTS, self._consumer, ids, types))
        except Exception as error:
            _stop_if_receipts_broken(error)
            raise
        return {row[0] for row in rows}

    async def _run_handler(self, conn: asyncpg.Connection[Any], item: _Ready) -> None:
        """The handler under its soft time limit; a timeout becomes :class:`HandlerTimeout`."""
        async with self._handler_call([item]):
            await item.handler.func(item.event, conn)

    async def _run_batch_handler(
        self, conn: asyncpg.Connection[Any], items: list[_Ready]
    ) -> list[Exception | None]:
        """A batch handler's call for ``items``, under its time limit for the call as a whole."""
        async with self._handler_call(items):
            return await items[0].handler.apply_many([item.event for item in items], conn)

    @asynccontextmanager
    async def _handler_call(self, items: list[_Ready]) -> AsyncIterator[None]:
        """One call of the handler of ``items`` (one event, or a batch handler's run) under the
        handler's soft time limit; each event is charged an equal share of the call's time."""
        handler = items[0].handler
        limit = handler.timeout.total_seconds() if handler.timeout else self._default_timeout
        started = time.perf_counter()
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                yield
        except TimeoutError as error:
            if deadline.expired():
                shown = format_duration(timedelta(seconds=limit))
                events = f" for {len(items)} events" if len(items) > 1 else ""
                raise HandlerTimeout(
                    f"{handler.qualname} ran past its {shown} limit{events}"
                ) from error
            raise
        except asyncpg.InsufficientPrivilegeError as error:
            # A missing grant is the deployment's fault, not the event's: stop rather than
            # dead-letter every event of this type.
            raise PipelineFault(f"{handler.qualname}: {error} (a grant is missing)") from error
        finally:
            share = (time.perf_counter() - started) / len(items)
            for item in items:
                item.handler_seconds = share

    def _failed(self, item: _Ready, error: BaseException) -> Failed:
        attempts = attempts_so_far(item.delivery.headers)
        return Failed(error, self._policy.decide(error, attempts), attempts)


_EPOCH = datetime.fromtimestamp(0, UTC)


def _stop_if_receipts_broken(error: Exception) -> None:
    if classify(error) is ErrorKind.PERMANENT:
        # Not the event's fault: the receipts table itself is broken or missing.
        raise PipelineFault(f"cannot write receipts: {error}") from error


def _timed_out(verdict: Verdict) -> bool:
    return isinstance(verdict, Failed) and isinstance(
        verdict.error, HandlerTimeout | TimeoutError | asyncpg.QueryCanceledError
    )


def _connection_lost(conn: asyncpg.Connection[Any]) -> bool:
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        # The pool has already taken back a connection that died under us.
        return True


def _raise_unless_the_events_fault(conn: asyncpg.Connection[Any], error: Exception) -> None:
    """Raise ``error`` again if no event can be blamed for it: the service cannot work, the
    connection was lost or the database is unavailable. Return for the event's own failure."""
    if isinstance(error, ConfigError | PipelineFault):
        raise error
    _raise_if_connection_lost(conn, error)
    if classify(error) is ErrorKind.UNAVAILABLE:
        raise error


def _raise_if_connection_lost(conn: asyncpg.Connection[Any], error: BaseException) -> None:
    if not isinstance(error, DatabaseUnavailable) and _connection_lost(conn):
        raise DatabaseUnavailable(f"the database connection was lost: {error}") from error
