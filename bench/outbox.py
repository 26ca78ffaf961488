"""The outbox relay's latency and top throughput (issue 34): commit to confirmed publish, p50 and
p99, at 500 and 1,000 rows a second, beside the rows a second it relays from a backlog.

    make bench-outbox
    .venv/bin/python -m bench.outbox --rates 500,1000 --seconds 10 --backlog 20000

One database (``python -m consumer migrate --create-database``), one ingress exchange and
topology of its own (``bench_<id>_outbox``), and ``python -m consumer run`` at its defaults with
the relay on. The relayed rows' type, :data:`EVENT_TYPE`, is handled by no handler: the harness
binds a quorum queue of its own (``<name>.sink``, the same queue type as the service's work
queues, so a confirm waits for the same Raft commit) to the ingress exchange under that routing
key, so each row the relay publishes lands there and nowhere else.

- **Top throughput**: :data:`BACKLOG` rows enqueued before the service starts (transactions of
  :data:`BACKLOG_CHUNK` rows), then the relay drains them; from the first row seen sent to the
  last, polling the count of sent rows every 50 ms.
- **Latency**, at each rate: :data:`CONNECTIONS` paced producers, each on one asyncpg
  connection at its share of the rate, one row a transaction (``consumer.outbox.enqueue`` +
  COMMIT), the rows due by each 2 ms tick written one after another. Two figures per row, the
  first :data:`WARMUP` second left out:

  - ``arrival``: from the moment the producer's COMMIT returned to the moment the harness's
    consumer of the sink queue received the message (``time.time()`` both, one machine clock).
    The relay's confirm comes from the broker at about the same moment, not necessarily before.
  - ``confirmed``: ``sent_at - created_at`` from the table (the database's clock both):
    ``created_at`` is ``now()``, the start of the producer's transaction, so the figure includes
    that transaction (its insert and commit); ``sent_at`` is ``clock_timestamp()`` at the mark,
    after the broker's confirm. This is the relay's whole promise, commit to confirmed.

The producer's own achieved rate is shown: one connection doing one transaction at a time may fall
short of the asked rate on a loaded machine. Results go to
``bench/results/outbox-<time>.{json,txt}``; the last stdout line is the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiormq
import asyncpg

from bench import measure, procfs, report
from bench.cli import _common, _positive_numbers, _service_env
from bench.events import Workload
from bench.infra import BenchError, Child, Infra
from bench.paced import TICK, due
from bench.run import _cleanup, machine, progress
from consumer.outbox import enqueue

__all__ = [
    "BACKLOG",
    "EVENT_TYPE",
    "GOAL_MS",
    "GOAL_RATE",
    "RATES",
    "latencies_ms",
    "outbox_lines",
    "summarize_latency",
]

EVENT_TYPE = "bench.relayed"
RATES = (500.0, 1000.0)
SECONDS = 10.0
WARMUP = 1.0
BACKLOG = 20_000
BACKLOG_CHUNK = 500
CONNECTIONS = 4
"""Producers side by side, each pacing its share of the rate: one connection doing one
transaction at a time waits for each commit's WAL flush, and reached only 230-270 rows/s here."""
GOAL_MS = 20.0
GOAL_RATE = 500.0
ARRIVAL_WAIT = 60.0
"""How long after the last commit every row must have arrived."""


@dataclass(frozen=True, slots=True)
class OutboxOptions:
    rates: tuple[float, ...]
    seconds: float
    backlog: int
    amqp_url: str
    admin_dsn: str
    results_dir: Path
    connections: int = CONNECTIONS
    keep_logs: bool = False
    service_env: Mapping[str, str] = field(default_factory=dict)


# -- pure parts ---------------------------------------------------------------------------------


def latencies_ms(
    starts: Mapping[uuid.UUID, float], ends: Mapping[uuid.UUID, float], warmup_until: float
) -> list[float]:
    """Sorted ``ends - starts`` in milliseconds of the rows that started at or after
    ``warmup_until`` and have an end."""
    return sorted(
        (ends[key] - start) * 1000.0
        for key, start in starts.items()
        if start >= warmup_until and key in ends
    )


def summarize_latency(values_ms: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p99 and max (nearest rank) of sorted milliseconds, and how many."""
    if not values_ms:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = list(values_ms)
    return {
        "count": len(ordered),
        "p50_ms": round(measure.quantile(ordered, 0.50), 2),
        "p99_ms": round(measure.quantile(ordered, 0.99), 2),
        "max_ms": round(ordered[-1], 2),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def outbox_lines(result: Mapping[str, Any]) -> list[str]:
    """The table: one line per rate, then the top throughput and the goal's verdict."""
    lines = [
        f"outbox relay, {result['machine']}",
        "",
        "| rows/s asked | produced/s | rows | arrival p50 | arrival p99 | confirmed p50 | "
        "confirmed p99 | confirmed max |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rates"]:
        arrival, confirmed = row["arrival"], row["confirmed"]
        lines.append(
            f"| {row['rate']:,.0f} | {row['produced_rate']:,.0f} | {confirmed['count']} | "
            f"{_ms(arrival['p50_ms'])} | {_ms(arrival['p99_ms'])} | "
            f"{_ms(confirmed['p50_ms'])} | {_ms(confirmed['p99_ms'])} | "
            f"{_ms(confirmed['max_ms'])} |"
        )
    top = result.get("throughput") or {}
    if top.get("rate"):
        lines.append(
            f"\ntop throughput: {top['rate']:,.0f} rows/s ({top['rows']:,} rows from a backlog, "
            f"first sent to last; by sent_at {top.get('table_rate') or 0:,.0f} rows/s)"
        )
    goal = next((row for row in result["rates"] if row["rate"] == GOAL_RATE), None)
    if goal is not None and goal["confirmed"]["p99_ms"] is not None:
        verdict = "yes" if goal["confirmed"]["p99_ms"] < GOAL_MS else "NO"
        lines.append(f"confirmed p99 under {GOAL_MS:.0f} ms at {GOAL_RATE:.0f}/s: {verdict}")
    return lines


# -- the harness's two ends ---------------------------------------------------------------------


async def _paced_enqueue(dsn: str, rate: float, seconds: float) -> dict[uuid.UUID, float]:
    """``rate`` rows a second for ``seconds``, one a transaction; the time (``time.time()``) each
    one's COMMIT returned, by event id."""
    committed: dict[uuid.UUID, float] = {}
    conn = await asyncpg.connect(dsn)
    try:
        total = int(rate * seconds)
        start = time.monotonic()
        sent = 0
        while sent < total:
            for _ in range(due(time.monotonic() - start, rate, total) - sent):
                async with conn.transaction():
                    event_id = await enqueue(conn, EVENT_TYPE, {"n": sent})
                committed[event_id] = time.time()
                sent += 1
            await asyncio.sleep(TICK)
    finally:
        await conn.close()
    return committed


class _Sink:
    """The harness's consumer of the sink queue: the arrival time of every message by its id."""

    def __init__(self, amqp_url: str, queue: str) -> None:
        self._url = amqp_url
        self._queue = queue
        self.arrivals: dict[uuid.UUID, float] = {}
        self._connection: aiormq.abc.AbstractConnection | None = None

    async def declare(self, exchange: str) -> None:
        connection = await aiormq.connect(self._url)
        try:
            channel = await connection.channel()
            await channel.queue_declare(
                self._queue, durable=True, arguments={"x-queue-type": "quorum"}
            )
            await channel.queue_bind(self._queue, exchange, routing_key=EVENT_TYPE)
        finally:
            await connection.close()

    async def purge(self) -> None:
        connection = await aiormq.connect(self._url)
        try:
            channel = await connection.channel()
            await channel.queue_purge(self._queue)
        finally:
            await connection.close()

    async def __aenter__(self) -> _Sink:
        self._connection = await aiormq.connect(self._url)
        channel = await self._connection.channel()
        await channel.basic_qos(prefetch_count=2000)

        async def arrived(message: aiormq.abc.DeliveredMessage) -> None:
            now = time.time()
            with contextlib.suppress(TypeError, ValueError):
                self.arrivals[uuid.UUID(message.header.properties.message_id)] = now

        await channel.basic_consume(self._queue, arrived, no_ack=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def wait_for(self, ids: Sequence[uuid.UUID], limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while any(key not in self.arrivals for key in ids):
            if time.monotonic() > deadline:
                missing = sum(key not in self.arrivals for key in ids)
                raise BenchError(f"{missing} of {len(ids)} relayed rows did not arrive")
            await asyncio.sleep(0.1)


async def _confirmed_ages(
    dsn: str, ids: Sequence[uuid.UUID], limit_s: float = ARRIVAL_WAIT
) -> dict[uuid.UUID, float]:
    """``sent_at - created_at`` (seconds, the database's clock) of the sent rows among ``ids``,
    once every one of them is marked sent (or ``limit_s`` has passed). A row reaches the sink
    before the relay's round marks it (after the round's last confirm, then its commit): read at
    once, the last rows would be left out, the slowest first."""
    conn = await asyncpg.connect(dsn)
    deadline = time.monotonic() + limit_s
    try:
        while True:
            rows = await conn.fetch(
                "SELECT event_id, extract(epoch FROM sent_at - created_at)::float8 AS age "
                "FROM outbox WHERE event_id = ANY($1::uuid[]) AND sent_at IS NOT NULL",
                list(ids),
            )
            if len(rows) >= len(set(ids)) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    finally:
        await conn.close()
    return {row["event_id"]: row["age"] for row in rows}


async def _backlog(dsn: str, rows: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for first in range(0, rows, BACKLOG_CHUNK):
            async with conn.transaction():
                for number in range(first, min(rows, first + BACKLOG_CHUNK)):
                    await enqueue(conn, EVENT_TYPE, {"n": number})
    finally:
        await conn.close()


async def _drain(child: Child, dsn: str, database: str, rows: int) -> dict[str, Any]:
    """Poll the sent rows until all ``rows`` are; the rate from the first seen sent to the last,
    and the same from the table's ``sent_at``."""
    watch = procfs.CpuWatch(measure.cpu_groups(child.pid, database))
    conn = await asyncpg.connect(dsn)
    try:
        first_time = first_count = 0.0
        last_change, last_count = time.monotonic(), -1
        while True:
            count = int(
                await conn.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL")
            )
            now = time.time()
            if count > 0 and not watch.started:
                first_time, first_count = now, count
                watch.start(now)
            if count >= rows:
                cpu = watch.stop(now)
                break
            if count != last_count:
                last_change, last_count = time.monotonic(), count
            elif time.monotonic() - last_change > measure.STALL_TIMEOUT:
                raise BenchError(f"the relay made no progress for 90s at {count}/{rows}")
            if child.exited() is not None:
                raise BenchError(f"the service exited {child.exited()}:\n{child.log_tail()}")
            await asyncio.sleep(measure.POLL_INTERVAL)
        span = await conn.fetchval(
            "SELECT extract(epoch FROM max(sent_at) - min(sent_at))::float8 FROM outbox"
        )
    finally:
        await conn.close()
    rate = (count - first_count) / (now - first_time) if now > first_time else None
    return {
        "rows": rows,
        "rate": round(rate, 1) if rate else None,
        "table_rate": round(rows / span, 1) if span else None,
        "cpu": {key: round(value, 1) for key, value in cpu.items()},
    }


async def _latency(
    dsn: str, sink: _Sink, rate: float, seconds: float, connections: int
) -> dict[str, Any]:
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    started = time.time()
    committed: dict[uuid.UUID, float] = {}
    share = rate / connections
    for part in await asyncio.gather(
        *(_paced_enqueue(dsn, share, seconds) for _ in range(connections))
    ):
        committed.update(part)
    produced_for = time.time() - started
    ids = list(committed)
    await sink.wait_for(ids, ARRIVAL_WAIT)
    ages = await _confirmed_ages(dsn, ids)
    warmup_until = started + WARMUP
    confirmed = sorted(
        ages[key] * 1000.0 for key, at in committed.items() if at >= warmup_until and key in ages
    )
    return {
        "rate": rate,
        "connections": connections,
        "produced_rate": round(len(ids) / produced_for, 1),
        "load_average": load,
        "arrival": summarize_latency(latencies_ms(committed, sink.arrivals, warmup_until)),
        "confirmed": summarize_latency(confirmed),
        "unsent": len(ids) - len(ages),
    }


async def run_outbox(options: OutboxOptions) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    infra = Infra.start(options.amqp_url, options.admin_dsn, options.results_dir, stamp)
    result: dict[str, Any] = {
        "kind": "outbox",
        "started": stamp,
        "machine": machine(),
        "options": {
            "rates": list(options.rates),
            "seconds": options.seconds,
            "backlog": options.backlog,
            "service_env": dict(options.service_env),
        },
        "rates": [],
    }
    progress(f"outbox {infra.prefix}: {result['machine']}")
    name = infra.name("outbox")
    failed = False
    try:
        dsn = await infra.create_database(name, Workload(1, 1, 1))
        env = infra.child_env({**options.service_env, **measure.owned_env(infra, name, dsn)})
        await infra.run_module("topology", "apply", env=env)
        sink = _Sink(infra.amqp_url, f"{name}.sink")
        await sink.declare(f"{name}.events")
        progress(f"  enqueueing a backlog of {options.backlog:,} rows")
        await _backlog(dsn, options.backlog)
        child = Child.spawn(
            "service", [sys.executable, "-m", "consumer", "run"], env, infra.log_file("service")
        )
        try:
            result["throughput"] = await _drain(child, dsn, name, options.backlog)
            progress(f"  top throughput {result['throughput']}")
            await sink.purge()
            async with sink:
                for rate in options.rates:
                    row = await _latency(dsn, sink, rate, options.seconds, options.connections)
                    progress(f"  {rate:,.0f}/s: {row}")
                    result["rates"].append(row)
        finally:
            result["exit_code"] = await child.stop()
    except BaseException:
        failed = True
        raise
    finally:
        await _cleanup(infra)
        if failed or options.keep_logs:
            result["logs"] = str(infra.log_dir)
        else:
            shutil.rmtree(infra.log_dir, ignore_errors=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.outbox", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--rates", type=_positive_numbers, default=RATES, help="rows a second")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="at each rate")
    parser.add_argument("--backlog", type=int, default=BACKLOG, help="rows for the throughput")
    parser.add_argument(
        "--connections", type=int, default=CONNECTIONS, help="producers, each at its share"
    )
    _common(parser)
    arguments = parser.parse_args(argv)
    if arguments.seconds <= WARMUP or arguments.backlog < 1 or arguments.connections < 1:
        raise SystemExit(
            f"--seconds must be above {WARMUP:.0f}, --backlog and --connections at least 1"
        )
    options = OutboxOptions(
        rates=arguments.rates,
        seconds=arguments.seconds,
        backlog=arguments.backlog,
        connections=arguments.connections,
        amqp_url=arguments.amqp_url,
        admin_dsn=arguments.admin_dsn,
        results_dir=arguments.results_dir,
        keep_logs=arguments.keep_logs,
        service_env=_service_env(arguments.service_env),
    )
    try:
        result = asyncio.run(run_outbox(options))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report.publish(result, "\n".join(outbox_lines(result)), options.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
