"""``consumer topology migrate --from-queues-file OLD.toml``: move an install from the plan of its
old queue table to the plan of the one ``CONSUMER_QUEUES_FILE`` names, while the consumers run.

The steps are :func:`topology.table_migration.plan_table_migration`'s: an event type that moves
between queues is bound to its new queue first, then unbound from its old one, whose consumers
apply what it already holds of it; each queue's own settings (ladder, delivery limit, work queue
generation) migrate as without a table; a queue that leaves the table has what it holds moved.
``--rollback`` migrates back, from the new table's plan to the old one's.
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
)
from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, fail, load_handlers, load_queue_table
from consumer.errors import QueueTableError
from consumer.service.components import table_specs
from topology.migration_plan import MigrationRefused
from topology.model import Topology
from topology.names import Names
from topology.plan import build_topology
from topology.table_migration import TableMigration, plan_table_migration

__all__ = ["run_table_migrate"]


def _old_table(settings: Settings, path: str) -> QueueTable:
    # Not checked against today's handlers: a type removed since is the old table's to route.
    try:
        return read_queue_table(Path(path), settings)
    except QueueTableError as error:
        fail(f"--from-queues-file: {error}", EXIT_CONFIG)


def _plan(
    settings: Settings, arguments: argparse.Namespace
) -> tuple[TableMigration, list[Names], list[Topology]]:
    """The migration, the names of every queue of both tables, and the plans migrated to."""
    flags = from_flags(arguments)
    if flags:
        fail(
            f"{', '.join(flags)}: with CONSUMER_QUEUES_FILE each queue's old settings are those "
            "of the old table: name it with --from-queues-file",
            EXIT_CONFIG,
        )
    if arguments.from_queues_file is None:
        fail(
            "CONSUMER_QUEUES_FILE: name the queue table the install was set up with "
            "(--from-queues-file OLD.toml)",
            EXIT_CONFIG,
        )
    registry = load_handlers(settings)
    new = table_specs(load_queue_table(settings, registry))
    old = table_specs(_old_table(settings, arguments.from_queues_file))
    names = [spec.names for spec in (*old, *new)]
    if arguments.rollback:
        old, new = new, old
    try:
        return plan_table_migration(old, new), names, [build_topology(spec) for spec in new]
    except MigrationRefused as error:
        fail(str(error), EXIT_CONFIG)


def run_table_migrate(settings: Settings, arguments: argparse.Namespace) -> int:
    migration, names, targets = _plan(settings, arguments)
    if answered_offline(migration, dry_run=arguments.dry_run):
        return 0
    # A copy moved out of any queue's work queue: that queue's redeliver exchange is the service's.
    if not carry_out(settings, migration.plan, moved_headers(*names), arguments.wait, targets):
        return EXIT_PENDING
    for move in migration.moved:
        print(f"moved {move.describe()}", flush=True)
    print("migrated: the queue table's plan is in place")
    return 0
