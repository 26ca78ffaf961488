"""The dead-letter tools read what the queue held when they started, however fast letters come."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aio_pika

from tests.support import TestEnv, queue_depth, run_cli, wait_until


async def test_listing_stops_at_what_was_there_while_letters_keep_arriving(env: TestEnv) -> None:
    # Given a dead-letter queue that letters keep arriving in (a crash loop dead-lettering away)
    await env.apply_topology()
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    dlx = await channel.get_exchange(env.names.dlx)
    sent = 0

    async def dead_letter_one() -> None:
        nonlocal sent
        sent += 1
        await dlx.publish(aio_pika.Message(f"poison {sent}".encode()), routing_key="test.behave")

    for _ in range(40):
        await dead_letter_one()

    async def forty() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) == 40

    await wait_until(forty, what="40 dead letters")

    async def keep_dead_lettering() -> None:
        while True:
            await dead_letter_one()
            if sent % 100 == 0:
                await asyncio.sleep(0)  # let the test go on; still faster than a reader

    arriving = asyncio.create_task(keep_dead_lettering())
    try:
        # When an operator lists them while letters arrive faster than the tool reads
        await wait_until(lambda: _at_least(env, 1000), what="letters arriving")
        result = await asyncio.to_thread(
            run_cli, "consumer", "dlq", "list", "--json", env=env.env(), timeout=60
        )
        during = sent
    finally:
        arriving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await arriving
        await connection.close()

    # Then the tool lists what was there when it started, and ends, though more kept coming
    assert result.returncode == 0, result.stderr
    listed = len([json.loads(line) for line in result.stdout.splitlines()])
    assert 1000 <= listed < during


async def _at_least(env: TestEnv, count: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) >= count
