"""What an exception raised while applying an event means for that event, decided by its type
alone (never its message text): the driver's and the broker's errors translated into the
service's kinds of failure."""

from __future__ import annotations

import enum

import asyncpg

from consumer.errors import DatabaseUnavailable, HandlerTimeout, PermanentError, TransientError

__all__ = ["ErrorKind", "classify", "schema_missing", "timed_out"]


class ErrorKind(enum.Enum):
    """What an exception means for the event that raised it."""

    TRANSIENT = "transient"
    PERMANENT = "permanent"
    UNAVAILABLE = "unavailable"


# SQLSTATEs a retry can fix: serialization failure, deadlock, lock not available (lock_timeout),
# query canceled (statement_timeout).
_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.LockNotAvailableError,
    asyncpg.QueryCanceledError,
    # Undefined table or column (42P01, 42703): handler code deployed before its migration ran,
    # a deploy-ordering race that `consumer migrate` ends (`consumer run` refuses to start while
    # a migration is pending, so only a replica started before the new code's migration meets
    # it). The ladder gives the migration time; a handler that names a table that never comes
    # is dead-lettered when the ladder ends (retries_exhausted), and the metric
    # consumer_schema_missing_total counts each meeting meanwhile.
    asyncpg.UndefinedTableError,
    asyncpg.UndefinedColumnError,
    # A handler's own network calls (an HTTP API, a cache) failing or timing out.
    ConnectionError,
    TimeoutError,
)

# The database connection is gone or cannot be made: nothing about the event is wrong. Other
# connection errors are only "unavailable" when the pipeline sees its database connection closed.
_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
    # The driver's protocol state broke, as when the server cuts a connection mid-statement:
    # never the event's fault. If the database answers, the event is simply tried again.
    asyncpg.InternalClientError,
)


def classify(error: BaseException) -> ErrorKind:
    """Decide, by type only, what an exception raised while applying an event means."""
    if isinstance(error, TransientError):
        return ErrorKind.TRANSIENT
    if isinstance(error, PermanentError):
        return ErrorKind.PERMANENT
    if isinstance(error, _UNAVAILABLE_ERRORS):
        return ErrorKind.UNAVAILABLE
    if isinstance(error, _TRANSIENT_ERRORS):
        return ErrorKind.TRANSIENT
    return ErrorKind.PERMANENT


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a time limit running out: the soft limit, a driver's or a statement's
    timeout. Waiting on a database that stopped answering looks like this too."""
    return isinstance(error, HandlerTimeout | TimeoutError | asyncpg.QueryCanceledError)


def schema_missing(error: BaseException) -> bool:
    """Whether ``error`` is a table or column the handler names not being there (yet)."""
    return isinstance(error, asyncpg.UndefinedTableError | asyncpg.UndefinedColumnError)
