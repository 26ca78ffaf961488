"""Every error the service raises or classifies, in one tree.

::

    ConsumerError
    ├── ConfigError            a bad setting or handler module; start-up stops (exit 2)
    ├── TopologyError          the broker's queues and exchanges are not what the service needs
    │   ├── TopologyMissing    something is not declared: run ``consumer topology apply``
    │   └── TopologyConflict   something exists with other arguments; nothing was changed
    ├── MigrationError         a migration cannot be applied (an applied file was edited...)
    ├── HandlerError           what handlers raise to say how an event failed
    │   ├── TransientError     waiting may fix it: the event climbs the retry ladder
    │   │   └── HandlerTimeout the handler ran past its soft time limit and was cancelled
    │   └── PermanentError     no retry can fix it: the event is dead-lettered at once
    ├── DatabaseUnavailable    the database cannot be reached: pause, count no attempt
    ├── PipelineFault          the service itself cannot work (no receipts table): it stops
    └── PublishFailed          the broker did not confirm a publish: return the original
        └── Unroutable         no queue is bound for the routing key

Library errors are translated here, by type, never by message text: :func:`classify`
decides what an exception raised while applying an event means.
"""

from __future__ import annotations

import enum

import asyncpg


class ConsumerError(Exception):
    """Base of every error the service defines."""


class ConfigError(ConsumerError):
    """A setting or handler module is unusable; the message names it."""


class TopologyError(ConsumerError):
    """The broker topology is not what the service needs."""


class TopologyMissing(TopologyError):
    """A queue or exchange the service needs is not declared."""


class TopologyConflict(TopologyError):
    """A queue or exchange exists with arguments other than the plan's."""


class MigrationError(ConsumerError):
    """A migration cannot be applied."""


class HandlerError(ConsumerError):
    """Raised by handlers to say how applying an event failed."""


class TransientError(HandlerError):
    """A failure that waiting may fix (a dependency down, a lock held): retry later."""


class HandlerTimeout(TransientError):
    """The handler ran past its soft time limit: cancelled, its transaction rolled back."""


class PermanentError(HandlerError):
    """A failure no retry can fix (a business rule, bad data): dead-letter at once."""


class DatabaseUnavailable(ConsumerError):
    """The database cannot be reached; the service pauses instead of failing events."""


class PipelineFault(ConsumerError):
    """Something no event can be blamed for is broken (no receipts table, a missing grant): stop."""


class PublishFailed(ConsumerError):
    """The broker nacked, returned or did not confirm a publish in time."""


class Unroutable(PublishFailed):
    """The broker returned a mandatory publish: no queue is bound for it."""


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


def error_name(error: BaseException) -> str:
    """A stable, low-cardinality name for an exception's class."""
    cls = type(error)
    module = cls.__module__
    if module in ("builtins", __name__):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"
