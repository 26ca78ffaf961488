"""Found in review, now a regression test. The defect was: crash-attribution marks of competing
consumers count as deaths.

``CrashLedger.begin`` (sql in consumer/db/crashes.py) adds a crash whenever the mark's owner
differs, without knowing whether that owner is alive: three processes applying copies of one
redelivered event alone at the same time (a producer's duplicate publish, returned by a reconnect)
give it two "crashes", and the third process dead-letters its copy as ``crashed``. No process died.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aio_pika

from tests.servers import free_port
from tests.support import (
    ServiceProcess,
    TestEnv,
    behave,
    drain_queue,
    fetchval,
)


async def test_live_consumers_applying_one_event_never_count_as_crashes(env: TestEnv) -> None:
    settings = {"prefetch": "1", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    event_id = uuid.uuid4()
    async with env.producer() as producer:
        for _ in range(3):  # a producer that retried its publish twice
            await producer.send("test.behave", behave("dup", sleep_s=3), event_id=event_id)

    # The three copies are delivered once and returned (redelivered), as a reconnect would.
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    queue = await channel.get_queue(env.names.work)
    held = [await queue.get(no_ack=False) for _ in range(3)]
    assert all(m is not None for m in held)

    services = [
        await ServiceProcess(env, f"s{n}", http_port=str(free_port()), **settings)
        .start()
        .wait_ready()
        for n in range(3)
    ]
    await connection.close()  # the copies go back, redelivered, one to each consumer

    await asyncio.sleep(10)
    letters = await drain_queue(env.amqp_url, env.names.dead)
    dead = [
        (uuid.UUID(json.loads(m.body)["event_id"]), str(m.headers.get("consumer-dead-reason")))
        for m in letters
    ]
    effects = await fetchval(
        env.database_url, "SELECT count(*) FROM test_effects WHERE event_id = $1", event_id
    )
    codes = [await s.stop() for s in services]
    print(f"exit codes={codes} effects={effects} dead={dead}")
    assert (event_id, "crashed") not in dead, "a live duplicate convicted as crashed"
