"""The migration sets ``consumer migrate`` applies, in order, and the files in each.

A set is a folder of ``NNN_what_it_does.sql`` files, applied in name order. The order of the sets:

1. the service's own set, ``consumer.sql`` (receipts, the run-time role's grants): always first.
   Its source is the repository's top-level ``sql/``; the wheel carries it as ``consumer/sql/``.
2. then the set of each module in ``CONSUMER_HANDLERS`` that declares one, in that order. A
   handler module declares its folder, relative to the module's own folder, with ``MIGRATIONS``::

       # billing/handlers.py                 (billing/sql/001_charges.sql, ...)
       MIGRATIONS = "sql"

A set is named after its folder's place among the packages (``billing.sql``): the ledger records
each file under that name, with its checksum. Modules that declare the same folder share one set,
as the reference handlers do (``consumer.handlers.sql``), applied once, where the first of them
stands in ``CONSUMER_HANDLERS``. Nothing here touches the database; :mod:`consumer.db.migrations`
applies the sets.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import ModuleType

from consumer.errors import ConfigError, MigrationError
from consumer.registry import import_handler_module

__all__ = [
    "DECLARATION",
    "REFERENCE_MODULE",
    "SERVICE_SET",
    "Migration",
    "MigrationSet",
    "declared_set",
    "discover",
    "migration_sets",
    "reference_set",
    "service_set",
]

SERVICE_SET = "consumer.sql"
REFERENCE_MODULE = "consumer.handlers.inventory"
"""A module that declares the reference handlers' set (consumer.handlers.notifications too)."""
DECLARATION = "MIGRATIONS"

_FILENAME = re.compile(r"^\d{3,}_[A-Za-z0-9_]+\.sql$")


@dataclass(frozen=True, slots=True)
class MigrationSet:
    """A named folder of migrations."""

    name: str
    folder: Path


@dataclass(frozen=True, slots=True)
class Migration:
    """One file of a set, read: its SQL and the SHA-256 the ledger keeps."""

    set_name: str
    filename: str
    sql: str
    checksum: str

    @property
    def label(self) -> str:
        return f"{self.set_name}/{self.filename}"


def service_set() -> MigrationSet:
    """The service's own set: beside the package when installed, else the source tree's sql/."""
    package = Path(__file__).resolve().parents[1]  # consumer/, this module's package's parent
    installed = package / "sql"
    return MigrationSet(SERVICE_SET, installed if installed.is_dir() else package.parent / "sql")


def declared_set(module: ModuleType) -> MigrationSet | None:
    """The set a handler module declares with ``MIGRATIONS``, or None when it declares none."""
    declared = getattr(module, DECLARATION, None)
    if declared is None:
        return None
    where = f"CONSUMER_HANDLERS: {module.__name__}.{DECLARATION}"
    relative = PurePosixPath(declared) if isinstance(declared, str) else None
    if relative is None or not declared or relative.is_absolute() or ".." in relative.parts:
        raise ConfigError(f"{where} must name a folder beside the module, like 'sql'")
    if module.__file__ is None:
        raise ConfigError(f"{where}: the module has no folder (a namespace package)")
    folder = Path(module.__file__).resolve().parent.joinpath(*relative.parts)
    if not folder.is_dir():
        # Typically a wheel built without the folder: it must be in the package's data.
        raise ConfigError(f"{where}: {folder} is not a folder (is it in the package's data?)")
    is_package = hasattr(module, "__path__")
    package = module.__name__ if is_package else module.__name__.rpartition(".")[0]
    name = ".".join(part for part in (package, *relative.parts) if part)
    return MigrationSet(name, folder)


def migration_sets(handler_modules: Iterable[str]) -> list[MigrationSet]:
    """The service's set, then each handler module's, in order; one set per folder."""
    sets = [service_set()]
    for module_name in handler_modules:
        found = declared_set(import_handler_module(module_name))
        if found is None or found in sets:
            continue
        for other in sets:
            if other.name == found.name:
                raise ConfigError(
                    f"CONSUMER_HANDLERS: two migration folders are both named {found.name}: "
                    f"{other.folder} and {found.folder}"
                )
        sets.append(found)
    return sets


def reference_set() -> MigrationSet:
    """The reference handlers' set, enabled or not (the old ledger's files map onto it)."""
    found = declared_set(import_handler_module(REFERENCE_MODULE))
    assert found is not None, f"{REFERENCE_MODULE} declares {DECLARATION}"
    return found


def discover(migration_set: MigrationSet) -> list[Migration]:
    """The set's migration files, in the order they apply."""
    if not migration_set.folder.is_dir():
        raise MigrationError(
            f"no migrations directory at {migration_set.folder} (set {migration_set.name})"
        )
    migrations = []
    for path in sorted(migration_set.folder.iterdir()):
        if path.suffix != ".sql":
            continue
        if not _FILENAME.match(path.name):
            raise MigrationError(
                f"{migration_set.name}/{path.name}: migration files are named like "
                "001_what_it_does.sql"
            )
        data = path.read_bytes()
        migrations.append(
            Migration(
                migration_set.name,
                path.name,
                data.decode("utf-8"),
                hashlib.sha256(data).hexdigest(),
            )
        )
    return migrations
