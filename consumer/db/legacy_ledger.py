"""Moving from the ledger of releases before 0.2, ``schema_migrations``, to ``consumer_migrations``.

Those releases recorded ``sql/*.sql`` by file name in a table called ``schema_migrations``, a name
other tools (golang-migrate, Rails, dbmate...) use for ledgers of their own, with other columns.
When the new ledger is created, this looks at ``schema_migrations``: if it is this service's (its
columns, and the first release's first file among its rows), what it says was applied is recorded
in the new ledger, so nothing runs twice. Another tool's table of that name is never read past its
columns, nor changed; neither is this service's old ledger (an older release still reads it).

The old files map onto the new sets: the receipts and the reference tables were split in two sets
(the reference handlers' tables are created only where those handlers run), the grants likewise.
A row the map does not know (a fork's own ``003_charges.sql``) is kept under the set name
``schema_migrations``, to be claimed by the first handler set that has a file of that name and
checksum (see :func:`consumer.db.migrations.plan`).
"""

from __future__ import annotations

from typing import Any

import asyncpg

from consumer.db.migration_sets import SERVICE_SET, discover, reference_set, service_set

__all__ = ["LEGACY_LEDGER", "UNCLAIMED", "take_over"]

LEGACY_LEDGER = "schema_migrations"
UNCLAIMED = LEGACY_LEDGER
"""The set name of rows carried over from the old ledger that no set has claimed."""

_COLUMNS = frozenset({"filename", "checksum", "applied_at"})
_FIRST_FILE = "001_receipts_and_reference_tables.sql"

# Each file of the old ledger, and the files of the new sets that do what it did.
_MOVED: dict[str, tuple[tuple[str, str], ...]] = {
    _FIRST_FILE: (
        (SERVICE_SET, "001_receipts.sql"),
        ("consumer.handlers.sql", "001_reference_tables.sql"),
    ),
    "002_app_role_grants.sql": (
        (SERVICE_SET, "002_app_role_grants.sql"),
        ("consumer.handlers.sql", "002_app_role_grants.sql"),
    ),
}

_OLD_COLUMNS = """
SELECT attname FROM pg_attribute
WHERE attrelid = to_regclass('schema_migrations') AND attnum > 0 AND NOT attisdropped
"""

_RECORD = """
INSERT INTO consumer_migrations (migration_set, filename, checksum, applied_at)
VALUES ($1, $2, $3, $4)
"""


async def take_over(conn: asyncpg.Connection[Any]) -> list[str]:
    """Record in ``consumer_migrations`` what this service's old ledger says was applied; return
    the labels recorded (none when there is no such ledger). Run inside the transaction that
    creates the new ledger."""
    columns = {row["attname"] for row in await conn.fetch(_OLD_COLUMNS)}
    if columns != _COLUMNS:
        return []  # absent, or another tool's
    rows = await conn.fetch(
        "SELECT filename, checksum, applied_at FROM schema_migrations ORDER BY filename"
    )
    if _FIRST_FILE not in {row["filename"] for row in rows}:
        return []  # the same columns, but not this service's history
    checksums = {
        (migration.set_name, migration.filename): migration.checksum
        for migration in (*discover(service_set()), *discover(reference_set()))
    }
    recorded = []
    for row in rows:
        moved = _MOVED.get(row["filename"])
        targets = (
            [(set_name, filename, checksums[set_name, filename]) for set_name, filename in moved]
            if moved is not None
            else [(UNCLAIMED, row["filename"], row["checksum"])]
        )
        for set_name, filename, checksum in targets:
            await conn.execute(_RECORD, set_name, filename, checksum, row["applied_at"])
            recorded.append(f"{set_name}/{filename}")
    return recorded
