"""The dead-letter tools on large letters: a scan ends when what the queue held has arrived (or
its channel closes), never on a guess that nothing more is coming; an incomplete one says so."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime

import aio_pika

from consumer.amqp.connect import connect
from consumer.cli.dlq.stream import Held, QueueScan
from consumer.cli.producer import envelope_body
from consumer.service.components import broker_config
from tests.support import TestEnv, queue_depth, run_cli, wait_until

LETTERS = 300
LETTER_BYTES = 1024 * 1024
BIG_LETTERS = 40
BIG_LETTER_BYTES = 32 * 1024 * 1024


def dlq(env: TestEnv, *args: str) -> tuple[int, str, str]:
    result = run_cli("consumer", "dlq", *args, env=env.env(), timeout=300)
    return result.returncode, result.stdout, result.stderr


async def fill_large_letters(env: TestEnv, count: int, size: int) -> list[str]:
    """``count`` letters of about ``size`` bytes each, published straight into the dead-letter
    exchange as the service publishes its own (reason headers, no ``x-death``); their ids in
    queue order."""
    await env.apply_topology()
    ids: list[str] = []
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        dlx = await channel.get_exchange(env.names.dlx)
        for index in range(count):
            event_id = uuid.uuid4()
            body = envelope_body(
                "test.behave",
                {"key": f"k{index}", "padding": "x" * size},
                event_id=event_id,
                occurred_at=datetime.now(UTC),
            )
            ids.append(str(event_id))
            message = aio_pika.Message(
                body,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={
                    "consumer-dead-reason": "permanent_failure",
                    "consumer-attempt": 0,
                    "consumer-dead-lettered-at": datetime.now(UTC).isoformat(),
                },
                message_id=str(event_id),
            )
            await dlx.publish(message, routing_key="test.behave", timeout=60)
    finally:
        await connection.close()
    assert await queue_depth(env.amqp_url, env.names.dead) == count
    return ids


async def test_hundreds_of_large_letters_are_all_listed_shown_and_purged(env: TestEnv) -> None:
    # Given 300 letters of 1 MiB in the dead-letter queue
    ids = await fill_large_letters(env, LETTERS, LETTER_BYTES)

    # When an operator lists them
    code, out, err = dlq(env, "list")

    # Then every one is counted, and the queue keeps them all
    assert code == 0, err
    assert f"{LETTERS} dead letters (of {LETTERS} in the queue)" in out
    code, out, err = dlq(env, "list", "--json")
    assert code == 0, err
    assert [json.loads(line)["id"] for line in out.splitlines()] == ids
    # And the last of them is found by show
    code, out, err = dlq(env, "show", ids[-1])
    assert code == 0, err
    assert f"id:              {ids[-1]}" in out
    # And a selective purge removes every one it selects
    code, out, err = dlq(env, "purge", "--reason", "permanent_failure", "--yes")
    assert code == 0, err
    assert f"purged {LETTERS} of {LETTERS} read" in out
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def test_letters_the_broker_takes_seconds_to_send_are_all_listed(env: TestEnv) -> None:
    # Given 40 letters of 32 MiB: RabbitMQ reads a consumer's whole window of them before it
    # sends the first (1.9 s here for these, 0.2 s for 300 of 1 MiB), while the queue already
    # counts none ready
    ids = await fill_large_letters(env, BIG_LETTERS, BIG_LETTER_BYTES)

    # When an operator lists them, and replays them (dry run)
    code, out, err = dlq(env, "list", "--json")
    dry_code, dry_out, dry_err = dlq(env, "replay", "--all", "--dry-run")

    # Then every one is listed, none missed for arriving late
    assert code == 0, err
    assert [json.loads(line)["id"] for line in out.splitlines()] == ids
    assert dry_code == 0, dry_err
    assert f"of {BIG_LETTERS} would be replayed" in dry_out
    assert await queue_depth(env.amqp_url, env.names.dead) == BIG_LETTERS


async def test_a_scan_that_cannot_read_what_the_queue_held_says_so_and_fails(
    env: TestEnv,
) -> None:
    # Given letters in the dead-letter queue, and another client taking some of them away while
    # an operator lists them
    count = 2000
    await fill_large_letters(env, count, 64)
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    queue = await channel.get_queue(env.names.dead, ensure=False)
    taken = 0
    stop = asyncio.Event()

    async def take_some() -> None:
        nonlocal taken
        while not stop.is_set():
            message = await queue.get(no_ack=True, fail=False)
            if message is not None:
                taken += 1
            await asyncio.sleep(0.02)

    taking = asyncio.create_task(take_some())
    try:
        result = await asyncio.to_thread(
            run_cli,
            "consumer",
            "dlq",
            "list",
            "--stall-timeout",
            "3s",
            env=env.env(),
            timeout=120,
        )
    finally:
        stop.set()  # not a cancel: a get cancelled in flight may take a message uncounted
        await taking
        await connection.close()

    # Then the list says it is incomplete, on stderr, and exits non-zero
    assert taken > 0
    assert result.returncode == 1, result.stdout + result.stderr
    assert "incomplete" in result.stderr
    assert "nothing arrived for 3s" in result.stderr
    # And what it read is back in the queue
    assert await queue_depth(env.amqp_url, env.names.dead) == count - taken


async def test_a_scan_whose_channel_closes_ends_at_once_and_says_so(env: TestEnv) -> None:
    # Given 30 letters, and a scan reading them a window of 5 at a time
    await fill_large_letters(env, 30, 64)
    connection = await connect(broker_config(env.settings()), "test-scan")
    started = time.monotonic()
    read = 0
    try:
        async with QueueScan(connection, queue=env.names.dead, window=5, stall=60) as scan:
            async for held in scan.messages():
                read += 1
                if read == 3:
                    # When its channel closes under it (the broker closes a channel that acks a
                    # tag it never delivered)
                    await scan.take(Held(held.message, held.tag + 1000, held.consumer))
    finally:
        await connection.close()

    # Then the scan ends at once, not after its stall bound, and says why
    assert time.monotonic() - started < 30
    assert 3 <= read < 30
    assert scan.incomplete
    assert scan.shortfall is not None
    assert f"the channel reading {env.names.dead} closed" in scan.shortfall
    assert "unknown delivery tag" in scan.shortfall
    # And every letter is still in the queue
    await wait_until(lambda: _depth_is(env, 30), what="the letters back in the queue")


async def _depth_is(env: TestEnv, expected: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) == expected
