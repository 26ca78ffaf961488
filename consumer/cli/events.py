"""``consumer events show EVENT_ID``: where one event is: applied, dead-lettered, or waiting in
the retry ladder; and the chain it belongs to, through the outbox: what caused it, what it caused.

Applied is a receipt (in ``receipts`` or ``receipts_legacy``). The chain is the outbox's rows
(sql/008): the event's own row names the event whose handler published it (``caused_by``), or
none for an application's enqueue; the rows ``caused_by`` the event are what its handler
published. Dead-lettered and retrying are found by scanning the dead-letter queue and each rung's
delay queue (:mod:`consumer.cli.dlq.stream`): AMQP has no lookup by id, so each queue is read from
its head, at most ``--scan`` messages, held and given back in order. A rung's messages are held
for the scan's few seconds, which delays their retry by as much; each one given back counts as a
delivery (on RabbitMQ 4.0 to 4.2 a rung's default delivery limit of 20 would, after 20 scans, send
it on to the work queue early: a retry sooner, nothing lost). The work queue itself is not
scanned: it is the service's to consume.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import aiormq
import asyncpg
from aio_pika.abc import AbstractConnection

from consumer.amqp import headers as h
from consumer.amqp.connect import connect, describe_amqp_error
from consumer.cli.common import connect_or_fail, positive_int
from consumer.cli.dlq.letters import DeadMessage, event_id_from, read_dead_letter
from consumer.cli.dlq.main import add_stall_timeout
from consumer.cli.dlq.output import shown
from consumer.cli.dlq.stream import Delivered, QueueScan
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_FAILURE, fail, load_handlers, load_queue_table
from consumer.db.database import describe_database_error
from consumer.errors import BrokerUnreachable
from consumer.pipeline.envelope_parser import EnvelopeParser
from consumer.service.components import broker_config, envelope_limits, names_for

__all__ = ["add_events_parser", "run_events"]

DEFAULT_SCAN = 10_000
_RUNG_IDLE = 1.0
"""Seconds with nothing ready and nothing arriving after which a rung's scan ends: a rung's
messages expire under the scan (at its head), so fewer than it held may ever come."""
_RECEIPTS = """
SELECT 'receipts' AS held_in, type, occurred_at, received_at FROM receipts
WHERE consumer = $1 AND event_id = $2
UNION ALL
SELECT 'receipts_legacy', type, NULL, received_at FROM receipts_legacy
WHERE consumer = $1 AND event_id = $2
ORDER BY received_at
"""
_OWN_ROW = """
SELECT caused_by, caused_by_consumer, created_at, sent_at, failed_at FROM outbox
WHERE event_id = $1 ORDER BY id
"""
_CAUSED = """
SELECT event_id, type, created_at, sent_at, failed_at FROM outbox
WHERE caused_by = $1 ORDER BY id
"""


@dataclass(frozen=True, slots=True)
class Stored:
    """What the database holds of one event: its receipts and its part in the outbox's chain."""

    receipts: list[asyncpg.Record]
    own_rows: list[asyncpg.Record]
    caused: list[asyncpg.Record]


def add_events_parser(commands: Any) -> None:
    events = commands.add_parser(
        "events",
        help="where one event is: applied, dead-lettered or waiting to be retried; what caused "
        "it and what it caused",
    )
    actions = events.add_subparsers(dest="events_command", required=True)
    show = actions.add_parser(
        "show",
        help="its receipt, its outbox chain, its dead letters and its copies waiting in the retry "
        "ladder",
        description="Reads the receipts and the outbox (the event that caused this one, the "
        "events it caused), then scans the dead-letter queue and each retry rung from its head "
        "(at most --scan messages each, given back in order).",
    )
    show.add_argument("event_id", type=UUID, help="the event's event_id")
    show.add_argument(
        "--scan",
        type=positive_int,
        default=DEFAULT_SCAN,
        help=f"at most this many messages read from each queue (default {DEFAULT_SCAN})",
    )
    add_stall_timeout(show)


@dataclass(frozen=True, slots=True)
class Found:
    queue: str
    messages: list[Delivered]
    read: int
    present: int
    limit: int
    shortfall: str | None = None


def run_events(settings: Settings, arguments: argparse.Namespace) -> int:
    try:
        return asyncio.run(
            _show(settings, arguments.event_id, arguments.scan, arguments.stall_timeout)
        )
    except BrokerUnreachable as error:
        fail(str(error))
    except aiormq.exceptions.ChannelAccessRefused as error:
        fail(f"RabbitMQ refused: {describe_amqp_error(error)}")


async def _show(settings: Settings, event_id: UUID, scan: int, stall: float) -> int:
    stored = await _stored(settings, event_id)
    receipts = stored.receipts
    for row in receipts:
        occurred = f" occurred_at={row['occurred_at'].isoformat()}" if row["occurred_at"] else ""
        print(
            f"applied:        {shown(row['type'])}{occurred}, receipt written "
            f"{row['received_at'].isoformat()} ({row['held_in']})"
        )
    if not receipts:
        print("applied:        no receipt (not applied, or older than the receipts kept)")
    for line in _chain(stored):
        print(line)
    registry = load_handlers(settings)
    parser = EnvelopeParser(envelope_limits(settings))
    # Every queue of the queue table's (without one, the service's one queue): an event's type
    # may have moved between queues since it was dead-lettered.
    table = load_queue_table(settings, registry)
    every = [names_for(queue.settings, queue.name) for queue in table.queues]
    queues: list[tuple[str, str]] = []
    dead_queues = set()
    for names, spec in zip(every, table.queues, strict=True):
        queues.append(("dead-lettered", names.dead))
        dead_queues.add(names.dead)
        queues += [("retrying", names.rung(delay)) for delay in spec.settings.retry_delays]
    connection = await connect(broker_config(settings), "events")
    # A row of its own waiting in the outbox is where the event is until the relay sends it.
    located = bool(receipts) or any(row["sent_at"] is None for row in stored.own_rows)
    incomplete = False
    try:
        for what, queue in queues:
            expires = queue not in dead_queues
            found = await _look(connection, queue, str(event_id), scan, stall, expires=expires)
            if found is None:
                print(f"{what + ':':<15} {queue} does not exist")
                continue
            if found.shortfall is not None:
                incomplete = True
                print(
                    f"error: incomplete: read {found.read} of the {found.present} messages "
                    f"{queue} held when the scan began: {found.shortfall}",
                    file=sys.stderr,
                )
            for letter in (
                read_dead_letter(m, 0, registry=registry, parser=parser) for m in found.messages
            ):
                located = True
                print(_line(what, queue, letter))
            if not found.messages:
                print(f"{what + ':':<15} not in {_extent(found)}")
    finally:
        await connection.close()
    works = ", ".join(names.work for names in every)
    print(
        f"not looked for in {works}, the service's own queue{'s' if len(every) > 1 else ''}: "
        "an event found nowhere else may be there, waiting or being processed"
    )
    return 0 if located and not incomplete else EXIT_FAILURE


async def _stored(settings: Settings, event_id: UUID) -> Stored:
    conn = await connect_or_fail(settings)
    try:
        return Stored(
            list(await conn.fetch(_RECEIPTS, settings.name, event_id)),
            list(await conn.fetch(_OWN_ROW, event_id)),
            list(await conn.fetch(_CAUSED, event_id)),
        )
    except asyncpg.PostgresError as error:
        fail(f"cannot read the receipts and the outbox: {describe_database_error(error)}")
    finally:
        await conn.close()


def _chain(stored: Stored) -> list[str]:
    """The event's place in the outbox's chain: what caused it, then what it caused."""
    lines = []
    for row in stored.own_rows:
        cause = (
            f"event {row['caused_by']} (its handler in {shown(row['caused_by_consumer'] or '?')})"
            if row["caused_by"] is not None
            else "an application (consumer.outbox.enqueue)"
        )
        lines.append(f"caused by:      {cause}; {_row_state(row)}")
    if not stored.own_rows:
        lines.append("caused by:      no outbox row (a producer sent it, or its row is pruned)")
    for row in stored.caused:
        lines.append(f"caused:         {row['event_id']} {shown(row['type'])}, {_row_state(row)}")
    if not stored.caused:
        lines.append("caused:         no event in the outbox (none published, or the rows pruned)")
    return lines


def _row_state(row: asyncpg.Record) -> str:
    written = f"outbox row written {row['created_at'].isoformat()}"
    if row["sent_at"] is not None:
        return f"{written}, sent {row['sent_at'].isoformat()}"
    if row["failed_at"] is not None:
        return f"{written}, refused by the broker {row['failed_at'].isoformat()}"
    return f"{written}, not sent yet"


async def _look(
    connection: AbstractConnection,
    queue: str,
    event_id: str,
    limit: int,
    stall: float,
    *,
    expires: bool,
) -> Found | None:
    """The letters of ``event_id`` among the first ``limit`` messages of ``queue``; ``None`` if
    the queue does not exist. ``expires``: its messages expire (a rung)."""
    hits: list[Delivered] = []
    idle_end = _RUNG_IDLE if expires else None
    try:
        async with QueueScan(connection, queue=queue, stall=stall, idle_end=idle_end) as scan:
            async for held in scan.messages(limit):
                # Only the id is decoded for every message; a hit is read in full.
                if event_id_from(held.message.body) == event_id:
                    hits.append(held.message)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    return Found(queue, hits, scan.read, scan.present, limit, scan.shortfall)


def _extent(found: Found) -> str:
    if found.read < found.present and found.read >= found.limit:
        return f"the first {found.read} of the {found.present} in {found.queue} (--scan)"
    if found.read < found.present:
        return (
            f"{found.queue} ({found.read} read of the {found.present} it held; the others left "
            "it meanwhile)"
        )
    return f"{found.queue} ({found.read} read)"


def _line(what: str, queue: str, letter: DeadMessage) -> str:
    error = f"{shown(letter.error_class or '')} {shown(letter.error_message or '', 200)}".strip()
    if what == "dead-lettered":
        when = letter.dead_lettered_at.isoformat() if letter.dead_lettered_at else "?"
        return (
            f"dead-lettered:  in {queue}, reason {shown(letter.reason)}, at {when}, after "
            f"{'?' if letter.attempts is None else letter.attempts} retries; {error}"
        )
    last = _stamp(letter.headers.get(h.LAST_FAILURE_AT))
    return (
        f"retrying:       in {queue}, retry {letter.attempts} of the ladder, last failure "
        f"{last}; {error}"
    )


def _stamp(value: object) -> str:
    text = h.text(value)
    if text is None:
        return "?"
    try:
        return datetime.fromisoformat(text).isoformat()
    except ValueError:
        return shown(text)
