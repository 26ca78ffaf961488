"""The PostgreSQL connection pool, and the translation of "cannot reach it" into one error type."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import asyncpg
from pydantic import SecretStr

from consumer.errors import ConfigError, DatabaseStalled, DatabaseUnavailable
from consumer.redact import scrub
from consumer.tls import DatabaseConnect, database_connector, database_dsn

__all__ = [
    "Database",
    "DatabaseConfig",
    "Guard",
    "LockCheck",
    "describe_database_error",
    "guarded",
    "guarded_transaction",
]

Connection = asyncpg.Connection
T = TypeVar("T")

# Connecting can fail like this without anything being wrong with the settings.
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.ConnectionDoesNotExistError,
    # Several hosts, none of them the primary now: a failover under way.
    asyncpg.TargetServerAttributeNotMatched,
)

# These mean the settings are wrong: waiting will not help.
_CONFIG_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.InvalidCatalogNameError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidPasswordError,
    asyncpg.InsufficientPrivilegeError,
)

# The same role's sessions show their wait events without pg_read_all_stats.
_WAITING_ON_LOCK = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1"

_LOCK_CHECK_ERRORS: tuple[type[BaseException], ...] = (
    *_CONNECT_ERRORS,
    *_CONFIG_ERRORS,
    asyncpg.PostgresError,
)

ACQUIRE_TIMEOUT = 5.0
PROBE_TIMEOUT = 2.0


def describe_database_error(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return scrub(f"{type(error).__name__}: {text}")


@dataclass(frozen=True)
class DatabaseConfig:
    """Where PostgreSQL is, how to reach it, and the pool's shape."""

    url: SecretStr
    safe_url: str
    sslmode: str | None = None
    sslrootcert: Path | None = None
    pool_size: int = 4
    command_timeout: float = 60.0
    application_name: str = "consumer"

    @property
    def dsn(self) -> str:
        """The URL with the TLS settings in its query (a secret: never print it)."""
        return database_dsn(
            self.url.get_secret_value(), sslmode=self.sslmode, sslrootcert=self.sslrootcert
        )

    @property
    def database_name(self) -> str:
        return urlsplit(self.url.get_secret_value()).path.lstrip("/") or "postgres"

    def connector(self) -> DatabaseConnect:
        return database_connector(self.safe_url)


LockCheck = Callable[[int], Awaitable[bool]]
"""Whether the server backend with this pid waits for a lock: :meth:`Database.waiting_on_lock`."""


async def guarded(
    conn: asyncpg.Connection[Any],
    step: Awaitable[T],
    *,
    within: float,
    lock_check: LockCheck | None = None,
) -> T:
    """``step`` on ``conn``, or :class:`DatabaseUnavailable` if no answer comes ``within`` seconds.

    For the service's own statements (BEGIN, receipts, savepoints, COMMIT): a server that stops
    answering (frozen, partitioned) would otherwise hold the connection for as long as TCP does.
    The connection is dropped; whatever it was doing is rolled back by the server or, if the
    COMMIT got through, found as a receipt when the message comes back.

    A statement that can wait for another transaction's row lock (a receipt whose first copy is
    still being applied) passes ``lock_check``: while the server says the backend waits for a
    lock, that is contention and the statement goes on waiting; only a silent server is a stall.
    """
    if lock_check is not None:
        return await _guarded_with_locks(conn, step, within, lock_check)
    deadline = asyncio.timeout(within)
    try:
        async with deadline:
            return await step
    except TimeoutError:
        if not deadline.expired():
            raise
        conn.terminate()
        raise DatabaseStalled(f"the database did not answer within {within:g}s") from None


async def _guarded_with_locks(
    conn: asyncpg.Connection[Any], step: Awaitable[T], within: float, lock_check: LockCheck
) -> T:
    pid = conn.get_server_pid()
    stalled = False

    async def watch() -> None:
        nonlocal stalled
        while True:
            await asyncio.sleep(within)
            if not await lock_check(pid):
                stalled = True
                conn.terminate()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await step
    except Exception:
        if stalled:
            raise DatabaseStalled(f"the database did not answer within {within:g}s") from None
        raise
    finally:
        watcher.cancel()


@asynccontextmanager
async def guarded_transaction(
    conn: asyncpg.Connection[Any], *, within: float
) -> AsyncIterator[None]:
    """A transaction whose BEGIN, COMMIT and ROLLBACK are each :func:`guarded`. Its receipts
    commit only if it is sealed first (:meth:`consumer.receipts.Receipts.seal`)."""
    transaction = conn.transaction()
    await guarded(conn, transaction.start(), within=within)
    try:
        yield
    except BaseException:
        if not _closed(conn):
            await guarded(conn, transaction.rollback(), within=within)
        raise
    await guarded(conn, transaction.commit(), within=within)


def _closed(conn: asyncpg.Connection[Any]) -> bool:
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True  # the pool has already taken back a connection that died


async def _keep_session(_: asyncpg.Connection[Any]) -> None:
    """Skip asyncpg's RESET ALL round trip on every release.

    The pool still rolls back a transaction left open; the service keeps no other session state,
    and handlers must not either (use ``SET LOCAL``, which ends with the transaction).
    """


class Guard:
    """Runs the service's own statements on a connection, each :func:`guarded` against a server
    that stops answering; those that may wait for another transaction's row lock ask ``database``
    whether they do before they count as stalled."""

    def __init__(self, database: Database, *, within: float) -> None:
        self._database = database
        self.within = within

    async def run(
        self, conn: asyncpg.Connection[Any], step: Awaitable[T], *, locks: bool = False
    ) -> T:
        lock_check = self._database.waiting_on_lock if locks else None
        return await guarded(conn, step, within=self.within, lock_check=lock_check)


class Database:
    """A pool of at most :attr:`DatabaseConfig.pool_size` connections, opened lazily.

    The pool starts empty so the service can start while the database is down: it pauses and
    probes instead of exiting.
    """

    def __init__(self, config: DatabaseConfig) -> None:
        self._config = config
        self._pool: asyncpg.Pool[Any] | None = None
        self.server_started: object = None

    async def __aenter__(self) -> Database:
        if self._pool is not None:
            raise RuntimeError("Database is already open")
        config = self._config
        self._pool = await asyncpg.create_pool(
            config.dsn,
            connect=config.connector(),
            min_size=0,
            max_size=config.pool_size,
            command_timeout=config.command_timeout,
            server_settings={"application_name": config.application_name},
            reset=_keep_session,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            await asyncio.wait_for(pool.close(), timeout=5)
        except (TimeoutError, OSError, asyncpg.PostgresError):
            pool.terminate()

    @property
    def pool(self) -> asyncpg.Pool[Any]:
        if self._pool is None:
            raise RuntimeError("Database is not open")
        return self._pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection[Any]]:
        """A pooled connection; :class:`DatabaseUnavailable` when none can be had."""
        try:
            conn = await self.pool.acquire(timeout=ACQUIRE_TIMEOUT)
        except _CONFIG_ERRORS as error:
            raise ConfigError(f"CONSUMER_DATABASE_URL: {describe_database_error(error)}") from None
        except _CONNECT_ERRORS as error:
            raise DatabaseUnavailable(describe_database_error(error)) from error
        try:
            # A pooled proxy that forwards to asyncpg.Connection; handlers see it as one.
            yield cast("asyncpg.Connection[Any]", conn)
        finally:
            # A broken connection makes release raise after the pool has terminated it.
            with contextlib.suppress(Exception):
                await self.pool.release(conn)

    async def probe(self) -> None:
        """Raise :class:`DatabaseUnavailable` unless the database answers on a new connection.

        A new connection, not a pooled one: the pool's may all be busy or stuck on a server that
        stopped answering, and what matters is whether a fresh session can be had now. Notes when
        the server started (:attr:`server_started`): a restart since tells an outage apart from
        an event that kills its own backend.
        """
        connect = self._config.connector()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                conn = await connect(self._config.dsn, timeout=PROBE_TIMEOUT)
                try:
                    self.server_started = await conn.fetchval("SELECT pg_postmaster_start_time()")
                finally:
                    conn.terminate()
        except _CONFIG_ERRORS as error:
            raise ConfigError(f"CONSUMER_DATABASE_URL: {describe_database_error(error)}") from None
        except _CONNECT_ERRORS as error:
            raise DatabaseUnavailable(describe_database_error(error)) from error

    async def connect_one(self) -> asyncpg.Connection[Any]:
        """A connection of its own, outside the pool (the caller closes it)."""
        connect = self._config.connector()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                conn: asyncpg.Connection[Any] = await connect(
                    self._config.dsn, timeout=PROBE_TIMEOUT
                )
                return conn
        except _CONFIG_ERRORS as error:
            raise ConfigError(f"CONSUMER_DATABASE_URL: {describe_database_error(error)}") from None
        except _CONNECT_ERRORS as error:
            raise DatabaseUnavailable(describe_database_error(error)) from error

    async def waiting_on_lock(self, pid: int) -> bool:
        """Whether backend ``pid`` is waiting for a lock another transaction holds: contention,
        not an outage. False when the database cannot say (it does not answer)."""
        connect = self._config.connector()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                conn = await connect(self._config.dsn, timeout=PROBE_TIMEOUT)
                try:
                    return bool(await conn.fetchval(_WAITING_ON_LOCK, pid))
                finally:
                    conn.terminate()
        except _LOCK_CHECK_ERRORS:
            return False

    @property
    def size(self) -> int:
        return self._pool.get_size() if self._pool is not None else 0

    @property
    def in_use(self) -> int:
        if self._pool is None:
            return 0
        return self._pool.get_size() - self._pool.get_idle_size()
