"""Which migration sets apply, in which order, and what a run does with each file (no database)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from consumer.config.settings import DEFAULT_HANDLER_MODULES
from consumer.db.legacy_ledger import UNCLAIMED
from consumer.db.migration_sets import (
    Migration,
    MigrationSet,
    declared_set,
    discover,
    migration_sets,
    reference_set,
    service_set,
)
from consumer.db.migrations import Step, plan
from consumer.errors import ConfigError, MigrationError
from tests.support import REPO


def _module(name: str, file: Path, *, package: bool = False, **attributes: object) -> ModuleType:
    module = ModuleType(name)
    module.__file__ = str(file)
    if package:
        module.__path__ = [str(file.parent)]
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def _migration(set_name: str, filename: str, checksum: str = "c1") -> Migration:
    return Migration(set_name, filename, "SELECT 1", checksum)


# -- declaring a set -----------------------------------------------------------------------------


def test_a_module_without_migrations_declares_no_set(tmp_path: Path) -> None:
    assert declared_set(_module("billing.handlers", tmp_path / "handlers.py")) is None


@pytest.mark.parametrize(
    ("name", "package", "folder", "set_name"),
    [
        ("billing.handlers", False, "sql", "billing.sql"),
        ("billing", True, "sql", "billing.sql"),
        ("billing.handlers", False, "db/migrations", "billing.db.migrations"),
        ("handlers", False, "sql", "sql"),
    ],
)
def test_a_set_is_named_after_its_folders_place_among_the_packages(
    tmp_path: Path, name: str, package: bool, folder: str, set_name: str
) -> None:
    (tmp_path / folder).mkdir(parents=True)
    file = tmp_path / ("__init__.py" if package else "handlers.py")
    module = _module(name, file, package=package, MIGRATIONS=folder)

    assert declared_set(module) == MigrationSet(set_name, (tmp_path / folder).resolve())


@pytest.mark.parametrize("declared", ["", "/etc", "../elsewhere", 3, ["sql"]])
def test_a_set_must_be_a_folder_beside_the_module(tmp_path: Path, declared: object) -> None:
    module = _module("billing.handlers", tmp_path / "handlers.py", MIGRATIONS=declared)

    with pytest.raises(ConfigError, match=r"billing\.handlers\.MIGRATIONS must name a folder"):
        declared_set(module)


def test_a_missing_folder_is_named(tmp_path: Path) -> None:
    module = _module("billing.handlers", tmp_path / "handlers.py", MIGRATIONS="sql")

    with pytest.raises(ConfigError, match=r"is not a folder \(is it in the package's data\?\)"):
        declared_set(module)


# -- the sets of a deployment --------------------------------------------------------------------


def test_the_service_set_is_the_top_level_sql_folder_in_a_source_tree() -> None:
    assert service_set() == MigrationSet("consumer.sql", REPO / "sql")


def test_the_reference_handlers_share_one_set_after_the_services() -> None:
    sets = migration_sets(DEFAULT_HANDLER_MODULES)

    assert sets == [service_set(), reference_set()]
    assert reference_set() == MigrationSet(
        "consumer.handlers.sql", REPO / "consumer" / "handlers" / "sql"
    )


def test_handler_modules_without_a_set_add_none() -> None:
    assert migration_sets(["tests.handlers.behave"]) == [service_set()]


def test_a_module_that_cannot_be_imported_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot import 'no\.such\.module'"):
        migration_sets(["no.such.module"])


def test_discover_refuses_a_badly_named_file(tmp_path: Path) -> None:
    (tmp_path / "001_ok.sql").write_text("SELECT 1;")
    (tmp_path / "later.sql").write_text("SELECT 1;")

    with pytest.raises(MigrationError, match=r"team\.sql/later\.sql: migration files are named"):
        discover(MigrationSet("team.sql", tmp_path))


# -- planning a run ------------------------------------------------------------------------------


def test_pending_files_run_in_order_and_applied_ones_are_skipped() -> None:
    files = [_migration("consumer.sql", "001_a.sql"), _migration("team.sql", "001_a.sql")]

    steps = plan(files, {("consumer.sql", "001_a.sql"): "c1"})

    assert steps == [Step(files[1])]


def test_an_edited_file_is_refused_before_anything_runs() -> None:
    files = [_migration("consumer.sql", "001_a.sql"), _migration("team.sql", "001_b.sql", "c2")]

    with pytest.raises(MigrationError, match=r"^team\.sql/001_b\.sql was edited after"):
        plan(files, {("team.sql", "001_b.sql"): "c1"})


def test_a_handler_set_claims_a_file_of_the_old_ledger_once() -> None:
    files = [
        _migration("consumer.sql", "003_things.sql"),
        _migration("team.sql", "003_things.sql"),
        _migration("other.sql", "003_things.sql"),
    ]

    steps = plan(files, {(UNCLAIMED, "003_things.sql"): "c1"})

    # The service's own files are never a fork's: only a handler set claims, and only the first
    assert steps == [Step(files[0]), Step(files[1], claim=True), Step(files[2])]


def test_a_claim_with_other_content_is_refused() -> None:
    with pytest.raises(MigrationError, match=r"a different 003_things\.sql was applied"):
        plan(
            [_migration("team.sql", "003_things.sql", "c2")], {(UNCLAIMED, "003_things.sql"): "c1"}
        )
