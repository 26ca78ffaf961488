"""Plain SQL migrations applied to the database: each file in its own transaction, recorded in the
service's ledger, ``consumer_migrations`` (set, file name, SHA-256), set after set in the order
:mod:`consumer.db.migration_sets` gives.

A file edited after it was applied stops the run before anything is applied. Two replicas starting
at once serialise on an advisory lock, so the second finds the work done. Running it again changes
nothing. A database migrated by a release before 0.2 has its old ledger taken over once
(:mod:`consumer.db.legacy_ledger`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from consumer.config.settings import DEFAULT_HANDLER_MODULES
from consumer.db.database import describe_database_error
from consumer.db.legacy_ledger import UNCLAIMED, take_over
from consumer.db.migration_sets import (
    SERVICE_SET,
    Migration,
    MigrationSet,
    discover,
    migration_sets,
)
from consumer.errors import MigrationError

__all__ = [
    "LEDGER",
    "MigrationReport",
    "Step",
    "create_database_if_missing",
    "migrate",
    "pending",
    "plan",
]

LEDGER = "consumer_migrations"

# pg_advisory_lock takes a bigint; any constant works as long as every replica uses the same one.
_LOCK_KEY = 0x636F6E73756D6572  # "consumer"

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS consumer_migrations (
    migration_set  text        NOT NULL,
    filename       text        NOT NULL,
    checksum       text        NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (migration_set, filename)
)
"""
_DESCRIBE_LEDGER = (
    "COMMENT ON TABLE consumer_migrations IS 'rabbit-pg-consumer: the SQL migrations "
    "applied by consumer migrate, per migration set, with their SHA-256'"
)
_RECORD = "INSERT INTO consumer_migrations (migration_set, filename, checksum) VALUES ($1, $2, $3)"
_RELEASE_CLAIMED = "DELETE FROM consumer_migrations WHERE migration_set = $1 AND filename = $2"


@dataclass(frozen=True, slots=True)
class Step:
    """A pending migration, and whether to run it or only record it (``claim``: it was applied
    under the old ledger, from a file of the same name and content)."""

    migration: Migration
    claim: bool = False


@dataclass(slots=True)
class MigrationReport:
    """What one run did; both empty when the database was up to date."""

    applied: list[str] = field(default_factory=list)
    """Labels (``set/file``) of the files run now."""
    recorded: list[str] = field(default_factory=list)
    """Labels recorded as applied without running: taken over from the old ledger."""


def plan(migrations: Sequence[Migration], ledger: Mapping[tuple[str, str], str]) -> list[Step]:
    """The steps that bring a database with ``ledger`` (``(set, file) -> checksum``) up to date.

    Raises :class:`MigrationError`, before anything runs, for a file edited after it was applied.
    """
    unclaimed = {
        filename: checksum
        for (set_name, filename), checksum in ledger.items()
        if set_name == UNCLAIMED
    }
    steps = []
    for migration in migrations:
        recorded = ledger.get((migration.set_name, migration.filename))
        if recorded is not None:
            if recorded != migration.checksum:
                raise MigrationError(
                    f"{migration.label} was edited after it was applied "
                    f"(recorded sha256 {recorded[:12]}, file has {migration.checksum[:12]}); "
                    "restore it and put the change in a new migration"
                )
            continue
        # The service's files are all in the old ledger's map; a handler set's file may be one a
        # fork kept in its copy of sql/ before it had a package of its own.
        old = unclaimed.pop(migration.filename, None) if migration.set_name != SERVICE_SET else None
        if old is not None and old != migration.checksum:
            raise MigrationError(
                f"{migration.label}: a different {migration.filename} was applied under the old "
                f"ledger (recorded sha256 {old[:12]}, file has {migration.checksum[:12]}); "
                "give the new file another name"
            )
        steps.append(Step(migration, claim=old is not None))
    return steps


async def migrate(
    conn: asyncpg.Connection[Any], sets: Sequence[MigrationSet] | None = None
) -> MigrationReport:
    """Apply every pending migration of ``sets``, in order (by default the service's set and the
    reference handlers'); return what was done."""
    if sets is None:
        sets = migration_sets(DEFAULT_HANDLER_MODULES)
    migrations = [migration for migration_set in sets for migration in discover(migration_set)]
    report = MigrationReport()
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        report.recorded = await _ledger(conn)
        ledger = {
            (row["migration_set"], row["filename"]): row["checksum"]
            for row in await conn.fetch(
                "SELECT migration_set, filename, checksum FROM consumer_migrations"
            )
        }
        for step in plan(migrations, ledger):
            migration = step.migration
            async with conn.transaction():
                if step.claim:
                    await conn.execute(_RELEASE_CLAIMED, UNCLAIMED, migration.filename)
                else:
                    await _run(conn, migration)
                await conn.execute(
                    _RECORD, migration.set_name, migration.filename, migration.checksum
                )
            (report.recorded if step.claim else report.applied).append(migration.label)
        return report
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)


async def pending(conn: asyncpg.Connection[Any], migrations: Sequence[Migration]) -> list[str]:
    """Labels (``set/file``) of ``migrations`` the ledger does not record as applied: all of them
    when there is no ledger. Only reads (``consumer run`` asks, as the run-time role, which may
    read the ledger but not write it); an edited file is ``consumer migrate``'s to refuse."""
    if await conn.fetchval("SELECT to_regclass('consumer_migrations') IS NULL"):
        return [migration.label for migration in migrations]
    applied = {
        (row["migration_set"], row["filename"])
        for row in await conn.fetch("SELECT migration_set, filename FROM consumer_migrations")
    }
    return [
        migration.label
        for migration in migrations
        if (migration.set_name, migration.filename) not in applied
    ]


async def _run(conn: asyncpg.Connection[Any], migration: Migration) -> None:
    try:
        await conn.execute(migration.sql)
    except asyncpg.PostgresError as error:
        # Name the file: with several sets, "relation stock already exists" alone does not say
        # whose migration met whose table.
        raise MigrationError(
            f"migration failed: {migration.label}: {describe_database_error(error)}"
        ) from error


async def _ledger(conn: asyncpg.Connection[Any]) -> list[str]:
    """Make sure the ledger exists; when it is new, take over the old one. Returns the labels
    taken over."""
    existed = await conn.fetchval("SELECT to_regclass('consumer_migrations') IS NOT NULL")
    async with conn.transaction():
        # Always issued, even when the ledger exists: a role that may not create tables (the
        # run-time role) is refused here, at the first statement, whatever the database holds.
        await conn.execute(_CREATE_LEDGER)
        if existed:
            return []
        await conn.execute(_DESCRIBE_LEDGER)
        return await take_over(conn)


async def create_database_if_missing(conn: asyncpg.Connection[Any], name: str) -> bool:
    """Create database ``name`` from a connection to another database; True if it was created."""
    exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
    if exists:
        return False
    quoted = '"' + name.replace('"', '""') + '"'
    try:
        await conn.execute(f"CREATE DATABASE {quoted}")
    except asyncpg.DuplicateDatabaseError:
        return False  # another replica made it first
    return True
