"""Throwaway databases for handler tests: a template migrated once, a fresh copy per test.

The template holds the service's migrations and those of the handler modules' sets, applied by
the same code as ``consumer migrate``, and the receipts' partitions the service makes at
start-up; each test gets ``CREATE DATABASE ... TEMPLATE`` of it (a
file copy on the server, a few tens of milliseconds), dropped when the test ends. Each name
carries a random part: tests running side by side (pytest-xdist, two checkouts) never meet.

The server is the one ``CONSUMER_TEST_ADMIN_DSN`` names (a role that may create databases),
``postgresql://postgres@127.0.0.1:5432/postgres`` by default.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from consumer.config.settings import Settings
from consumer.db.migration_sets import migration_sets
from consumer.db.migrations import migrate
from consumer.db.pruning import ReceiptPruner
from consumer.service.components import receipt_window

__all__ = [
    "ADMIN_DSN_VARIABLE",
    "DEFAULT_ADMIN_DSN",
    "TemplateDatabase",
    "admin_dsn",
    "database_url",
    "fresh_database",
]

ADMIN_DSN_VARIABLE = "CONSUMER_TEST_ADMIN_DSN"
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def admin_dsn() -> str:
    """``CONSUMER_TEST_ADMIN_DSN``, or the local server as ``postgres``."""
    return os.environ.get(ADMIN_DSN_VARIABLE) or DEFAULT_ADMIN_DSN


def database_url(dsn: str, database: str) -> str:
    """``dsn`` with its database replaced by ``database`` (query and credentials kept)."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class TemplateDatabase:
    """A database migrated with the service's and ``handlers``' migration sets, to copy from.

    ::

        async with TemplateDatabase(["billing.handlers"]) as template:
            async with template.copy() as url:
                ...  # a migrated database of the test's own at ``url``

    Made on entry, dropped on exit; :meth:`copy` may be entered any number of times meanwhile.
    """

    def __init__(
        self,
        handlers: Sequence[str],
        *,
        admin: str | None = None,
        prefix: str = "consumer_test",
        settings: Settings | None = None,
    ) -> None:
        """``settings``: the receipts' window to make partitions for (the environment's
        ``CONSUMER_RECEIPT_*`` by default)."""
        self.handlers = tuple(handlers)
        self._settings = settings or Settings(handlers=self.handlers)
        self.admin_dsn = admin or admin_dsn()
        self._prefix = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.name = f"{self._prefix}_template"
        self._copies = 0
        self._made = False

    @property
    def url(self) -> str:
        """The template's own URL (tests use copies: a template with a session open cannot be
        copied)."""
        return database_url(self.admin_dsn, self.name)

    async def __aenter__(self) -> TemplateDatabase:
        sets = migration_sets(self.handlers)  # a handler module that cannot load fails here
        await _admin(self.admin_dsn, f"CREATE DATABASE {_quoted(self.name)}")
        self._made = True
        try:
            conn = await asyncpg.connect(self.url)
            try:
                await migrate(conn, sets)
                # The receipts' partitions, as the service makes them before it consumes: made
                # once here, every copy has them.
                window = receipt_window(self._settings)
                skew = self._settings.max_future_skew
                await ReceiptPruner(window, max_future_skew=skew).prune(conn, wait=True)
            finally:
                await conn.close()
        except BaseException:
            await self._drop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._drop()

    async def _drop(self) -> None:
        if self._made:
            self._made = False
            await drop_database(self.admin_dsn, self.name)

    async def new_copy(self) -> str:
        """A fresh copy of the template: its URL. Drop it with :meth:`drop_copy`."""
        if not self._made:
            raise RuntimeError("the template database is not made: use `async with` first")
        self._copies += 1
        name = f"{self._prefix}_{self._copies}"
        await _admin(
            self.admin_dsn, f"CREATE DATABASE {_quoted(name)} TEMPLATE {_quoted(self.name)}"
        )
        return database_url(self.admin_dsn, name)

    async def drop_copy(self, url: str) -> None:
        """Drop a copy :meth:`new_copy` made, ending its sessions."""
        name = urlsplit(url).path.lstrip("/")
        if not name.startswith(f"{self._prefix}_") or name == self.name:
            raise ValueError(f"{name!r} is not a copy of {self.name}")
        await drop_database(self.admin_dsn, name)

    @asynccontextmanager
    async def copy(self) -> AsyncIterator[str]:
        """A fresh copy of the template, its URL yielded, dropped afterwards (its sessions
        ended)."""
        url = await self.new_copy()
        try:
            yield url
        finally:
            await self.drop_copy(url)


@asynccontextmanager
async def fresh_database(
    handlers: Sequence[str], *, admin: str | None = None
) -> AsyncIterator[str]:
    """One migrated database, its URL yielded, dropped afterwards: for a runner that has no
    per-run set-up (a template is faster for many tests: :class:`TemplateDatabase`)."""
    async with TemplateDatabase(handlers, admin=admin) as template, template.copy() as url:
        yield url


async def drop_database(admin: str, name: str) -> None:
    """Drop database ``name`` if it exists, ending its sessions."""
    await _admin(admin, f"DROP DATABASE IF EXISTS {_quoted(name)} WITH (FORCE)")


async def _admin(dsn: str, statement: str, *args: Any) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement, *args)
    finally:
        await conn.close()
