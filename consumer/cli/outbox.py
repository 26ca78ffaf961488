"""``consumer outbox {list,show,retry}``: the outbox's rows for an operator.

``list`` shows the rows owed (committed, not yet sent), the failed ones (refused by the broker for
good: ``failed_at`` set) or all of them; ``show`` one event's row in full; ``retry`` gives failed
rows back to the relay by clearing their ``failed_at``, once their cause is fixed. Each runs on
one database connection, as the run-time role may (:mod:`consumer.db.outbox_admin`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any
from uuid import UUID

import asyncpg

from consumer.cli.common import connect_or_fail, positive_int
from consumer.cli.dlq.output import shown
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_FAILURE, fail
from consumer.db.database import describe_database_error
from consumer.db.outbox_admin import (
    Listing,
    OutboxEntry,
    Retried,
    list_rows,
    retry_failed,
    rows_of,
)

__all__ = ["add_outbox_parser", "run_outbox"]

DEFAULT_LIMIT = 50


def add_outbox_parser(commands: Any) -> None:
    outbox = commands.add_parser(
        "outbox",
        help="the outbox's rows: those owed, those the broker refused; give failed ones back",
    )
    actions = outbox.add_subparsers(dest="outbox_command", required=True)
    listing = actions.add_parser(
        "list",
        help="the rows owed (default), failed (--failed) or all (--all), oldest first",
    )
    which = listing.add_mutually_exclusive_group()
    which.add_argument(
        "--failed",
        dest="which",
        action="store_const",
        const=Listing.FAILED,
        help="the rows the broker refused for good (failed_at set)",
    )
    which.add_argument(
        "--all",
        dest="which",
        action="store_const",
        const=Listing.ALL,
        help="every row kept: owed, sent and failed",
    )
    listing.set_defaults(which=Listing.OWED)
    listing.add_argument(
        "--newest-first", action="store_true", help="the newest rows first (default: oldest)"
    )
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=DEFAULT_LIMIT,
        help=f"at most this many rows (default {DEFAULT_LIMIT})",
    )
    show = actions.add_parser("show", help="one event's outbox row in full")
    show.add_argument("event_id", type=UUID, help="the event's event_id")
    retry = actions.add_parser(
        "retry",
        help="clear failed_at (and last_error) so that the relay publishes the rows again",
        description="Gives failed rows back to the relay, which publishes them at its next "
        "round. Fix their cause first (for an unroutable row: the missing binding, with "
        "`consumer topology apply`), or the broker refuses them again.",
    )
    chosen = retry.add_mutually_exclusive_group(required=True)
    chosen.add_argument("event_ids", nargs="*", type=UUID, default=[], metavar="EVENT_ID")
    chosen.add_argument("--all-failed", action="store_true", help="every failed row")
    retry.add_argument(
        "--dry-run", action="store_true", help="say how many would be given back; change nothing"
    )


def run_outbox(settings: Settings, arguments: argparse.Namespace) -> int:
    return asyncio.run(_run(settings, arguments))


async def _run(settings: Settings, arguments: argparse.Namespace) -> int:
    conn = await connect_or_fail(settings)
    try:
        if arguments.outbox_command == "list":
            return await _list(conn, arguments)
        if arguments.outbox_command == "show":
            return await _show(conn, arguments.event_id)
        if not arguments.all_failed and not arguments.event_ids:
            fail("outbox retry needs event ids or --all-failed")
        ids = None if arguments.all_failed else arguments.event_ids
        return _report_retry(await retry_failed(conn, ids, dry_run=arguments.dry_run), arguments)
    except asyncpg.PostgresError as error:
        fail(f"cannot read or update the outbox: {describe_database_error(error)}")
    finally:
        await conn.close()


async def _list(conn: Any, arguments: argparse.Namespace) -> int:
    rows = await list_rows(
        conn, arguments.which, limit=arguments.limit, newest_first=arguments.newest_first
    )
    print(
        f"{'id':>8}  {'event_id':<36}  {'type':<24}  {'key':<16}  {'age':>9}  "
        f"{'attempts':>8}  {'state':<6}  last_error"
    )
    for row in rows:
        print(
            f"{row.id:>8}  {row.event_id!s:<36}  {shown(row.type, 64):<24}  "
            f"{shown(row.order_key or '-', 32):<16}  {_age(row.age):>9}  {row.attempts:>8}  "
            f"{row.state:<6}  {shown(row.last_error or '', 80)}"
        )
    if not rows:
        print(f"no {'' if arguments.which is Listing.ALL else arguments.which + ' '}rows")
    elif len(rows) == arguments.limit:
        print(f"the first {len(rows)} (--limit)")
    return 0


async def _show(conn: Any, event_id: UUID) -> int:
    rows = await rows_of(conn, event_id)
    if not rows:
        print(f"error: no outbox row with event_id {event_id}", file=sys.stderr)
        return EXIT_FAILURE
    for number, row in enumerate(rows):
        if number:
            print()
        for line in _full(row):
            print(line)
    return 0


def _full(row: OutboxEntry) -> list[str]:
    cause = (
        f"{row.caused_by} (its handler in {shown(row.caused_by_consumer or '?')})"
        if row.caused_by is not None
        else "an application (consumer.outbox.enqueue)"
    )
    body = row.body_json()
    shown_body = (
        json.dumps(body, indent=2, ensure_ascii=True)
        if body is not None
        else shown(row.body, 2000) + "  (not JSON)"
    )
    return [
        f"id:          {row.id}",
        f"event_id:    {row.event_id}",
        f"type:        {shown(row.type)}",
        f"key:         {shown(row.order_key or '-')}",
        f"state:       {row.state}",
        f"caused_by:   {cause}",
        f"created_at:  {row.created_at.isoformat()} ({_age(row.age)} ago)",
        f"sent_at:     {row.sent_at.isoformat() if row.sent_at else '-'}",
        f"failed_at:   {row.failed_at.isoformat() if row.failed_at else '-'}",
        f"attempts:    {row.attempts}",
        f"last_error:  {shown(row.last_error or '-', 2000)}",
        f"headers:     {shown(row.headers, 2000)}",
        "body:",
        *("  " + shown(line, 2000) for line in shown_body.splitlines()),
    ]


def _report_retry(retried: Retried, arguments: argparse.Namespace) -> int:
    if retried.unknown:
        listed = ", ".join(str(event_id) for event_id in retried.unknown)
        print(f"error: no outbox row with event_id {listed}: nothing changed", file=sys.stderr)
        return EXIT_FAILURE
    verb = "would give back" if arguments.dry_run else "gave back"
    for event_id in retried.event_ids:
        print(f"{verb} {event_id}")
    if not arguments.all_failed:
        for event_id in dict.fromkeys(arguments.event_ids):
            if event_id not in retried.event_ids:
                print(f"not failed: {event_id} (owed or sent): left as it is")
    print(f"{verb} {len(retried.event_ids)} failed rows to the relay")
    return 0


def _age(seconds: float) -> str:
    """``seconds`` in its two largest units: 42s, 5m12s, 3h04m, 2d05h."""
    whole = max(int(seconds), 0)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
