"""Whose fault a failure is, and the verdict on an event that failed.

An event's own failure gets the retry policy's decision (:mod:`consumer.pipeline.retry`); what no
event can be blamed for (the service cannot work, the connection or the database went away, a
handler ended the transaction) is raised past the event, for the batch engine to handle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from consumer.amqp.delivery import Delivery
from consumer.amqp.headers import attempts_so_far
from consumer.classification import ErrorKind, classify
from consumer.db.database import Database
from consumer.error_text import message_of
from consumer.errors import (
    ConfigError,
    ConnectionLostRepeatedly,
    DatabaseStalled,
    DatabaseUnavailable,
    HandlerEndedTransaction,
    PipelineFault,
    SwallowedDatabaseError,
)
from consumer.pipeline.calls import connection_lost
from consumer.pipeline.outcome import Failed
from consumer.pipeline.ready import Ready
from consumer.pipeline.retry import DeadLetter, DeadLetterReason, RetryPolicy

__all__ = [
    "Judge",
    "aborted_before",
    "on_a_connection",
    "own_fault",
    "raise_if_connection_lost",
    "raise_unless_the_events_fault",
]


class Judge:
    """Turns an event's failure into a :class:`~consumer.pipeline.outcome.Failed` verdict."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy

    def failed(
        self,
        delivery: Delivery,
        error: BaseException,
        *,
        isolated: bool = False,
        connection_losses: int = 0,
    ) -> Failed:
        """The verdict on ``delivery`` failing with ``error``, its database connection having
        broken ``connection_losses`` times in a row before. ``isolated``: it was applied on its
        own, so a connection that broke under it counts against it
        (:data:`~consumer.pipeline.retry.MAX_CONNECTION_LOSSES`; a stalled server does not, and a
        restart is forgiven at the resume). Nothing of ``delivery`` changes: the verdict says
        whether it goes the isolated way next and the losses so far, for the dispatcher."""
        unavailable = classify(error) is ErrorKind.UNAVAILABLE
        if unavailable and isolated and not isinstance(error, DatabaseStalled):
            connection_losses += 1
        attempts = attempts_so_far(delivery.headers)
        decision = self._policy.decide(error, attempts, connection_losses)
        if isinstance(decision, DeadLetter) and decision.reason is DeadLetterReason.CONNECTION_LOST:
            error = ConnectionLostRepeatedly(
                f"its database connection broke {connection_losses} times in a row while "
                f"it was applied alone, the database answering in between (last: {error})"
            )
        # Which event of a batch broke the connection is not known: each goes isolated next.
        return Failed(
            error,
            decision,
            attempts,
            isolated_next=unavailable,
            connection_losses=connection_losses,
        )

    def stalled(
        self,
        delivery: Delivery,
        timeout: BaseException,
        down: BaseException,
        connection_losses: int = 0,
    ) -> Failed:
        """The verdict on ``delivery`` whose time limit ran out while, a probe says, the database
        does not answer (``down``): the policy's decision with that knowledge."""
        attempts = attempts_so_far(delivery.headers)
        decision = self._policy.decide(timeout, attempts, connection_losses, database_answers=False)
        return Failed(down, decision, attempts, connection_losses=connection_losses)


T = TypeVar("T")


async def on_a_connection(
    database: Database,
    work: Callable[[asyncpg.Connection[Any]], Awaitable[T]],
    *,
    failed: Callable[[Exception], T],
) -> T:
    """``work`` on a pooled connection of its own, what it raises sorted three ways: a lost
    connection is :class:`DatabaseUnavailable` whatever the handler made of it; what no event can
    be blamed for (:class:`ConfigError`, :class:`PipelineFault`) goes on up; anything else, the
    pool's own refusal included, is this work's failure, and ``failed(error)`` its verdict."""
    try:
        async with database.connection() as conn:
            try:
                return await work(conn)
            except Exception as error:
                raise_if_connection_lost(conn, error)
                raise
    except (ConfigError, PipelineFault):
        raise
    except Exception as error:
        return failed(error)


def own_fault(error: Exception, item: Ready) -> Exception:
    """``error`` as the fault of ``item``, applied on its own or in its own savepoint: a failed
    transaction there means its handler swallowed an earlier database error."""
    if isinstance(error, asyncpg.InFailedSQLTransactionError):
        return SwallowedDatabaseError.for_handler(item.handler.qualname)
    return error


def aborted_before(error: BaseException) -> bool:
    """Whether ``error`` is, or was raised from, a statement refused because the transaction was
    already aborted: then an earlier handler swallowed a database error, not this one (a handler
    may well wrap database errors in its own)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, asyncpg.InFailedSQLTransactionError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def raise_unless_the_events_fault(conn: asyncpg.Connection[Any], error: Exception) -> None:
    """Raise ``error`` again if no event can be blamed for it: the service cannot work, the
    connection was lost, the database is unavailable, or a handler ended the transaction (then
    every event is applied again isolated). Return for the event's own failure."""
    if isinstance(error, ConfigError | PipelineFault | HandlerEndedTransaction):
        raise error
    raise_if_connection_lost(conn, error)
    if classify(error) is ErrorKind.UNAVAILABLE:
        raise error


def raise_if_connection_lost(conn: asyncpg.Connection[Any], error: BaseException) -> None:
    if not isinstance(error, DatabaseUnavailable) and connection_lost(conn):
        lost = f"the database connection was lost: {message_of(error)}"
        raise DatabaseUnavailable(lost) from error
