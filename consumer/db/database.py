"""The PostgreSQL connection pool, and the translation of "cannot reach it" into one error type."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import asyncpg
from pydantic import SecretStr

from consumer.config.tls import DatabaseConnect, database_connector, database_dsn
from consumer.deadlines import Deadline
from consumer.errors import ConfigError, DatabaseUnavailable
from consumer.redact import scrub

__all__ = [
    "Database",
    "DatabaseConfig",
    "describe_database_error",
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

# The server's side of a link that went silent (a partition drops packets, no RST): without these,
# the server learns its client is gone only from the system's TCP keepalive (two hours on Linux),
# and a session caught idle in a transaction keeps its row locks, receipts included, until then.
# Keepalives: a peer silent for 30s is probed every 10s, and given up after 3 unanswered probes;
# data the peer never acknowledges gives up after a minute (tcp_user_timeout).
TCP_SETTINGS = {
    "tcp_keepalives_idle": "30",
    "tcp_keepalives_interval": "10",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "60000",
}


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
    idle_in_transaction_timeout: float | None = None
    """Seconds after which the server ends a session idle inside a transaction (rolled back, its
    locks released): what a client that went silent mid-transaction leaves. None: the server's
    own setting."""

    @property
    def server_settings(self) -> dict[str, str]:
        """The session settings every connection of the service opens with (its startup
        packet: no round trip)."""
        settings = {"application_name": self.application_name, **TCP_SETTINGS}
        if self.idle_in_transaction_timeout is not None:
            milliseconds = max(1, round(self.idle_in_transaction_timeout * 1000))
            settings["idle_in_transaction_session_timeout"] = str(milliseconds)
        return settings

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


async def _keep_session(_: asyncpg.Connection[Any]) -> None:
    """Skip asyncpg's RESET ALL round trip on every release.

    The pool still rolls back a transaction left open; the service keeps no other session state,
    and handlers must not either (use ``SET LOCAL``, which ends with the transaction).
    """


class PooledConnection:
    """One connection of the pool for the ``async with`` block, given back after it. A class,
    not a generator's context manager: every batch takes one."""

    __slots__ = ("_conn", "_pool")

    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool

    async def __aenter__(self) -> asyncpg.Connection[Any]:
        try:
            # Our own limit, not acquire's timeout=, which wraps the acquire in a task.
            async with Deadline(ACQUIRE_TIMEOUT):
                conn = await self._pool.acquire()
        except _CONFIG_ERRORS as error:
            raise ConfigError(f"CONSUMER_DATABASE_URL: {describe_database_error(error)}") from None
        except _CONNECT_ERRORS as error:
            raise DatabaseUnavailable(describe_database_error(error)) from error
        self._conn = conn
        # A pooled proxy that forwards to asyncpg.Connection; handlers see it as one.
        return cast("asyncpg.Connection[Any]", conn)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A broken connection makes release raise after the pool has terminated it. The limit:
        # a release may talk to the server (a close at max_queries, the rollback and cancel left
        # by a cancelled statement), and asyncpg takes the acquire's timeout, which ours is not,
        # as its budget; without one a stalled server would hold the batch's acks for good.
        with contextlib.suppress(Exception):
            await self._pool.release(self._conn, timeout=ACQUIRE_TIMEOUT)


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
            server_settings=config.server_settings,
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

    def connection(self) -> PooledConnection:
        """A pooled connection (``async with``); :class:`DatabaseUnavailable` when none can be
        had."""
        return PooledConnection(self.pool)

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
                    self._config.dsn,
                    timeout=PROBE_TIMEOUT,
                    server_settings=self._config.server_settings,
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
    def max_size(self) -> int:
        return self._config.pool_size

    @property
    def in_use(self) -> int:
        if self._pool is None:
            return 0
        return self._pool.get_size() - self._pool.get_idle_size()
