"""``python -m bench.long_transaction``: what a transaction held open for minutes costs PostgreSQL.

A handler that does minutes of work inside its event's transaction holds that transaction open
for as long. This measures what that costs the database, on a scratch database of its own (made
from ``--admin-dsn``, dropped at the end), in two phases of ``--minutes`` each:

- ``short``: a writer updates rows of a table (``--rows`` rows, ``--rate`` updates a second, each
  its own short transaction), nothing else: the baseline;
- ``held``: the same writer while another connection holds a transaction open, idle, after
  updating one row (as a handler's transaction does once it has written), for the whole phase; a
  third connection tries, now and then, to update the held row (``lock_timeout`` 1s) and counts
  how often it is refused.

At the end of each phase, with the long transaction still open, ``VACUUM (VERBOSE)`` the table:
its report says how many dead row versions it could not remove. Sampled every ``--every`` seconds:
the locks the long transaction holds (``pg_locks``), the age of the xmin horizon it holds back
(``age(backend_xid)`` in ``pg_stat_activity``), the table's dead tuples (``n_dead_tup``) and its
size on disk (``pg_table_size``). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import asyncpg

from bench.infra import scratch_database

__all__ = ["Phase", "main", "measure"]

_NOT_REMOVABLE = re.compile(r"(\d+) are dead but not yet removable")
_REMOVED = re.compile(r"tuples: (\d+) removed")
_HORIZON = re.compile(r"removable cutoff: (\d+), which was (\d+) XIDs old")


@dataclass
class Sample:
    at: float
    locks: dict[str, int]
    xid_age: int | None
    dead_tuples: int
    table_bytes: int


@dataclass
class Phase:
    name: str
    seconds: float
    updates: int = 0
    refused_lock_waits: int = 0
    lock_tries: int = 0
    samples: list[Sample] = field(default_factory=list)
    vacuum_removed: int | None = None
    vacuum_not_removable: int | None = None
    vacuum_cutoff_age: int | None = None
    size_before: int = 0
    size_after: int = 0
    size_after_commit_vacuum: int = 0
    not_removable_after_commit: int | None = None


async def _vacuum(conn: asyncpg.Connection[Any]) -> tuple[int | None, int | None, int | None]:
    """VACUUM (VERBOSE) the table: removed, dead but not removable, the cutoff's age in XIDs."""
    notices: list[str] = []

    def listen(_: Any, message: Any) -> None:
        notices.append(str(message))

    conn.add_log_listener(listen)
    try:
        await conn.execute("VACUUM (VERBOSE) work_rows")
    finally:
        conn.remove_log_listener(listen)
    text = "\n".join(notices)
    removed = _REMOVED.search(text)
    kept = _NOT_REMOVABLE.search(text)
    horizon = _HORIZON.search(text)
    return (
        int(removed[1]) if removed else None,
        int(kept[1]) if kept else None,
        int(horizon[2]) if horizon else None,
    )


async def _sample(conn: asyncpg.Connection[Any], holder: int | None, started: float) -> Sample:
    await conn.execute("SELECT pg_stat_force_next_flush()")
    locks: dict[str, int] = {}
    xid_age = None
    if holder is not None:
        for row in await conn.fetch(
            "SELECT locktype || ' ' || mode AS lock, count(*) AS n FROM pg_locks "
            "WHERE pid = $1 AND granted GROUP BY 1 ORDER BY 1",
            holder,
        ):
            locks[row["lock"]] = int(row["n"])
        xid_age = await conn.fetchval(
            "SELECT age(backend_xid) FROM pg_stat_activity WHERE pid = $1", holder
        )
    dead = await conn.fetchval(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'work_rows'"
    )
    size = await conn.fetchval("SELECT pg_table_size('work_rows')")
    return Sample(round(time.monotonic() - started, 1), locks, xid_age, int(dead), int(size))


async def _phase(
    dsn: str, name: str, seconds: float, rows: int, rate: float, every: float
) -> Phase:
    phase = Phase(name, seconds)
    setup = await asyncpg.connect(dsn)
    await setup.execute(
        "DROP TABLE IF EXISTS work_rows; "
        "CREATE TABLE work_rows (id int PRIMARY KEY, n int NOT NULL, pad text NOT NULL) "
        "WITH (autovacuum_enabled = false)"
    )
    await setup.execute(
        "INSERT INTO work_rows SELECT g, 0, repeat('x', 100) FROM generate_series(1, $1) g", rows
    )
    await setup.execute("VACUUM (ANALYZE) work_rows")
    phase.size_before = int(await setup.fetchval("SELECT pg_table_size('work_rows')"))
    holder: asyncpg.Connection[Any] | None = None
    holder_pid = None
    transaction = None
    if name == "held":
        holder = await asyncpg.connect(dsn)
        transaction = holder.transaction()
        await transaction.start()
        # As a handler's transaction: it has written (its row locked, an xid taken), then waits.
        await holder.execute("UPDATE work_rows SET n = n + 1 WHERE id = 1")
        holder_pid = holder.get_server_pid()
    writer = await asyncpg.connect(dsn)
    prober = await asyncpg.connect(dsn)
    await prober.execute("SET lock_timeout = '1s'")
    started = time.monotonic()
    deadline = started + seconds
    next_sample = started
    next_probe = started + 5
    interval = 1.0 / rate
    try:
        while (now := time.monotonic()) < deadline:
            if now >= next_sample:
                phase.samples.append(await _sample(setup, holder_pid, started))
                next_sample += every
            if now >= next_probe:
                phase.lock_tries += 1
                try:
                    await prober.execute("UPDATE work_rows SET n = n + 1 WHERE id = 1")
                except asyncpg.LockNotAvailableError:
                    phase.refused_lock_waits += 1
                next_probe += 5
            await writer.execute(
                "UPDATE work_rows SET n = n + 1 WHERE id = $1", random.randint(2, rows)
            )
            phase.updates += 1
            await asyncio.sleep(interval)
        phase.samples.append(await _sample(setup, holder_pid, started))
        (
            phase.vacuum_removed,
            phase.vacuum_not_removable,
            phase.vacuum_cutoff_age,
        ) = await _vacuum(setup)
        phase.size_after = int(await setup.fetchval("SELECT pg_table_size('work_rows')"))
        if transaction is not None:
            await transaction.commit()
        _, phase.not_removable_after_commit, _ = await _vacuum(setup)
        phase.size_after_commit_vacuum = int(
            await setup.fetchval("SELECT pg_table_size('work_rows')")
        )
    finally:
        for conn in (writer, prober, setup, holder):
            if conn is not None:
                await conn.close()
    return phase


async def measure(
    admin_dsn: str, *, minutes: float, rows: int, rate: float, every: float
) -> dict[str, Any]:
    seconds = minutes * 60
    async with scratch_database(admin_dsn, f"bench_longtx_{uuid.uuid4().hex[:10]}") as dsn:
        conn = await asyncpg.connect(dsn)
        version = await conn.fetchval("SHOW server_version")
        await conn.close()
        phases = [await _phase(dsn, name, seconds, rows, rate, every) for name in ("short", "held")]
    return {
        "server_version": version,
        "minutes": minutes,
        "rows": rows,
        "rate": rate,
        "phases": [asdict(phase) for phase in phases],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_transaction", description=__doc__)
    parser.add_argument(
        "--admin-dsn",
        default=os.environ.get(
            "CONSUMER_TEST_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="a role that may create and drop a database",
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="each phase's length")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=200.0, help="the writer's updates a second")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    arguments = parser.parse_args(argv)
    result = asyncio.run(
        measure(
            arguments.admin_dsn,
            minutes=arguments.minutes,
            rows=arguments.rows,
            rate=arguments.rate,
            every=arguments.every,
        )
    )
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
