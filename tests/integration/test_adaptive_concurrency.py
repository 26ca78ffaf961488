"""Concurrency that follows the handler: outcomes on the real broker and database, not timings.

Per-event handlers start at every worker the pool allows and small batches; one that awaits I/O
keeps parallel workers, batch handlers alone come back to one worker and full batches (said in the
log), and every event is applied exactly once; ``CONSUMER_WORKERS`` pins the count.
"""

from __future__ import annotations

import uuid

from consumer.service.concurrency_policy import START_BATCH_SIZE
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
    # Given a service at its defaults, whose handlers include per-event ones: it starts at every
    # worker the pool allows and small batches, before anything is measured
    await env.apply_topology()
    service = await ServiceProcess(env, db_pool_size="3").start().wait_ready()
    assert await service.metric("consumer_workers") == 3
    assert await service.metric("consumer_batch_size") == START_BATCH_SIZE

    # When its handler awaits I/O (10 ms a call) for a stream of events
    ids = await _send_awaiting(env, EVENTS)
    await _all_applied(env, EVENTS)
    await service.wait_idle()

    # Then it kept parallel workers and small batches, and applied each event once
    assert await service.metric("consumer_workers") > 1
    # (smaller than full batches: sized so the transaction's own round trips are a small share)
    assert 1 <= await service.metric("consumer_batch_size") < 50
    changes = [line for line in service.log_lines() if line.get("event") == "concurrency changed"]
    assert all(line["reason"] == "handlers await" for line in changes), changes
    await assert_applied_once(env.database_url, ids)


async def test_batch_handlers_come_down_to_one_worker_and_full_batches(env: TestEnv) -> None:
    # Given a service at its defaults, started at parallel workers and small batches
    await env.apply_topology()
    service = await ServiceProcess(env, db_pool_size="3").start().wait_ready()
    assert await service.metric("consumer_workers") == 3

    # When only its batch handler has events to apply
    events = [("test.behave_many", {"key": f"b{n}"}, uuid.uuid4()) for n in range(EVENTS)]
    async with env.producer() as producer:
        await producer.send_many(events)
    await _all_applied(env, EVENTS)
    await service.wait_idle()

    # Then it went back to one worker and full batches, said why, and applied each event once
    assert await service.metric("consumer_workers") == 1
    assert await service.metric("consumer_batch_size") == 50
    assert await service.metric("consumer_concurrency_changes_total") >= 1
    changes = [line for line in service.log_lines() if line.get("event") == "concurrency changed"]
    assert changes, service.log_tail()
    assert changes[-1]["reason"] == "batch handlers"
    await assert_applied_once(env.database_url, [event_id for _, _, event_id in events])


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
