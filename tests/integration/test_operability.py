"""What lets someone run it: metrics, health, logs, graceful shutdown and the two time limits."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import aio_pika
import aiohttp

from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    fetch,
    fetchval,
    queue_depth,
    run_cli,
    wait_until,
)


async def test_each_metric_moves_when_it_should(env: TestEnv) -> None:
    await env.apply_topology()
    service = await ServiceProcess(env, db_pool_size="3").start().wait_ready()
    assert await service.metric("consumer_broker_connected") == 1
    assert await service.metric("consumer_consuming") == 1
    assert await service.metric("consumer_paused") == 0
    metrics = await service.metrics()
    assert any(name == "consumer_build_info" and value == 1 for (name, _), value in metrics.items())
    assert metrics[("consumer_service_info", (("name", env.name),))] == 1
    assert await service.metric("consumer_db_pool_max") == 3
    # One worker per 400 deliveries of the default window of 400
    assert await service.metric("consumer_workers") == 1
    assert await service.metric("process_start_time_seconds") > 0
    assert not [name for (name, _) in metrics if name.endswith("_created")]

    async with env.producer() as producer:
        slow = await producer.send("test.behave", behave("slow", sleep_s=1.5))

        async def busy() -> bool:
            return (
                await service.metric("consumer_in_flight") == 1
                and await service.metric("consumer_db_pool_in_use") >= 1
            )

        await wait_until(busy, what="one event in flight")
        assert 1 <= await service.metric("consumer_db_pool_size") <= 3  # opened lazily, up to 3

        ok = await producer.send("test.behave", behave("ok"))
        await producer.send("test.behave", behave("ok"), event_id=ok)  # a duplicate
        retried = await producer.send("test.behave", behave("retry", fail_transient=1))
        await producer.send("test.behave", behave("dead", permanent=True))
        await producer.send_raw(b"garbage", "test.behave")

    async def settled() -> bool:
        return await service.metric("consumer_in_flight") == 0 and await _effects(env) == 3

    await wait_until(settled, timeout=30, what="everything settled")
    await assert_applied_once(env.database_url, [slow, ok, retried])
    counts = {
        outcome: await service.metric("consumer_messages_total", type=type_, outcome=outcome)
        for outcome, type_ in [
            ("processed", "test.behave"),
            ("duplicate", "test.behave"),
            ("retried", "test.behave"),
            ("dead_lettered", "test.behave"),
            ("poison", "unknown"),
        ]
    }
    assert counts == {"processed": 3, "duplicate": 1, "retried": 1, "dead_lettered": 1, "poison": 1}
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 1
    assert await service.metric("consumer_dead_letters_total", reason="permanent_failure") == 1
    assert await service.metric("consumer_dead_letters_total", reason="not_json") == 1
    assert await service.metric("consumer_handler_duration_seconds_count", type="test.behave") == 5
    assert await service.metric("consumer_handler_duration_seconds_sum", type="test.behave") >= 1.5
    assert await service.metric("consumer_event_lag_seconds_count", type="test.behave") == 3
    assert await service.metric("consumer_db_pool_in_use") == 0

    # A redelivery: kill a worker holding an event, the next one sees it flagged redelivered.
    async with env.producer() as producer:
        await producer.send("test.behave", behave("held", sleep_s=2))
    await wait_until(
        lambda: service.metric_at_least("consumer_in_flight", 1), what="the held event"
    )
    service.kill()
    second = await ServiceProcess(env, "second").start().wait_ready()
    await wait_until(
        lambda: second.metric_at_least("consumer_redeliveries_total", 1), what="a redelivery"
    )


async def test_health_endpoints_and_nothing_else(env: TestEnv) -> None:
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    base = f"http://127.0.0.1:{service.port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/healthz") as response:
            assert response.status == 200
        async with session.get(f"{base}/readyz") as response:
            assert response.status == 200
            assert await response.json() == {
                "broker_connected": True,
                "consuming": True,
                "database": True,
                "paused": False,
                "workers": True,
                "ready": True,
            }
        async with session.get(f"{base}/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
        async with session.get(f"{base}/admin") as response:
            assert response.status == 404
        async with session.post(f"{base}/metrics") as response:
            assert response.status == 405

    # Readiness means really consuming: a deleted work queue makes it false at once.
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    await channel.queue_delete(env.names.work)
    await connection.close()

    async def not_ready() -> bool:
        status, body = await service.readyz()
        return status == 503 and body["consuming"] is False

    await wait_until(not_ready, what="readyz to turn false")
    assert await service.stop() == 0  # and a service without its queue still stops cleanly


async def test_one_log_line_per_outcome_without_payloads_or_passwords(
    env: TestEnv, amqp_url: str
) -> None:
    # Trust authentication ignores the password, so it can be a canary here.
    canary = "Canary-Pa55word-" + uuid.uuid4().hex[:6]
    database_url = env.database_url.replace("postgres@", f"postgres:{canary}@")
    await env.apply_topology()
    service = await ServiceProcess(env, database_url=database_url).start().wait_ready()
    async with env.producer() as producer:
        good = await producer.send("test.behave", behave("secret-payload-value"))
        bad = await producer.send("test.behave", behave("also-secret", permanent=True))

    async def two_lines() -> bool:
        return len([x for x in service.log_lines() if x.get("event") == "message settled"]) == 2

    await wait_until(two_lines, what="two outcome lines")
    lines = {x["event_id"]: x for x in service.log_lines() if x.get("event") == "message settled"}
    for event_id, outcome in ((good, "processed"), (bad, "dead_lettered")):
        line = lines[str(event_id)]
        assert line["outcome"] == outcome
        assert line["type"] == "test.behave"
        assert line["redelivered"] is False
        assert line["attempt"] == 0
        assert isinstance(line["duration_ms"], float)
        assert line["message_id"]
    assert lines[str(bad)]["error_class"] == "PermanentError"
    assert "error_class" not in lines[str(good)]

    # A failing start-up prints the URL too: it must come out without the password.
    failing = run_cli(
        "consumer",
        "migrate",
        env=env.env(database_url=f"postgresql://nobody:{canary}@127.0.0.1:1/x"),
    )
    assert failing.returncode == 1
    assert "nobody:***@" in failing.stderr
    assert await service.stop() == 0
    everything = service.log_text() + failing.stdout + failing.stderr
    assert canary not in everything
    assert "secret-payload-value" not in everything
    assert "also-secret" not in everything


async def test_sigterm_under_load_drains_exits_0_and_loses_nothing(env: TestEnv) -> None:
    await env.apply_topology()
    ids = [uuid.uuid4() for _ in range(1000)]
    async with env.producer() as producer:
        await producer.send_many(
            ("test.behave", behave(f"k{n}", sleep_s=0.02), event_id)
            for n, event_id in enumerate(ids)
        )
    # Two workers taking five at a time out of a prefetch of 50: at any moment most prefetched
    # events have not started.
    service = ServiceProcess(
        env, shutdown_grace="8s", db_pool_size="2", workers="2", batch_size="5", prefetch="50"
    ).start()
    await service.wait_ready()
    await wait_until(lambda: _effects_at_least(env, 100), what="100 effects")

    service.signal(signal.SIGTERM)
    assert await service.wait_exit(timeout=30) == 0
    said = [line.get("event", "") for line in service.log_lines()]
    assert not [line for line in said if "shutdown grace expired" in line]  # drained in time
    draining = next(x for x in service.log_lines() if x.get("event") == "draining")
    assert draining["returned_to_queue"] > 0  # prefetched, never started: back to the queue
    applied = await _effects(env)
    assert applied < 1000

    after = await ServiceProcess(env, "after").start().wait_ready()
    await wait_until(lambda: _effects_at_least(env, 1000), timeout=120, what="all effects")
    await after.wait_idle()
    await assert_applied_once(env.database_url, ids)
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 1000
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def test_a_second_signal_exits_at_once(env: TestEnv) -> None:
    await env.apply_topology()
    service = await ServiceProcess(env, shutdown_grace="60s").start().wait_ready()
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("long", sleep_s=30))
    await wait_until(lambda: service.metric_at_least("consumer_in_flight", 1), what="in flight")
    service.signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    assert service.returncode is None  # still draining the 30s handler
    service.signal(signal.SIGINT)
    assert await service.wait_exit(timeout=5) == 130  # not after the handler's 30s
    # Its line is out though the exit skips the clean-up that writes out held log lines.
    said = [line.get("event") for line in service.log_lines()]
    assert "stopping: finishing in-flight messages" in said
    assert "second signal: exiting now" in said
    # The unfinished event was never acked: it is back in the queue, not lost.
    await wait_until(
        lambda: _depth_at_least(env, env.names.work, 1), what="the event back in the queue"
    )
    [back] = await drain_queue(env.amqp_url, env.names.work, ack=False)
    assert json.loads(back.body)["event_id"] == str(event_id)
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0


async def test_work_past_the_shutdown_grace_is_left_to_the_next_process(env: TestEnv) -> None:
    # Given a service with a 1s shutdown grace applying an event whose handler takes a minute
    # (on its first call only)
    await env.apply_topology()
    limits = {"handler_timeout": "120s", "hard_timeout": "150s"}
    first = ServiceProcess(env, "first", shutdown_grace="1s", **limits).start()
    await first.wait_ready()
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("slow", sleep_s=60, sleep_calls=1))
    await wait_until(lambda: _calls_are(env, event_id, 1), what="the handler to start")

    # When it is told to stop
    first.signal(signal.SIGTERM)

    # Then it exits 0 once the grace is over, long before the handler would have finished,
    # saying so, and the event it was applying has no effect and no receipt
    assert await first.wait_exit(timeout=30) == 0
    said = [line.get("event", "") for line in first.log_lines()]
    assert len([line for line in said if "shutdown grace expired" in line]) == 1
    assert await _effects(env) == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0

    # And the next process applies it, exactly once
    second = await ServiceProcess(env, "second", **limits).start().wait_ready()
    await wait_until(lambda: _effects_at_least(env, 1), what="the effect")
    await second.wait_idle()
    await assert_applied_once(env.database_url, [event_id])
    calls = await fetch(
        env.database_url, "SELECT pid FROM handler_calls WHERE event_id = $1 ORDER BY id", event_id
    )
    assert [row["pid"] for row in calls] == [first.pid, second.pid]


async def test_the_soft_limit_cancels_rolls_back_and_retries(env: TestEnv) -> None:
    await env.apply_topology()
    service = ServiceProcess(env, handler_timeout="300ms", hard_timeout="5s").start()
    await service.wait_ready()
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("slowpoke", sleep_s=1))

    await wait_until(
        lambda: _depth_at_least(env, env.names.dead, 1), timeout=30, what="the dead letter"
    )
    calls = await fetchval(
        env.database_url, "SELECT count(*) FROM handler_calls WHERE event_id = $1", event_id
    )
    assert calls == 4  # the first try and three retries, each cut off at 300ms
    assert await _effects(env) == 0
    assert await service.metric("consumer_retries_published_total", rung="800ms") == 1
    timed_out = [x for x in service.log_lines() if x.get("error_class") == "HandlerTimeout"]
    assert len(timed_out) == 4
    assert "ran past its 300ms limit" in timed_out[0]["error"]


async def test_the_hard_limit_ends_a_blocked_process_and_the_next_one_dead_letters_the_culprit(
    env: TestEnv,
) -> None:
    # Given an event whose handler blocks the event loop, among innocent ones behind it
    await env.apply_topology()
    async with env.producer() as producer:
        blocker = await producer.send("test.behave", behave("blocks", block_s=30))
        innocents = [uuid.uuid4() for _ in range(50)]
        await producer.send_many(
            ("test.behave", behave(f"i{n}"), i) for n, i in enumerate(innocents)
        )
    limits = {"handler_timeout": "500ms", "hard_timeout": "1500ms"}

    # When the watchdog ends the first process
    first = ServiceProcess(env, "first", **limits).start()
    # Blocked for 30s, past the soft limit that cannot cancel blocking code: only the watchdog
    # ends the process (code 3) within the wait.
    assert await first.wait_exit(timeout=25) == 3
    [critical] = [x for x in first.log_lines() if x.get("level") == "critical"]
    assert critical["event_id"] == str(blocker)
    assert critical["type"] == "test.behave"
    assert critical["handler"] == "tests.handlers.behave.behave"
    assert critical["convicted"] is True

    # Then the next process dead-letters the culprit at once, without running it again, and
    # applies every innocent event exactly once
    second = await ServiceProcess(env, "second", **limits).start().wait_ready()
    await wait_until(lambda: _depth_at_least(env, env.names.dead, 1), what="the dead letter")
    await wait_until(lambda: _effects_at_least(env, 50), what="the innocent effects")
    assert second.returncode is None
    calls = await fetchval(
        env.database_url, "SELECT count(*) FROM handler_calls WHERE event_id = $1", blocker
    )
    assert calls == 1
    per_event = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    assert {row["event_id"]: row["n"] for row in per_event} == dict.fromkeys(innocents, 1)
    listed = run_cli("consumer", "dlq", "list", "--json", env=env.env())
    [letter] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["id"] == str(blocker)
    assert letter["reason"] == "hard_time_limit"
    assert letter["error_class"] == "HardTimeLimitExceeded"
    assert "blocked the event loop" in letter["error"]


async def _calls_are(env: TestEnv, event_id: uuid.UUID, expected: int) -> bool:
    calls = await fetchval(
        env.database_url, "SELECT count(*) FROM handler_calls WHERE event_id = $1", event_id
    )
    return int(calls) == expected


async def _effects(env: TestEnv) -> int:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects"))


async def _effects_at_least(env: TestEnv, expected: int) -> bool:
    return await _effects(env) >= expected


async def _depth_at_least(env: TestEnv, queue: str, expected: int) -> bool:
    return await queue_depth(env.amqp_url, queue) >= expected
