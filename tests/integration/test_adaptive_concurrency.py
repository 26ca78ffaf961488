"""Concurrency that follows the handler: outcomes on the real broker and database, not timings.

A per-event handler that awaits I/O ends with more than one worker (``consumer_workers``), says so
in the log, and still applies every event exactly once; ``CONSUMER_WORKERS`` pins the count.
"""

from __future__ import annotations

import uuid

from tests.support import ServiceProcess, TestEnv, assert_applied_once, behave, fetchval, wait_until

EVENTS = 600


async def _send_awaiting(env: TestEnv, count: int) -> list[uuid.UUID]:
    events = [("test.behave", behave(f"io{n}", sleep_s=0.01), uuid.uuid4()) for n in range(count)]
    async with env.producer() as producer:
        await producer.send_many(events)
    return [event_id for _, _, event_id in events]


async def _all_applied(env: TestEnv, count: int) -> None:
    async def done() -> bool:
        return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) >= count

    await wait_until(done, timeout=240, what=f"{count} effects")


async def test_a_handler_awaiting_io_gets_parallel_workers(env: TestEnv) -> None:
    # Given a service at its defaults (one worker to start with)
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    assert await service.metric("consumer_workers") == 1

    # When its handler awaits I/O (10 ms a call) for a stream of events
    ids = await _send_awaiting(env, EVENTS)
    await _all_applied(env, EVENTS)
    await service.wait_idle()

    # Then it chose more workers, said so, and applied each event once
    assert await service.metric("consumer_workers") > 1
    assert 1 <= await service.metric("consumer_batch_size") <= 50
    assert await service.metric("consumer_concurrency_changes_total") >= 1
    changes = [line for line in service.log_lines() if line.get("event") == "concurrency changed"]
    assert changes, service.log_tail()
    assert changes[0]["reason"] == "handlers await"
    assert changes[0]["workers"] > 1
    await assert_applied_once(env.database_url, ids)


async def test_consumer_workers_pins_the_worker_count(env: TestEnv) -> None:
    # Given a service told to run one worker
    await env.apply_topology()
    service = await ServiceProcess(env, workers="1").start().wait_ready()

    # When its handler awaits I/O, which would otherwise get more
    ids = await _send_awaiting(env, EVENTS // 2)
    await _all_applied(env, EVENTS // 2)
    await service.wait_idle()

    # Then it kept one worker
    assert await service.metric("consumer_workers") == 1
    assert all(
        line["workers"] == 1
        for line in service.log_lines()
        if line.get("event") == "concurrency changed"
    )
    await assert_applied_once(env.database_url, ids)
