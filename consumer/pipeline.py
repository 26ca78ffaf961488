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
alone. Two copies of one event in a batch are applied once: the later copy takes the first one's
verdict.

A handler can break the transaction without raising: it catches a database error without a
savepoint (PostgreSQL has aborted the transaction, and COMMIT would answer ROLLBACK with no
error), or it runs COMMIT or ROLLBACK itself. Neither is ever acked as applied: the transaction is
checked before its commit and after each handler call, the batch is applied again event by event,
and only the culprit fails (:class:`~consumer.errors.SwallowedDatabaseError`,
:class:`~consumer.errors.HandlerEndedTransaction`).

A delivery that came back after a process death or a broken connection is applied alone, marked
in progress (:mod:`consumer.crashes`): :meth:`Pipeline.process_alone`.
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

from consumer.calls import HandlerCall, HandlerCalls
from consumer.crashes import CrashLedger
from consumer.database import Database, guarded, guarded_transaction
from consumer.delivery import Delivery
from consumer.durations import format_duration, to_milliseconds
from consumer.envelope import (
    Envelope,
    EnvelopeLimits,
    EnvelopeParser,
    Poison,
    PoisonReason,
    check_content_type,
    one_line,
)
from consumer.errors import (
    ConfigError,
    ConnectionLostRepeatedly,
    DatabaseUnavailable,
    ErrorKind,
    HandlerEndedTransaction,
    HandlerTimeout,
    PipelineFault,
    SwallowedDatabaseError,
    classify,
    error_name,
)
from consumer.headers import attempts_so_far
from consumer.outcome import Applied, Failed, Outcome, Rejected, Verdict
from consumer.registry import Handler, HandlerRegistry
from consumer.retry import DeadLetter, DeadLetterReason, Retry, RetryPolicy, Return
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

# Each event's savepoint is taken and released inside that event's own failure handling: the
# release fails if its handler swallowed a database error, which then blames it and no other.
_SAVEPOINT = "SAVEPOINT consumer_event"
_RELEASE_SAVEPOINT = "RELEASE SAVEPOINT consumer_event"
_ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT consumer_event; RELEASE SAVEPOINT consumer_event"

_RECEIPT_EXISTS = "SELECT EXISTS (SELECT FROM receipts WHERE consumer = $1 AND event_id = $2)"

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
        ledger: CrashLedger,
        calls: HandlerCalls | None = None,
        on_conflict: Callable[[], object] = lambda: None,
    ) -> None:
        self._on_conflict = on_conflict
        self._ledger = ledger
        self._calls = calls or HandlerCalls()
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
        """The delivery parsed and bound to its handler (or why it is poison), parsed once.

        Any exception is poison: pydantic lets through what a validator raises other than
        ``ValueError`` and ``AssertionError``, and a delivery must never be left unsettled.
        """
        if delivery.prepared is None:
            try:
                delivery.prepared = self.prepare(delivery)
            except Poison as poison:
                delivery.prepared = poison
            except Exception as error:
                delivery.prepared = Poison(
                    PoisonReason.INVALID_PAYLOAD,
                    one_line(f"{error_name(error)}: {error}", 300),
                    error_class=error_name(error),
                )
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
        first_copy: dict[UUID, int] = {}
        later_copies: list[tuple[int, Delivery, Envelope[Any], int]] = []
        for index, delivery in enumerate(deliveries):
            prepared = self.prepared(delivery)
            if isinstance(prepared, Poison):
                outcomes[index] = Outcome(delivery, Rejected(prepared))
                continue
            handler, event = prepared
            first = first_copy.get(event.event_id)
            if first is not None:
                later_copies.append((index, delivery, event, first))
                continue
            first_copy[event.event_id] = len(ready)
            ready.append((index, _Ready(delivery, handler, event)))
        if ready:
            verdicts = await self._blame_a_stalled_database(
                await self._apply([item for _, item in ready])
            )
            for (index, item), verdict in zip(ready, verdicts, strict=True):
                outcomes[index] = Outcome(item.delivery, verdict, item.event, item.handler_seconds)
            for index, delivery, event, first in later_copies:
                verdict = _later_copy(verdicts[first], attempts_so_far(delivery.headers))
                outcomes[index] = Outcome(delivery, verdict, event)
        return [outcomes[index] for index in range(len(deliveries))]

    async def process_alone(self, delivery: Delivery) -> Outcome:
        """The verdict for a delivery applied alone, marked in progress (:mod:`consumer.crashes`):
        it came back after a process died or its database connection broke."""
        prepared = self.prepared(delivery)
        if isinstance(prepared, Poison):
            return Outcome(delivery, Rejected(prepared))
        handler, event = prepared
        item = _Ready(delivery, handler, event)
        (verdict,) = await self._blame_a_stalled_database([await self._apply_marked(item)])
        return Outcome(delivery, verdict, event, item.handler_seconds)

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
                except HandlerEndedTransaction as ended:
                    return await self._after_ended_transaction(conn, item, ended)
                except Exception as error:
                    _raise_if_connection_lost(conn, error)
                    raise
        except (ConfigError, PipelineFault):
            raise
        except Exception as error:
            return self._failed(item, _own_fault(error, item), alone=True)
        return Applied(duplicate=not fresh, committed_at=datetime.now(UTC))

    async def _apply_marked(self, item: _Ready) -> Verdict:
        """Mark the event in progress (committed), then apply it alone in a transaction that
        clears the mark whatever the handler does; see :mod:`consumer.crashes`."""
        event_id = item.event.event_id
        try:
            async with self._database.connection() as conn:
                try:
                    row = await self._step(conn, self._ledger.begin(conn, event_id), locks=True)
                    conviction = self._ledger.mark_of(row).conviction()
                    if conviction is not None:
                        await self._step(conn, self._ledger.clear(conn, event_id))
                        return self._failed(item, conviction)
                    async with guarded_transaction(conn, within=self._stall):
                        verdict = await self._apply_in_savepoint(conn, item)
                        await self._step(conn, self._ledger.clear(conn, event_id))
                except HandlerEndedTransaction as ended:
                    verdict = await self._after_ended_transaction(conn, item, ended)
                    await self._step(conn, self._ledger.clear(conn, event_id))
                    return verdict
                except Exception as error:
                    _raise_if_connection_lost(conn, error)
                    raise
        except (ConfigError, PipelineFault):
            raise
        except Exception as error:
            return self._failed(item, error, alone=True)
        if isinstance(verdict, Applied):
            return Applied(verdict.duplicate, datetime.now(UTC))
        return verdict

    async def _after_ended_transaction(
        self, conn: asyncpg.Connection[Any], item: _Ready, ended: HandlerEndedTransaction
    ) -> Verdict:
        """The handler committed or rolled back the transaction itself. If that committed the
        receipt, the effect went with it: the event is applied (and the bug is reported);
        otherwise nothing of it is left and it is dead-lettered."""
        committed = await self._step(
            conn, conn.fetchval(_RECEIPT_EXISTS, self._consumer, item.event.event_id)
        )
        if committed:
            return Applied(False, datetime.now(UTC), note=str(ended))
        return self._failed(item, ended)

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
                    found: list[Verdict | None]
                    try:
                        found = list(await self._apply_optimistically(conn, items))
                    except _HandlerFailed as failure:
                        found = await self._apply_in_savepoints(conn, items, failure, deferred)
                except Exception as error:
                    _raise_if_connection_lost(conn, error)
                    raise
        except (ConfigError, PipelineFault):
            raise
        except Exception as error:
            if classify(error) is ErrorKind.UNAVAILABLE:
                # Which of them broke it is not known: each is applied alone next time.
                for item in items:
                    item.delivery.alone = True
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
    ) -> list[Applied | None]:
        async with guarded_transaction(conn, within=self._stall):
            # A batch holds its row locks until it commits: never wait long behind another
            # batch (see _CONTENTION), so lock convoys cannot build up.
            await self._step(conn, conn.execute(self._batch_lock_timeout))
            fresh = await self._insert_receipts(conn, items)
            verdicts: list[Applied | None] = [None] * len(items)
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
                    if items[index].event.event_id in fresh:
                        run.append(index)
                    else:
                        verdicts[index] = Applied(True, _EPOCH)
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
            if isinstance(error, asyncpg.InFailedSQLTransactionError):
                failed = None  # a handler before this one swallowed an error: not this one's
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
                verdict = await self._apply_in_savepoint(conn, items[index])
                if isinstance(verdict, Failed) and isinstance(verdict.error, _CONTENTION):
                    self._on_conflict()
                    # Commit what is done, so our locks go; the rest goes round again.
                    deferred.extend(kept[number:])
                    break
                verdicts[index] = verdict
        return verdicts

    async def _apply_in_savepoint(self, conn: asyncpg.Connection[Any], item: _Ready) -> Verdict:
        """One event in a savepoint of the open transaction: its failure rolls back only itself.
        Raises what no event can be blamed for."""
        await self._step(conn, conn.execute(_SAVEPOINT))
        try:
            fresh = await self._insert_receipt(conn, item)
            if fresh:
                await self._run_handler(conn, item)
            await self._step(conn, conn.execute(_RELEASE_SAVEPOINT))
        except Exception as error:
            _raise_unless_the_events_fault(conn, error)
            await self._step(conn, conn.execute(_ROLLBACK_TO_SAVEPOINT))
            return self._failed(item, _own_fault(error, item))
        return Applied(not fresh, _EPOCH)

    async def _step(
        self, conn: asyncpg.Connection[Any], step: Awaitable[T], *, locks: bool = False
    ) -> T:
        """One of the service's own statements, guarded against a stalled server; ``locks``:
        it may wait for another transaction's row lock, which is contention, not a stall."""
        lock_check = self._database.waiting_on_lock if locks else None
        return await guarded(conn, step, within=self._stall, lock_check=lock_check)

    async def _insert_receipt(self, conn: asyncpg.Connection[Any], item: _Ready) -> bool:
        event = item.event
        try:
            return bool(
                await self._step(
                    conn,
                    conn.fetchval(_INSERT_RECEIPT, self._consumer, event.event_id, event.type),
                    locks=True,
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
            rows = await self._step(
                conn, conn.fetch(_INSERT_RECEIPTS, self._consumer, ids, types), locks=True
            )
        except Exception as error:
            _stop_if_receipts_broken(error)
            raise
        return {row[0] for row in rows}

    async def _run_handler(self, conn: asyncpg.Connection[Any], item: _Ready) -> None:
        """The handler under its soft time limit; a timeout becomes :class:`HandlerTimeout`."""
        async with self._handler_call(conn, [item]):
            await item.handler.func(item.event, conn)

    async def _run_batch_handler(
        self, conn: asyncpg.Connection[Any], items: list[_Ready]
    ) -> list[Exception | None]:
        """A batch handler's call for ``items``, under its time limit for the call as a whole."""
        async with self._handler_call(conn, items):
            return await items[0].handler.apply_many([item.event for item in items], conn)

    @asynccontextmanager
    async def _handler_call(
        self, conn: asyncpg.Connection[Any], items: list[_Ready]
    ) -> AsyncIterator[None]:
        """One call of the handler of ``items`` (one event, or a batch handler's run) under the
        handler's soft time limit; each event is charged an equal share of the call's time.
        The call is registered for the watchdog, and must leave the transaction open."""
        handler = items[0].handler
        limit = handler.timeout.total_seconds() if handler.timeout else self._default_timeout
        call = HandlerCall(
            handler=handler.qualname,
            event_type=handler.event_type,
            event_ids=tuple(item.event.event_id for item in items),
            message_id=items[0].delivery.message_id,
        )
        started = time.perf_counter()
        deadline = asyncio.timeout(limit)
        try:
            try:
                with self._calls.entered(call):
                    async with deadline:
                        yield
            except Exception as error:
                if not _connection_lost(conn) and not conn.is_in_transaction():
                    raise HandlerEndedTransaction.for_handler(handler.qualname) from error
                raise
            if not conn.is_in_transaction():
                raise HandlerEndedTransaction.for_handler(handler.qualname)
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

    def _failed(self, item: _Ready, error: BaseException, *, alone: bool = False) -> Failed:
        """The verdict on ``item`` failing with ``error``. ``alone``: it was applied on its own,
        so a broken connection counts against it (:data:`~consumer.retry.MAX_CONNECTION_LOSSES`)."""
        delivery = item.delivery
        if classify(error) is ErrorKind.UNAVAILABLE:
            delivery.alone = True
            if alone:
                delivery.connection_losses += 1
        attempts = attempts_so_far(delivery.headers)
        decision = self._policy.decide(error, attempts, delivery.connection_losses)
        if isinstance(decision, DeadLetter) and decision.reason is DeadLetterReason.CONNECTION_LOST:
            error = ConnectionLostRepeatedly(
                f"its database connection broke {delivery.connection_losses} times in a row while "
                f"it was applied alone, the database answering in between (last: {error})"
            )
        return Failed(error, decision, attempts)


_EPOCH = datetime.fromtimestamp(0, UTC)


def _later_copy(first: Verdict, attempts: int) -> Verdict:
    """The verdict on a second copy of an event, in the batch of its first copy: a duplicate
    where the first committed or goes on along the ladder, else the first's fate."""
    if isinstance(first, Applied):
        return Applied(True, first.committed_at)
    if isinstance(first, Failed):
        if isinstance(first.decision, Retry):
            return Applied(True, datetime.now(UTC))
        return Failed(first.error, first.decision, attempts)
    return first


def _own_fault(error: Exception, item: _Ready) -> Exception:
    """``error`` as the fault of ``item``, applied on its own or in its own savepoint: a failed
    transaction there means its handler swallowed an earlier database error."""
    if isinstance(error, asyncpg.InFailedSQLTransactionError):
        return SwallowedDatabaseError.for_handler(item.handler.qualname)
    return error


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
    connection was lost, the database is unavailable, or a handler ended the transaction (then
    every event is applied again alone). Return for the event's own failure."""
    if isinstance(error, ConfigError | PipelineFault | HandlerEndedTransaction):
        raise error
    _raise_if_connection_lost(conn, error)
    if classify(error) is ErrorKind.UNAVAILABLE:
        raise error


def _raise_if_connection_lost(conn: asyncpg.Connection[Any], error: BaseException) -> None:
    if not isinstance(error, DatabaseUnavailable) and _connection_lost(conn):
        raise DatabaseUnavailable(f"the database connection was lost: {error}") from error
