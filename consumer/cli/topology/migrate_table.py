"""``consumer topology migrate --from-queues-file OLD.toml``: move an install from the plan of its
old queue table to the plan of the one ``CONSUMER_QUEUES_FILE`` names, while the consumers run.

The steps are :func:`topology.table_migration.plan_table_migration`'s: an event type that moves
between queues is bound to its new queue first, then unbound from its old one, whose consumers
apply what it already holds of it; each queue's own settings (ladder, delivery limit, work queue
generation) migrate as without a table; a queue that leaves the table has what it holds moved.
``--rollback`` migrates back, from the new table's plan to the old one's.

A service without a table is a table of one queue (:meth:`QueueTable.default`, today's names):
``--from-queues-file none`` says the install had none (the ``--from-*`` settings flags may then
give its old settings), and ``CONSUMER_QUEUES_FILE`` unset with ``--from-queues-file OLD.toml``
goes back to none.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from consumer.cli.topology.migrate import (
    EXIT_PENDING,
    answered_offline,
    carry_out,
    from_flags,
    moved_headers,
    old_settings,
)
from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, fail, load_handlers, load_queue_table
from consumer.errors import QueueTableError
from consumer.registry import HandlerRegistry
from consumer.service.components import table_specs
from topology.migration_plan import MigrationRefused
from topology.names import Names
from topology.plan import TopologySpec, build_topology
from topology.table_migration import TableMigration, plan_table_migration

__all__ = ["NO_TABLE", "run_table_migrate"]

NO_TABLE = "none"
"""``--from-queues-file none``: the install was set up without a queue table."""


def _old_table(settings: Settings, path: str) -> QueueTable:
    # Not checked against today's handlers: a type removed since is the old table's to route.
    try:
        return read_queue_table(Path(path), settings)
    except QueueTableError as error:
        fail(f"--from-queues-file: {error}", EXIT_CONFIG)


def _refuse_flags(settings: Settings, arguments: argparse.Namespace) -> None:
    """The ``--from-*`` settings flags name an old service without a table's settings only."""
    flags = ", ".join(from_flags(arguments))
    if not flags or arguments.from_queues_file == NO_TABLE:
        return
    if arguments.from_queues_file is not None:
        fail(
            f"{flags}: with --from-queues-file OLD.toml each queue's old settings are those of "
            "the old table: write them in it",
            EXIT_CONFIG,
        )
    # Only an install without a table gives its old settings by flags: say how.
    fail(
        f"{flags}: with CONSUMER_QUEUES_FILE, name the install's old table (--from-queues-file "
        f"OLD.toml, each queue's old settings in it), or --from-queues-file {NO_TABLE} if it had "
        "none (the flags then give its old settings)",
        EXIT_CONFIG,
    )


def _old(
    settings: Settings, arguments: argparse.Namespace, registry: HandlerRegistry
) -> QueueTable:
    """The table the install was set up with: the file ``--from-queues-file`` names, or (``none``)
    the one queue of a service without a table, on the settings the ``--from-*`` flags give."""
    source = arguments.from_queues_file
    if source is None:
        fail(
            "CONSUMER_QUEUES_FILE: name the queue table the install was set up with "
            f"(--from-queues-file OLD.toml, or {NO_TABLE} if it had none)",
            EXIT_CONFIG,
        )
    if source == NO_TABLE:
        if settings.queues_file is None:
            fail(
                f"--from-queues-file {NO_TABLE}: CONSUMER_QUEUES_FILE is unset too, so the "
                "install has no queue table before or after: without --from-queues-file, the "
                "--from-* flags migrate its settings",
                EXIT_CONFIG,
            )
        return QueueTable.default(old_settings(settings, arguments), registry)
    return _old_table(settings, source)


def _plan(
    settings: Settings, arguments: argparse.Namespace
) -> tuple[TableMigration, list[Names], list[TopologySpec]]:
    """The migration, the names of every queue of both tables, and the plans migrated to."""
    _refuse_flags(settings, arguments)
    registry = load_handlers(settings)
    # Unset, CONSUMER_QUEUES_FILE gives the one queue of a service without a table.
    new = table_specs(load_queue_table(settings, registry))
    old = table_specs(_old(settings, arguments, registry))
    names = [spec.names for spec in (*old, *new)]
    if arguments.rollback:
        old, new = new, old
    try:
        return plan_table_migration(old, new), names, new
    except MigrationRefused as error:
        fail(str(error), EXIT_CONFIG)


def _migrated(new: list[TopologySpec]) -> str:
    (first, *rest) = new
    if rest or first.names.queue is not None:
        return "migrated: the queue table's plan is in place"
    return f"migrated: {first.names.work} is the work queue, without a queue table"


def run_table_migrate(settings: Settings, arguments: argparse.Namespace) -> int:
    migration, names, new = _plan(settings, arguments)
    if answered_offline(migration, dry_run=arguments.dry_run):
        return 0
    # A copy moved out of any queue's work queue: that queue's redeliver exchange is the service's.
    targets = [build_topology(spec) for spec in new]
    if not carry_out(settings, migration.plan, moved_headers(*names), arguments.wait, targets):
        return EXIT_PENDING
    for move in migration.moved:
        print(f"moved {move.describe()}", flush=True)
    print(_migrated(new))
    return 0
