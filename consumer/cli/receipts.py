"""``consumer receipts prune [--dry-run]``: one round of receipt partition upkeep by hand.

The service runs the same round every ``CONSUMER_RECEIPT_PRUNE_INTERVAL``; this is for a cron job
where it cannot, for a look at what would go (``--dry-run``), and for the benchmark. The round
keeps the outbox's partitions too, under the same retention (its lines begin ``outbox:``).
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta
from typing import Any

import asyncpg

from consumer.cli.common import connect_or_fail
from consumer.config.queue_table import read_queue_table
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, fail
from consumer.db.database import describe_database_error
from consumer.db.pruning import Dropped, PruneReport, ReceiptPruner
from consumer.errors import ConfigError
from consumer.service.components import receipt_window

__all__ = ["add_receipts_parser", "run_receipts"]


def add_receipts_parser(commands: Any) -> None:
    """``receipts`` as a subcommand of ``consumer``."""
    receipts = commands.add_parser(
        "receipts",
        help="drop the receipts older than CONSUMER_RECEIPT_RETENTION (with a queue table, the "
        "longest of its queues'), whole partitions at once",
        description="Make the receipt partitions ahead of time, then drop every partition wholly "
        "older than CONSUMER_RECEIPT_RETENTION. One replica at a time: if another holds the "
        "lock, nothing is done.",
    )
    actions = receipts.add_subparsers(dest="receipts_command", required=True)
    prune = actions.add_parser("prune", help="one round of partition upkeep")
    prune.add_argument(
        "--dry-run", action="store_true", help="say what would be dropped; change nothing"
    )


def run_receipts(settings: Settings, arguments: argparse.Namespace) -> int:
    return asyncio.run(_prune(settings, dry_run=arguments.dry_run))


def _kept(settings: Settings) -> timedelta | None:
    """With a queue table, the longest retention of its queues: a queue's own
    ``receipt_retention`` may be longer than the setting, and its receipts must stay."""
    if settings.queues_file is None:
        return None
    try:
        return read_queue_table(settings.queues_file, settings).receipt_retention
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)


async def _prune(settings: Settings, *, dry_run: bool) -> int:
    pruner = ReceiptPruner(
        receipt_window(settings, _kept(settings)),
        max_future_skew=settings.max_future_skew,
        lock_wait=settings.receipt_prune_lock_wait,
    )
    conn = await connect_or_fail(settings)
    try:
        report = await pruner.prune(conn, dry_run=dry_run)
        stats = await pruner.stats(conn)
    except asyncpg.PostgresError as error:
        fail(f"pruning failed, nothing of it kept: {describe_database_error(error)}")
    finally:
        await conn.close()
    _print(report)
    print(f"kept: {stats.partitions} partitions, about {stats.estimated_rows} receipts")
    return 0


def _print(report: PruneReport) -> None:
    _print_part("", report.ran, report.dry_run, report.created, report.dropped, "receipts")
    # The outbox's lines apart, after the receipts' (which scripts read as they were).
    _print_part(
        "outbox: ",
        report.outbox_ran,
        report.dry_run,
        report.outbox_created,
        report.outbox_dropped,
        "rows",
    )


def _print_part(
    prefix: str, ran: bool, dry_run: bool, created: int, dropped: list[Dropped], unit: str
) -> None:
    if not ran:
        print(f"{prefix}another replica is pruning now: nothing done")
        return
    verb = "would drop" if dry_run else "dropped"
    if created:
        print(f"{prefix}created {created} partitions ahead")
    for one in dropped:
        print(
            f"{prefix}{verb} {one.partition} [{one.starts.isoformat()}, "
            f"{one.ends.isoformat()}), about {one.estimated_rows} {unit}"
        )
    if not dropped:
        print(f"{prefix}nothing older than the retention")
