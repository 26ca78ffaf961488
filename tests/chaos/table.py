"""A scenario's queues on the broker, with a queue table or without, and the figures it reports
queue by queue: which queue each event goes through, and the other queues' throughput before,
during and after one queue's trouble (from the receipts' and the handler calls' times)."""

from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.service.components import names_for
from tests.chaos.observe import EndState
from tests.chaos.verify import Verdict, by_queue
from tests.chaos.workload import UNKNOWN, Kind, PlannedEvent, Workload, publication_of
from tests.support import TestEnv, connect_any
from topology.apply import apply_topology


@dataclass(frozen=True)
class BrokerQueues:
    """The work, delay and dead-letter queues the consumers use, each table queue's (labelled)
    or the service's one (labelled ``""``); a sharded queue's work queues are its shards."""

    work: dict[str, list[str]]
    delay: dict[str, list[str]]
    dead: dict[str, str]
    hash: dict[str, str] = field(default_factory=dict)
    """A sharded queue's consistent-hash exchange, by label."""

    @property
    def busy(self) -> list[str]:
        """Work queues (every shard) and delay queues: empty once everything is settled."""
        return [
            queue for label, works in self.work.items() for queue in (*works, *self.delay[label])
        ]

    @property
    def shards(self) -> list[str]:
        """Every sharded queue's shard queues."""
        return [q for label, works in self.work.items() if label in self.hash for q in works]


def read_table(env: TestEnv) -> QueueTable | None:
    settings = env.settings()
    if settings.queues_file is None:
        return None
    return read_queue_table(settings.queues_file, settings)


def broker_queues(env: TestEnv) -> BrokerQueues:
    table = read_table(env)
    if table is None:
        names, settings = env.names, env.settings()
        return BrokerQueues(
            {"": [names.work]},
            {"": [names.rung(delay) for delay in settings.retry_delays]},
            {"": names.dead},
        )
    work, delay, dead, hashes = {}, {}, {}, {}
    for queue in table.queues:
        names = names_for(queue.settings, queue.name)
        work[queue.label] = [names.work]
        if queue.shards > 1:
            work[queue.label] = [names.shard(n) for n in range(1, queue.shards + 1)]
            hashes[queue.label] = names.hash
        delay[queue.label] = [names.rung(d) for d in queue.settings.retry_delays]
        dead[queue.label] = names.dead
    return BrokerQueues(work, delay, dead, hashes)


async def set_up(env: TestEnv, unknown_to: str) -> None:
    """Declare the topology of the queue table ``env`` uses (:meth:`TestEnv.use_queue_table`,
    before any consumer is made; removed with the scenario's), and bind the type no handler
    takes to queue ``unknown_to``'s work queue (a sharded queue's hash exchange), as a handler
    removed since leaves it."""
    queues = broker_queues(env)
    connection = await connect_any(env.amqp_url)
    try:
        await apply_topology(connection, env.topologies[-1])
        channel = await connection.channel()
        if unknown_to in queues.hash:
            exchange = await channel.get_exchange(queues.hash[unknown_to], ensure=False)
            await exchange.bind(env.settings().exchange, UNKNOWN)
            return
        [work] = queues.work[unknown_to]
        queue = await channel.get_queue(work, ensure=False)
        await queue.bind(env.settings().exchange, UNKNOWN)
    finally:
        await connection.close()


def queue_of(table: QueueTable, event: PlannedEvent, unknown_to: str) -> str:
    """The queue ``event`` goes through: its routing key's (poison under ``test.behave``'s key
    goes where that type goes; the unknown type where the runner bound it)."""
    if event.routing_key == UNKNOWN:
        return unknown_to
    return table.queue_of(event.routing_key).label


@dataclass(frozen=True)
class Stretch:
    """The faulty queue's trouble: from the first handler call of its first mixed-in event to
    the last handler call of any (wall clock of the database)."""

    began: datetime
    ended: datetime


async def trouble_of(dsn: str, workload: Workload, kinds: set[Kind]) -> Stretch | None:
    ids = [e.event_id for e in workload.events if e.kind in kinds and e.event_id is not None]
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        row = await conn.fetchrow(
            "SELECT min(called_at), max(called_at) FROM handler_calls "
            "WHERE event_id = ANY($1::uuid[])",
            ids,
        )
    finally:
        await conn.close()
    if row is None or row[0] is None:
        return None
    return Stretch(row[0], row[1])


async def _receipts(dsn: str, consumer: str) -> list[Any]:
    """The scenario's receipts: each event's type, id and ``received_at``."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return list(
            await conn.fetch(
                "SELECT type, event_id, received_at FROM receipts WHERE consumer = $1", consumer
            )
        )
    finally:
        await conn.close()


async def throughput_around(
    dsn: str, consumer: str, table: QueueTable, stretch: Stretch
) -> dict[str, dict[str, float]]:
    """Each queue's fresh commits a second (receipts by ``received_at``, by type) before the
    stretch (from the first receipt), during it, and after it (to the last receipt)."""
    rows = await _receipts(dsn, consumer)
    if not rows:
        return {}
    first = min(row["received_at"] for row in rows)
    last = max(row["received_at"] for row in rows)
    windows = {
        "before": (first, stretch.began),
        "during": (stretch.began, stretch.ended),
        "after": (stretch.ended, last),
    }
    rates: dict[str, dict[str, float]] = {}
    for queue in table.queues:
        times = [row["received_at"] for row in rows if row["type"] in queue.types]
        rates[queue.label] = {}
        for name, (start, end) in windows.items():
            seconds = (end - start).total_seconds()
            count = sum(1 for at in times if start <= at < end)
            rates[queue.label][name] = count / seconds if seconds > 0 else 0.0
    return rates


def describe_throughput(
    rates: dict[str, dict[str, float]], stretch: Stretch, faulty: str
) -> list[str]:
    seconds = (stretch.ended - stretch.began).total_seconds()
    lines = [f"queue {faulty}'s trouble: {seconds:.1f}s (first to last call of its faulty events)"]
    for label, rate in rates.items():
        lines.append(
            f"queue {label}{' (faulty)' if label == faulty else ''}: commits a second before "
            f"{rate['before']:.0f}, during {rate['during']:.0f}, after {rate['after']:.0f}"
        )
    return lines


def by_queue_checked(
    workload: Workload, state: EndState, verdict: Verdict, table: QueueTable, unknown_to: str
) -> None:
    """:func:`~tests.chaos.verify.by_queue` for ``table``'s queues."""
    by_queue(
        workload, state, verdict, lambda event: queue_of(table, event, unknown_to), table.names
    )


@dataclass(frozen=True)
class Window:
    """One queue's events that must apply, over a stretch of wall clock: effects committed in it
    and publications confirmed in it, a second; and how long those publications waited for their
    commit (median and 95th percentile, seconds), which a paused stream does not flatter."""

    effects: float
    published: float
    wait_median: float | None
    wait_p95: float | None


def window_of(
    commits: list[float], waits: list[tuple[float, float]], start: float, end: float
) -> Window:
    seconds = end - start
    if seconds <= 0:
        return Window(0.0, 0.0, None, None)
    done = sum(1 for at in commits if start <= at < end)
    waited = sorted(wait for sent, wait in waits if start <= sent < end)
    return Window(
        done / seconds,
        len(waited) / seconds,
        statistics.median(waited) if waited else None,
        waited[min(len(waited) - 1, int(0.95 * len(waited)))] if waited else None,
    )


async def isolation(
    dsn: str,
    consumer: str,
    table: QueueTable,
    workload: Workload,
    confirmed_at: dict[str, float],
    stretch: Stretch,
    unknown_to: str,
) -> dict[str, tuple[Window, Window]]:
    """Each queue's :class:`Window` before ``stretch`` (from the first confirm) and during it."""
    rows = await _receipts(dsn, consumer)
    received: dict[uuid.UUID, float] = {
        row["event_id"]: row["received_at"].timestamp() for row in rows
    }
    sent: dict[str, float] = {}
    for attempt, confirmed in confirmed_at.items():
        key = publication_of(attempt).rsplit(".", 1)[0]
        sent[key] = min(confirmed, sent.get(key, confirmed))
    commits: dict[str, list[float]] = {label: [] for label in table.names}
    waits: dict[str, list[tuple[float, float]]] = {label: [] for label in table.names}
    for event in workload.events:
        at = received.get(event.event_id) if event.kind.applies and event.event_id else None
        if at is None or event.key not in sent:
            continue
        label = queue_of(table, event, unknown_to)
        commits[label].append(at)
        waits[label].append((sent[event.key], at - sent[event.key]))
    if not sent:
        return {}
    first, began, ended = min(sent.values()), stretch.began.timestamp(), stretch.ended.timestamp()
    return {
        label: (
            window_of(commits[label], waits[label], first, began),
            window_of(commits[label], waits[label], began, ended),
        )
        for label in table.names
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def describe_isolation(
    windows: dict[str, tuple[Window, Window]],
    stretch: Stretch,
    faulty: str,
    restarts: dict[str, int],
    processes: dict[str, str],
) -> list[str]:
    """What the faulty queue's crash loops cost each queue, before them and during them (first to
    last handler call of the crash events), and how often the process that runs it ended by
    itself and was started again (``processes``: which process runs each)."""
    seconds = (stretch.ended - stretch.began).total_seconds()
    lines = [f"queue {faulty}'s crash loops: {seconds:.1f}s (first to last call of its crashes)"]
    for label, (before, during) in windows.items():
        kept = f" ({during.effects / before.effects:.0%})" if before.effects > 0 else ""
        lines.append(
            f"isolation: queue {label}{' (faulty)' if label == faulty else ''} in "
            f"{processes[label]}: effects a second before / during the crash loops "
            f"{before.effects:.1f} / {during.effects:.1f}{kept}; published a second "
            f"{before.published:.1f} / {during.published:.1f}; publication to commit, median "
            f"{_seconds(before.wait_median)} / {_seconds(during.wait_median)}, p95 "
            f"{_seconds(before.wait_p95)} / {_seconds(during.wait_p95)}; its process restarted "
            f"after exiting by itself {restarts[label]}x"
        )
    return lines
