"""Found in review, now a regression test. The defect was: PostgreSQL restarts while a slow,
innocent handler runs are counted as the event breaking its own connection
(``Pipeline._failed(alone=True)``), and after three it is dead-lettered ``connection_lost``.

``_apply_alone`` (a batch of one, which is what an idle worker takes) and ``_apply_marked`` both
pass ``alone=True``; nothing tells a server restart (every backend gone, the database answering
afterwards) from an event that kills its own backend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import asyncpg

from tests.conftest import make_template
from tests.servers import ThrowawayPostgres
from tests.support import (
    ServiceProcess,
    TestEnv,
    behave,
    drain_queue,
    queue_depth,
)


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


async def test_database_restarts_never_count_as_the_events_connection_losses(
    env: TestEnv, postgres: ThrowawayPostgres
) -> None:
    await make_template(postgres.admin_dsn, "consumer")
    dsn = postgres.dsn("consumer")
    env = dataclasses.replace(env, database_url=dsn)
    settings = {"handler_timeout": "10s", "hard_timeout": "15s"}
    await env.apply_topology(**settings)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    event_id = uuid.uuid4()
    async with env.producer() as producer:
        await producer.send("test.behave", behave("slow", sleep_s=3), event_id=event_id)

    restarts = 0
    for call in (1, 2, 3):
        for _ in range(300):
            if await _calls(dsn, event_id) >= call:
                break
            await asyncio.sleep(0.1)
        else:
            break
        # An operator (or a failover) restarts the database while the handler is running.
        postgres.stop()
        postgres.start()
        restarts += 1

    await asyncio.sleep(8)
    letters = await drain_queue(env.amqp_url, env.names.dead)
    reasons = [str(m.headers.get("consumer-dead-reason")) for m in letters]
    ids = [uuid.UUID(json.loads(m.body)["event_id"]) for m in letters]
    effects = -1
    conn = await asyncpg.connect(dsn)
    try:
        effects = int(await conn.fetchval("SELECT count(*) FROM test_effects"))
    finally:
        await conn.close()
    depth = await queue_depth(env.amqp_url, env.names.work)
    dead = list(zip(ids, reasons, strict=True))
    print(f"restarts={restarts} dead={dead} effects={effects} depth={depth}")
    await service.stop()
    # Expected: a database restart is an outage, never the event's fault: it is applied.
    assert event_id not in ids, f"innocent dead-lettered: {reasons}"
