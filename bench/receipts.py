"""``python -m bench receipts``: what receipts retention costs (README "Performance").

Three measurements, each in a database of its own, dropped afterwards:

1. **upgrade**: a database of the release before (sql/001-004) holding ``--upgrade-rows``
   receipts in the plain table is migrated (sql/005) while a probe reads receipts in a loop; the
   migration's transaction (the time consumers are blocked: it holds the table's lock from its
   first statement to its commit) and the probe's slowest read.
2. **prune**: ``--rows`` synthetic receipts spread evenly from the start of the oldest day's
   partition to now (``INSERT ... SELECT generate_series`` into the partitioned table), then
   ``consumer receipts prune`` removing the oldest day (run as the command, timed from outside,
   interpreter start included); the receipts' table + index size before and after.
3. **insert**: the service's own batched receipt statement (``consumer.receipts``), sealed and
   committed, ``--batches`` times ``--batch-size`` events, against the receipts of 2. and against
   an empty table.

``--partition`` sets the partitions' span (``CONSUMER_RECEIPT_PARTITION``, default 1h) for 2.
and 3.: the migration's daily partitions, empty, are replaced by partitions that wide from a week
back.
The service's throughput while a prune runs: ``python -m bench prune-load`` (bench/prune_load.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from bench.infra import REPO, dsn_for, scratch_database
from consumer.config.settings import Settings
from consumer.db.migration_sets import SERVICE_SET, MigrationSet, service_set
from consumer.db.migrations import migrate
from consumer.db.receipts import _INSERT_MANY, _SEAL
from topology.durations import format_duration

__all__ = [
    "ReceiptsOptions",
    "dropped_partitions",
    "generate",
    "repartition",
    "run_receipts",
    "table",
]

CHUNK = 1_000_000
"""Rows per generating statement."""

DEFAULT_PARTITION: timedelta = Settings.model_fields["receipt_partition"].default
"""``CONSUMER_RECEIPT_PARTITION``'s default, that of ``--partition``."""
WEEK = timedelta(days=7)
"""How far back the synthetic receipts go (and the partitions made for them)."""
PRUNE_RETENTION = timedelta(days=6)
"""The retention the prune step runs with: it drops the oldest day of the week."""
AHEAD = timedelta(days=2)
"""How far ahead partitions are made, as the service's default settings do."""

_SIZE = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint
FROM pg_partition_tree('receipts') WHERE isleaf
"""
_GENERATE_PARTITIONED = """
INSERT INTO receipts (consumer, event_id, type, occurred_at)
SELECT 'bench', gen_random_uuid(), 'inventory.reserve', start + (i::float8 / $3) * (now() - start)
FROM generate_series($1::bigint, $2::bigint) AS i,
     date_bin($4::interval, now() - interval '7 days', timestamptz '2000-01-01 00:00:00+00')
         AS start
"""
_GENERATE_PLAIN = """
INSERT INTO receipts (consumer, event_id, type, received_at)
SELECT 'bench', gen_random_uuid(), 'inventory.reserve',
       now() - interval '3 days' + (i::float8 / $3) * interval '3 days'
FROM generate_series($1::bigint, $2::bigint) AS i
"""
# The migration's partitions (a day each, sql/005) are empty: replaced by partitions of the
# measured span, made by the same function the service calls, from a week back.
_UNPARTITION = """
SELECT name FROM consumer_receipt_partitions WHERE name <> 'receipts_legacy'
"""
_PROBE = "SELECT count(*) FROM receipts WHERE consumer = 'probe' AND event_id = $1"


@dataclass(frozen=True, slots=True)
class ReceiptsOptions:
    rows: int
    upgrade_rows: int
    batches: int
    batch_size: int
    admin_dsn: str
    results_dir: Path
    partition: timedelta = DEFAULT_PARTITION


async def run_receipts(options: ReceiptsOptions) -> dict[str, Any]:
    stamp = uuid.uuid4().hex[:8]
    result: dict[str, Any] = {"kind": "receipts", "options": _plain(options)}
    result["upgrade"] = await _in_database(
        options.admin_dsn, f"bench_receipts_upgrade_{stamp}", _upgrade, options
    )
    empty_dsn = dsn_for(options.admin_dsn, f"bench_receipts_empty_{stamp}")

    async def prune(dsn: str, options: ReceiptsOptions) -> dict[str, Any]:
        return await _prune(dsn, empty_dsn, options)

    async def with_empty(_: str, options: ReceiptsOptions) -> dict[str, Any]:
        found: dict[str, Any] = await _in_database(
            options.admin_dsn, f"bench_receipts_{stamp}", prune, options
        )
        return found

    result["prune"] = await _in_database(
        options.admin_dsn, f"bench_receipts_empty_{stamp}", with_empty, options
    )
    insert = result["prune"]["insert"]
    empty, full = insert["empty_ms_median"], insert["full_ms_median"]
    result["insert_ratio"] = full / empty if empty else None
    return result


def _plain(options: ReceiptsOptions) -> dict[str, Any]:
    return {
        "rows": options.rows,
        "upgrade_rows": options.upgrade_rows,
        "batches": options.batches,
        "batch_size": options.batch_size,
        "partition_s": options.partition.total_seconds(),
    }


async def _in_database(admin_dsn: str, name: str, step: Any, options: ReceiptsOptions) -> Any:
    async with scratch_database(admin_dsn, name) as dsn:
        return await step(dsn, options)


async def repartition(conn: asyncpg.Connection[Any], width: timedelta, back: timedelta) -> int:
    """Replace a freshly migrated database's (empty) partitions by partitions ``width`` wide
    from ``back`` ago to :data:`AHEAD` from now, made by ``consumer_receipts_extend``; how many."""
    async with conn.transaction():
        for name in await conn.fetch(_UNPARTITION):
            await conn.execute(f'DROP TABLE "{name[0]}"')
        await conn.execute(
            "DELETE FROM consumer_receipt_partitions WHERE name <> 'receipts_legacy'"
        )
        made: int = await conn.fetchval(
            "SELECT consumer_receipts_extend($1, $2, $3, interval '1 minute')", width, back, AHEAD
        )
    return made


async def generate(conn: asyncpg.Connection[Any], statement: str, rows: int, *extra: Any) -> float:
    started = time.perf_counter()
    for first in range(1, rows + 1, CHUNK):
        last = min(first + CHUNK - 1, rows)
        async with conn.transaction():
            await conn.execute("SELECT set_config('consumer.sealed', 'yes', true)")
            await conn.execute(statement, first, last, rows, *extra)
    await conn.execute("ANALYZE receipts")
    return time.perf_counter() - started


async def _upgrade(dsn: str, options: ReceiptsOptions) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    probe = await asyncpg.connect(dsn)
    try:
        with tempfile.TemporaryDirectory() as folder:
            before = Path(folder)
            for path in sorted(service_set().folder.glob("*.sql")):
                if path.name < "005":
                    shutil.copy(path, before / path.name)
            await migrate(conn, [MigrationSet(SERVICE_SET, before)])
        generated = await generate(conn, _GENERATE_PLAIN, options.upgrade_rows)
        stop = asyncio.Event()
        waits: list[float] = []

        async def read() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                await probe.fetchval(_PROBE, uuid.uuid4())
                waits.append(time.perf_counter() - started)

        reading = asyncio.create_task(read())
        await asyncio.sleep(0.5)
        started = time.perf_counter()
        report = await migrate(conn, [service_set()])
        migrated = time.perf_counter() - started
        await asyncio.sleep(0.5)
        stop.set()
        await reading
        legacy = await conn.fetchval("SELECT count(*) FROM receipts_legacy")
    finally:
        await probe.close()
        await conn.close()
    return {
        "rows": options.upgrade_rows,
        "generate_s": round(generated, 1),
        "applied": report.applied,
        "migration_s": round(migrated, 3),
        "probe_reads": len(waits),
        "probe_max_ms": round(max(waits) * 1000, 1),
        "legacy_rows": legacy,
    }


async def _insert_cost(
    full: asyncpg.Connection[Any], empty: asyncpg.Connection[Any], options: ReceiptsOptions
) -> dict[str, Any]:
    """The service's receipt statement and seal, one transaction per batch as a batch does,
    alternately in the full and the empty database (so that the shared machine's moods fall on
    both alike). The consumer is the receipts' own ('bench'), as in a service's database."""
    timings: dict[str, list[float]] = {"full": [], "empty": []}
    for _ in range(options.batches):
        for label, conn in (("full", full), ("empty", empty)):
            ids = [uuid.uuid4() for _ in range(options.batch_size)]
            now = datetime.now(UTC)
            times = [now] * len(ids)
            types = ["inventory.reserve"] * len(ids)
            started = time.perf_counter()
            async with conn.transaction():
                await conn.fetch(_INSERT_MANY, "bench", ids, types, times, "100ms")
                await conn.fetchval(_SEAL, len(ids))
            timings[label].append(time.perf_counter() - started)
    return {
        "batches": options.batches,
        "batch_size": options.batch_size,
        **{
            f"{label}_ms_median": round(statistics.median(found) * 1000, 3)
            for label, found in timings.items()
        },
        **{
            f"{label}_ms_mean": round(statistics.fmean(found) * 1000, 3)
            for label, found in timings.items()
        },
    }


async def _prune(dsn: str, empty_dsn: str, options: ReceiptsOptions) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    empty = await asyncpg.connect(empty_dsn)
    try:
        await migrate(empty, [service_set()])
        await migrate(conn, [service_set()])
        await repartition(empty, options.partition, WEEK)
        await repartition(conn, options.partition, WEEK)
        generated = await generate(conn, _GENERATE_PARTITIONED, options.rows, options.partition)
        size_before = await conn.fetchval(_SIZE)
        partitions_before = await conn.fetchval(
            "SELECT count(*) FROM pg_partition_tree('receipts') WHERE isleaf"
        )
        insert = await _insert_cost(conn, empty, options)
        rows_before = await conn.fetchval("SELECT count(*) FROM receipts")
        # The command's own cost (interpreter, connection, the partitions ahead) without a drop,
        # then with it: the oldest of the week's partitions is wholly older than six days.
        dry_s, _ = await _prune_command(dsn, options.partition, "--dry-run")
        async with _Inserter(dsn) as inserter:
            prune_s, out = await _prune_command(dsn, options.partition)
        size_after = await conn.fetchval(_SIZE)
        rows_after = await conn.fetchval("SELECT count(*) FROM receipts")
    finally:
        await empty.close()
        await conn.close()
    return {
        "rows": options.rows,
        "generate_s": round(generated, 1),
        "partitions_before": partitions_before,
        "size_before_mb": round(size_before / 2**20, 1),
        "dry_run_s": round(dry_s, 3),
        "prune_s": round(prune_s, 3),
        "prune_output": out.splitlines(),
        "partitions_dropped": sum(name != "receipts_legacy" for name in dropped_partitions(out)),
        "rows_removed": rows_before - rows_after,
        "inserts_during_prune": len(inserter.waits),
        "slowest_insert_during_prune_ms": round(max(inserter.waits) * 1000, 1),
        "size_after_mb": round(size_after / 2**20, 1),
        "rows_after": rows_after,
        "insert": insert,
    }


class _Inserter:
    """The service's receipt statement in a loop on a connection of its own, timing each batch
    (of 10) while the prune runs: how long the consume path waits for it."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self.waits: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Inserter:
        conn = await asyncpg.connect(self._dsn)
        self._task = asyncio.create_task(self._insert(conn))
        await asyncio.sleep(0.2)
        return self

    async def __aexit__(self, *_: object) -> None:
        await asyncio.sleep(0.2)
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _insert(self, conn: asyncpg.Connection[Any]) -> None:
        try:
            while not self._stop.is_set():
                ids = [uuid.uuid4() for _ in range(10)]
                times = [datetime.now(UTC)] * len(ids)
                started = time.perf_counter()
                async with conn.transaction():
                    await conn.fetch(
                        _INSERT_MANY, "bench", ids, ["inventory.reserve"] * 10, times, "100ms"
                    )
                    await conn.fetchval(_SEAL, len(ids))
                self.waits.append(time.perf_counter() - started)
        finally:
            await conn.close()


async def _prune_command(dsn: str, partition: timedelta, *args: str) -> tuple[float, str]:
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "consumer", "receipts", "prune", *args),
        env=_env(dsn, partition),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"consumer receipts prune failed: {err.decode().strip()}")
    return seconds, out.decode().strip()


def _env(dsn: str, partition: timedelta) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")}
    return {
        **base,
        "CONSUMER_DATABASE_URL": dsn,
        "CONSUMER_RECEIPT_RETENTION": format_duration(PRUNE_RETENTION),
        "CONSUMER_RECEIPT_PARTITION": format_duration(partition),
        "PYTHONPATH": str(REPO),
    }


def dropped_partitions(output: str) -> list[str]:
    """The partitions ``consumer receipts prune`` says it dropped (``dropped <name> [...``);
    with ``--dry-run`` it says ``would drop``, so none."""
    return [line.split(" ")[1] for line in output.splitlines() if line.startswith("dropped ")]


def table(result: dict[str, Any]) -> str:
    upgrade, prune = result["upgrade"], result["prune"]
    insert = prune["insert"]
    lines = [
        f"upgrade of {upgrade['rows']:,} receipts: migration {upgrade['migration_s']} s "
        f"(the lock held), slowest concurrent read {upgrade['probe_max_ms']} ms "
        f"({upgrade['probe_reads']} reads), {upgrade['legacy_rows']:,} kept in receipts_legacy",
        f"prune of one day ({prune['rows_removed']:,} of {prune['rows']:,} receipts over 7 "
        f"days, {prune.get('partitions_dropped', '?')} of {prune['partitions_before']} partitions "
        f"{format_duration(timedelta(seconds=result['options'].get('partition_s', 86400)))} wide):"
        " consumer receipts prune "
        f"{prune['prune_s']} s, its --dry-run "
        f"{prune['dry_run_s']} s (interpreter start included); table + indexes "
        f"{prune['size_before_mb']} MB -> {prune['size_after_mb']} MB; slowest of "
        f"{prune['inserts_during_prune']} receipt inserts meanwhile "
        f"{prune['slowest_insert_during_prune_ms']} ms",
        f"receipt insert + seal, {insert['batch_size']} per batch, median of "
        f"{insert['batches']} each, alternating: {insert['full_ms_median']} ms with "
        f"{prune['rows']:,} kept, {insert['empty_ms_median']} ms empty "
        f"(ratio {result['insert_ratio']:.3f})",
    ]
    return "\n".join(lines)
