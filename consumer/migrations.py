"""Plain SQL migrations: ``sql/NNN_name.sql`` applied in order, each in its own transaction.

Every applied file is recorded with its SHA-256; a file edited after it was applied stops the run
before anything is applied. Two replicas starting at once serialise on an advisory lock, so the
second finds the work done. Running it again changes nothing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from consumer.errors import MigrationError

DEFAULT_DIRECTORY = Path(__file__).resolve().parent.parent / "sql"

# pg_advisory_lock takes a bigint; any constant works as long as every replica uses the same one.
_LOCK_KEY = 0x636F6E73756D6572  # "consumer"
_FILENAME = re.compile(r"^\d{3,}_[A-Za-z0-9_]+\.sql$")

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    filename    text PRIMARY KEY,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True, slots=True)
class Migration:
    filename: str
    sql: str
    checksum: str


def discover(directory: Path) -> list[Migration]:
    """The migration files in ``directory``, in the order they apply."""
    if not directory.is_dir():
        raise MigrationError(f"no migrations directory at {directory}")
    migrations = []
    for path in sorted(directory.iterdir()):
        if path.suffix != ".sql":
            continue
        if not _FILENAME.match(path.name):
            raise MigrationError(
                f"{path.name}: migration files are named like 001_what_it_does.sql"
            )
        data = path.read_bytes()
        migrations.append(
            Migration(path.name, data.decode("utf-8"), hashlib.sha256(data).hexdigest())
        )
    return migrations


async def migrate(conn: asyncpg.Connection[Any], directory: Path = DEFAULT_DIRECTORY) -> list[str]:
    """Apply every pending migration; return the names applied (empty when up to date)."""
    migrations = discover(directory)
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        await conn.execute(_CREATE_LEDGER)
        applied = {
            row["filename"]: row["checksum"]
            for row in await conn.fetch("SELECT filename, checksum FROM schema_migrations")
        }
        for migration in migrations:
            recorded = applied.get(migration.filename)
            if recorded is not None and recorded != migration.checksum:
                raise MigrationError(
                    f"{migration.filename} was edited after it was applied "
                    f"(recorded sha256 {recorded[:12]}, file has {migration.checksum[:12]}); "
                    "restore it and put the change in a new migration"
                )
        done = []
        for migration in migrations:
            if migration.filename in applied:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (filename, checksum) VALUES ($1, $2)",
                    migration.filename,
                    migration.checksum,
                )
            done.append(migration.filename)
        return done
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)


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
