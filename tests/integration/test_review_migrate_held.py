"""Found in review: ``consumer topology migrate`` deleted a leaving retry rung once it held no
ready message, whoever held its messages unacked: a reader such as ``consumer events show`` (a
:class:`~consumer.cli.dlq.stream.QueueScan` of each rung) gives them back when it ends, by then into
a queue that is gone, and the retry copy is lost."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from consumer.cli.dlq.stream import QueueScan
from consumer.cli.producer import envelope_body
from consumer.cli.topology.migrate import EXIT_PENDING
from tests.support import (
    TestEnv,
    behave,
    connect_any,
    queue_depth,
    queue_exists,
    run_cli,
    wait_until,
)
from topology.names import RETRY_RUNG

OLD = {"retry_delays": "200ms,400ms,30s"}
NEW = {"retry_delays": "200ms,400ms"}
FROM = "--from-retry-delays=200ms,400ms,30s"


async def test_a_rung_is_not_deleted_while_a_reader_holds_its_messages(env: TestEnv) -> None:
    # Given a retry copy waiting in the 30s rung, which the new ladder drops
    await env.apply_topology(**OLD)
    rung = f"{env.name}.retry.30s"
    body = envelope_body(
        "test.behave", behave("w"), event_id=uuid.uuid4(), occurred_at=datetime.now(UTC)
    )
    async with env.producer() as producer:
        await producer.send_raw(
            body,
            "test.behave",
            headers={"consumer-attempt": 1, RETRY_RUNG: "30s"},
            exchange=env.names.retry,
        )
    await wait_until(lambda: _depth_is(env, rung, 1), timeout=10, what="the copy in its rung")

    # When the migration runs while `consumer events show` scans that rung (holding what it read)
    connection = await connect_any(env.amqp_url)
    try:
        async with QueueScan(connection, queue=rung) as scan:
            read = [held async for held in scan.messages()]
            assert len(read) == 1
            during = await asyncio.to_thread(
                run_cli, "consumer", "topology", "migrate", FROM, env=env.env(**NEW), timeout=120
            )
    finally:
        await connection.close()

    # Then the rung waits for its reader, and a second run, after it, moves the copy on
    assert during.returncode == EXIT_PENDING, during.stdout + during.stderr
    assert await queue_exists(env.amqp_url, rung)
    after = await asyncio.to_thread(
        run_cli, "consumer", "topology", "migrate", FROM, env=env.env(**NEW), timeout=120
    )
    assert after.returncode == 0, after.stdout + after.stderr
    assert not await queue_exists(env.amqp_url, rung)
    # Through the nearest rung left (400ms), back to the work queue
    await wait_until(
        lambda: _depth_is(env, env.names.work, 1), timeout=10, what="the copy back in work"
    )


async def _depth_is(env: TestEnv, queue: str, depth: int) -> bool:
    return await queue_depth(env.amqp_url, queue) == depth
