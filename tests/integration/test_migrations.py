"""``python -m consumer migrate``: ordered, checksummed, idempotent, safe when run concurrently."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import asyncpg
import pytest

from consumer.errors import MigrationError
from consumer.migrations import DEFAULT_DIRECTORY, migrate
from tests.conftest import drop_database
from tests.support import fetch, run_cli


@pytest.fixture
async def empty_database(admin_dsn: str) -> object:
    name = f"ctest_migrate_{id(object())}"
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    yield admin_dsn.rsplit("/", 1)[0] + "/" + name
    await drop_database(admin_dsn, name)


async def _migrate(dsn: str, directory: Path = DEFAULT_DIRECTORY) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return await migrate(conn, directory)
    finally:
        await conn.close()


async def test_running_twice_changes_nothing(empty_database: str) -> None:
    first = await _migrate(empty_database)
    assert first == sorted(path.name for path in DEFAULT_DIRECTORY.glob("*.sql"))
    assert await _migrate(empty_database) == []
    rows = await fetch(empty_database, "SELECT filename, checksum FROM schema_migrations")
    assert [row["filename"] for row in rows] == first


async def test_concurrent_runs_apply_each_file_once(empty_database: str) -> None:
    results = await asyncio.gather(*(_migrate(empty_database) for _ in range(4)))
    applied = [name for result in results for name in result]
    assert sorted(applied) == sorted(path.name for path in DEFAULT_DIRECTORY.glob("*.sql"))
    rows = await fetch(empty_database, "SELECT count(*) AS n FROM schema_migrations")
    assert rows[0]["n"] == len(applied)


async def test_an_edited_applied_file_is_refused(empty_database: str, tmp_path: Path) -> None:
    directory = tmp_path / "sql"
    shutil.copytree(DEFAULT_DIRECTORY, directory)
    await _migrate(empty_database, directory)
    first = sorted(directory.glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- an innocent-looking edit\n")
    (directory / "999_later.sql").write_text("CREATE TABLE later (id int);")

    with pytest.raises(MigrationError, match=f"{first.name} was edited after it was applied"):
        await _migrate(empty_database, directory)
    # Nothing after the refusal was applied.
    tables = await fetch(empty_database, "SELECT to_regclass('later') AS t")
    assert tables[0]["t"] is None


async def test_the_command_creates_the_database_and_reports_an_edit(
    admin_dsn: str, tmp_path: Path
) -> None:
    name = f"ctest_cli_{id(tmp_path)}"
    dsn = admin_dsn.rsplit("/", 1)[0] + "/" + name
    environment = {"CONSUMER_DATABASE_URL": dsn, "PATH": "/usr/bin:/bin"}
    directory = tmp_path / "sql"
    shutil.copytree(DEFAULT_DIRECTORY, directory)
    try:
        created = run_cli(
            "consumer", "migrate", "--create-database", "--dir", str(directory), env=environment
        )
        assert created.returncode == 0, created.stderr
        assert f"created database {name}" in created.stdout
        again = run_cli("consumer", "migrate", "--dir", str(directory), env=environment)
        assert again.stdout.strip() == "database is up to date"
        edited = sorted(directory.glob("*.sql"))[0]
        edited.write_text(edited.read_text() + "-- edited\n")
        refused = run_cli("consumer", "migrate", "--dir", str(directory), env=environment)
        assert refused.returncode == 1
        assert refused.stderr.startswith(f"error: {edited.name} was edited after it was applied")
        assert "Traceback" not in refused.stderr
    finally:
        await drop_database(admin_dsn, name)
