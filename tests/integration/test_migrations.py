"""``consumer migrate``: migration sets in order, each file checksummed in the service's own ledger,
idempotent, safe when run concurrently; other tools' tables left alone; a database of release 0.1
moved to the new ledger without anything applied twice."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import sys
import textwrap
import uuid
from pathlib import Path

import asyncpg
import pytest

from consumer.config.settings import DEFAULT_HANDLER_MODULES
from consumer.db.migration_sets import (
    MigrationSet,
    discover,
    migration_sets,
    reference_set,
    service_set,
)
from consumer.db.migrations import MigrationReport, migrate
from consumer.errors import MigrationError
from tests.conftest import drop_database
from tests.support import REPO, fetch, fetchval, run_cli

# sql/ exactly as release 0.1 shipped it, and how that release's migrate recorded it.
RELEASE_0_1 = Path(__file__).parent / "release_0_1"
# What its two files became: two files of the service's set and two of the reference set.
RELEASE_0_1_MOVED = [
    "consumer.sql/001_receipts.sql",
    "consumer.sql/002_app_role_grants.sql",
    "consumer.handlers.sql/001_reference_tables.sql",
    "consumer.handlers.sql/002_app_role_grants.sql",
]
_RELEASE_0_1_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    filename    text PRIMARY KEY,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)
"""


async def _migrate(dsn: str, sets: list[MigrationSet] | None = None) -> MigrationReport:
    conn = await asyncpg.connect(dsn)
    try:
        return await migrate(conn, sets)
    finally:
        await conn.close()


async def _execute(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _labels(*sets: MigrationSet) -> list[str]:
    return [migration.label for migration_set in sets for migration in discover(migration_set)]


async def _ledger(dsn: str) -> list[tuple[str, str, str]]:
    rows = await fetch(
        dsn,
        "SELECT migration_set, filename, checksum FROM consumer_migrations "
        "ORDER BY applied_at, migration_set, filename",
    )
    return [(row["migration_set"], row["filename"], row["checksum"]) for row in rows]


@pytest.fixture(autouse=True)
def _forget_team_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each test writes its own ``team`` package: an earlier test's must not be found imported.
    for module in ("team", "team.handlers"):
        monkeypatch.delitem(sys.modules, module, raising=False)


def _team_package(root: Path, *, files: dict[str, str] | None = None) -> Path:
    """A handler package of a team's own under ``root``: ``team.handlers`` with a handler and
    ``MIGRATIONS = "sql"``, and its migrations in ``team/sql``."""
    package = root / "team"
    (package / "sql").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "handlers.py").write_text(
        textwrap.dedent(
            """
            from typing import Any

            from consumer import Connection, Envelope, register

            MIGRATIONS = "sql"


            @register("team.thing", payload=dict)
            async def thing(event: Envelope[Any], conn: Connection) -> None:
                pass
            """
        )
    )
    for filename, sql in (files or {"001_things.sql": "CREATE TABLE things (id int);"}).items():
        (package / "sql" / filename).write_text(sql)
    return package


def _added_since_0_1() -> list[str]:
    """The service's and the reference set's migrations that release 0.1 did not have."""
    return [m for m in _labels(service_set(), reference_set()) if m not in RELEASE_0_1_MOVED]


async def _as_release_0_1(dsn: str, *extra: tuple[str, str]) -> None:
    """Migrate ``dsn`` as release 0.1 did: its two files and then ``extra`` (a fork's own, as
    ``(filename, sql)``), each recorded in its ledger, schema_migrations."""
    files = [(path.name, path.read_text()) for path in sorted(RELEASE_0_1.glob("*.sql"))]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(_RELEASE_0_1_LEDGER)
        for filename, sql in [*files, *extra]:
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (filename, checksum) VALUES ($1, $2)",
                    filename,
                    hashlib.sha256(sql.encode()).hexdigest(),
                )
    finally:
        await conn.close()


# -- sets, order, ledger ------------------------------------------------------------------------


async def test_running_twice_changes_nothing(empty_database: str) -> None:
    first = await _migrate(empty_database)

    expected = _labels(service_set(), reference_set())
    assert first.applied == expected
    assert expected[0] == "consumer.sql/001_receipts.sql"
    assert first.recorded == []
    again = await _migrate(empty_database)
    assert again == MigrationReport()
    ledger = await _ledger(empty_database)
    assert [f"{set_name}/{filename}" for set_name, filename, _ in ledger] == expected
    assert {row[2] for row in ledger} == {
        migration.checksum for s in (service_set(), reference_set()) for migration in discover(s)
    }


async def test_concurrent_runs_apply_each_file_once(empty_database: str) -> None:
    results = await asyncio.gather(*(_migrate(empty_database) for _ in range(4)))

    applied = [label for result in results for label in result.applied]
    assert sorted(applied) == sorted(_labels(service_set(), reference_set()))
    assert await fetchval(empty_database, "SELECT count(*) FROM consumer_migrations") == len(
        applied
    )


async def test_the_service_set_comes_first_then_each_handler_set_in_handler_order(
    empty_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a team's package listed before the reference handlers
    _team_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = migration_sets(["team.handlers", *DEFAULT_HANDLER_MODULES])

    # When migrating with those sets
    report = await _migrate(empty_database, sets)

    # Then the service's set ran first, then the team's, then the reference set (once, though
    # two modules declare it), each file recorded under its set
    assert [s.name for s in sets] == ["consumer.sql", "team.sql", "consumer.handlers.sql"]
    assert report.applied == _labels(*sets)
    assert [(s, f) for s, f, _ in await _ledger(empty_database)] == [
        tuple(label.split("/")) for label in report.applied
    ]


async def test_reference_tables_exist_only_where_the_reference_handlers_run(
    empty_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a database with a stock table of its own
    await _execute(empty_database, "CREATE TABLE stock (id serial PRIMARY KEY, name text)")
    _team_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    # When a team's handlers alone are migrated
    report = await _migrate(empty_database, migration_sets(["team.handlers"]))

    # Then their tables and the service's are there, and the stock table is untouched
    assert report.applied == [*_labels(service_set()), "team.sql/001_things.sql"]
    columns = await fetch(
        empty_database,
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'stock' "
        "ORDER BY ordinal_position",
    )
    assert [row["column_name"] for row in columns] == ["id", "name"]
    for table, exists in (("receipts", True), ("things", True), ("stock_movements", False)):
        assert (await fetchval(empty_database, f"SELECT to_regclass('{table}')") is not None) is (
            exists
        )


async def test_a_set_meeting_a_table_of_its_own_name_stops_naming_the_file(
    empty_database: str,
) -> None:
    # Given a database with a stock table of its own, and the reference handlers enabled anyway
    await _execute(empty_database, "CREATE TABLE stock (id serial PRIMARY KEY, name text)")

    # When migrating, the reference set's first file meets it
    with pytest.raises(MigrationError) as caught:
        await _migrate(empty_database)

    # Then the error names that file; the service's set is in, nothing of the failed file is
    assert str(caught.value) == (
        "migration failed: consumer.handlers.sql/001_reference_tables.sql: "
        'DuplicateTableError: relation "stock" already exists'
    )
    assert {s for s, _, _ in await _ledger(empty_database)} == {"consumer.sql"}
    assert await fetchval(empty_database, "SELECT to_regclass('stock_movements')") is None


async def test_an_edited_applied_file_is_refused(empty_database: str, tmp_path: Path) -> None:
    folder = tmp_path / "sql"
    shutil.copytree(service_set().folder, folder)
    sets = [MigrationSet("consumer.sql", folder)]
    await _migrate(empty_database, sets)
    first = sorted(folder.glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- an innocent-looking edit\n")
    (folder / "999_later.sql").write_text("CREATE TABLE later (id int);")

    with pytest.raises(
        MigrationError, match=f"consumer.sql/{first.name} was edited after it was applied"
    ):
        await _migrate(empty_database, sets)
    # Nothing after the refusal was applied.
    assert await fetchval(empty_database, "SELECT to_regclass('later')") is None


async def test_the_command_applies_a_teams_set_creates_the_database_and_reports_an_edit(
    admin_dsn: str, tmp_path: Path
) -> None:
    name = f"ctest_cli_{uuid.uuid4().hex[:10]}"
    dsn = admin_dsn.rsplit("/", 1)[0] + "/" + name
    package = _team_package(tmp_path)
    environment = {
        "CONSUMER_DATABASE_URL": dsn,
        "CONSUMER_HANDLERS": "team.handlers",
        "PATH": os.environ["PATH"],
        "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}",
    }
    try:
        created = run_cli("consumer", "migrate", "--create-database", env=environment)
        assert created.returncode == 0, created.stderr
        assert created.stdout.splitlines() == [
            f"created database {name}",
            *(f"applied {label}" for label in _labels(service_set())),
            "applied team.sql/001_things.sql",
        ]
        again = run_cli("consumer", "migrate", env=environment)
        assert again.stdout == "database is up to date\n"
        edited = package / "sql" / "001_things.sql"
        edited.write_text(edited.read_text() + "-- edited\n")
        refused = run_cli("consumer", "migrate", env=environment)
        assert refused.returncode == 1
        assert refused.stderr.startswith(
            "error: team.sql/001_things.sql was edited after it was applied"
        )
        assert len(refused.stderr.splitlines()) == 1
    finally:
        await drop_database(admin_dsn, name)


# -- other tools' tables ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "ledger"),
    [
        (
            "golang-migrate",
            "CREATE TABLE schema_migrations (version bigint PRIMARY KEY, dirty bool)",
        ),
        ("rails", "CREATE TABLE schema_migrations (version varchar PRIMARY KEY)"),
        (
            "one with this service's columns but not its history",
            "CREATE TABLE schema_migrations (filename text PRIMARY KEY, checksum text NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now());"
            "INSERT INTO schema_migrations (filename, checksum) VALUES ('1_users.sql', 'x')",
        ),
    ],
)
async def test_another_tools_schema_migrations_is_left_alone(
    empty_database: str, tool: str, ledger: str
) -> None:
    # Given a schema_migrations table that another tool owns
    await _execute(empty_database, ledger)
    before = await fetch(empty_database, "SELECT * FROM schema_migrations")

    # When migrating
    report = await _migrate(empty_database)

    # Then everything is applied and recorded in the service's own ledger, and the other tool's
    # table is as it was
    assert report.applied == _labels(service_set(), reference_set()), tool
    assert report.recorded == []
    assert await fetch(empty_database, "SELECT * FROM schema_migrations") == before


# -- a database of release 0.1 ------------------------------------------------------------------


async def test_a_release_0_1_database_moves_to_the_new_ledger_without_applying_anything(
    empty_database: str,
) -> None:
    # Given a database migrated by release 0.1, with data in its tables
    await _as_release_0_1(empty_database)
    await _execute(empty_database, "INSERT INTO stock VALUES ('SKU-1', 7)")
    old_ledger = await fetch(empty_database, "SELECT * FROM schema_migrations ORDER BY filename")

    # When this release migrates it
    report = await _migrate(empty_database)

    # Then nothing of 0.1 ran again (only migrations added since, if any): the old ledger's rows
    # became the new sets' rows, with the files' checksums
    assert sorted(report.recorded) == sorted(RELEASE_0_1_MOVED)
    assert report.applied == _added_since_0_1()
    current = {
        (m.set_name, m.filename): m.checksum
        for s in (service_set(), reference_set())
        for m in discover(s)
    }
    assert {(s, f): c for s, f, c in await _ledger(empty_database)} == current
    assert await fetchval(empty_database, "SELECT available FROM stock") == 7
    # The old ledger is left as it was (an older release still reads it)
    assert await fetch(empty_database, "SELECT * FROM schema_migrations ORDER BY filename") == (
        old_ledger
    )
    assert await _migrate(empty_database) == MigrationReport()


async def test_a_release_0_1_database_gets_only_the_service_migrations_added_since(
    empty_database: str, tmp_path: Path
) -> None:
    # Given a database of release 0.1, and a service set with one more migration
    await _as_release_0_1(empty_database)
    folder = tmp_path / "sql"
    shutil.copytree(service_set().folder, folder)
    (folder / "900_in_progress.sql").write_text("CREATE TABLE consumer_later (id int);")

    # When migrating
    report = await _migrate(empty_database, [MigrationSet("consumer.sql", folder), reference_set()])

    # Then only the new file ran (and those added since 0.1, if any)
    assert sorted(report.applied) == sorted(
        [*_added_since_0_1(), "consumer.sql/900_in_progress.sql"]
    )
    assert await fetchval(empty_database, "SELECT to_regclass('consumer_later')") is not None


async def test_a_forks_own_migration_is_claimed_by_the_set_that_now_holds_it(
    empty_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a fork of release 0.1 that added its own sql/003_things.sql
    things = "CREATE TABLE things (id int);"
    await _as_release_0_1(empty_database, ("003_things.sql", things))
    # and now keeps that file, unchanged, in a handler package of its own
    _team_package(tmp_path, files={"003_things.sql": things, "004_more.sql": "SELECT 1;"})
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = migration_sets(["team.handlers", *DEFAULT_HANDLER_MODULES])

    # When migrating
    report = await _migrate(empty_database, sets)

    # Then the fork's file is recorded under its new set without running again (it would fail:
    # the table exists) and the new file runs
    assert sorted(report.recorded) == sorted(
        [*RELEASE_0_1_MOVED, "schema_migrations/003_things.sql", "team.sql/003_things.sql"]
    )
    assert report.applied == [*_added_since_0_1(), "team.sql/004_more.sql"]
    ledger = {f"{s}/{f}" for s, f, _ in await _ledger(empty_database)}
    assert "schema_migrations/003_things.sql" not in ledger
    assert "team.sql/003_things.sql" in ledger


async def test_a_fork_file_of_the_same_name_and_other_content_is_refused(
    empty_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _as_release_0_1(empty_database, ("003_things.sql", "CREATE TABLE things (id int);"))
    _team_package(tmp_path, files={"003_things.sql": "CREATE TABLE things (id bigint);"})
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(
        MigrationError, match=r"a different 003_things\.sql was applied under the old"
    ):
        await _migrate(empty_database, migration_sets(["team.handlers"]))
