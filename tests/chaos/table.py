"""A scenario's queues on the broker, with a queue table or without, and the figures it reports
queue by queue: which queue each event goes through, and the other queues' throughput before,
during and after one queue's trouble (from the receipts' and the handler calls' times)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.service.components import names_for
from tests.chaos.observe import EndState
from tests.chaos.verify import Verdict, by_queue
from tests.chaos.workload import UNKNOWN, Kind, PlannedEvent, Workload
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


async def throughput_around(
    dsn: str, consumer: str, table: QueueTable, stretch: Stretch
) -> dict[str, dict[str, float]]:
    """Each queue's fresh commits a second (receipts by ``received_at``, by type) before the
    stretch (from the first receipt), during it, and after it (to the last receipt)."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows: list[Any] = await conn.fetch(
            "SELECT type, received_at FROM receipts WHERE consumer = $1", consumer
        )
    finally:
        await conn.close()
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
