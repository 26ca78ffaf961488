"""Found in review, now a regression test. The defect was: a crash-attribution mark left behind by a
process that did not die.

``Pipeline._apply_marked`` commits the mark, then applies the event in a transaction that clears
it. If that transaction does not finish (the database connection breaks: the service pauses and
holds the delivery) and the process is then stopped gracefully (SIGTERM during the pause: the
held deliveries are given back, exit 0), the mark stays with the old owner. The next process's
``CrashLedger.begin`` counts it as a death (``owner <> EXCLUDED.owner``). Two such graceful stops
during database outages convict an innocent, slow event as ``crashed``: no process ever died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import asyncpg

from tests.conftest import make_template
from tests.servers import ThrowawayPostgres
from tests.support import ServiceProcess, TestEnv, behave, drain_queue


async def _calls(dsn: str, event_id: uuid.UUID) -> int:
    try:
        conn = await asyncpg.connect(dsn, timeout=2)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return -1
    try:
        return int(
            await conn.fetchval("SELECT count(*) FROM handler_calls WHERE event_id = $1", event_id)
        )
    except (OSError, asyncpg.PostgresError):
        return -1
    finally:
        await conn.close()


async def _wait_calls(dsn: str, event_id: uuid.UUID, n: int) -> None:
    for _ in range(400):
        if await _calls(dsn, event_id) >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"handler call {n} never came")


async def _wait_paused(service: ServiceProcess) -> None:
    for _ in range(300):
        try:
            if await service.metric("consumer_paused") == 1:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("never paused")


async def test_graceful_stops_during_database_restarts_never_count_as_crashes(
    env: TestEnv, postgres: ThrowawayPostgres
) -> None:
    await make_template(postgres.admin_dsn, "consumer")
    dsn = postgres.dsn("consumer")
    env = dataclasses.replace(env, database_url=dsn)
    settings = {"handler_timeout": "10s", "hard_timeout": "15s"}
    await env.apply_topology(**settings)
    event_id = uuid.uuid4()
    async with env.producer() as producer:
        await producer.send("test.behave", behave("slow", sleep_s=2), event_id=event_id)

    service = await ServiceProcess(env, "p1", **settings).start().wait_ready()
    # The database goes away while the handler runs (call 1, in a batch of one): held, alone next.
    await _wait_calls(dsn, event_id, 1)
    postgres.stop()
    await _wait_paused(service)
    postgres.start()
    # Applied alone, marked (owner p1); the database goes away again during the handler.
    await _wait_calls(dsn, event_id, 2)
    postgres.stop()
    await _wait_paused(service)
    exit_codes = [await service.stop()]  # SIGTERM during the pause: graceful
    postgres.start()
    marks = [await _mark(dsn, event_id)]

    for run in (2, 3):
        service = await ServiceProcess(env, f"p{run}", **settings).start().wait_ready()
        if run == 2:
            await _wait_calls(dsn, event_id, 3)
            postgres.stop()
            await _wait_paused(service)
            exit_codes.append(await service.stop())
            postgres.start()
            marks.append(await _mark(dsn, event_id))
    await asyncio.sleep(5)
    letters = await drain_queue(env.amqp_url, env.names.dead)
    dead = [
        (uuid.UUID(json.loads(m.body)["event_id"]), str(m.headers.get("consumer-dead-reason")))
        for m in letters
    ]
    exit_codes.append(await service.stop())
    print(f"exit codes={exit_codes} marks after each stop={marks} dead={dead}")
    assert all(code == 0 for code in exit_codes), "no process died"
    assert (event_id, "crashed") not in dead, "an innocent convicted as crashed"


async def _mark(dsn: str, event_id: uuid.UUID) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT owner, crashes FROM consumer_in_progress WHERE event_id = $1", event_id
        )
        return dict(row) if row else None
    finally:
        await conn.close()
